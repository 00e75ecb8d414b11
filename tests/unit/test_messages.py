"""The control messages' schemas (shared/messages.py) and the witness proof's envelope (shared/witness.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from shared.messages import (
    MAX_ERROR_CHARS,
    MAX_HEALTH_IDS,
    MAX_INFO_ITEMS,
    MAX_INFO_TEXT,
    MAX_PUBLIC_KEY,
    HealthReport,
    Heartbeat,
    JoinRequest,
    Message,
    MessageError,
    ProofEnvelope,
    parse_message,
)
from shared.witness import Proof, ProofError

KEY = "A" * 43 + "="  # the shape of a base64 Ed25519 public key
# what participant/daemon.py sends today, field for field
DAEMON_JOIN = {"run_id": "demo-run", "participant": "alice", "public_key": KEY, "sent_at": 1_795_000_000.25,
               "info": {"host": "gpu-01", "os_pid": 4242, "python": "3.12.3", "torch": "2.13.0", "device": "cuda:0",
                        "gpu": "NVIDIA H100 80GB HBM3", "task": "participant.tasks.digits:task"}}
DAEMON_HEARTBEAT = {"participant": "alice", "ready_epoch": 0, "sent_at": 1_795_000_001.5,
                    "info": {"host": "gpu-01", "os_pid": 4242, "activity": "training round 3"}}
DAEMON_HEALTH = {"unhealthy": ["dave", "erin"]}


def encode(body: Any) -> bytes:
    return json.dumps(body).encode()


def refusal(model: type[Message], body: Any) -> MessageError:
    with pytest.raises(MessageError) as info:
        parse_message(model, body if isinstance(body, bytes) else encode(body))
    assert len(str(info.value)) <= MAX_ERROR_CHARS
    return info.value


# --- valid messages -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "model, body", [(JoinRequest, DAEMON_JOIN), (Heartbeat, DAEMON_HEARTBEAT), (HealthReport, DAEMON_HEALTH)]
)
def test_what_participants_send_today_is_valid_and_round_trips(model: type[Message], body: dict[str, Any]) -> None:
    parsed = parse_message(model, encode(body))
    dumped = parsed.model_dump(mode="json")
    assert dumped == {"schema": 1, **body}  # the version is filled in; everything else is kept as sent
    assert parse_message(model, encode(dumped)) == parsed


def test_senders_build_messages_and_dump_them() -> None:
    join = JoinRequest(run_id="demo-run", participant="alice", public_key=KEY, sent_at=1.5)
    assert join.model_dump(mode="json") == {"schema": 1, "run_id": "demo-run", "participant": "alice",
                                            "public_key": KEY, "sent_at": 1.5, "info": {}}
    beat = Heartbeat(participant="alice", sent_at=2.0, ready_epoch=2, info={"activity": "ready for epoch 2"})
    assert parse_message(Heartbeat, json.dumps(beat.model_dump(mode="json"))) == beat
    report = HealthReport(unhealthy=("dave",))
    assert report.model_dump(mode="json") == {"schema": 1, "unhealthy": ["dave"]}


def test_optional_fields() -> None:
    beat = parse_message(Heartbeat, b'{"participant": "alice", "sent_at": 5}')
    assert beat.ready_epoch is None and beat.info == {}
    assert parse_message(Heartbeat, b'{"participant": "alice", "sent_at": 5, "ready_epoch": null}').ready_epoch is None
    join = parse_message(JoinRequest, encode({"run_id": "r", "participant": "a", "public_key": KEY, "sent_at": 5}))
    assert join.info == {}
    assert parse_message(HealthReport, b'{"unhealthy": [], "schema": 1}').unhealthy == ()


def test_info_keeps_flat_values() -> None:
    info = {"s": "x", "i": 3, "f": 1.5, "b": True, "n": None}
    assert parse_message(Heartbeat, encode({"participant": "a", "sent_at": 5, "info": info})).info == info


def test_messages_are_frozen() -> None:
    beat = Heartbeat(participant="alice", sent_at=5.0)
    with pytest.raises(ValidationError):
        beat.ready_epoch = 3  # type: ignore[misc]


# --- malformed messages -------------------------------------------------------------------------------


@pytest.mark.parametrize("model", [JoinRequest, Heartbeat, HealthReport, ProofEnvelope])
def test_not_json_and_not_an_object(model: type[Message]) -> None:
    assert str(refusal(model, b"\xff{not json")) == "not a JSON document"
    assert str(refusal(model, b"")) == "not a JSON document"
    assert str(refusal(model, b"[1, 2]")) == "not a JSON object"
    assert str(refusal(model, b'"text"')) == "not a JSON object"


@pytest.mark.parametrize(
    "model, body", [(JoinRequest, DAEMON_JOIN), (Heartbeat, DAEMON_HEARTBEAT), (HealthReport, DAEMON_HEALTH)]
)
def test_an_extra_field_is_named(model: type[Message], body: dict[str, Any]) -> None:
    error = refusal(model, {**body, "admin": True})
    assert error.fields == ("admin",)
    assert str(error) == "field 'admin': Extra inputs are not permitted"


@pytest.mark.parametrize(
    "model, body, field, words",
    [
        (Heartbeat, {**DAEMON_HEARTBEAT, "ready_epoch": "3"}, "ready_epoch", "Input should be a valid integer"),
        (Heartbeat, {**DAEMON_HEARTBEAT, "ready_epoch": 1.0}, "ready_epoch", "Input should be a valid integer"),
        (Heartbeat, {**DAEMON_HEARTBEAT, "ready_epoch": True}, "ready_epoch", "Input should be a valid integer"),
        (Heartbeat, {**DAEMON_HEARTBEAT, "ready_epoch": -1}, "ready_epoch", "greater than or equal to 0"),
        (Heartbeat, {**DAEMON_HEARTBEAT, "info": ["host"]}, "info", "Input should be an object"),
        (Heartbeat, {**DAEMON_HEARTBEAT, "info": {"nested": {"a": 1}}}, "info.nested", "info is flat"),
        (Heartbeat, {"ready_epoch": 1}, "participant", "Field required"),
        (Heartbeat, {"participant": 7}, "participant", "valid string"),
        (Heartbeat, {"participant": "../etc"}, "participant", "invalid participant id"),
        (Heartbeat, {"participant": "global"}, "participant", "reserved"),
        (JoinRequest, {**DAEMON_JOIN, "public_key": None}, "public_key", "valid string"),
        (JoinRequest, {k: v for k, v in DAEMON_JOIN.items() if k != "run_id"}, "run_id", "Field required"),
        (JoinRequest, {**DAEMON_JOIN, "schema": 2}, "schema", "Input should be 1"),
        (HealthReport, {"unhealthy": "dave"}, "unhealthy", "Input should be a valid array"),
        (HealthReport, {"unhealthy": ["dave", 3]}, "unhealthy[1]", "valid string"),
        (HealthReport, {"unhealthy": ["dave", "a/b"]}, "unhealthy[1]", "invalid participant id"),
        (HealthReport, {}, "unhealthy", "Field required"),
    ],
)
def test_a_wrong_type_or_value_is_named(model: type[Message], body: Any, field: str, words: str) -> None:
    error = refusal(model, body)
    assert field in error.fields
    assert f"field '{field}': " in str(error) and words in str(error)


def test_non_finite_info_numbers_are_refused() -> None:
    error = refusal(Heartbeat, b'{"participant": "a", "sent_at": 5, "info": {"load": NaN}}')
    assert error.fields == ("info.load",) and "finite" in str(error)


@pytest.mark.parametrize(
    "model, body, field",
    [
        (JoinRequest, {**DAEMON_JOIN, "public_key": "k" * (MAX_PUBLIC_KEY + 1)}, "public_key"),
        (JoinRequest, {**DAEMON_JOIN, "run_id": "r" * 1000}, "run_id"),
        (JoinRequest, {**DAEMON_JOIN, "participant": "a" * 64}, "participant"),
        (JoinRequest, {**DAEMON_JOIN, "public_key": ""}, "public_key"),
        (Heartbeat, {"participant": "a", "info": {"host": "h" * (MAX_INFO_TEXT + 1)}}, "info.host"),
        (Heartbeat, {"participant": "a", "info": {f"k{i}": i for i in range(MAX_INFO_ITEMS + 1)}}, "info"),
        (Heartbeat, {"participant": "a", "ready_epoch": 10**12}, "ready_epoch"),
        (HealthReport, {"unhealthy": [f"p{i}" for i in range(MAX_HEALTH_IDS + 1)]}, "unhealthy"),
    ],
)
def test_oversized_strings_and_lists_are_refused(model: type[Message], body: Any, field: str) -> None:
    assert field in refusal(model, body).fields


def test_an_oversized_info_key_is_named_but_not_echoed_in_full() -> None:
    error = refusal(Heartbeat, {"participant": "a", "sent_at": 5, "info": {"k" * 5000: 1}})
    assert error.fields[0].startswith("info.kkk") and error.fields[0].endswith("…")
    assert len(str(error)) < 200


def test_a_hostile_document_is_never_echoed_at_length() -> None:
    body = {**DAEMON_HEARTBEAT, **{("x" * 10_000) + str(i): "y" * 10_000 for i in range(50)}}
    error = refusal(Heartbeat, body)
    assert len(error.problems) == 50 and len(str(error)) <= MAX_ERROR_CHARS
    assert "and 47 more" in str(error) or str(error).endswith("…")
    control = refusal(Heartbeat, encode({**DAEMON_HEARTBEAT, "evil\u001b[31m\nline": 1}))
    assert "\n" not in str(control) and "\u001b" not in str(control)


# --- the witness proof's envelope ---------------------------------------------------------------------


def proof() -> Proof:
    return Proof.build("demo-run", 3, "alice", 1, {"bob": "d" * 64, "carol": "e" * 64}, 4, complete=True, loss=0.5,
                       throughput=12.0, evaluations={"bob": 0.4, "global": 0.6})


def proof_body(**changes: Any) -> bytes:
    body = json.loads(proof().to_json())
    body.update(changes)
    return encode({k: v for k, v in body.items() if v is not None})


def test_a_proof_round_trips_through_its_envelope() -> None:
    original = proof()
    assert Proof.from_json(original.to_json()) == original
    envelope = parse_message(ProofEnvelope, original.to_json())
    assert envelope.model_dump(mode="json") == json.loads(original.to_json())
    assert Proof.from_json(original.to_json().encode()).attests("bob", "d" * 64)


@pytest.mark.parametrize(
    "body, words",
    [
        (b"not json", "witness proof is not JSON"),
        (b"[]", "witness proof must be a JSON object with schema 1"),
        (proof_body(schema=2), "witness proof must be a JSON object with schema 1"),
        (b'{"schema": 1, "participants": 5}', "witness proof lacks 'run_id'"),
        (proof_body(round=-1), "witness proof field 'round': Input should be greater than or equal to 0"),
        (proof_body(position="1"), "witness proof field 'position': Input should be a valid integer"),
        (proof_body(witness="a/b"), "field 'witness': invalid participant id"),
        (proof_body(loss=None, throughput="fast"), "field 'throughput'"),
        (proof_body(evaluations={"bob": "x"}), "field 'evaluations.bob'"),
        (proof_body(complete=1), "field 'complete': Input should be a valid boolean"),
        (proof_body(participants={"bits": 8, "hashes": 1, "hex": "zz"}), "bloom filter data is not hex"),
        (proof_body(digests={"bits": 8, "hashes": 1, "hex": "0000"}), "bloom filter data does not match its size"),
        (proof_body(digests={"bits": 2, "hashes": 1, "hex": "00"}), "field 'digests.bits'"),
        (proof_body(digests={"bits": 8, "hashes": 99, "hex": "00"}), "field 'digests.hashes'"),
        (proof_body(extra=1), "field 'extra': Extra inputs are not permitted"),
        (b'{"schema": 1, "run_id": "r", "loss": NaN}', "witness proof lacks"),
    ],
)
def test_malformed_proofs_raise_proof_error_naming_the_problem(body: bytes, words: str) -> None:
    with pytest.raises(ProofError) as info:
        Proof.from_json(body)
    assert words in str(info.value) and str(info.value).startswith("witness proof")
    assert isinstance(info.value, ValueError)


def test_non_finite_proof_metrics_are_refused() -> None:
    body = proof().to_json().replace('"loss": 0.5', '"loss": Infinity')
    with pytest.raises(ProofError, match="field 'loss': Input should be a finite number"):
        Proof.from_json(body)


@pytest.mark.parametrize("model, body", [(JoinRequest, DAEMON_JOIN), (Heartbeat, DAEMON_HEARTBEAT)])
def test_messages_at_one_key_per_participant_must_say_when_they_were_sent(model: type[Message], body: dict) -> None:  # type: ignore[type-arg]
    # A join request or heartbeat without `sent_at` (or with a non-finite one) could be replayed forever
    for bad in ({k: v for k, v in body.items() if k != "sent_at"}, {**body, "sent_at": "now"}, {**body, "sent_at": -1}):
        assert refusal(model, bad).fields == ("sent_at",)
