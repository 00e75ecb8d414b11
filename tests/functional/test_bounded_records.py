"""Every field an uploader controls is bounded before it is recorded: a refusal is always recorded, even
when the refused object quotes hundreds of kilobytes of attacker text back into its reason."""

from __future__ import annotations

from typing import Any

import boto3
import numpy as np

from shared import keys, wire
from shared.limits import MAX_ITEM_BYTES, MAX_KEY_CHARS, MAX_REASON_CHARS
from tests.functional.conftest import MODEL, Harness

BIG = 300 * 1024  # with the rest of an item, over DynamoDB's 400 KB limit if recorded whole


def items(h: Harness) -> list[dict[str, Any]]:
    table = boto3.client("dynamodb", region_name="us-east-1")
    return table.scan(TableName=h.res.table)["Items"]


def item_bytes(item: dict[str, Any]) -> int:
    return sum(len(k) + len(str(v)) for k, v in item.items())


def started(harness_factory: Any) -> Harness:
    h: Harness = harness_factory(max_update_bytes=4 * 1024 * 1024, min_clients=3, min_per_round=3)
    h.start(["alice", "bob", "carol"])
    return h


def assert_recorded_and_bounded(h: Harness, outcome: dict[str, Any]) -> None:
    assert outcome["recorded"] and outcome["accepted"] is False
    assert len(outcome["reason"]) <= MAX_REASON_CHARS
    assert all(item_bytes(i) < MAX_ITEM_BYTES // 2 for i in items(h))


def test_a_tensor_name_of_300_kb_is_refused_and_recorded(harness_factory) -> None:  # type: ignore[no-untyped-def]
    h = started(harness_factory)
    arrays = {**MODEL, "n" * BIG: np.zeros(2, np.float32)}
    meta = wire.UpdateMeta(h.config.run_id, 0, "alice", 10, {"loss": 1.0}).to_metadata()
    outcome = h.send(keys.update_key(h.config.run_id, 0, "alice"), wire.encode(arrays, meta))
    assert_recorded_and_bounded(h, outcome)
    assert "unexpected tensors" in outcome["reason"]
    assert "unexpected tensors" in h.deps.store.update_record(0, "alice").reason


def test_metadata_keys_and_values_of_300_kb_are_refused_and_recorded(harness_factory) -> None:  # type: ignore[no-untyped-def]
    h = started(harness_factory)
    meta = wire.UpdateMeta(h.config.run_id, 0, "bob", 10, {"loss": 1.0}).to_metadata()
    for pid, bad in (("bob", {**meta, "fed.samples": "9" * BIG}), ("carol", {**meta, "k" * BIG: "v" * BIG})):
        outcome = h.send(keys.update_key(h.config.run_id, 0, pid), wire.encode(MODEL, {**bad, "fed.participant": pid}))
        assert outcome["recorded"]
        assert len(outcome["reason"]) <= MAX_REASON_CHARS
    assert all(item_bytes(i) < MAX_ITEM_BYTES // 2 for i in items(h))


def test_a_key_of_s3s_maximum_length_outside_the_layout_is_refused_and_recorded(harness: Harness) -> None:
    harness.scheduled_tick()
    key = keys.run_prefix(harness.config.run_id) + "x/" * ((MAX_KEY_CHARS - 20) // 2)
    outcome = harness.send(key, b"{}")
    assert_recorded_and_bounded(harness, outcome)
    (refusal,) = harness.deps.store.refusals()
    assert len(refusal.key) <= MAX_KEY_CHARS and len(refusal.reason) <= MAX_REASON_CHARS


def test_control_messages_with_oversized_fields_are_refused_and_recorded(harness_factory) -> None:  # type: ignore[no-untyped-def]
    h = started(harness_factory)
    # A heartbeat whose fields are far over their bounds, and one over the control-message size limit
    for body in (h.heartbeat_bytes("alice", ready_epoch=1, info={"k" * 40000: 1}),
                 b'{"participant": "' + b"a" * BIG + b'"}'):
        outcome = h.send(keys.heartbeat_key(h.config.run_id, "alice"), body)
        assert_recorded_and_bounded(h, outcome)
    # And the run goes on: the round still closes with everyone's update
    for k, pid in enumerate(["alice", "bob", "carol"]):
        h.upload(pid, {n: (a * 0 + k).astype(a.dtype) for n, a in MODEL.items()})
    assert h.state().round == 1


def test_a_witness_proof_at_the_size_limit_is_recorded_and_one_over_it_refused(harness_factory) -> None:  # type: ignore[no-untyped-def]
    from shared.messages import MAX_PROOF_BYTES
    from shared.witness import Proof

    # Given a witnessed round, and proofs padded with evaluations to just under and just over the size limit
    h: Harness = harness_factory(min_clients=3, min_per_round=3, min_updates=2, witness_nodes=3,
                                 round_witness_time=600)
    h.start(["alice", "bob", "carol"])
    s = h.state()

    def proof(witness: str, target: int) -> bytes:
        evaluations: dict[str, float] = {}
        body = b""
        while len(body) < target:
            evaluations.update({f"{len(evaluations):06d}" + "e" * 50: 0.5 for _ in range(200)})
            body = Proof.build(h.config.run_id, s.round, witness, s.witnesses.index(witness), {}, 3, complete=True,
                               evaluations=dict(list(evaluations.items())[:-1])).to_json().encode()
        return body

    under, over = proof(s.witnesses[0], MAX_PROOF_BYTES - 20_000), proof(s.witnesses[1], MAX_PROOF_BYTES + 1000)
    assert MAX_PROOF_BYTES - 20_000 <= len(under) <= MAX_PROOF_BYTES < len(over)
    # When both are uploaded
    ok = h.send(keys.witness_key(h.config.run_id, s.round, s.witnesses[0]), under)
    refused = h.send(keys.witness_key(h.config.run_id, s.round, s.witnesses[1]), over)
    # Then the first is recorded whole (the item fits the table), the second refused with its reason
    assert ok["accepted"] and ok["recorded"], ok
    assert refused["accepted"] is False and "size limit" in refused["reason"]
    assert h.deps.store.proof_record(s.round, s.witnesses[0]) is not None
    assert all(item_bytes(i) < MAX_ITEM_BYTES for i in items(h))
