"""Work sized by measured throughput (shared.sizing): the split, the plan the tick records, the deadline that follows
it, slow versus stuck participants, and a fleet of speeds 1, 1, 1 and 0.25 run through the real tick."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared import sizing
from shared.config import RunConfig, WorkSizing
from shared.machine import tick
from shared.selection import assigned_count, assignment, permutation
from shared.sizing import Share, Speed
from shared.state import (
    Aggregate,
    Member,
    MemberStatus,
    ParticipantView,
    Phase,
    RecordRound,
    RoundSummary,
    RunState,
    Snapshot,
    UpdateView,
)
from store.records import state_from_body, state_to_body

T0 = 1000.0

# --- the split --------------------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(total=st.integers(0, 5000), weights=st.lists(st.integers(1, 10_000), min_size=1, max_size=40))
def test_split_sums_to_the_total_and_gives_everyone_a_part(total: int, weights: list[int]) -> None:
    parts = sizing.split(total, weights)
    assert sum(parts) == total and len(parts) == len(weights)
    if total >= len(weights):
        assert min(parts) >= 1
    # proportional: every part within one unit of its exact share, unless a part had to be raised to 1
    weight = sum(weights)
    if total * min(weights) >= weight:
        for w, part in zip(weights, parts, strict=True):
            assert abs(part - total * w / weight) < 1


@settings(max_examples=100, deadline=None)
@given(
    n=st.integers(1, 3000),
    rates=st.dictionaries(st.sampled_from([f"p{i}" for i in range(12)]), st.floats(0.01, 1e6), min_size=1),
    seed=st.text("0123456789abcdef", min_size=64, max_size=64),
)
def test_sized_assignments_are_disjoint_covering_and_identical_in_every_process(
    n: int, rates: dict[str, float], seed: str
) -> None:
    order = sorted(rates)
    speeds = {p: Speed(r) for p, r in rates.items()}
    plan = sizing.make_plan(order, speeds, steps=0, sized=True, max_ratio=8.0)
    # the plan as the state stores it, read back as another process reads it
    again = state_from_body(json.loads(json.dumps(state_to_body(RunState("r", plan=plan)))), 1).plan
    assert again == plan
    parts = [assignment(seed, n, plan, p) for p in order]
    joined = sorted(int(i) for part in parts for i in part)
    assert joined == list(range(n))  # disjoint and covering
    assert [len(part) for part in parts] == [assigned_count(n, again, p) for p in order]
    assert all((assignment(seed, n, again, p) == part).all() for p, part in zip(order, parts, strict=True))


def test_equal_weights_cut_the_slices_the_equal_split_always_cut() -> None:
    seed = "ab" * 32
    selected = ("c", "a", "b")
    plan = sizing.make_plan(selected, {"a": Speed(1.0), "b": Speed(50.0)}, steps=0, sized=False, max_ratio=8)
    for pid in selected:
        assert (assignment(seed, 100, plan, pid) == assignment(seed, 100, selected, pid)).all()
    assert [assigned_count(100, selected, p) for p in selected] == [34, 33, 33]
    assert sorted(int(i) for p in selected for i in assignment(seed, 100, plan, p)) == sorted(
        permutation(seed, 100).tolist())


def test_weights_follow_throughput_clamped_around_the_median() -> None:
    speeds = {"a": Speed(100.0), "b": Speed(100.0), "c": Speed(25.0), "d": Speed(1e9)}
    plan = sizing.make_plan(["a", "b", "c", "d", "new"], speeds, steps=0, sized=True, max_ratio=8.0)
    w = {s.pid: s.weight for s in plan}
    assert w["a"] == w["b"] == w["new"] == sizing.WEIGHT_SCALE  # a newcomer counts at the fleet median
    assert w["c"] == sizing.WEIGHT_SCALE // 4
    assert w["d"] == 8 * sizing.WEIGHT_SCALE  # a claim of a billion samples per second buys 8x, no more


def test_local_steps_are_split_by_throughput_too() -> None:
    speeds = {"a": Speed(30.0), "b": Speed(10.0)}
    plan = sizing.make_plan(["a", "b"], speeds, steps=40, sized=True, max_ratio=8.0)
    assert [(s.pid, s.steps) for s in plan] == [("a", 60), ("b", 20)]  # 80 steps, 3:1
    assert sum(s.steps for s in plan) == 80
    equal = sizing.make_plan(["a", "b"], speeds, steps=40, sized=False, max_ratio=8.0)
    assert [s.steps for s in equal] == [40, 40]


def test_in_local_data_mode_each_ones_own_steps_are_scaled_by_its_speed() -> None:
    own = {"a": 10, "b": 40, "c": 40}  # each one's local_epochs passes over its own data, in steps
    speeds = {"a": Speed(100.0), "b": Speed(100.0), "c": Speed(25.0)}
    plan = sizing.make_plan(["a", "b", "c"], speeds, steps=own, sized=True, max_ratio=8.0)
    assert [(s.pid, s.steps) for s in plan] == [("a", 10), ("b", 40), ("c", 10)]
    same = sizing.make_plan(["a", "b", "c"], {}, steps=own, sized=True, max_ratio=8.0)
    assert [s.steps for s in same] == [10, 40, 40]  # nothing measured: as without sizing


def test_the_deadline_follows_the_prediction_within_its_bounds() -> None:
    assert sizing.deadline_seconds({"a": 10.0, "b": 12.0}, 2, 3.0, 5.0, 300.0) == 36.0
    assert sizing.deadline_seconds({"a": 1.0}, 1, 3.0, 5.0, 300.0) == 5.0  # floor
    assert sizing.deadline_seconds({"a": 500.0}, 1, 3.0, 5.0, 300.0) == 300.0  # ceiling
    assert sizing.deadline_seconds({"a": 10.0}, 2, 3.0, 5.0, 300.0) == 300.0  # someone without an estimate
    assert sizing.deadline_seconds({"a": 10.0}, 1, 0.0, 5.0, 300.0) == 300.0  # off


# --- a fleet of mixed speeds through the real tick, on a virtual clock ---------------------------------------

SIZE = 1437  # the digits training set
BASE_RATE = 10.0  # samples per second of a host at speed 1
OVERHEAD = 0.5  # seconds of a round that do not grow with the share (download, evaluation, upload)
SPEEDS = {"p1": 1.0, "p2": 1.0, "p3": 1.0, "p4": 0.25}  # the throttle factors: p4 is four times slower


@dataclass
class Fleet:
    """Participants whose training time is exactly their units / (BASE_RATE x throttle): a deterministic throttle on a
    virtual clock, so the round times the coordinator records are exact."""

    config: RunConfig
    speeds: dict[str, float]

    def run(self, rounds: int) -> list[RoundSummary]:
        now = T0
        members = {p: Member(MemberStatus.ACTIVE, now) for p in self.speeds}
        state = RunState("sim-run", version=1, phase=Phase.WARMUP, epoch=1, global_digest="g0", members=members,
                         deadline=now)
        views = {p: ParticipantView(p, T0 - 10, now, ready_epoch=1, heard_at=now) for p in self.speeds}
        summaries: list[RoundSummary] = []
        updates: dict[str, UpdateView] = {}
        state = self._tick(state, views, updates, now, summaries)
        while len(summaries) < rounds:
            assert state.phase is Phase.TRAIN
            arrivals = sorted(
                (state.round_started + OVERHEAD + self._units(state, p) / (BASE_RATE * self.speeds[p]), p)
                for p in state.selected
            )
            updates, round_no = {}, state.round
            for at, pid in arrivals:
                if at > state.deadline:
                    break
                now = at
                seconds = self._units(state, pid) / (BASE_RATE * self.speeds[pid])
                updates[pid] = UpdateView(pid, state.round, True, samples=assigned_count(SIZE, state.plan, pid),
                                          digest=f"d-{pid}", metrics={"loss": 1.0, "train_seconds": seconds},
                                          received_at=now)
                views = {p: ParticipantView(p, T0 - 10, now, ready_epoch=1, heard_at=now) for p in self.speeds}
                state = self._tick(state, views, updates, now, summaries)
            if state.round == round_no:  # someone missed the deadline: the round closes then
                now = state.deadline
                state = self._tick(state, views, updates, now, summaries)
        return summaries

    def _units(self, state: RunState, pid: str) -> int:
        return assigned_count(SIZE, state.plan, pid) * self.config.local_epochs

    def _tick(self, state: RunState, views: dict[str, ParticipantView], updates: dict[str, UpdateView], now: float,
              summaries: list[RoundSummary]) -> RunState:
        d = tick(Snapshot(state, views, updates), self.config, now)
        for e in d.effects:
            if isinstance(e, RecordRound):
                summaries.append(e.summary)
            if isinstance(e, Aggregate):  # FedAvg weights: exactly the samples each trained, all of them once
                assert sum(i.samples for i in e.inputs) == SIZE
        return d.state.evolve(global_digest="g") if d.state.phase is Phase.TRAIN else d.state


def mixed(sizing_mode: WorkSizing) -> list[RoundSummary]:
    config = RunConfig(run_id="sim-run", min_clients=4, min_per_round=4, total_rounds=6, max_round_train_time=600,
                       warmup_time=0, work_sizing=sizing_mode, round_witness_time=0)
    return Fleet(config, SPEEDS).run(6)


def test_with_throughput_sizing_a_four_times_slower_host_no_longer_sets_the_pace() -> None:
    sized, equal = mixed(WorkSizing.THROUGHPUT), mixed(WorkSizing.EQUAL)
    # the ideal balanced round: every host as fast as the fast ones, equal shares (nobody waits for anyone)
    ideal = OVERHEAD + SIZE / len(SPEEDS) / BASE_RATE
    # the best any split of this fleet can do: everyone finishing together
    best = OVERHEAD + SIZE / (BASE_RATE * sum(SPEEDS.values()))
    # round 0 calibrates (no measurements yet: equal shares); from round 1 on the split follows the measurements
    for r in sized[1:]:
        assert r.aggregated and len(r.counted) == 4 and r.samples == SIZE
        assert r.seconds <= 1.3 * ideal, (r.round, r.seconds, ideal)
        assert r.seconds <= 1.02 * best, (r.round, r.seconds, best)
        assert r.shares["p4"] * 4 == pytest.approx(r.shares["p1"], rel=0.01)
    for r in equal:
        assert 3.8 * ideal <= r.seconds <= 4.0 * ideal, (r.round, r.seconds, ideal)
    assert sized[0].seconds == pytest.approx(equal[0].seconds)
    # what each participant spent in a sized round: all finish within one sample of the slow host of each other
    finished = sized[-1].finished
    assert max(finished.values()) - min(finished.values()) <= 1 / (BASE_RATE * min(SPEEDS.values())) + 1e-9
    print(f"ideal {ideal:.1f}s; sized {sized[-1].seconds:.1f}s ({sized[-1].seconds / ideal:.2f}x), equal "
          f"{equal[-1].seconds:.1f}s ({equal[-1].seconds / ideal:.2f}x); shares {dict(sized[-1].shares)}")


def test_a_host_that_misses_the_deadline_while_progressing_is_kept_with_a_smaller_share() -> None:
    config = RunConfig(run_id="sim-run", min_clients=2, min_per_round=2, max_round_train_time=100, warmup_time=0)
    members = {p: Member(MemberStatus.ACTIVE, T0) for p in ("a", "b")}
    plan = (Share("a", 1000), Share("b", 1000))
    speeds = {"a": Speed(10.0), "b": Speed(10.0)}
    s = RunState("sim-run", version=1, phase=Phase.TRAIN, epoch=1, round=3, global_digest="g", members=members,
                 selected=("a", "b"), plan=plan, speeds=speeds, round_started=T0, deadline=T0 + 100, round_units=1000)
    now = T0 + 100
    views = {
        "a": ParticipantView("a", T0 - 10, now, heard_at=now),
        "b": ParticipantView("b", T0 - 10, now, heard_at=now, progress_round=3, progress_done=20, progress_total=100,
                             progress_at=now - 1),
    }
    upd = UpdateView("a", 3, False, reason="bad")  # a refused: no update counted, but it did upload
    d = tick(Snapshot(s, views, {"a": upd}), config, now)
    assert d.state.members["b"].status is MemberStatus.ACTIVE and d.state.late == ("b",)
    assert d.state.speeds["b"].rate < 5.0  # smaller than half what was expected: a smaller share next round
    assert any("kept, with a smaller share" in getattr(e, "message", "") for e in d.effects)
    # a second miss in a row drops it
    s2 = d.state.evolve(phase=Phase.TRAIN, selected=("a", "b"), plan=plan, round=4, round_started=now,
                        deadline=now + 100)
    later = now + 100
    views["b"] = ParticipantView("b", T0 - 10, later, heard_at=later, progress_round=4, progress_done=50,
                                 progress_total=100, progress_at=later - 1)
    views["a"] = ParticipantView("a", T0 - 10, later, heard_at=later)
    d2 = tick(Snapshot(s2, views, {"a": UpdateView("a", 4, True, samples=5, digest="x")}), config, later)
    summary = next(e.summary for e in d2.effects if isinstance(e, RecordRound))
    assert summary.dropped == {"b": "missed the deadline of round 4"}


def test_a_stuck_participant_does_not_hold_the_round_and_is_dropped_with_that_reason() -> None:
    config = RunConfig(run_id="sim-run", min_clients=2, min_per_round=2, max_round_train_time=300, warmup_time=0,
                       stuck_timeout=60)
    members = {p: Member(MemberStatus.ACTIVE, T0) for p in ("a", "b", "c")}
    s = RunState("sim-run", version=1, phase=Phase.TRAIN, epoch=1, round=2, global_digest="g", members=members,
                 selected=("a", "b", "c"), plan=(Share("a"), Share("b"), Share("c")), round_started=T0,
                 deadline=T0 + 300)
    now = T0 + 90
    views = {p: ParticipantView(p, T0 - 10, now, heard_at=now) for p in ("a", "b")}
    # c heartbeats (seen just now) but its progress in round 2 last moved 70 s ago
    views["c"] = ParticipantView("c", T0 - 10, now, heard_at=now, progress_round=2, progress_done=3,
                                 progress_total=10, progress_at=T0 + 20)
    ups = {p: UpdateView(p, 2, True, samples=5, digest=f"d{p}") for p in ("a", "b")}
    d = tick(Snapshot(s, views, ups), config, now)
    assert "round_closed" in d.fired  # before the deadline: nobody waits for a stuck participant
    assert d.state.members["c"].status is MemberStatus.DROPPED
    assert d.state.members["c"].reason.startswith("stuck: its training progress in round 2 did not move for 70s")
    # progress that moves keeps it in
    views["c"] = ParticipantView("c", T0 - 10, now, heard_at=now, progress_round=2, progress_done=4,
                                 progress_total=10, progress_at=now - 5)
    d = tick(Snapshot(s, views, ups), config, now)
    assert d.fired == () and d.state.members["c"].status is MemberStatus.ACTIVE


def test_the_tick_sets_the_deadline_from_the_prediction() -> None:
    config = RunConfig(run_id="sim-run", min_clients=4, min_per_round=4, total_rounds=6, max_round_train_time=600,
                       warmup_time=0, round_witness_time=0, deadline_margin=2.0, min_round_train_time=30)
    captured: list[RunState] = []
    fleet = Fleet(config, SPEEDS)
    original = fleet._tick

    def spy(state, views, updates, now, summaries):  # type: ignore[no-untyped-def]
        new = original(state, views, updates, now, summaries)
        captured.append(new)
        return new

    fleet._tick = spy  # type: ignore[method-assign]
    fleet.run(3)
    starts = {s.round: s for s in captured if s.phase is Phase.TRAIN}
    assert starts[0].deadline - starts[0].round_started == 600  # nothing measured yet: the ceiling
    best = OVERHEAD + SIZE / (BASE_RATE * sum(SPEEDS.values()))
    limit = starts[2].deadline - starts[2].round_started
    assert limit == pytest.approx(2.0 * best, rel=0.02)  # the latest predicted finish x deadline_margin


def test_a_participant_trains_its_planned_slice_or_steps() -> None:
    from participant.decide import Train
    from participant.training import Workload, round_work

    class FakeTask:
        train_size = 1000

    plan = (Share("a", 3000, 0), Share("b", 1000, 0))
    config = RunConfig(run_id="sim-run", batch_size=10, local_epochs=2)
    work = Workload("x:task", config, FakeTask(), None)
    a = Train(0, 1, "ab" * 32, ("a", "b"), "g", plan)
    mine = round_work(work, a, "b")
    assert (len(mine.indices), mine.steps, mine.claim, mine.units) == (250, 0, 250, 500)
    assert (mine.indices == assignment("ab" * 32, 1000, plan, "b")).all()
    # with local_steps the plan's steps are this participant's own count
    stepped = (Share("a", 3000, 60), Share("b", 1000, 20))
    lm = Workload("x:task", config.model_copy(update={"local_steps": 40}), FakeTask(), None)
    mine = round_work(lm, Train(0, 1, "ab" * 32, ("a", "b"), "g", stepped), "a")
    assert (len(mine.indices), mine.steps, mine.claim, mine.units) == (750, 60, 750, 600)
    # local data mode: its own data; the claim is the distinct samples its steps reach
    own = Workload("x:task", config, FakeTask(), None, own=np.arange(100))
    mine = round_work(own, Train(0, 1, "ab" * 32, ("a", "b"), "g", (Share("a", 1000, 5), Share("b", 1000, 20))), "a")
    assert (len(mine.indices), mine.steps, mine.claim, mine.units) == (100, 5, 50, 50)


def test_another_process_cuts_the_same_slices_from_the_recorded_plan() -> None:
    import subprocess
    import sys

    speeds = {"p1": Speed(100.0), "p2": Speed(97.5), "p3": Speed(101.0), "p4": Speed(25.0)}
    plan = sizing.make_plan(["p3", "p1", "p4", "p2"], speeds, steps=0, sized=True, max_ratio=8.0)
    body = json.dumps(state_to_body(RunState("r", plan=plan, seed="5e" * 32)))
    here = {p: assignment("5e" * 32, SIZE, plan, p).tolist() for p in speeds}
    code = (
        "import json, sys\n"
        "from store.records import state_from_body\n"
        "from shared.selection import assignment\n"
        "s = state_from_body(json.loads(sys.stdin.read()), 1)\n"
        f"print(json.dumps({{p.pid: assignment(s.seed, {SIZE}, s.plan, p.pid).tolist() for p in s.plan}}))\n"
    )
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONHASHSEED": "12345",
           "PYTHONPATH": os.pathsep.join(x for x in (root, os.environ.get("PYTHONPATH", "")) if x)}
    out = subprocess.run([sys.executable, "-c", code], input=body, capture_output=True, text=True, check=True,
                         env=env)
    assert json.loads(out.stdout) == here


def test_a_claimed_training_time_is_taken_within_what_its_arrival_shows() -> None:
    # 1e-6 s of training claimed by an update that arrived 10 s into the round, the fleet's overhead about 1 s
    assert sizing.observed_seconds(1e-6, 10.0, 1.0) == pytest.approx(8.0)
    assert sizing.observed_seconds(1e-6, 10.0, None) == pytest.approx(1.0)  # no estimates: a tenth at least
    assert sizing.observed_seconds(9.0, 10.0, 1.0) == 9.0  # an honest report stands
    assert sizing.observed_seconds(30.0, 10.0, 1.0) == 30.0  # longer than the interval: it only makes itself slow
    assert sizing.observed_seconds(1e-6, 0.0, 1.0) == 1e-6  # nothing observed


def test_a_claimed_jump_in_speed_is_trusted_only_gradually() -> None:
    before = Speed(100.0)
    after = sizing.smoothed(before, 1e9, 0.0, alpha=1.0)
    assert after.rate == pytest.approx(200.0)  # at most RATE_GROWTH x a round, even fully weighted
    assert sizing.smoothed(None, 1e9, 0.0, alpha=0.5, ceiling=100.0).rate == pytest.approx(200.0)
    assert sizing.smoothed(before, 50.0, 0.0, alpha=1.0).rate == pytest.approx(50.0)  # slowing down is believed


def test_no_claimed_speed_buys_more_than_a_fair_share_of_the_round() -> None:
    speeds = {"a": Speed(100.0), "b": Speed(100.0), "c": Speed(100.0), "x": Speed(1e9), "y": Speed(1e9)}
    plan = sizing.make_plan(sorted(speeds), speeds, steps=0, sized=True, max_ratio=8.0, max_share=2.0)
    assert {s.pid: s.weight for s in plan} == {"a": 1000, "b": 1000, "c": 1000, "x": 2000, "y": 2000}
    # slow hosts are still sized down to 1/max_speed_ratio
    slow = {**speeds, "x": Speed(1.0), "y": Speed(1.0)}
    assert [s.weight for s in sizing.make_plan(sorted(slow), slow, steps=0, sized=True, max_ratio=8.0,
                                               max_share=2.0)] == [1000, 1000, 1000, 125, 125]


def test_fedavg_weights_are_capped_at_a_fair_share_of_the_median_claim() -> None:
    assert sizing.fedavg_weights({"a": 100, "b": 120, "c": 90, "x": 10_000}, 2.0) == {"a": 100, "b": 120, "c": 90,
                                                                                        "x": 220}
    assert sizing.fedavg_weights({"a": 100, "x": 10_000}, 2.0) == {"a": 100, "x": 200}  # of two, the smaller
    assert sizing.fedavg_weights({"a": 100, "x": 10_000}, float("inf")) == {"a": 100, "x": 10_000}
    assert sizing.fedavg_weights({}, 2.0) == {}
