"""Witness proofs and health reports through the ingest handler; unit rules of the witness module."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from shared import keys, wire
from shared.state import MemberStatus, Phase
from shared.witness import BloomFilter, Proof, elect, quorum
from tests.functional.conftest import MODEL, Harness

PIDS = ["alice", "bob", "carol", "dave"]


def model(k: float) -> dict[str, np.ndarray]:
    return {name: (arr + k).astype(arr.dtype) for name, arr in MODEL.items()}


@pytest.fixture
def witnessed(harness_factory) -> Harness:  # type: ignore[no-untyped-def]
    h = harness_factory(min_clients=3, min_per_round=3, min_updates=2, witness_nodes=3, round_witness_time=600,
                        health_strikes=1)
    h.start(PIDS)
    return h


def recorded_digests(h: Harness) -> dict[str, str]:
    return {pid: u.digest for pid, u in h.deps.store.updates(h.state().round).items() if u.accepted}


def send_proof(h: Harness, witness: str, attested: dict[str, str], override: dict[str, object] | None = None
               ) -> dict[str, object]:
    s = h.state()
    position = s.witnesses.index(witness) if witness in s.witnesses else 0
    proof = Proof.build(h.config.run_id, s.round, witness, position, attested, len(s.selected), complete=True)
    body = json.loads(proof.to_json())
    body.update(override or {})
    return h.send(keys.witness_key(h.config.run_id, s.round, witness), json.dumps(body).encode())


def test_quorum_values() -> None:
    assert [quorum(n) for n in range(0, 10)] == [0, 1, 2, 2, 2, 3, 4, 4, 5, 6]


def test_election_is_identical_for_any_order_of_candidates() -> None:
    first = elect("ab" * 32, ["a", "b", "c", "d", "e"], 3)
    assert first == elect("ab" * 32, ["e", "d", "c", "b", "a"], 3) and len(set(first)) == 3


def test_bloom_filter_false_positive_rate_is_close_to_its_design_value() -> None:
    rng = random.Random(1)
    for items in (10, 100, 1000):
        bloom = BloomFilter.for_capacity(items, 0.01)
        for i in range(items):
            bloom.add(f"in-{i}")
        assert all(f"in-{i}" in bloom for i in range(items))
        trials = 20_000
        hits = sum(1 for _ in range(trials) if f"out-{rng.random()}" in bloom)
        assert 0.002 < hits / trials < 0.02, (items, hits / trials)


def test_poisoned_update_not_attested_is_not_aggregated_and_health_report_drops_it(witnessed: Harness) -> None:
    h = witnessed
    for i, pid in enumerate(PIDS):
        h.upload(pid, model(100.0 if pid == "dave" else 1.0 + i))
    digests = recorded_digests(h)
    honest = {p: d for p, d in digests.items() if p != "dave"}
    witnesses = h.state().witnesses
    for w in witnesses[:2]:
        assert send_proof(h, w, honest)["accepted"]
    # two of three proofs are a quorum, and they attest every counted update (dave's is a norm outlier): the
    # third could change nothing, so the round closes at once
    s = h.state()
    assert s.round == 1 and s.health["dave"] == 0 and s.health_quorum == 2
    summary = h.deps.store.rounds()[0]
    assert "dave" not in summary.counted and summary.proofs == 2
    expected = np.mean([model(1.0 + i)["dense.bias"] for i in range(3)], axis=0)
    np.testing.assert_allclose(h.global_model(1)["dense.bias"], expected, rtol=1e-6)
    # When a member reports dave (and, wrongly, alice) as unhealthy
    report = json.dumps({"unhealthy": ["dave", "alice"]}).encode()
    h.send(keys.health_key(h.config.run_id, 0, "bob"), report)
    s = h.state()
    assert s.members["dave"].status is MemberStatus.DROPPED and "health check" in s.members["dave"].reason
    assert s.members["alice"].status is MemberStatus.ACTIVE


@pytest.mark.parametrize(
    "case, words",
    [
        ("not a witness", "not an elected witness"),
        ("spoofed position", "spoofed position"),
        ("wrong round", "not being witnessed"),
        ("duplicate", "duplicate"),
        ("malformed", "witness proof refused"),
        ("other witness named", "another run, round or witness"),
    ],
)
def test_bad_proofs_are_refused(witnessed: Harness, case: str, words: str) -> None:
    h = witnessed
    s = h.state()
    w = s.witnesses[0]
    outsider = next(p for p in PIDS if p not in s.witnesses)
    if case == "not a witness":
        result = send_proof(h, outsider, {})
    elif case == "spoofed position":
        result = send_proof(h, w, {}, {"position": (s.witnesses.index(w) + 1) % 3})
    elif case == "wrong round":
        result = h.send(keys.witness_key(h.config.run_id, 7, w), b"{}")
    elif case == "duplicate":
        assert send_proof(h, w, {})["accepted"]
        result = send_proof(h, w, {"alice": "x"})
    elif case == "malformed":
        result = h.send(keys.witness_key(h.config.run_id, s.round, w), b'{"schema": 1, "participants": 5}')
    else:
        result = send_proof(h, w, {}, {"witness": s.witnesses[1]})
    assert result["accepted"] is False and words in str(result["reason"])
    assert any(words in r.reason for r in h.deps.store.refusals())
    assert h.state().phase is Phase.TRAIN


def test_quorum_missed_ends_the_epoch_without_aggregating(witnessed: Harness) -> None:
    import time

    from coordinator.service import run_tick

    h = witnessed
    for i, pid in enumerate(PIDS):
        h.upload(pid, model(1.0 + i))
    send_proof(h, h.state().witnesses[0], recorded_digests(h))
    run_tick(h.deps, time.time() + h.config.max_round_train_time + h.config.round_witness_time + 2)
    summary = h.deps.store.rounds()[0]
    assert not summary.aggregated and summary.proofs == 1
    assert h.state().aggregated == 0


def test_checkpoint_at_the_end_of_an_epoch(harness_factory) -> None:  # type: ignore[no-untyped-def]
    h = harness_factory(rounds_per_epoch=1, total_rounds=2, cooldown_time=600)
    h.start(["alice", "bob"])
    h.upload("alice", model(1.0))
    h.upload("bob", model(2.0))
    s = h.state()
    assert s.phase is Phase.COOLDOWN
    latest = keys.latest_checkpoint_key(h.config.run_id)
    pointer = json.loads(h.s3.get_object(Bucket=h.res.bucket, Key=latest)["Body"].read())
    body = json.loads(h.s3.get_object(Bucket=h.res.bucket, Key=pointer["state_key"])["Body"].read())
    assert body["round"] == 1 and body["global_digest"] == s.global_digest
    saved = h.s3.get_object(Bucket=h.res.bucket, Key=body["global_key"])["Body"].read()
    assert wire.digest(saved) == s.global_digest
