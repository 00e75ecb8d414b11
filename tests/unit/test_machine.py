"""The coordinator state machine: every row of the transition table, and the table's own shape."""

from __future__ import annotations

import pytest

from shared.config import RunConfig
from shared.machine import TRANSITIONS, count_strikes, tick, transition_table
from shared.state import (
    AdoptInitialModel,
    Aggregate,
    CarryGlobal,
    Member,
    MemberStatus,
    ParticipantView,
    Phase,
    RecordRound,
    RunState,
    Snapshot,
    UpdateView,
    WriteCheckpoint,
)
from shared.witness import Proof

CFG = RunConfig(
    run_id="unit-run",
    min_clients=2,
    min_per_round=2,
    min_updates=1,
    total_rounds=3,
    warmup_time=10,
    max_round_train_time=30,
    round_witness_time=5,
    cooldown_time=5,
    liveness_timeout=20,
)
T0 = 1000.0


def pv(pid: str, seen: float = T0, ready: int = 0, init: str = "", joined: float = T0 - 50,
       heard: float | None = None) -> ParticipantView:
    """A participant that joined at `joined` and was heard from after its join (at `seen`, unless `heard` says
    otherwise; 0: never since its join)."""
    return ParticipantView(pid, joined_at=joined, last_seen=seen, ready_epoch=ready, init_digest=init,
                           heard_at=seen if heard is None else heard)


def members(*pids: str) -> dict[str, Member]:
    return {p: Member(MemberStatus.ACTIVE, T0 - 10) for p in pids}


def state(phase: Phase, **kw: object) -> RunState:
    base = dict(run_id="unit-run", version=3, phase=phase, epoch=1, global_digest="g0", deadline=T0 + 100)
    base.update(kw)
    return RunState(**base)  # type: ignore[arg-type]


def upd(pid: str, rnd: int = 0, ok: bool = True) -> UpdateView:
    return UpdateView(pid, rnd, ok, samples=10, digest=f"d-{pid}", reason="" if ok else "bad", metrics={"loss": 1.0})


# Each scenario: (transition name, snapshot, now) such that that row is the first to fire.
SCENARIOS = {
    "epoch_start": (
        Snapshot(RunState("unit-run"), {"a": pv("a", init="i"), "b": pv("b")}),
        T0,
    ),
    "warmup_too_few": (
        Snapshot(state(Phase.WARMUP, members=members("a", "b")), {"a": pv("a"), "b": pv("b", seen=T0 - 60)}),
        T0,
    ),
    "warmup_done": (
        Snapshot(state(Phase.WARMUP, members=members("a", "b")), {"a": pv("a", ready=1), "b": pv("b", ready=1)}),
        T0,
    ),
    "train_too_few": (
        Snapshot(
            state(Phase.TRAIN, members=members("a", "b"), selected=("a", "b")),
            {"a": pv("a"), "b": pv("b", seen=T0 - 60)},
        ),
        T0,
    ),
    "round_closed": (
        Snapshot(
            state(Phase.TRAIN, members=members("a", "b"), selected=("a", "b")),
            {"a": pv("a"), "b": pv("b")},
            {"a": upd("a"), "b": upd("b")},
        ),
        T0,
    ),
    "aggregate_epoch_end": (
        Snapshot(
            state(Phase.WITNESS, members=members("a", "b"), counted=("a", "b"), aggregated=2, round=2, deadline=T0),
            {"a": pv("a"), "b": pv("b")},
            {"a": upd("a", 2), "b": upd("b", 2)},
        ),
        T0,
    ),
    "witness_too_few": (
        Snapshot(
            state(Phase.WITNESS, members=members("a", "b"), counted=("a",), deadline=T0),
            {"a": pv("a"), "b": pv("b", seen=T0 - 60)},
            {"a": upd("a")},
        ),
        T0,
    ),
    "aggregate_next_round": (
        Snapshot(
            state(Phase.WITNESS, members=members("a", "b"), counted=("a",), deadline=T0),
            {"a": pv("a"), "b": pv("b")},
            {"a": upd("a"), "b": upd("b", ok=False)},
        ),
        T0,
    ),
    "round_retry": (
        Snapshot(
            state(Phase.WITNESS, members=members("a", "b"), counted=(), deadline=T0),
            {"a": pv("a"), "b": pv("b")},
            {"a": upd("a", ok=False), "b": upd("b", ok=False)},
        ),
        T0,
    ),
    "witness_quorum_missed": (
        Snapshot(
            state(Phase.WITNESS, members=members("a", "b", "c"), selected=("a", "b", "c"), counted=("a", "b", "c"),
                  witnesses=("a", "b", "c"), deadline=T0),
            {p: pv(p) for p in "abc"},
            {p: upd(p) for p in "abc"},
            {"a": Proof.build("unit-run", 0, "a", 0, {p: f"d-{p}" for p in "abc"}, 3, True)},
        ),
        T0,
    ),
    "witness_redraw": (  # b's proof attests nothing of what a attests: b is struck, d draws its seat
        Snapshot(
            state(Phase.WITNESS, members=members("a", "b", "c", "d"), selected=("a", "b", "c", "d"),
                  counted=("a", "b", "c"), witnesses=("a", "b", "c"), deadline=T0, seed="00"),
            {p: pv(p) for p in "abcd"},
            {p: upd(p) for p in "abc"},
            {"a": Proof.build("unit-run", 0, "a", 0, {p: f"d-{p}" for p in "abc"}, 4, True),
             "b": Proof.build("unit-run", 0, "b", 1, {}, 4, True)},
        ),
        T0,
    ),
    "witness_redraw_training": (
        Snapshot(
            state(Phase.TRAIN, members=members("a", "b", "c", "d"), selected=("a", "b", "c", "d"),
                  witnesses=("a", "b", "c"), seed="00"),
            {p: pv(p) for p in "abcd"},
            refused_proofs={"c": "its participants filter has 64 of 64 bits set"},
        ),
        T0,
    ),
    "finish_waiting": (Snapshot(state(Phase.WAITING, members={}, aggregated=3, round=3)), T0),
    "resume": (Snapshot(state(Phase.PAUSED, members={}), {"a": pv("a"), "b": pv("b")}), T0),
    **{
        f"pause_{phase.name.lower()}": (
            Snapshot(state(phase, members=members("a", "b"), pause_requested=True), {"a": pv("a"), "b": pv("b")}),
            T0,
        )
        for phase in (Phase.WAITING, Phase.WARMUP, Phase.TRAIN, Phase.WITNESS, Phase.COOLDOWN)
    },
    "run_complete": (
        Snapshot(state(Phase.COOLDOWN, members=members("a", "b"), aggregated=3, round=3, deadline=T0)),
        T0,
    ),
    "next_epoch": (
        Snapshot(
            state(Phase.COOLDOWN, members=members("a", "b"), aggregated=1, round=1, deadline=T0),
            {"a": pv("a"), "b": pv("b"), "c": pv("c")},
        ),
        T0,
    ),
    "next_epoch_waiting": (
        Snapshot(
            state(Phase.COOLDOWN, members=members("a", "b"), aggregated=1, round=1, deadline=T0),
            {"a": pv("a"), "b": pv("b", seen=T0 - 60)},
        ),
        T0,
    ),
}


def test_every_transition_has_a_scenario() -> None:
    assert {t.name for t in TRANSITIONS} == set(SCENARIOS)


@pytest.mark.parametrize("row", TRANSITIONS, ids=lambda t: t.name)
def test_transition_fires(row) -> None:  # type: ignore[no-untyped-def]
    # Given a run set up for this row
    snap, now = SCENARIOS[row.name]
    assert snap.state.phase is row.source
    # When the coordinator ticks
    decision = tick(snap, CFG, now)
    # Then this row fires first and the run moves to its target
    assert decision.fired[0] == row.name, decision.fired
    assert decision.changed
    first_target = row.target
    if len(decision.fired) == 1:
        assert decision.state.phase is first_target


def test_table_shape() -> None:
    sources = {t.source for t in TRANSITIONS}
    assert Phase.FINISHED not in sources, "nothing leaves Finished"
    for phase in Phase:
        if phase is not Phase.FINISHED:
            assert phase in sources, f"{phase} has no way out"
    reachable, frontier = {Phase.WAITING}, [Phase.WAITING]
    while frontier:
        here = frontier.pop()
        for t in TRANSITIONS:
            if t.source is here and t.target not in reachable:
                reachable.add(t.target)
                frontier.append(t.target)
    assert reachable == set(Phase)
    assert transition_table().count("\n") == len(TRANSITIONS) + 1


def test_epoch_start_adopts_the_first_offer_and_admits_live_participants() -> None:
    snap = Snapshot(RunState("unit-run"), {"b": pv("b", init="ib"), "a": pv("a", init="ia"), "z": pv("z", T0 - 99)})
    d = tick(snap, CFG, T0)
    assert d.state.phase is Phase.WARMUP and d.state.epoch == 1
    assert set(d.state.members) == {"a", "b"}  # z is silent: not admitted
    assert AdoptInitialModel("a", "ia", 0) in d.effects
    assert d.state.global_digest == "ia"


def test_epoch_start_adopts_the_model_most_offered_not_the_first_id() -> None:
    # An attacker whose id sorts first offers a model of the right shape with weights of its own; the honest
    # participants all built the same one from the run's seed
    fleet = {"a": pv("a", init="evil"), "b": pv("b", init="honest"), "c": pv("c", init="honest")}
    d = tick(Snapshot(RunState("unit-run"), fleet), CFG, T0)
    assert d.state.global_digest == "honest" and d.state.model_source == "b"
    tie = {"a": pv("a", init="x"), "b": pv("b", init="y")}
    assert tick(Snapshot(RunState("unit-run"), tie), CFG, T0).state.global_digest == "x"  # equals: first by id


def test_no_epoch_without_a_model_or_an_offer() -> None:
    snap = Snapshot(RunState("unit-run"), {"a": pv("a"), "b": pv("b")})
    assert not tick(snap, CFG, T0).changed


def test_late_joiner_waits_for_the_next_epoch() -> None:
    snap = Snapshot(
        state(Phase.TRAIN, members=members("a", "b"), selected=("a", "b")),
        {"a": pv("a"), "b": pv("b"), "late": pv("late")},
    )
    d = tick(snap, CFG, T0)
    assert "late" not in d.state.members and "late" not in d.state.selected


def test_selection_is_fraction_with_minimum() -> None:
    cfg = CFG.model_copy(update={"fraction_per_round": 0.5, "min_per_round": 2, "min_clients": 2})
    pids = [f"p{i}" for i in range(10)]
    snap = Snapshot(
        state(Phase.WARMUP, members=members(*pids)), {p: pv(p, ready=1) for p in pids}
    )
    d = tick(snap, cfg, T0)
    assert len(d.state.selected) == 5
    assert tick(snap, cfg, T0).state.selected == d.state.selected  # deterministic


def test_deadline_drops_the_missing_and_freezes_the_count() -> None:
    snap = Snapshot(
        state(Phase.TRAIN, members=members("a", "b", "c"), selected=("a", "b", "c"), deadline=T0),
        {p: pv(p) for p in "abc"},
        {"a": upd("a")},
    )
    cfg = CFG.model_copy(update={"min_clients": 1, "min_per_round": 1})
    d = tick(snap, cfg, T0)
    assert d.fired[0] == "round_closed"  # and, without witnesses, the round is decided at once
    assert d.state.members["b"].status is MemberStatus.DROPPED
    assert "deadline" in d.state.members["b"].reason
    (rec,) = [e for e in d.effects if isinstance(e, RecordRound)]
    assert rec.summary.counted == ("a",) and "b" in rec.summary.dropped
    assert "b" not in d.state.selected


def test_aggregate_effect_lists_exactly_the_counted_updates() -> None:
    snap = SCENARIOS["aggregate_next_round"][0]
    d = tick(snap, CFG, T0)
    (agg,) = [e for e in d.effects if isinstance(e, Aggregate)]
    assert [i.participant for i in agg.inputs] == ["a"]
    (rec,) = [e for e in d.effects if isinstance(e, RecordRound)]
    assert rec.summary.refused == {"b": "bad"}
    assert d.state.round == 1 and d.state.aggregated == 1


def test_retry_carries_the_model_and_uses_a_new_round_number() -> None:
    snap = SCENARIOS["round_retry"][0]
    d = tick(snap, CFG, T0)
    assert CarryGlobal(0, "g0") in d.effects
    assert d.state.round == 1 and d.state.aggregated == 0
    assert d.state.global_digest == "g0"


def test_one_tick_runs_a_whole_round_when_nothing_waits() -> None:
    cfg = CFG.model_copy(update={"round_witness_time": 0})
    snap = SCENARIOS["round_closed"][0]
    d = tick(snap, cfg, T0)
    assert d.fired == ("round_closed", "aggregate_next_round")
    assert d.state.phase is Phase.TRAIN and d.state.round == 1
    assert d.state.global_digest == ""  # filled in by resolve() once the aggregate is written


def test_nothing_to_do_changes_nothing() -> None:
    snap = Snapshot(
        state(Phase.TRAIN, members=members("a", "b"), selected=("a", "b")), {"a": pv("a"), "b": pv("b")}
    )
    d = tick(snap, CFG, T0)
    assert not d.changed and d.fired == () and d.effects == ()


# --- witnesses, health checks, epochs, pause ----------------------------------------------------------

CFG_W = CFG.model_copy(update={"witness_nodes": 3, "min_clients": 3, "min_per_round": 3, "round_witness_time": 5})


def witness_round(proofs: dict[str, dict[str, str]], complete: bool = True, **kw: object) -> Snapshot:
    pids = ("a", "b", "c", "d")
    updates = {p: upd(p) for p in pids}
    built = {w: Proof.build("unit-run", 0, w, i, att, 4, complete) for i, (w, att) in enumerate(proofs.items())}
    base: dict[str, object] = dict(members=members(*pids), selected=pids, witnesses=("a", "b", "c"), deadline=T0 + 100)
    base.update(kw)
    phase = base.pop("phase", Phase.TRAIN)
    return Snapshot(state(phase, **base), {p: pv(p) for p in pids}, updates, built)  # type: ignore[arg-type]


def test_opportunistic_witnessing_closes_the_round_once_a_quorum_checked_everything() -> None:
    honest = {p: f"d-{p}" for p in "abc"}  # nobody attests d
    one = witness_round({"a": honest})
    assert not tick(one, CFG_W, T0).changed, "one proof of three is not a quorum"
    two = witness_round({"a": honest, "b": honest})
    d = tick(two, CFG_W, T0)
    assert d.fired == ("round_closed",)  # RoundWitness then waits for the third proof or its deadline
    three = witness_round({"a": honest, "b": honest, "c": honest}, phase=Phase.WITNESS, counted=tuple("abcd"))
    d = tick(three, CFG_W, T0)
    assert d.fired[0] == "aggregate_next_round"
    (agg,) = [e for e in d.effects if isinstance(e, Aggregate)]
    assert [i.participant for i in agg.inputs] == ["a", "b", "c"], "the unattested update is not aggregated"
    (rec,) = [e for e in d.effects if isinstance(e, RecordRound)]
    assert rec.summary.health == {"a": 3, "b": 3, "c": 3, "d": 0} and rec.summary.proofs == 3
    assert d.state.health == rec.summary.health and d.state.health_quorum == 2


def test_an_attestation_of_other_bytes_does_not_count() -> None:
    wrong = {"a": "d-a", "b": "d-b", "c": "d-c", "d": "not-its-digest"}
    snap = witness_round({w: wrong for w in "abc"}, phase=Phase.WITNESS, counted=tuple("abcd"), deadline=T0)
    (rec,) = [e for e in tick(snap, CFG_W, T0).effects if isinstance(e, RecordRound)]
    assert rec.summary.health["d"] == 0 and "d" not in rec.summary.counted


def test_without_witnesses_missing_uploaders_are_not_dropped_at_the_deadline_but_by_health_reports() -> None:
    snap = witness_round({"a": {p: f"d-{p}" for p in "abc"}}, deadline=T0)
    snap = Snapshot(snap.state, snap.participants, {p: upd(p) for p in "abc"}, snap.proofs)
    d = tick(snap, CFG_W, T0)
    assert d.state.members["d"].status is MemberStatus.ACTIVE
    # Given the round closed with d unattested, a health report naming d (and a healthy a) arrives
    after = Snapshot(
        state(Phase.TRAIN, members=members(*"abcd"), selected=tuple("abcd"), witnesses=("a", "b", "c"),
              health_round=0, health={"a": 3, "b": 3, "c": 3, "d": 0}, health_quorum=2, round=1,
              strikes={"d": 2}, strikes_needed=2),
        {p: pv(p) for p in "abcd"},
        health_reports={"b": ("d", "a")},
    )
    d = tick(after, CFG_W, T0)
    assert d.state.members["d"].status is MemberStatus.DROPPED and "health check" in d.state.members["d"].reason
    assert "2 witnessed rounds in a row" in d.state.members["d"].reason
    assert d.state.members["a"].status is MemberStatus.ACTIVE, "a report the records contradict drops nobody"
    # A report from a non-member changes nothing
    outsider = Snapshot(after.state, after.participants, health_reports={"zed": ("d",)})
    assert not tick(outsider, CFG_W, T0).changed


def test_a_health_report_drops_only_on_the_configured_strikes_in_a_row() -> None:
    # Given a round that closes with d unattested by every witness (one strike; two are needed by default)
    honest = {p: f"d-{p}" for p in "abc"}
    closing = witness_round({w: honest for w in "abc"}, phase=Phase.WITNESS, counted=tuple("abcd"))
    closed = tick(closing, CFG_W, T0).state
    assert closed.strikes == {"d": 1} and closed.strikes_needed == CFG_W.health_strikes == 2
    assert closed.unhealthy() == ()

    def reported(s: RunState, cfg: RunConfig = CFG_W) -> RunState:
        return tick(Snapshot(s, {p: pv(p) for p in "abcd"}, health_reports={"b": ("d",)}), cfg, T0).state

    # Then a report naming d drops nobody after one unlucky round
    assert reported(closed).members["d"].status is MemberStatus.ACTIVE
    # But a second witnessed round in a row unattested does; a good round in between clears the count
    again = closed.evolve(strikes={"d": 2})
    assert again.unhealthy() == ("d",) and reported(again).members["d"].status is MemberStatus.DROPPED
    assert count_strikes({"d": 1}, {"a": 3, "d": 3}, 2) == {}
    assert count_strikes({"d": 1, "c": 1}, {"a": 3, "d": 0}, 2) == {"d": 2, "c": 1}, "c was not scored: kept"
    # And with health_strikes = 1 the first unattested round is enough
    strict = CFG_W.model_copy(update={"health_strikes": 1})
    first = tick(closing, strict, T0).state
    assert first.unhealthy() == ("d",) and reported(first, strict).members["d"].status is MemberStatus.DROPPED


def test_a_tick_that_read_the_clock_before_the_round_began_dates_its_drop_inside_the_round() -> None:
    # Given round 1 began at T0 + 5 (another invocation committed it), and a tick whose clock reads T0 (it read the
    # clock before that commit, or its host's clock is behind) applies a health report naming d
    began = T0 + 5
    during = Snapshot(
        state(Phase.TRAIN, members=members(*"abcd"), selected=tuple("abcd"), witnesses=("a", "b", "c"), round=1,
              phase_started=began, round_started=began, health_round=0, health={"a": 3, "b": 3, "c": 3, "d": 0},
              health_quorum=2, strikes={"d": 2}, strikes_needed=2),
        {p: pv(p) for p in "abcd"}, health_reports={"b": ("d",)},
    )
    d = tick(during, CFG_W, T0)
    # Then the drop is dated after the round began, not before it
    assert d.state.members["d"].status is MemberStatus.DROPPED and d.state.members["d"].since > began
    # And the round's record names it when the round closes
    closing = Snapshot(d.state.evolve(phase=Phase.WITNESS, counted=tuple("abc"), deadline=began + 1),
                       {p: pv(p, seen=began + 2) for p in "abcd"}, {p: upd(p, 1) for p in "abc"})
    (rec,) = [e for e in tick(closing, CFG_W, began + 2).effects if isinstance(e, RecordRound)]
    assert rec.summary.dropped == {"d": d.state.members["d"].reason}


def test_witnesses_are_elected_at_round_start() -> None:
    snap = SCENARIOS["warmup_done"][0]
    snap = Snapshot(snap.state.evolve(members=members(*"abcd")), {p: pv(p, ready=1) for p in "abcd"})
    d = tick(snap, CFG_W, T0)
    assert len(d.state.witnesses) == 3 and set(d.state.witnesses) <= set(d.state.selected)


def test_cooldown_writes_a_checkpoint() -> None:
    snap = SCENARIOS["aggregate_epoch_end"][0]
    d = tick(snap, CFG, T0)
    assert WriteCheckpoint(1, 3) in d.effects


def test_epoch_time_ends_the_epoch() -> None:
    cfg = CFG.model_copy(update={"epoch_time": 30, "total_rounds": 50})
    snap = SCENARIOS["aggregate_next_round"][0]
    snap = Snapshot(snap.state.evolve(epoch_started=T0 - 31), snap.participants, snap.updates)
    assert tick(snap, cfg, T0).fired[0] == "aggregate_epoch_end"


def test_pause_closes_an_open_round_and_resume_waits_for_members() -> None:
    snap = SCENARIOS["pause_train"][0]
    d = tick(snap, CFG, T0)
    assert d.state.phase is Phase.PAUSED and CarryGlobal(0, "g0") in d.effects and d.state.members == {}
    assert not tick(Snapshot(d.state, snap.participants), CFG, T0 + 999).changed, "a paused run stays paused"
    resumed = tick(Snapshot(d.state.evolve(pause_requested=False), snap.participants), CFG, T0)
    assert resumed.fired[:2] == ("resume", "epoch_start")


# --- admission: liveness since joining, and a bound on new members per epoch --------------------------


def admitted(d: object) -> set[str]:
    return set(d.state.members)  # type: ignore[attr-defined]


def test_a_joiner_not_heard_from_since_its_join_is_not_admitted() -> None:
    # Given a and b heard from after joining, and c whose join request is all the coordinator has seen of it
    snap = Snapshot(RunState("unit-run"), {"a": pv("a", init="i"), "b": pv("b"), "c": pv("c", heard=0)})
    # When an epoch starts
    d = tick(snap, CFG, T0)
    # Then c is not admitted, live as its join made it look
    assert d.fired[0] == "epoch_start" and admitted(d) == {"a", "b"}
    # And with only unproven joiners besides a, no epoch starts at all
    alone = Snapshot(RunState("unit-run"), {"a": pv("a", init="i"), "b": pv("b", heard=0), "c": pv("c", heard=0)})
    assert not tick(alone, CFG, T0).changed


def test_an_epoch_admits_at_most_max_admissions_new_participants_earliest_joined_first() -> None:
    # Given 3 admissions an epoch, and six live joiners heard from: f and e joined first, b and a tie after them
    cfg = CFG.model_copy(update={"max_admissions_per_epoch": 3})
    joined = {"f": T0 - 90, "e": T0 - 80, "b": T0 - 70, "a": T0 - 70, "c": T0 - 60, "d": T0 - 50}
    snap = Snapshot(RunState("unit-run"), {p: pv(p, joined=t, init="i") for p, t in joined.items()})
    # When the first epoch starts
    d = tick(snap, cfg, T0)
    # Then it admits exactly three: the earliest joined, the tie broken by id
    assert admitted(d) == {"f", "e", "a"}
    assert d.state.model_source == "a"  # the first offer (by id) among those admitted
    assert any("3 live participants wait for a later epoch" in str(e) for e in d.effects)
    # And the same snapshot always admits the same three
    assert admitted(tick(snap, cfg, T0)) == admitted(d)


def test_members_of_the_last_epoch_are_not_counted_against_the_bound() -> None:
    # Given an epoch of a, b, c cooling down (b dropped during it), 2 admissions an epoch, and four newcomers
    cfg = CFG.model_copy(update={"max_admissions_per_epoch": 2})
    members_now = {**members("a", "c"), "b": Member(MemberStatus.DROPPED, T0 - 5, "silent")}
    newcomers = {p: pv(p, joined=T0 - 40 + i) for i, p in enumerate(["n1", "n2", "n3", "n4"])}
    snap = Snapshot(state(Phase.COOLDOWN, members=members_now, aggregated=1, round=1, deadline=T0),
                    {"a": pv("a"), "b": pv("b"), "c": pv("c"), **newcomers})
    # When the next epoch starts
    d = tick(snap, cfg, T0)
    # Then every live member of the last epoch is back (b too), and only the two earliest newcomers join them
    assert d.fired[0] == "next_epoch"
    assert admitted(d) == {"a", "b", "c", "n1", "n2"}
    assert all(m.status is MemberStatus.ACTIVE for m in d.state.members.values())
    # And at the epoch after, the two left out are admitted
    later = Snapshot(d.state.evolve(phase=Phase.COOLDOWN, deadline=T0 + 50),
                     {p: pv(p, seen=T0 + 50, joined=v.joined_at) for p, v in snap.participants.items()})
    assert admitted(tick(later, cfg, T0 + 50)) == {"a", "b", "c", "n1", "n2", "n3", "n4"}


def test_a_flood_of_joiners_adds_at_most_the_bound_however_many_prove_liveness() -> None:
    # Given an epoch of five honest members cooling down, and 300 flood identities that joined later and all
    # sent a heartbeat since
    honest = [f"h{i}" for i in range(5)]
    flood = {f"flood{i:03d}": pv(f"flood{i:03d}", joined=T0 - 30 + i / 100) for i in range(300)}
    snap = Snapshot(state(Phase.COOLDOWN, members=members(*honest), aggregated=1, round=1, deadline=T0),
                    {**{p: pv(p) for p in honest}, **flood})
    # When the next epoch starts (100 admissions an epoch by default)
    d = tick(snap, CFG, T0)
    # Then the honest members are all in, with the 100 earliest flood identities and no more
    assert set(honest) <= admitted(d)
    assert len(admitted(d) - set(honest)) == CFG.max_admissions_per_epoch == 100
    assert admitted(d) - set(honest) == {f"flood{i:03d}" for i in range(100)}


def test_the_bound_cannot_be_below_min_clients() -> None:
    with pytest.raises(ValueError, match="max_admissions_per_epoch"):
        RunConfig(run_id="unit-run", min_clients=5, min_per_round=5, max_admissions_per_epoch=4)


def test_a_recorded_update_keeps_its_sender_alive_without_a_write_to_its_participant_record() -> None:
    from shared.state import heard_through_updates

    # Given a and b last heard from 30 s ago (liveness timeout 20 s), and a's update of the round recorded 5 s ago
    views = {p: pv(p, seen=T0 - 30) for p in "ab"}
    seen = heard_through_updates(views, {"a": UpdateView("a", 0, True, received_at=T0 - 5)})
    # Then a counts as heard from when it uploaded, b does not; and the tick drops only b
    assert seen["a"].last_seen == T0 - 5 and seen["a"].heard_at == T0 - 5 and seen["b"] == views["b"]
    seen["c"] = pv("c")  # (a third, heard from now: the epoch keeps its minimum of two members)
    snap = Snapshot(state(Phase.TRAIN, members=members("a", "b", "c"), selected=("a", "b", "c")), seen)
    d = tick(snap, CFG, T0)
    assert d.state.members["a"].status is MemberStatus.ACTIVE and d.state.members["b"].status is MemberStatus.DROPPED


def test_an_update_of_an_earlier_round_keeps_its_sender_alive_once_that_round_closed() -> None:
    from shared.state import heard_through_updates

    # Given a round in which a and b both uploaded (5 s ago), their heartbeats last recorded 30 s ago (timeout 20 s:
    # a participant does not heartbeat within an interval of an update upload)
    old = {p: pv(p, seen=T0 - 30) for p in "ab"}
    updates = {p: UpdateView(p, 0, True, samples=10, digest=f"d-{p}", received_at=T0 - 5) for p in "ab"}
    snap = Snapshot(state(Phase.TRAIN, members=members("a", "b"), selected=("a", "b")),
                    heard_through_updates(old, updates), updates)
    # When the round closes and the next one starts
    d = tick(snap, CFG, T0)
    assert d.state.round == 1 and d.state.phase is Phase.TRAIN
    # Then the members remember when their updates were uploaded, and a tick of the new round (no update of it yet,
    # no heartbeat since) sees both alive and drops no one
    assert {p: m.heard for p, m in d.state.members.items()} == {"a": T0 - 5, "b": T0 - 5}
    later = Snapshot(d.state, heard_through_updates(old, {}, d.state.members))
    assert all(m.status is MemberStatus.ACTIVE for m in tick(later, CFG, T0 + 10).state.members.values())
    # while without that memory they would have been dropped as silent
    forgetful = Snapshot(d.state, heard_through_updates(old, {}))
    assert all(m.status is MemberStatus.DROPPED for m in tick(forgetful, CFG, T0 + 10).state.members.values())


def test_an_epoch_admits_its_members_with_the_time_they_were_last_heard_from() -> None:
    d = tick(SCENARIOS["epoch_start"][0], CFG, T0)
    assert {p: m.heard for p, m in d.state.members.items()} == {"a": T0, "b": T0}


def test_the_first_epoch_waits_for_a_live_joiner_not_yet_heard_from_within_the_start_grace() -> None:
    # Given a and b heard from, and c, who joined at the same time, whose heartbeat has not been ingested yet
    joined = T0 - 4
    fleet = {"a": pv("a", init="i", joined=joined), "b": pv("b", joined=joined),
             "c": pv("c", seen=joined, joined=joined, heard=0)}
    # When a tick looks within the start grace (10 s) of the join that made min_clients
    # Then no epoch starts: c is awaited
    assert not tick(Snapshot(RunState("unit-run"), fleet), CFG, T0).changed
    # And once c is heard from, the epoch starts with all three
    heard = {**fleet, "c": pv("c", joined=joined)}
    d = tick(Snapshot(RunState("unit-run"), heard), CFG, T0)
    assert d.fired[0] == "epoch_start" and admitted(d) == {"a", "b", "c"}
    # And without news from c, it starts with a and b once the grace has passed
    d = tick(Snapshot(RunState("unit-run"), fleet), CFG, joined + CFG.start_grace)
    assert d.fired[0] == "epoch_start" and admitted(d) == {"a", "b"}
    # And with start_grace 0 it starts with them at once
    d = tick(Snapshot(RunState("unit-run"), fleet), CFG.model_copy(update={"start_grace": 0.0}), T0)
    assert d.fired[0] == "epoch_start" and admitted(d) == {"a", "b"}


def test_the_start_grace_counts_from_the_quorums_join_and_awaits_only_live_joiners_with_room() -> None:
    # Given a and b, who joined long ago and were heard from, and c, a joiner of a moment ago not heard from since
    old = {"a": pv("a", init="i"), "b": pv("b"), "c": pv("c", joined=T0 - 1, seen=T0 - 1, heard=0)}
    # When a tick looks: the grace counts from the join that made min_clients (50 s ago), not from c's
    # Then the epoch starts without waiting for c
    d = tick(Snapshot(RunState("unit-run"), old), CFG, T0)
    assert d.fired[0] == "epoch_start" and admitted(d) == {"a", "b"}
    # And a joiner gone silent past the liveness timeout holds nothing, nor one the admissions bound leaves no
    # room for
    recent = T0 - 2
    fleet = {"a": pv("a", init="i", joined=recent), "b": pv("b", joined=recent)}
    gone = T0 - CFG.liveness_timeout - 1
    silent = {**fleet, "c": pv("c", joined=gone, seen=gone, heard=0)}
    assert tick(Snapshot(RunState("unit-run"), silent), CFG, T0).fired[0] == "epoch_start"
    waiting = {**fleet, "c": pv("c", joined=recent, seen=recent, heard=0)}
    full = CFG.model_copy(update={"max_admissions_per_epoch": 2})
    assert tick(Snapshot(RunState("unit-run"), waiting), full, T0).fired[0] == "epoch_start"


def test_the_next_epoch_after_a_cooldown_does_not_wait_for_joiners() -> None:
    # Given a cooldown over, its members live, and a joiner of a moment ago not heard from since
    parts = {"a": pv("a"), "b": pv("b"), "c": pv("c", joined=T0 - 1, seen=T0 - 1, heard=0)}
    snap = Snapshot(state(Phase.COOLDOWN, deadline=T0 - 1, members=members("a", "b"), aggregated=1), parts)
    # When a tick runs: Then the next epoch starts with its members
    d = tick(snap, CFG, T0)
    assert d.fired[0] == "next_epoch" and admitted(d) == {"a", "b"}
