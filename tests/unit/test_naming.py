"""Resource names: no run's participant queue can be another run's queue, or a coordinator queue."""

from __future__ import annotations

import pytest
from hypothesis import assume, example, given
from hypothesis import strategies as st
from pydantic import ValidationError

from shared.config import RunConfig
from shared.keys import PARTICIPANT_ID_PATTERN, RUN_ID_PATTERN
from shared.naming import (
    PARTICIPANT_QUEUE_MARK,
    ingest_queue_name,
    join_queue_name,
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
