"""The admission rules (shared/admission.py): round slots, update metadata, participant info."""

from __future__ import annotations

from typing import Any

import pytest

from shared.admission import INFO_ITEMS, bounded_info, check_update_meta, slot_problem
from shared.config import RunConfig
from shared.selection import assigned_count
from shared.state import Member, Phase, RunState
from shared.wire import UpdateMeta, WireError

RUN = "unit-run"
PIDS = ("alice", "bob", "carol")


def state(**changes: Any) -> RunState:
    base: dict[str, Any] = dict(phase=Phase.TRAIN, epoch=1, round=4, members={p: Member() for p in PIDS},
                                selected=PIDS)
    base.update(changes)
    return RunState(RUN, **base)


def config(**changes: Any) -> RunConfig:
    return RunConfig(run_id=RUN, dataset_size=90, **changes)


def meta(pid: str = "bob", round_no: int = 4, samples: int = 30, run_id: str = RUN) -> UpdateMeta:
    return UpdateMeta(run_id, round_no, pid, samples, {"loss": 1.0})


# --- slot_problem -------------------------------------------------------------------------------------


def test_an_update_for_the_current_training_round_from_a_member_has_a_slot() -> None:
    assert slot_problem(state(), 4, "alice") == ""


@pytest.mark.parametrize(
    "changes, round_no, pid, reason",
    [
        ({"phase": Phase.FINISHED}, 4, "alice", "the run is finished"),
        ({"phase": Phase.FINISHED}, 9, "mallory", "the run is finished"),  # finished is said first
        ({}, 5, "alice", "wrong round: update for round 5, the run is at round 4"),
        ({}, 3, "alice", "wrong round: update for round 3, the run is at round 4"),
        ({"phase": Phase.WITNESS}, 4, "alice", f"round 4 is not accepting updates (phase {Phase.WITNESS})"),
        ({"phase": Phase.COOLDOWN}, 4, "alice", f"round 4 is not accepting updates (phase {Phase.COOLDOWN})"),
        ({}, 4, "mallory", "mallory is not a member of epoch 1"),
    ],
)
def test_why_an_update_has_no_slot(changes: dict[str, Any], round_no: int, pid: str, reason: str) -> None:
    assert slot_problem(state(**changes), round_no, pid) == reason


# --- check_update_meta --------------------------------------------------------------------------------


def test_believable_metadata_passes() -> None:
    assigned = assigned_count(90, PIDS, "bob")
    check_update_meta(meta(samples=assigned), config(), state(), "bob", 4)
    check_update_meta(meta(samples=1), config(), state(), "bob", 4)


@pytest.mark.parametrize(
    "bad, words",
    [
        (meta(run_id="other-run"), "another run, round or participant"),
        (meta(round_no=3), "another run, round or participant"),
        (meta(pid="alice"), "another run, round or participant"),
        (meta(samples=0), "sample count must be positive, got 0"),
        (meta(samples=-5), "sample count must be positive, got -5"),
        (meta(samples=31), "claims 31 samples, more than the 30 it was assigned"),
    ],
)
def test_unbelievable_metadata_is_refused(bad: UpdateMeta, words: str) -> None:
    with pytest.raises(WireError, match=words):
        check_update_meta(bad, config(), state(), "bob", 4)


def test_without_a_known_data_set_any_positive_count_is_believed() -> None:
    check_update_meta(meta(samples=10**6), RunConfig(run_id=RUN), state(), "bob", 4)


def test_an_unselected_participant_was_assigned_nothing() -> None:
    with pytest.raises(WireError, match="more than the 0 it was assigned"):
        check_update_meta(meta(samples=1), config(), state(selected=("alice", "carol")), "bob", 4)


# --- distance -----------------------------------------------------------------------------------------


# --- bounded_info -------------------------------------------------------------------------------------


def test_bounded_info_keeps_numbers_and_cuts_text() -> None:
    kept = bounded_info({"host": "h" * 500, "os_pid": 42, "load": 0.5, "gpu": True, "note": None, "k" * 80: "v"})
    assert kept == {"host": "h" * 200, "os_pid": 42, "load": 0.5, "gpu": True, "note": "None", "k" * 40: "v"}


def test_bounded_info_keeps_the_first_items_only() -> None:
    info = {f"key{i:02d}": i for i in range(50)}
    kept = bounded_info(info)
    assert list(kept) == [f"key{i:02d}" for i in range(INFO_ITEMS)]
    assert bounded_info({}) == {}


def test_a_message_is_fresh_only_within_the_clock_skew_of_its_arrival() -> None:
    from shared.admission import staleness

    assert staleness(1000.0, 1000.0, 300) == ""
    assert staleness(1000.0, 1299.0, 300) == "" and staleness(1299.0, 1000.0, 300) == ""  # clocks disagree a bit
    assert "stale: sent at 1000.000, received at 1301.000, more than 300 s apart" in staleness(1000.0, 1301.0, 300)


def test_an_update_uploaded_before_its_round_started_is_a_left_over_of_a_restored_run() -> None:
    s = state(round_started=1000.0)
    assert slot_problem(s, 4, "alice", uploaded_at=999.0) == ""  # whole-second event times, another clock
    assert "before round 4 started" in slot_problem(s, 4, "alice", uploaded_at=990.0)
