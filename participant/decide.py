"""What a participant does next: a pure function of the coordinator's state and what it knows locally.

`decide(state, local)` returns one action; the daemon carries it out and asks again. Keeping the
protocol's rules here, free of I/O, lets every case (selected or not, already uploaded, dropped,
late joiner, warmup, witness duty, health reports, finished) be unit-tested without AWS or torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.selection import as_plan
from shared.sizing import WorkPlan
from shared.state import LIVE_PHASES, MemberStatus, Phase, RunState

# Re-sending what the coordinator has not recorded yet: the join request first after 15 s, the ready report after
# 2 s, each later re-send waiting twice as long as the one before, up to the cap. Every re-send is one more event
# for the coordinator to ingest: a fixed interval lets a fleet that starts at once bury a lagging coordinator
# under its own retries (measured with 200 participants on the local stack: 4,600 join uploads in 12 minutes).
JOIN_RETRY_SECONDS, JOIN_RETRY_MAX_SECONDS = 15.0, 240.0
READY_RETRY_SECONDS, READY_RETRY_MAX_SECONDS = 2.0, 60.0


def retry_after(first: float, sends: int, cap: float) -> float:
    """How long to wait for something sent `sends` times to be recorded before sending it again."""
    return min(first * 2.0 ** max(sends - 1, 0), cap)


@dataclass(frozen=True)
class Local:
    """What the participant knows about itself, gathered before each decision (participant.protocol)."""

    pid: str
    joined: bool = True  # the coordinator has recorded our join request
    join_age: float = 0.0  # seconds since we last sent the join request
    join_sends: int = 1  # how many times this process has sent it
    offered: bool = False  # we sent an initial-model offer in this process
    held: str = ""  # digest of the global model we hold (downloaded and verified)
    unfit: str = ""  # digest of a global model we downloaded that does not fit our task
    reported_ready: int = 0  # last epoch we reported ready for in a heartbeat
    ready_age: float = 0.0  # seconds since that report
    ready_sends: int = 1  # how many times we sent the report for that epoch
    ready_recorded: int = 0  # the ready epoch the coordinator has recorded for us (read during warmup)
    ready_in_flight: bool = False  # no message of ours accepted since that report: it is still queued, not lost
    uploaded: frozenset[int] = field(default_factory=frozenset)  # rounds whose update we uploaded
    recorded: bool = False  # an update of ours is recorded (or stored) for state.round
    # witness duty for state.round (gathered only while we are one of its witnesses with a proof to send)
    witnessed: frozenset[int] = field(default_factory=frozenset)  # rounds whose witness proof we sent
    witness_missing: int = 0  # selected participants with no recorded update yet
    witness_unchecked: int = 0  # recorded, accepted updates we have not evaluated yet
    # health reports about state.health_round
    health_reported: frozenset[int] = field(default_factory=frozenset)  # rounds we sent a health report about
    health_confirmed: bool = False  # that round's witness proofs reached their quorum (its scores mean something)


# --- actions -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Wait:
    """Nothing to do until the state changes; `reason` is what the participant is waiting for. `announced`: what
    ends the wait is a change of the run's phase, round, epoch or model, which the coordinator publishes (a
    participant with a push queue waits on it instead of polling); otherwise it is a record of ours or of the
    round (our join, our ready report, the updates a witness checks), which only polling finds. `round_close`: only
    the round's close ends it (our update is in), so nothing is expected before the round's usual length."""

    reason: str
    announced: bool = False
    round_close: bool = False


@dataclass(frozen=True)
class Join:
    """(Re-)send the join request."""


@dataclass(frozen=True)
class OfferModel:
    """The run has no model yet: offer the task's freshly initialised model (seeded by the run's seed)."""


@dataclass(frozen=True)
class Fetch:
    """Download the global model the state points to (cached by digest) and verify its digest."""

    round: int
    digest: str


@dataclass(frozen=True)
class ReportReady:
    """Tell the coordinator, with an immediate heartbeat, that we hold the model for `epoch`."""

    epoch: int


@dataclass(frozen=True)
class Train:
    """Train the assigned samples of `round` from the global model `digest` and upload the update."""

    round: int
    epoch: int
    seed: str
    selected: tuple[str, ...]
    digest: str
    plan: WorkPlan = ()  # the round's shares (shared.sizing): everyone's weight and local steps; (): equal shares
    deadline: float = 0.0  # when the round closes at the latest (before it, only our being dropped closes it to us)

    @property
    def planned(self) -> WorkPlan:
        """The round's plan (a bare selection: equal weights)."""
        return self.plan or as_plan(self.selected)


@dataclass(frozen=True)
class CheckUpdates:
    """As a witness of `round`: download, verify and evaluate every recorded update not yet evaluated."""

    round: int


@dataclass(frozen=True)
class SendProof:
    """As a witness of `round`: upload the proof of what we attested; `complete`: every selected
    participant's update was recorded (and evaluated)."""

    round: int
    complete: bool


@dataclass(frozen=True)
class ReportHealth:
    """Upload a health report naming the members the witnesses of `round` did not attest."""

    round: int
    unhealthy: tuple[str, ...]


@dataclass(frozen=True)
class Finish:
    """The run is over: evaluate the final global model (if any) and exit; `unfit`: the final global model does
    not fit our task (nothing to evaluate)."""

    round: int
    digest: str
    unfit: bool = False


Action = Wait | Join | OfferModel | Fetch | ReportReady | Train | CheckUpdates | SendProof | ReportHealth | Finish


def unhealthy(state: RunState, pid: str) -> tuple[str, ...]:
    """Active members (other than `pid`) that fewer than a quorum of witnesses attested in the last
    witnessed round: the ones a health report names."""
    if state.health_round < 0 or not state.health:
        return ()
    return tuple(p for p in state.unhealthy() if p != pid)


def heartbeat_due(now: float, update_sent_at: float, after_update: float) -> bool:
    """Whether the heartbeat thread's beat at `now` should go out: not within `after_update` seconds
    (`RunConfig.heartbeat_after_update`) of our last update upload (monotonic clock), which showed the coordinator
    we are alive (a tick counts recorded updates as heard from, and looks in the bucket before dropping anyone)."""
    return now - update_sent_at >= after_update


def next_heartbeat(last_beat: float, update_sent_at: float, every: float, after_update: float) -> float:
    """When the next heartbeat is due (monotonic clock): one interval after the last heartbeat, and not before
    `after_update` seconds after the last update upload. Waiting for exactly that (not waking every interval and
    skipping a beat close to an upload, which left up to two intervals of silence after the last heartbeat) keeps
    the longest silence at one interval after a heartbeat, `after_update` after an update."""
    return max(last_beat + every, update_sent_at + after_update)


def is_witness_duty(state: RunState, local: Local) -> bool:
    """We are an elected witness of the current round and still owe its proof."""
    return (
        state.phase in (Phase.TRAIN, Phase.WITNESS)
        and local.pid in state.witnesses
        and state.round not in local.witnessed
    )


def is_resend(action: Action, local: Local) -> bool:
    """The action sends again what the coordinator has not recorded yet (no progress: polling keeps its pace)."""
    return isinstance(action, Join) or (isinstance(action, ReportReady) and local.reported_ready >= action.epoch)


def join_resend_due(sends: int) -> float:
    """Seconds after sending a join request (`sends` times so far) not yet recorded that it is sent again."""
    return retry_after(JOIN_RETRY_SECONDS, sends, JOIN_RETRY_MAX_SECONDS)


def still_open(state: RunState, train: Train, pid: str) -> bool:
    """The round of `train` is still open for our update (asked again after training, before uploading)."""
    return state.round == train.round and state.phase is Phase.TRAIN and pid in state.selected


def decide(state: RunState, local: Local) -> Action:
    action = _decide(state, local)
    if isinstance(action, Fetch) and action.digest and action.digest == local.unfit:
        # Nothing to train or witness from, and no reason to leave: a later global model (the run restored, or
        # restarted by its operator) may fit. A run that finished with it is over for us.
        if state.phase is Phase.FINISHED:
            return Finish(state.round, state.global_digest, unfit=True)
        return Wait(f"the global model of round {state.round} ({action.digest[:12]}) does not fit our task; "
                    "waiting for another", True)
    return action


def _decide(state: RunState, local: Local) -> Action:
    pid = local.pid
    if state.phase is Phase.FINISHED:
        if state.has_model and local.held != state.global_digest:
            return Fetch(state.round, state.global_digest)
        return Finish(state.round, state.global_digest)
    if not local.joined:
        if local.join_age >= join_resend_due(local.join_sends):
            return Join()
        if not state.has_model and not local.offered:  # kept by ingest until our join is registered
            return OfferModel()
        # Announced: with a push queue we listen on it rather than poll our record (which is looked at when a change
        # is pushed and before a re-send); what admits us, an epoch's start, is pushed. (A thousand joiners polling
        # their records from 0.2 s on outnumbered everything the join lane served.)
        return Wait("waiting for the join request to be recorded", True)
    if not state.has_model:
        if not local.offered:
            return OfferModel()
        if state.phase is Phase.WAITING:
            return Wait(f"waiting for members (the run needs its first epoch; {len(state.members)} admitted)", True)
        return Wait(f"waiting for the run's initial model ({state.phase})", True)
    member = state.members.get(pid)
    if member is None:
        if state.phase is Phase.WAITING:
            return Wait("waiting for enough members to start an epoch", True)
        return Wait(f"not a member of epoch {state.epoch}: admitted at the next epoch", True)
    if member.status is MemberStatus.DROPPED:
        why = f" ({member.reason})" if member.reason else ""
        return Wait(f"dropped from epoch {state.epoch}{why}: admitted again at the next epoch", True)
    if (report := _health_report(state, local)) is not None:
        return report
    if state.phase is Phase.WARMUP:
        if local.held != state.global_digest:
            return Fetch(state.round, state.global_digest)
        if local.reported_ready < state.epoch:
            return ReportReady(state.epoch)
        # Say it again if the heartbeat was lost, not merely queued: while our record shows no message of ours
        # accepted since it, a re-send would only queue behind it (with a thousand members warming up, re-sends
        # every few seconds grew the queue they waited in); the cap still re-sends one that was refused.
        due = retry_after(READY_RETRY_SECONDS, local.ready_sends, READY_RETRY_MAX_SECONDS)
        if local.ready_recorded < state.epoch and local.ready_age >= due and (
                not local.ready_in_flight or local.ready_age >= READY_RETRY_MAX_SECONDS):
            return ReportReady(state.epoch)
        return Wait(f"ready for epoch {state.epoch}; warmup ends when every member is ready")
    if state.phase is Phase.TRAIN:
        if pid not in state.selected:
            return Wait(f"not selected for round {state.round}", True)
        if state.round not in local.uploaded and not local.recorded:
            if local.held != state.global_digest:
                return Fetch(state.round, state.global_digest)
            return Train(state.round, state.epoch, state.seed, tuple(state.selected), state.global_digest,
                         tuple(state.plan), state.deadline)
        if is_witness_duty(state, local):
            return _witness(state, local)
        if state.round in local.uploaded:
            return Wait(f"update for round {state.round} uploaded; waiting for the round to close", True,
                        round_close=True)
        return Wait(f"an update for round {state.round} is already stored; waiting for the round to close", True,
                    round_close=True)
    if state.phase is Phase.WITNESS:
        if is_witness_duty(state, local):
            return _witness(state, local)
        return Wait(f"round {state.round} closed; waiting for its aggregation", True)
    if state.phase is Phase.COOLDOWN:
        return Wait(f"epoch {state.epoch} ended; cooldown", True)
    return Wait(f"phase {state.phase}", True)


def _witness(state: RunState, local: Local) -> Action:
    """Evaluate what has been recorded; send the proof once everything is in, or when the round closes."""
    if local.held != state.global_digest:  # the evaluation's reference (after a restart we may not hold it)
        return Fetch(state.round, state.global_digest)
    if local.witness_unchecked:
        return CheckUpdates(state.round)
    if local.witness_missing == 0:
        return SendProof(state.round, complete=True)
    if state.phase is Phase.WITNESS:
        return SendProof(state.round, complete=False)
    return Wait(f"witness of round {state.round}: {local.witness_missing} update(s) still to come")


def _health_report(state: RunState, local: Local) -> ReportHealth | None:
    """Once per witnessed round whose proofs reached the quorum: name the members it did not attest."""
    if state.phase not in LIVE_PHASES or state.health_round in local.health_reported or not local.health_confirmed:
        return None
    named = unhealthy(state, local.pid)
    return ReportHealth(state.health_round, named) if named else None
