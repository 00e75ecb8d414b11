"""Hypothesis drives the coordinator with joins, silences, uploads and time passing; invariants hold."""

from __future__ import annotations

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from shared.config import RunConfig
from shared.machine import resolve, tick
from shared.state import Aggregate, MemberStatus, ParticipantView, Phase, RunState, Snapshot, UpdateView

PIDS = [f"p{i}" for i in range(6)]
CFG = RunConfig(
    run_id="prop-run",
    min_clients=2,
    fraction_per_round=0.6,
    min_per_round=2,
    min_updates=2,
    total_rounds=4,
    rounds_per_epoch=2,
    warmup_time=5,
    max_round_train_time=20,
    round_witness_time=2,
    cooldown_time=3,
    liveness_timeout=15,
)


class CoordinatorMachine(RuleBasedStateMachine):
    @initialize()
    def start(self) -> None:
        self.now = 0.0
        self.state = RunState("prop-run")
        self.participants: dict[str, ParticipantView] = {}
        self.updates: dict[tuple[int, str], UpdateView] = {}
        self.counted: set[tuple[int, str]] = set()
        self.max_round = 0
        self.finished = False

    # --- the world -----------------------------------------------------------------------------------

    @rule(pid=st.sampled_from(PIDS), offer=st.booleans())
    def join(self, pid: str, offer: bool) -> None:
        if pid not in self.participants:
            self.participants[pid] = ParticipantView(pid, self.now, self.now, 0, "init" if offer else "")
        else:
            self.heartbeat(pid, ready=False)

    @rule(pid=st.sampled_from(PIDS), ready=st.booleans())
    def heartbeat(self, pid: str, ready: bool) -> None:
        p = self.participants.get(pid)
        if p is not None:
            epoch = self.state.epoch if ready else p.ready_epoch
            self.participants[pid] = ParticipantView(pid, p.joined_at, self.now, epoch, p.init_digest)

    @rule(pick=st.integers(0, 5), ok=st.booleans(), samples=st.integers(1, 50), anyone=st.booleans())
    def upload(self, pick: int, ok: bool, samples: int, anyone: bool) -> None:
        s = self.state
        pool = PIDS if anyone or not s.selected else s.selected
        pid = pool[pick % len(pool)]
        slot = (s.round, pid)
        # what ingest enforces: current round, RoundTrain, selected, once per slot
        if s.phase is Phase.TRAIN and pid in s.selected and slot not in self.updates:
            self.updates[slot] = UpdateView(pid, s.round, ok, samples if ok else 0, f"d{slot}", "" if ok else "bad")

    @rule(dt=st.floats(0.1, 6.0))
    def time_passes(self, dt: float) -> None:
        self.now += dt

    @rule()
    def long_silence(self) -> None:
        self.now += CFG.liveness_timeout + 1

    @rule()
    def everyone_alive(self) -> None:
        for pid in list(self.participants):
            self.heartbeat(pid, ready=True)

    @rule(dt=st.floats(0.1, 6.0))
    def busy_round(self, dt: float) -> None:
        """Everyone alive and every selected participant uploads: the path that makes progress."""
        for pid in PIDS[:3]:
            self.join(pid, offer=True)
        self.everyone_alive()
        for i in range(len(self.state.selected)):
            self.upload(i, ok=True, samples=10, anyone=False)
        self.now += dt
        self.do_tick()

    @rule()
    def do_tick(self) -> None:
        current = {pid: u for (rnd, pid), u in self.updates.items() if rnd == self.state.round}
        snap = Snapshot(self.state, dict(self.participants), current)
        decision = tick(snap, CFG, self.now)
        for effect in decision.effects:
            if isinstance(effect, Aggregate):
                assert len(effect.inputs) >= CFG.min_updates, "aggregated with too few updates"
                for item in effect.inputs:
                    slot = (effect.round, item.participant)
                    assert slot not in self.counted, f"update {slot} counted twice"
                    assert self.updates[slot].accepted, "a refused update was counted"
                    self.counted.add(slot)
                decision = resolve(decision, f"g{effect.round + 1}")
        assert decision.state.round >= self.state.round, "round number decreased"
        if self.finished:
            assert decision.state.phase is Phase.FINISHED
        self.state = decision.state.evolve(version=self.state.version + (1 if decision.changed else 0))
        self.finished = self.state.phase is Phase.FINISHED
        event(f"reached {self.state.phase}")
        event(f"aggregated {self.state.aggregated}")

    # --- invariants ----------------------------------------------------------------------------------

    @invariant()
    def no_dropped_participant_is_selected(self) -> None:
        if not hasattr(self, "state"):
            return
        for pid in self.state.selected:
            member = self.state.members.get(pid)
            assert member is not None and member.status is MemberStatus.ACTIVE

    @invariant()
    def counts_stay_in_bounds(self) -> None:
        if not hasattr(self, "state"):
            return
        assert self.state.aggregated <= CFG.total_rounds
        assert self.state.aggregated <= self.state.round

    @invariant()
    def a_training_run_has_a_model(self) -> None:
        if hasattr(self, "state") and self.state.phase in (Phase.WARMUP, Phase.TRAIN):
            assert self.state.has_model


CoordinatorMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=80, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestCoordinatorMachine = CoordinatorMachine.TestCase
