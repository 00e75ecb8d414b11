"""The participant's decision: one pure function of the run state and what it knows locally."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from participant.decide import (
    JOIN_RETRY_MAX_SECONDS,
    JOIN_RETRY_SECONDS,
    READY_RETRY_MAX_SECONDS,
    READY_RETRY_SECONDS,
    CheckUpdates,
    Fetch,
    Finish,
    Join,
    Local,
    OfferModel,
    ReportHealth,
    ReportReady,
    SendProof,
    Train,
    Wait,
    decide,
    heartbeat_due,
    unhealthy,
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

    def test_ready_re_sends_back_off_up_to_the_cap(self) -> None:
        s = state(phase=Phase.WARMUP, selected=(), epoch=2)
        for sends, wait in [(1, READY_RETRY_SECONDS), (3, 4 * READY_RETRY_SECONDS), (50, READY_RETRY_MAX_SECONDS)]:
            kept = local(reported_ready=2, ready_recorded=1, ready_sends=sends, ready_age=wait * 0.99)
            assert isinstance(decide(s, kept), Wait), sends
            assert decide(s, replace(kept, ready_age=wait)) == ReportReady(2), sends

    def test_a_ready_report_still_queued_is_not_sent_again_until_the_cap(self) -> None:
        # Given a ready report not recorded, and no message of ours accepted since it: it waits in the queue
        s = state(phase=Phase.WARMUP, selected=(), epoch=2)
        queued = local(reported_ready=2, ready_recorded=1, ready_in_flight=True, ready_age=4 * READY_RETRY_SECONDS)
        # Then it is not sent again (that would queue behind it), unless it waited the longest re-send interval
        assert isinstance(decide(s, queued), Wait)
        assert decide(s, replace(queued, ready_age=READY_RETRY_MAX_SECONDS)) == ReportReady(2)
        # and one the coordinator passed over (a later message of ours accepted) is sent again on the usual schedule
        assert decide(s, replace(queued, ready_in_flight=False)) == ReportReady(2)

    def test_non_member_in_warmup_waits(self) -> None:
        s = state(phase=Phase.WARMUP, members=("bob",), selected=())
        assert isinstance(decide(s, local(held="", reported_ready=0)), Wait)


class TestGlobalModelThatDoesNotFit:
    """A global model that does not fit our task (one offered by a participant of another task, in a run that named
    no initial model) is not ours to train from, nor a reason to leave the run."""

    @pytest.mark.parametrize("phase", [Phase.WARMUP, Phase.TRAIN])
    def test_it_waits_for_another_global_instead_of_fetching_it_again(self, phase: Phase) -> None:
        action = decide(state(phase=phase), local(held=OLD, unfit=G, reported_ready=0))
        assert isinstance(action, Wait) and action.announced and "does not fit our task" in action.reason

    def test_a_witness_waits_too(self) -> None:
        s = state(witnesses=(ME,))
        assert isinstance(decide(s, local(held=OLD, unfit=G, uploaded=frozenset({3}))), Wait)

    def test_the_next_global_is_fetched(self) -> None:
        assert decide(state(round_no=4, digest=G), local(held=OLD, unfit=OLD)) == Fetch(4, G)

    def test_a_run_that_finished_with_it_is_over_for_us(self) -> None:
        s = state(phase=Phase.FINISHED)
        assert decide(s, local(held=OLD, unfit=G)) == Finish(3, G, unfit=True)


class TestStartAndEnd:
    def test_no_model_yet_offers_the_initial_model_once(self) -> None:
        s = state(phase=Phase.WAITING, members=(), selected=(), digest="", round_no=0)
        assert decide(s, local(held="", reported_ready=0)) == OfferModel()
        assert isinstance(decide(s, local(held="", reported_ready=0, offered=True)), Wait)

    def test_join_not_recorded_waits_then_rejoins(self) -> None:
        s = state(phase=Phase.WAITING, members=(), selected=(), digest="", round_no=0)
        assert isinstance(decide(s, local(joined=False, join_age=1.0, offered=True)), Wait)
        assert decide(s, local(joined=False, join_age=JOIN_RETRY_SECONDS, offered=True)) == Join()

    def test_join_re_sends_wait_twice_as_long_each_time_up_to_the_cap(self) -> None:
        s = state(phase=Phase.WAITING, members=(), selected=(), digest="", round_no=0)
        for sends, wait in [(1, JOIN_RETRY_SECONDS), (2, 2 * JOIN_RETRY_SECONDS), (3, 4 * JOIN_RETRY_SECONDS),
                            (20, JOIN_RETRY_MAX_SECONDS)]:
            joiner = local(joined=False, join_sends=sends, offered=True, join_age=wait * 0.99)
            assert isinstance(decide(s, joiner), Wait), sends
            assert decide(s, replace(joiner, join_age=wait)) == Join(), sends

    def test_a_joiner_offers_its_model_at_once_then_listens_for_its_registration(self) -> None:
        # ingest keeps an offer sent before the join is registered, and the join function takes it: no need to poll
        # our record to learn when we may offer
        s = state(phase=Phase.WAITING, members=(), selected=(), digest="", round_no=0)
        assert decide(s, local(joined=False, join_age=1.0)) == OfferModel()
        assert decide(s, local(joined=False, join_age=1.0, offered=True)) == Wait(
            "waiting for the join request to be recorded", announced=True)
        assert decide(replace(s, global_digest=G), local(joined=False, join_age=1.0)) == Wait(
            "waiting for the join request to be recorded", announced=True)

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


class TestWitnessDuty:
    def witness_state(self, phase: Phase = Phase.TRAIN) -> RunState:
        return state(phase=phase, members=(ME, "bob", "carol"), selected=(ME, "bob", "carol"),
                     witnesses=("bob", ME))

    def test_own_training_comes_first(self) -> None:
        assert isinstance(decide(self.witness_state(), local(witness_missing=2)), Train)

    def test_after_uploading_it_verifies_what_was_recorded(self) -> None:
        action = decide(self.witness_state(), local(uploaded=frozenset({3}), witness_unchecked=1, witness_missing=1))
        assert action == CheckUpdates(3)

    def test_it_waits_for_the_missing_updates_while_the_round_is_open(self) -> None:
        action = decide(self.witness_state(), local(uploaded=frozenset({3}), witness_missing=1))
        assert isinstance(action, Wait) and "witness of round 3: 1 update(s) still to come" in action.reason

    def test_everything_recorded_and_verified_sends_a_complete_proof(self) -> None:
        assert decide(self.witness_state(), local(recorded=True)) == SendProof(3, complete=True)

    def test_the_round_closing_first_sends_what_it_has(self) -> None:
        s = self.witness_state(Phase.WITNESS)
        assert decide(s, local(uploaded=frozenset({3}), witness_missing=1)) == SendProof(3, complete=False)
        # even if our own training never finished
        assert decide(s, local(witness_missing=2)) == SendProof(3, complete=False)

    def test_the_global_model_is_fetched_first_after_a_restart(self) -> None:
        s = self.witness_state(Phase.WITNESS)
        assert decide(s, local(held="", witness_missing=1)) == Fetch(3, G)

    def test_a_proof_is_sent_once(self) -> None:
        action = decide(self.witness_state(Phase.WITNESS), local(witnessed=frozenset({3})))
        assert isinstance(action, Wait) and "aggregation" in action.reason

    def test_a_non_witness_has_no_duty(self) -> None:
        s = self.witness_state().evolve(witnesses=("bob", "carol"))
        action = decide(s, local(uploaded=frozenset({3})))
        assert isinstance(action, Wait) and "uploaded" in action.reason


class TestHealthReports:
    def scored(self, **kw: object) -> RunState:
        s = state(members=(ME, "bob", "carol", "dave"), selected=(ME, "bob"), health_round=2,
                  health={ME: 2, "bob": 2, "carol": 0, "dave": 1}, health_quorum=2, strikes={"carol": 2, "dave": 3},
                  strikes_needed=2)
        return s.evolve(**kw)

    def test_names_active_members_below_the_quorum_in_enough_rounds_in_a_row_except_itself(self) -> None:
        s = self.scored(health={ME: 0, "bob": 2, "carol": 0, "dave": 1}, strikes={ME: 2, "carol": 2, "dave": 2})
        assert unhealthy(s, ME) == ("carol", "dave")
        assert unhealthy(s.evolve(strikes={"carol": 1, "dave": 2}), ME) == ("dave",), "one round is not enough"

    def test_a_confirmed_round_is_reported_once_before_anything_else(self) -> None:
        assert decide(self.scored(), local(health_confirmed=True)) == ReportHealth(2, ("carol", "dave"))
        assert isinstance(decide(self.scored(), local(health_confirmed=True, health_reported=frozenset({2}))), Train)

    def test_a_round_whose_proofs_missed_the_quorum_is_not_reported(self) -> None:
        assert isinstance(decide(self.scored(), local(health_confirmed=False)), Train)

    def test_dropped_peers_are_not_named_again(self) -> None:
        s = self.scored()
        s = s.evolve(members={**s.members, "carol": Member(MemberStatus.DROPPED, 1.0, "health check")})
        assert decide(s, local(health_confirmed=True)) == ReportHealth(2, ("dave",))

    def test_nobody_reports_outside_an_epoch_or_when_not_a_member(self) -> None:
        assert isinstance(decide(self.scored(phase=Phase.COOLDOWN), local(health_confirmed=True)), Wait)
        s = self.scored()
        s = s.evolve(members={p: m for p, m in s.members.items() if p != ME})
        assert isinstance(decide(s, local(health_confirmed=True)), Wait)


def test_a_heartbeat_due_soon_after_an_update_upload_is_skipped() -> None:
    # Given an update uploaded at t = 100 that stands in for a heartbeat for 40 s
    # Then a beat due 5 s later is skipped (the update shows us alive), one due 40 s after it is sent
    assert not heartbeat_due(105.0, 100.0, 40.0)
    assert heartbeat_due(140.0, 100.0, 40.0) and heartbeat_due(145.0, 100.0, 40.0)
    # and without any update yet, every beat is sent
    assert heartbeat_due(1.0, -math.inf, 40.0)


def test_the_next_heartbeat_is_one_interval_after_a_heartbeat_and_longer_after_an_update() -> None:
    from participant.decide import next_heartbeat

    # heartbeats every 3 s, an update standing in for 6 s: after a heartbeat at 10 and an update at 12, at 18
    assert next_heartbeat(10.0, 12.0, 3.0, 6.0) == 18.0
    # no update since long before the last heartbeat: one interval after it
    assert next_heartbeat(10.0, float("-inf"), 3.0, 6.0) == 13.0
    assert next_heartbeat(10.0, 1.0, 3.0, 6.0) == 13.0


def test_an_update_stands_in_for_a_heartbeat_for_two_intervals_leaving_one_before_the_liveness_timeout() -> None:
    from shared.config import RunConfig

    # by default heartbeats every third of the liveness timeout: an update covers two of them
    assert RunConfig(run_id="run", liveness_timeout=180).heartbeat_after_update == 120
    # an interval set longer: the update covers what leaves one interval before the timeout, and never less than one
    assert RunConfig(run_id="run", liveness_timeout=180, heartbeat_interval=80).heartbeat_after_update == 100
    assert RunConfig(run_id="run", liveness_timeout=180, heartbeat_interval=100).heartbeat_after_update == 100
