"""Resource names: no run's participant queue can be another run's queue, or a coordinator queue; the S3 events' two
lanes take every upload and none of the coordinator's own objects."""

from __future__ import annotations

import re
from typing import Any

import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from shared import keys
from shared.config import RunConfig
from shared.keys import PARTICIPANT_ID_PATTERN, RUN_ID_PATTERN, ObjectKind
from shared.naming import (
    PARTICIPANT_QUEUE_MARK,
    ingest_queue_name,
    join_queue_name,
    join_request_pattern,
    object_created_pattern,
    participant_queue_name,
    participant_queue_prefix,
    state_topic_name,
)

RUN_IDS = st.from_regex(RUN_ID_PATTERN, fullmatch=True)


def accepted(run_id: str) -> bool:
    try:
        RunConfig(run_id=run_id)
    except ValidationError:
        return False
    return True


def coordinator_names(run_id: str) -> set[str]:
    return {ingest_queue_name(run_id), join_queue_name(run_id), state_topic_name(run_id)}


@given(run_id=RUN_IDS, pid=st.from_regex(PARTICIPANT_ID_PATTERN, fullmatch=True))
@example(run_id="abc-p", pid="x")  # its ingest queue would be run abc's queue of participant "ingest"
@example(run_id="ab-p-c", pid="x")  # its queue of "x" would be run ab's queue of participant "c-p-x"
@example(run_id="p-abc", pid="x")  # accepted: fed-p-abc-p-x still names run p-abc first
def test_a_participant_queue_name_belongs_to_one_run_only(run_id: str, pid: str) -> None:
    # Given a run id the configuration accepts
    assume(accepted(run_id))
    # Then its participant queue names hold the mark first right after the run id (so they name that run and
    # no other), and none of its coordinator names holds the mark (no participant queue is one of them)
    name = participant_queue_name(run_id, pid)
    if name is not None:
        assert name.startswith(participant_queue_prefix(run_id))
        assert name.removeprefix("fed-").split(PARTICIPANT_QUEUE_MARK, 1)[0] == run_id
    assert all(PARTICIPANT_QUEUE_MARK not in n.removeprefix("fed-") for n in coordinator_names(run_id))


@pytest.mark.parametrize("run_id", ["abc-p", "ab-p-c", "p-p-p"])
def test_a_run_id_that_would_read_as_a_participant_queue_is_refused_with_the_reason(run_id: str) -> None:
    with pytest.raises(ValidationError, match="participant queues are named"):
        RunConfig(run_id=run_id)


# --- the two lanes of S3 events -------------------------------------------------------------------------------------


def _wildcard(pattern: str, text: str) -> bool:
    """EventBridge's wildcard: `*` stands for any text, '/' included; every other character for itself."""
    return re.fullmatch(".*".join(map(re.escape, pattern.split("*"))), text, re.DOTALL) is not None


def routed(pattern: dict[str, Any], key: str) -> bool:
    """Whether an "Object Created" event of `key` matches `pattern`, by EventBridge's rules for the operators the
    lanes use (any other fails the test: its semantics would have to be checked first)."""
    (key_filter,) = pattern["detail"]["object"]["key"]
    match key_filter:
        case {"prefix": str(prefix)}:
            return key.startswith(prefix)
        case {"anything-but": {"prefix": str(prefix)}}:
            return not key.startswith(prefix)
        case {"anything-but": {"wildcard": list(wildcards)}}:
            return not any(_wildcard(w, key) for w in wildcards)
    raise AssertionError(f"an operator this test does not know: {key_filter}")


def keys_by_kind(run: str, pid: str, round_no: int, digest: str) -> dict[ObjectKind, list[str]]:
    """A key of every kind the layout has, each form of it."""
    return {
        ObjectKind.JOIN: [keys.join_key(run, pid)],
        ObjectKind.INIT: [keys.init_key(run, pid)],
        ObjectKind.HEARTBEAT: [keys.heartbeat_key(run, pid)],
        ObjectKind.UPDATE: [keys.update_key(run, round_no, pid)],
        ObjectKind.WITNESS: [keys.witness_key(run, round_no, pid)],
        ObjectKind.HEALTH: [keys.health_key(run, round_no, pid)],
        ObjectKind.GLOBAL: [keys.global_key(run, round_no, digest)],
        ObjectKind.OPTIMIZER: [keys.optimizer_key(run, round_no, digest)],
        ObjectKind.DELTA: [keys.delta_key(run, round_no, digest)],
        ObjectKind.STAGING: [keys.staging_key(run, round_no, digest),
                             keys.shard_result_key(run, round_no, digest, round_no)],
        ObjectKind.ROSTER: [keys.roster_key(run, digest)],
        ObjectKind.CHECKPOINT: [keys.checkpoint_global_key(run, round_no), keys.checkpoint_state_key(run, round_no),
                                keys.checkpoint_optimizer_key(run, round_no, digest), keys.latest_checkpoint_key(run)],
        ObjectKind.MANIFEST: [keys.manifest_key(run)],
        ObjectKind.CONFIG: [keys.config_key(run)],
    }


@settings(max_examples=300, deadline=None)
@given(run=RUN_IDS, pid=st.from_regex(keys.PARTICIPANT_ID_PATTERN, fullmatch=True), round_no=st.integers(0, 999_999),
       digest=st.text("0123456789abcdef", min_size=64, max_size=64))
@example(run="r1x", pid="global", round_no=1, digest="ab" * 32)  # a reserved name: refused below
@example(run="r1x", pid="000001", round_no=1, digest="ab" * 32)  # a shard outcome's name
def test_every_upload_goes_down_exactly_one_lane_and_no_coordinator_object_down_either(
    run: str, pid: str, round_no: int, digest: str
) -> None:
    # Given a key of every kind of the layout, for any participant id, round and digest
    assume(pid.lower() not in keys.RESERVED_IDS)
    by_kind = keys_by_kind(run, pid, round_no, digest)
    assert set(by_kind) == set(ObjectKind)  # a new kind must be placed here: uploaded, or the coordinator's
    main, join = object_created_pattern("b", run), join_request_pattern("b", run)
    for kind, found in by_kind.items():
        for key in found:
            assert keys.parse_key(key).kind is kind
            lanes = (routed(main, key), routed(join, key))
            if kind is ObjectKind.JOIN:
                # Then a join request goes down the join lane only
                assert lanes == (False, True), key
            elif kind in keys.UPLOADED_KINDS:
                # And every other upload down the main lane only
                assert lanes == (True, False), key
            else:
                # And nothing the coordinator writes goes down either: no invocation for nothing
                assert lanes == (False, False), key


@pytest.mark.parametrize("rest", ["joined/alice", "join", "rounds/1/alice", "rounds/000001/x/alice", "global/alice"])
def test_a_key_outside_the_layout_goes_down_the_main_lane_to_have_its_refusal_recorded(rest: str) -> None:
    key = f"{keys.run_prefix('r1x')}{rest}"
    with pytest.raises(keys.KeyError_):
        keys.parse_key(key)
    assert routed(object_created_pattern("b", "r1x"), key) and not routed(join_request_pattern("b", "r1x"), key)


def test_the_main_lane_uses_only_operators_eventbridge_documents_for_s3_keys() -> None:
    # Given the main lane's key filter: anything-but over a list of wildcards, each a key of the layout with `*`s
    (key_filter,) = object_created_pattern("b", "r1x")["detail"]["object"]["key"]
    wildcards = key_filter["anything-but"]["wildcard"]
    # Then no wildcard holds two `*` in a row (EventBridge refuses them) or a backslash (its escape)
    assert all("**" not in w and "\\" not in w for w in wildcards)
    assert set(key_filter) == {"anything-but"} and set(key_filter["anything-but"]) == {"wildcard"}
