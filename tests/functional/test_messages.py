"""Malformed and hostile control messages through the real ingest path (signed uploads to moto, the ingest
handler): every one is refused, the refusal is recorded, and its reason names the offending field.

The schemas are shared/messages.py; their unit tests are tests/unit/test_messages.py.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from shared import keys
from shared.messages import MAX_CONTROL_BYTES, MAX_ERROR_CHARS, MAX_HEALTH_IDS
from shared.state import Phase
from shared.witness import Proof
from tests.functional.conftest import Harness


def encode(body: Any) -> bytes:
    return json.dumps(body).encode()


def assert_refused(h: Harness, result: dict[str, Any], words: str) -> str:
    """The upload was refused with `words` in its reason, and the refusal was recorded with that reason."""
    reason = str(result["reason"])
    assert result["accepted"] is False and words in reason, result
    assert len(reason) <= len("witness proof refused: witness proof ") + MAX_ERROR_CHARS
    recorded = [r.reason for r in h.deps.store.refusals()]
    assert reason in recorded, recorded
    return reason


# --- join requests ------------------------------------------------------------------------------------


def join_body(h: Harness, pid: str, **changes: Any) -> dict[str, Any]:
    body = json.loads(h.join_bytes(pid))
    body.update(changes)
    return {k: v for k, v in body.items() if v is not None}


@pytest.mark.parametrize(
    "changes, words",
    [
        ({"info": ["host", "gpu"]}, "join request refused: field 'info': Input should be an object"),
        ({"info": {"host": {"nested": 1}}}, "join request refused: field 'info.host': "),
        ({"info": {"host": "h" * 5000}}, "join request refused: field 'info.host': "),
        ({"role": "admin"}, "join request refused: field 'role': Extra inputs are not permitted"),
        ({"public_key": 12345}, "join request refused: field 'public_key': Input should be a valid string"),
        ({"public_key": None}, "join request refused: field 'public_key': Field required"),
        ({"participant": "../../global"}, "join request refused: field 'participant': invalid participant id"),
        ({"schema": 99}, "join request refused: field 'schema': Input should be 1"),
    ],
)
def test_a_malformed_join_is_refused_naming_the_field(harness: Harness, changes: dict[str, Any], words: str) -> None:
    harness.scheduled_tick()
    result = harness.send(keys.join_key(harness.config.run_id, "eve"), encode(join_body(harness, "eve", **changes)))
    assert_refused(harness, result, words)
    assert harness.deps.store.participants() == {}
    # the same participant's well-formed join still works
    assert harness.join("eve")["accepted"]


def test_a_join_that_is_not_json_or_not_an_object(harness: Harness) -> None:
    harness.scheduled_tick()
    key = keys.join_key(harness.config.run_id, "eve")
    assert_refused(harness, harness.send(key, b"\x00\xffgarbage"), "join request refused: not a JSON document")
    assert_refused(harness, harness.send(key, b'["run_id"]'), "join request refused: not a JSON object")


def test_a_join_naming_another_participant_keeps_its_reason(harness: Harness) -> None:
    harness.scheduled_tick()
    body = join_body(harness, "eve", participant="alice")
    result = harness.send(keys.join_key(harness.config.run_id, "eve"), encode(body))
    assert_refused(harness, result, "join request names another participant than its key")


def test_a_join_with_today_s_body_and_an_explicit_schema_is_accepted(harness: Harness) -> None:
    harness.scheduled_tick()
    body = join_body(harness, "alice", schema=1)
    assert harness.send(keys.join_key(harness.config.run_id, "alice"), encode(body))["accepted"]
    assert harness.deps.store.participant("alice") is not None


# --- heartbeats ---------------------------------------------------------------------------------------


def send_heartbeat(h: Harness, pid: str, body: Any) -> dict[str, Any]:
    """A heartbeat body as given (bytes), or a dict sent now (`sent_at` added unless the case sets it)."""
    if not isinstance(body, bytes):
        body = encode({"sent_at": time.time(), **body})
    return h.send(keys.heartbeat_key(h.config.run_id, pid), body)


@pytest.mark.parametrize(
    "body, words",
    [
        ({"participant": "alice", "ready_epoch": "1"}, "heartbeat refused: field 'ready_epoch': "
                                                       "Input should be a valid integer"),
        ({"participant": "alice", "ready_epoch": 1.5}, "heartbeat refused: field 'ready_epoch': "),
        ({"participant": "alice", "ready_epoch": -3}, "heartbeat refused: field 'ready_epoch': "),
        ({"participant": "alice", "info": {"a": [1, 2]}}, "heartbeat refused: field 'info.a': "),
        ({"participant": "alice", "info": {f"k{i}": i for i in range(500)}}, "heartbeat refused: field 'info': "),
        ({"ready_epoch": 1}, "heartbeat refused: field 'participant': Field required"),
        ({"participant": "alice", "takeover": True}, "heartbeat refused: field 'takeover': Extra inputs"),
        (b"[]", "heartbeat refused: not a JSON object"),
        (b"{'participant': 'alice'}", "heartbeat refused: not a JSON document"),
    ],
)
def test_a_malformed_heartbeat_is_refused_naming_the_field(harness: Harness, body: Any, words: str) -> None:
    harness.start(["alice", "bob"])
    before = harness.deps.store.participant("alice")
    assert_refused(harness, send_heartbeat(harness, "alice", body), words)
    after = harness.deps.store.participant("alice")
    assert after is not None and before is not None and after.ready_epoch == before.ready_epoch


def test_a_heartbeat_naming_another_participant_is_refused(harness: Harness) -> None:
    harness.start(["alice", "bob"])
    result = send_heartbeat(harness, "alice", {"participant": "bob", "ready_epoch": 5})
    assert_refused(harness, result, "heartbeat names another participant than its key")


def test_a_hostile_field_name_is_not_recorded_at_length(harness: Harness) -> None:
    harness.start(["alice", "bob"])
    body = {"participant": "alice", **{"x" * 5_000 + str(i): i for i in range(10)}}
    reason = assert_refused(harness, send_heartbeat(harness, "alice", body), "heartbeat refused: field 'xxx")
    assert len(reason) <= len("heartbeat refused: ") + MAX_ERROR_CHARS


def test_a_control_message_over_the_size_limit_is_refused_before_parsing(harness: Harness) -> None:
    harness.start(["alice", "bob"])
    body = encode({"participant": "alice", "sent_at": time.time(), "info": {"pad": "p" * MAX_CONTROL_BYTES}})
    assert_refused(harness, send_heartbeat(harness, "alice", body), "heartbeat refused: over the size limit")


def test_a_well_formed_heartbeat_is_still_recorded(harness: Harness) -> None:
    harness.start(["alice", "bob"])
    result = send_heartbeat(harness, "alice", {"schema": 1, "participant": "alice", "ready_epoch": 7,
                                              "info": {"activity": "ready"}})
    assert result["accepted"], result
    record = harness.deps.store.participant("alice")
    assert record is not None and int(record.ready_epoch) == 7


# --- health reports -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body, words",
    [
        ({"unhealthy": "dave"}, "health report refused: field 'unhealthy': Input should be a valid array"),
        ({"unhealthy": ["dave", 7]}, "health report refused: field 'unhealthy[1]': Input should be a valid string"),
        ({"unhealthy": ["dave", "../x"]}, "health report refused: field 'unhealthy[1]': invalid participant id"),
        ({"unhealthy": [f"p{i}" for i in range(MAX_HEALTH_IDS + 1)]},
         f"health report refused: field 'unhealthy': Tuple should have at most {MAX_HEALTH_IDS} items"),
        ({}, "health report refused: field 'unhealthy': Field required"),
        ({"unhealthy": [], "verdict": "drop everyone"}, "health report refused: field 'verdict': Extra inputs"),
    ],
)
def test_a_malformed_health_report_is_refused_naming_the_field(harness: Harness, body: Any, words: str) -> None:
    harness.start(["alice", "bob"])
    result = harness.send(keys.health_key(harness.config.run_id, 0, "bob"), encode(body))
    assert_refused(harness, result, words)
    assert harness.state().phase is Phase.TRAIN and set(harness.state().active()) == {"alice", "bob"}


# --- witness proofs -----------------------------------------------------------------------------------


@pytest.fixture
def witnessed(harness_factory) -> Harness:  # type: ignore[no-untyped-def]
    h = harness_factory(min_clients=3, min_per_round=3, min_updates=2, witness_nodes=3, round_witness_time=600)
    h.start(["alice", "bob", "carol", "dave"])
    return h


def proof_bytes(h: Harness, witness: str, **changes: Any) -> bytes:
    s = h.state()
    proof = Proof.build(h.config.run_id, s.round, witness, s.witnesses.index(witness), {}, len(s.selected), True)
    body = json.loads(proof.to_json())
    body.update(changes)
    return encode({k: v for k, v in body.items() if v is not None})


@pytest.mark.parametrize(
    "changes, words",
    [
        ({"round": "0"}, "witness proof refused: witness proof field 'round': Input should be a valid integer"),
        ({"position": -1}, "witness proof refused: witness proof field 'position': "),
        ({"complete": "yes"}, "witness proof refused: witness proof field 'complete': "),
        ({"evaluations": {"bob": "0.5"}}, "witness proof refused: witness proof field 'evaluations.bob': "),
        ({"participants": {"bits": 8, "hashes": 1, "hex": "zz"}},
         "witness proof refused: witness proof field 'participants': bloom filter data is not hex"),
        ({"digests": {"bits": 1 << 30, "hashes": 1, "hex": ""}},
         "witness proof refused: witness proof field 'digests.bits': "),
        ({"forged": True}, "witness proof refused: witness proof field 'forged': Extra inputs are not permitted"),
        ({"run_id": None}, "witness proof refused: witness proof lacks 'run_id'"),
        ({"schema": 2}, "witness proof refused: witness proof must be a JSON object with schema 1"),
    ],
)
def test_a_malformed_proof_is_refused_naming_the_field(witnessed: Harness, changes: dict[str, Any],
                                                        words: str) -> None:
    h = witnessed
    w = h.state().witnesses[0]
    result = h.send(keys.witness_key(h.config.run_id, h.state().round, w), proof_bytes(h, w, **changes))
    assert_refused(h, result, words)
    assert h.deps.store.proofs(h.state().round) == {}
    # the witness's well-formed proof is still taken
    assert h.send(keys.witness_key(h.config.run_id, h.state().round, w), proof_bytes(h, w))["accepted"]
