"""Hypothesis drives the coordinator with joins, silences, uploads and time passing; invariants hold."""

from __future__ import annotations

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from shared.config import RunConfig
from shared.machine import resolve, tick
from shared.state import Aggregate, MemberStatus, ParticipantView, Phase, RecordRound, RunState, Snapshot, UpdateView
from shared.witness import Proof, quorum

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
    max_admissions_per_epoch=2,  # of the six, so that the bound is often reached
)


class CoordinatorMachine(RuleBasedStateMachine):
    config = CFG

    @initialize()
    def start(self) -> None:
        self.now = 0.0
        self.state = RunState("prop-run")
        self.participants: dict[str, ParticipantView] = {}
        self.updates: dict[tuple[int, str], UpdateView] = {}
        self.proofs: dict[tuple[int, str], Proof] = {}
        self.vouched: dict[int, set[str]] = {}  # round -> participants whose update some witness attested
        self.reports: dict[tuple[int, str], tuple[str, ...]] = {}
        self.counted: set[tuple[int, str]] = set()
        self.recorded_rounds: set[int] = set()
        self.finished = False

    # --- the world -----------------------------------------------------------------------------------

    @rule(pid=st.sampled_from(PIDS), offer=st.booleans())
    def join(self, pid: str, offer: bool) -> None:
        if pid not in self.participants:  # registered, not yet heard from since
            self.participants[pid] = ParticipantView(pid, self.now, self.now, 0, "init" if offer else "")
        else:
            self.heartbeat(pid, ready=False)

    @rule(pid=st.sampled_from(PIDS), ready=st.booleans())
    def heartbeat(self, pid: str, ready: bool) -> None:
        p = self.participants.get(pid)
        if p is not None:
            epoch = self.state.epoch if ready else p.ready_epoch
            self.participants[pid] = ParticipantView(pid, p.joined_at, self.now, epoch, p.init_digest,
                                                     heard_at=self.now)

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

    @rule(pick=st.integers(0, 5), skip=st.integers(0, 6), complete=st.booleans())
    def witness_proof(self, pick: int, skip: int, complete: bool) -> None:
        s = self.state
        if not s.witnesses or s.phase not in (Phase.TRAIN, Phase.WITNESS):
            return
        witness = s.witnesses[pick % len(s.witnesses)]
        if (s.round, witness) in self.proofs:
            return
        seen = {p: u.digest for (r, p), u in sorted(self.updates.items()) if r == s.round and u.accepted}
        attested = {p: d for i, (p, d) in enumerate(seen.items()) if i != skip}
        proof = Proof.build("prop-run", s.round, witness, s.witnesses.index(witness), attested, 6, complete)
        self.proofs[(s.round, witness)] = proof

    @rule(reporter=st.sampled_from(PIDS), named=st.lists(st.sampled_from(PIDS), max_size=3))
    def health_report(self, reporter: str, named: list[str]) -> None:
        self.reports[(self.state.health_round, reporter)] = tuple(named)

    @rule(paused=st.booleans())
    def operator(self, paused: bool) -> None:
        self.state = self.state.evolve(pause_requested=paused)

    @rule(dt=st.floats(0.1, 6.0))
    def busy_round(self, dt: float) -> None:
        """Everyone alive and every selected participant uploads: the path that makes progress."""
        for pid in PIDS[:3]:
            self.join(pid, offer=True)
        self.everyone_alive()
        for i in range(len(self.state.selected)):
            self.upload(i, ok=True, samples=10, anyone=False)
        for i in range(len(self.state.witnesses)):
            self.witness_proof(i, skip=99, complete=True)
        self.now += dt
        self.do_tick()

    @rule()
    def do_tick(self) -> None:
        s = self.state
        current = {pid: u for (rnd, pid), u in self.updates.items() if rnd == s.round}
        proofs = {w: p for (rnd, w), p in self.proofs.items() if rnd == s.round}
        reports = {r: named for (rnd, r), named in self.reports.items() if rnd == s.health_round}
        snap = Snapshot(s, dict(self.participants), current, proofs, reports)
        decision = tick(snap, self.config, self.now)
        starts = sum(1 for name in decision.fired if name in ("epoch_start", "next_epoch"))
        new = set(decision.state.members) - set(s.members)
        assert len(new) <= starts * self.config.max_admissions_per_epoch, "more new members than the bound"
        for effect in decision.effects:
            if isinstance(effect, RecordRound):
                assert effect.summary.round not in self.recorded_rounds, "a round was closed twice"
                self.recorded_rounds.add(effect.summary.round)
                if effect.summary.round == s.round:  # updates some witness attested: no health drop may follow
                    self.vouched[s.round] = {pid for pid, u in current.items()
                                             if any(p.attests(pid, u.digest) for p in proofs.values())}
            if isinstance(effect, Aggregate):
                assert len(effect.inputs) >= self.config.min_updates, "aggregated with too few updates"
                # the seats as the round closed: witnesses whose proofs were refused are unseated (redrawn, or the
                # seat given up when nobody is left to draw), and the quorum is of the seats that remain
                (closed,) = [e.summary for e in decision.effects
                             if isinstance(e, RecordRound) and e.summary.round == effect.round]
                if s.witnesses:
                    need = quorum(len(closed.witnesses))
                    assert need >= 1 and closed.quorum == need
                    for item in effect.inputs:
                        votes = sum(1 for w, p in proofs.items() if w in closed.witnesses
                                    and p.attests(item.participant, item.digest))
                        assert votes >= need, "aggregated an update a witness quorum did not attest"
                for item in effect.inputs:
                    slot = (effect.round, item.participant)
                    assert slot not in self.counted, f"update {slot} counted twice"
                    assert self.updates[slot].accepted, "a refused update was counted"
                    self.counted.add(slot)
                decision = resolve(decision, f"g{effect.round + 1}")
        assert decision.state.round >= s.round, "round number decreased"
        for pid, m in decision.state.members.items():
            was = s.members.get(pid)
            if m.status is MemberStatus.DROPPED and was is not None and was.status is MemberStatus.ACTIVE \
                    and m.reason.startswith("health check"):
                assert pid not in self.vouched.get(s.health_round, set()), "dropped a member a witness attested"
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
    def every_member_was_heard_from_after_joining(self) -> None:
        if not hasattr(self, "state"):
            return
        for pid in self.state.members:
            assert self.participants[pid].proven, f"{pid} admitted on its join request alone"

    @invariant()
    def counts_stay_in_bounds(self) -> None:
        if not hasattr(self, "state"):
            return
        assert self.state.aggregated <= self.config.total_rounds
        assert self.state.aggregated <= self.state.round

    @invariant()
    def a_training_run_has_a_model(self) -> None:
        if hasattr(self, "state") and self.state.phase in (Phase.WARMUP, Phase.TRAIN):
            assert self.state.has_model


class WitnessedCoordinatorMachine(CoordinatorMachine):
    config = CFG.model_copy(update={"witness_nodes": 3, "min_clients": 3, "min_per_round": 3, "min_updates": 2,
                                    "max_admissions_per_epoch": 3})


SETTINGS = settings(
    max_examples=150, stateful_step_count=80, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
CoordinatorMachine.TestCase.settings = SETTINGS
WitnessedCoordinatorMachine.TestCase.settings = SETTINGS
TestCoordinatorMachine = CoordinatorMachine.TestCase
TestWitnessedCoordinatorMachine = WitnessedCoordinatorMachine.TestCase
