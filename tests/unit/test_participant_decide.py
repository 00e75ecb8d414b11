"""The participant's decision: one pure function of the run state and what it knows locally."""

from __future__ import annotations

import pytest

from participant.decide import (
    JOIN_RETRY_SECONDS,
    READY_RETRY_SECONDS,
    Fetch,
    Finish,
    Join,
    Local,
    OfferModel,
    ReportReady,
    Train,
    Wait,
    decide,
)
from shared.state import Member, MemberStatus, Phase, RunState

ME = "alice"
G = "a" * 64  # the current global model's digest
OLD = "b" * 64


def state(phase: Phase = Phase.TRAIN, members: tuple[str, ...] = (ME, "bob"), selected: tuple[str, ...] = (ME, "bob"),
          digest: str = G, round_no: int = 3, epoch: int = 1, **kw: object) -> RunState:
    return RunState(
        run_id="r-run", version=7, phase=phase, epoch=epoch, round=round_no, seed="c" * 64,
        members={p: Member() for p in members}, selected=selected, global_digest=digest, **kw,  # type: ignore[arg-type]
    )


def local(**kw: object) -> Local:
    base: dict[str, object] = dict(pid=ME, held=G, reported_ready=1)
    base.update(kw)
    return Local(**base)  # type: ignore[arg-type]


class TestTraining:
    def test_selected_with_the_model_trains_exactly_this_round(self) -> None:
        # Given a round that selects us, and the model it trains from in hand
        action = decide(state(), local())
        # Then we train that round from that model, with the round's seed and selection
        assert action == Train(round=3, epoch=1, seed="c" * 64, selected=(ME, "bob"), digest=G)

    def test_selected_without_the_model_fetches_it_first(self) -> None:
        assert decide(state(), local(held=OLD)) == Fetch(3, G)

    def test_not_selected_waits(self) -> None:
        action = decide(state(selected=("bob",)), local())
        assert isinstance(action, Wait) and "not selected for round 3" in action.reason

    def test_already_uploaded_round_is_not_redone(self) -> None:
        action = decide(state(), local(uploaded=frozenset({2, 3})))
        assert isinstance(action, Wait) and "uploaded" in action.reason

    def test_update_already_stored_remotely_is_not_redone(self) -> None:
        # After a restart that lost the journal, the coordinator's record (or the object) says it is done
        action = decide(state(), local(recorded=True))
        assert isinstance(action, Wait) and "already stored" in action.reason

    def test_an_earlier_upload_does_not_block_the_next_round(self) -> None:
        assert isinstance(decide(state(round_no=4), local(uploaded=frozenset({3}))), Train)

    @pytest.mark.parametrize("phase", [Phase.WITNESS, Phase.COOLDOWN])
    def test_between_rounds_waits(self, phase: Phase) -> None:
        assert isinstance(decide(state(phase=phase, selected=()), local()), Wait)


class TestMembership:
    def test_dropped_member_waits_for_the_next_epoch_with_the_reason(self) -> None:
        s = state(selected=("bob",))
        s = s.evolve(members={**s.members, ME: Member(MemberStatus.DROPPED, 5.0, "silent for 61s")})
        action = decide(s, local())
        assert isinstance(action, Wait)
        assert "dropped" in action.reason and "silent for 61s" in action.reason and "next epoch" in action.reason

    def test_late_joiner_waits_and_does_not_download(self) -> None:
        action = decide(state(members=("bob", "carol"), selected=("bob",)), local(held=""))
        assert isinstance(action, Wait) and "not a member of epoch 1" in action.reason

    def test_waiting_for_members_with_a_model(self) -> None:
        action = decide(state(phase=Phase.WAITING, members=(), selected=()), local(held=""))
        assert isinstance(action, Wait) and "enough members" in action.reason


class TestWarmup:
    def test_member_without_the_model_fetches_it(self) -> None:
        s = state(phase=Phase.WARMUP, selected=(), round_no=0)
        assert decide(s, local(held="", reported_ready=0)) == Fetch(0, G)

    def test_member_holding_the_model_reports_ready_at_once(self) -> None:
        s = state(phase=Phase.WARMUP, selected=(), epoch=2)
        assert decide(s, local(reported_ready=1)) == ReportReady(2)

    def test_ready_reported_and_recorded_waits(self) -> None:
        s = state(phase=Phase.WARMUP, selected=(), epoch=2)
        action = decide(s, local(reported_ready=2, ready_recorded=2, ready_age=30.0))
        assert isinstance(action, Wait) and "ready for epoch 2" in action.reason

    def test_ready_not_recorded_is_reported_again_after_a_while(self) -> None:
        s = state(phase=Phase.WARMUP, selected=(), epoch=2)
        soon = local(reported_ready=2, ready_recorded=1, ready_age=READY_RETRY_SECONDS / 4)
        later = local(reported_ready=2, ready_recorded=1, ready_age=READY_RETRY_SECONDS)
        assert isinstance(decide(s, soon), Wait)
        assert decide(s, later) == ReportReady(2)

    def test_non_member_in_warmup_waits(self) -> None:
        s = state(phase=Phase.WARMUP, members=("bob",), selected=())
        assert isinstance(decide(s, local(held="", reported_ready=0)), Wait)


class TestStartAndEnd:
    def test_no_model_yet_offers_the_initial_model_once(self) -> None:
        s = state(phase=Phase.WAITING, members=(), selected=(), digest="", round_no=0)
        assert decide(s, local(held="", reported_ready=0)) == OfferModel()
        assert isinstance(decide(s, local(held="", reported_ready=0, offered=True)), Wait)

    def test_join_not_recorded_waits_then_rejoins(self) -> None:
        s = state(phase=Phase.WAITING, members=(), selected=(), digest="", round_no=0)
        assert isinstance(decide(s, local(joined=False, join_age=1.0)), Wait)
        assert decide(s, local(joined=False, join_age=JOIN_RETRY_SECONDS)) == Join()

    def test_no_offer_before_the_join_is_recorded(self) -> None:
        # the coordinator refuses offers from participants it does not know
        s = state(phase=Phase.WAITING, members=(), selected=(), digest="", round_no=0)
        assert not isinstance(decide(s, local(joined=False, join_age=1.0)), OfferModel)

    def test_finished_fetches_then_evaluates_the_final_model(self) -> None:
        s = state(phase=Phase.FINISHED, selected=(), round_no=15)
        assert decide(s, local(held=OLD)) == Fetch(15, G)
        assert decide(s, local(held=G)) == Finish(15, G)

    def test_finished_ends_even_for_a_non_member_or_unjoined_participant(self) -> None:
        s = state(phase=Phase.FINISHED, members=(), selected=(), round_no=15)
        assert decide(s, local(joined=False)) == Finish(15, G)

    def test_finished_without_a_model(self) -> None:
        s = state(phase=Phase.FINISHED, members=(), selected=(), digest="", round_no=0)
        assert decide(s, local(held="")) == Finish(0, "")
