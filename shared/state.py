"""The coordinator's state and what a tick sees and asks for: plain frozen data, no I/O.

`RunState` is owned by the tick and committed as one item with a version condition. The facts that
arrive from participants (joins, heartbeats, updates) are owned by the ingest function and reach the
tick read-only as `ParticipantView` and `UpdateView`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from shared.sizing import Speed, WorkPlan
from shared.witness import Proof


class Phase(StrEnum):
    WAITING = "WaitingForMembers"
    WARMUP = "Warmup"
    TRAIN = "RoundTrain"
    WITNESS = "RoundWitness"
    COOLDOWN = "Cooldown"
    FINISHED = "Finished"
    PAUSED = "Paused"


# The phases of an epoch in progress: only in them are silent members dropped and health reports sent and applied.
LIVE_PHASES = frozenset({Phase.WARMUP, Phase.TRAIN, Phase.WITNESS})



class MemberStatus(StrEnum):
    ACTIVE = "active"
    DROPPED = "dropped"


@dataclass(frozen=True)
class Member:
    """A participant admitted to the current epoch."""

    status: MemberStatus = MemberStatus.ACTIVE
    since: float = 0.0
    reason: str = ""
    # When it was last heard from by an update recorded in an earlier round of the epoch (its upload time), or when
    # it was last heard from at all as the epoch admitted it. Ingest writes an update's record, not the participant's
    # record too, and a participant does not heartbeat within an interval of an update upload: without this, a
    # member uploading every round would look silent since its last heartbeat once a round closed.
    heard: float = 0.0


@dataclass(frozen=True)
class RunState:
    run_id: str
    version: int = 0
    phase: Phase = Phase.WAITING
    epoch: int = 0  # epochs started; the current epoch's number (first epoch is 1)
    round: int = 0  # current round; every round number is used once and never decreases
    aggregated: int = 0  # rounds aggregated so far (the run is finished at total_rounds)
    seed: str = ""  # the current round's seed (hex)
    phase_started: float = 0.0
    deadline: float = 0.0  # when the current phase ends at the latest; 0: no deadline
    round_started: float = 0.0
    rounds_in_epoch: int = 0
    members: Mapping[str, Member] = field(default_factory=dict)
    selected: tuple[str, ...] = ()
    counted: tuple[str, ...] = ()  # accepted updates frozen for aggregation when RoundTrain ends
    # The updates the last closed round (round - 1) aggregated; () if it was not aggregated. A participant reads
    # its update's outcome here, in the roster it reads anyway, instead of from its update record.
    counted_last: tuple[str, ...] = ()
    excluded: Mapping[str, str] = field(default_factory=dict)  # accepted but left out at the freeze, and why
    global_digest: str = ""  # digest of rounds/<round>/global; "" before the run has a model
    optimizer_digest: str = ""  # the server optimizer state that made it (rounds/<round>/optimizer); "": zeros
    model_source: str = ""  # participant whose initial-model offer became round 0's model
    witnesses: tuple[str, ...] = ()  # elected for the current round, in position order
    epoch_started: float = 0.0
    health_round: int = -1  # the last closed round with witness records
    health: Mapping[str, int] = field(default_factory=dict)  # its health scores (proofs attesting each)
    health_quorum: int = 0
    # Witnessed rounds in a row, through health_round, each member's update went unattested (a score under the
    # quorum; no counted update scores 0), and how many make a health report drop it (RunConfig.health_strikes).
    strikes: Mapping[str, int] = field(default_factory=dict)
    strikes_needed: int = 1
    # Refused witness proofs of each participant over the run (RunConfig.witness_strikes of them drop it, and bar
    # it from witness seats), and the witnesses unseated from the current round for one (not drawn again for it).
    witness_strikes: Mapping[str, int] = field(default_factory=dict)
    unseated: tuple[str, ...] = ()
    pause_requested: bool = False  # set by the operator; the next tick pauses (and clearing it resumes)
    # Throughput sizing (shared.sizing): the smoothed estimate of every participant measured so far, the current
    # round's plan (who trains which share, fixed at round start), and who missed the last deadline while still
    # making progress (kept with a smaller share; a second miss drops it).
    speeds: Mapping[str, Speed] = field(default_factory=dict)
    plan: WorkPlan = ()
    late: tuple[str, ...] = ()
    round_units: float = 0.0  # samples x passes a whole round trains, as the last measured round's updates said

    @property
    def has_model(self) -> bool:
        # After a round closes its aggregate's digest is filled in only once written (machine.resolve),
        # but a run past round 0 always has a model.
        return bool(self.global_digest) or self.round > 0

    def active(self) -> list[str]:
        return sorted(p for p, m in self.members.items() if m.status is MemberStatus.ACTIVE)

    def unhealthy(self) -> tuple[str, ...]:
        """Active members a health report may drop: unattested by a quorum of witnesses in the last witnessed
        round and in the `strikes_needed - 1` witnessed rounds before it that scored them."""
        return tuple(p for p in self.active() if self.strikes.get(p, 0) >= self.strikes_needed
                     and self.health.get(p, self.health_quorum) < self.health_quorum)

    @property
    def needs_ticks(self) -> bool:
        """False while nothing happens until someone acts: the run is finished, or paused and not asked to resume
        (the tick schedule is off then, `store.schedule`)."""
        if self.phase is Phase.FINISHED:
            return False
        return not (self.phase is Phase.PAUSED and self.pause_requested)

    def evolve(self, **changes: Any) -> RunState:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class ParticipantView:
    """What ingest recorded about a participant: when it joined and was last heard from."""

    pid: str
    joined_at: float
    last_seen: float
    ready_epoch: int = 0  # last epoch for which it reported having the model loaded
    init_digest: str = ""  # digest of its initial-model offer, if it made one
    init_version: str = ""  # the S3 version of that offer ingest checked ("": not recorded)
    # When ingest last accepted a signed message from it after the join request that registered it (a
    # heartbeat or ready report, a signed update, a newer join request); 0: none yet. A time, not a
    # comparison of last_seen with joined_at: event times are whole seconds, and a heartbeat sent within the
    # second of the join would not move last_seen past joined_at.
    heard_at: float = 0.0
    samples: int = 0  # local data mode: its own data's sample count, registered at join
    # Training progress from its latest heartbeat: the round, units done of total, when it last moved (ingest's
    # clock), and the samples per second it measured in its last round. progress_round -1: never reported.
    progress_round: int = -1
    progress_done: int = 0
    progress_total: int = 0
    progress_at: float = 0.0
    rate: float = 0.0

    def stalled_for(self, round_no: int, round_started: float, now: float) -> float:
        """Seconds its training progress in `round_no` has not moved (counted from the round's start if it has not
        reported progress in that round yet)."""
        moved = self.progress_at if self.progress_round == round_no else 0.0
        return now - max(moved, round_started)

    def alive(self, now: float, timeout: float) -> bool:
        return now - self.last_seen <= timeout

    @property
    def proven(self) -> bool:
        """It has shown it is live since joining: only then may an epoch admit it."""
        return self.heard_at > 0


@dataclass(frozen=True)
class UpdateView:
    """An update recorded for the current round: accepted with its weight, or refused with a reason."""

    pid: str
    round: int
    accepted: bool
    samples: int = 0
    digest: str = ""
    reason: str = ""
    metrics: Mapping[str, float] = field(default_factory=dict)
    version_id: str = ""
    norm: float = -1.0  # L2 distance from the round's global model; -1: not measured
    received_at: float = 0.0  # when it was uploaded (the S3 event's time)
    data_offset: int = -1  # where its data section starts; -1: unknown (read from the file)


def heard_through_updates(participants: Mapping[str, ParticipantView], updates: Mapping[str, UpdateView],
                          members: Mapping[str, Member] | None = None) -> dict[str, ParticipantView]:
    """The participants as their signed updates show them: heard from when the latest was uploaded, the round's
    (its record) or an earlier round's of the epoch (`Member.heard`). Ingest writes the update's record only, not
    the participant's too: one write less per update."""
    heard = {pid: m.heard for pid, m in (members or {}).items() if m.heard}
    for pid, u in updates.items():
        heard[pid] = max(heard.get(pid, 0.0), u.received_at)
    out = dict(participants)
    for pid, at in heard.items():
        view = out.get(pid)
        if view is not None and at > view.last_seen:
            out[pid] = dataclasses.replace(view, last_seen=at, heard_at=max(view.heard_at, at))
    return out


@dataclass(frozen=True)
class Snapshot:
    state: RunState
    participants: Mapping[str, ParticipantView] = field(default_factory=dict)
    updates: Mapping[str, UpdateView] = field(default_factory=dict)  # current round only
    proofs: Mapping[str, Proof] = field(default_factory=dict)  # current round only, by witness
    health_reports: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # about state.health_round
    refused_proofs: Mapping[str, str] = field(default_factory=dict)  # current round: witness -> why ingest refused


# --- effects: what a tick asks its handler to do -----------------------------------------------------


@dataclass(frozen=True)
class AdoptInitialModel:
    """Copy a participant's initial-model offer to round 0's global key and record the manifest."""

    participant: str
    digest: str
    round: int
    version_id: str = ""  # the offer's S3 version ingest checked: read directly, not looked for


@dataclass(frozen=True)
class AggregateInput:
    participant: str
    samples: int
    digest: str
    version_id: str = ""  # the S3 object version accepted (uploads to the same key cannot swap it)
    norm: float = -1.0  # its distance from the round's global model, measured at ingest (clipping uses it)
    data_offset: int = -1  # where its data section starts, as ingest read it; -1: unknown


@dataclass(frozen=True)
class Aggregate:
    """Combine the counted updates of `round` into the global model of `round + 1`, before committing."""

    round: int
    inputs: tuple[AggregateInput, ...]
    base_digest: str = ""  # the round's own global model (clipped_fedavg and server optimizers start from it)
    optimizer_digest: str = ""  # the server optimizer state before the round; "": zeros (or no optimizer)


@dataclass(frozen=True)
class CarryGlobal:
    """A round that could not be aggregated: its global model becomes the next round's unchanged."""

    round: int
    digest: str  # of the model carried over; "" when it is the aggregate this same tick writes
    optimizer_digest: str = ""  # of the optimizer state carried with it ("": none, or the one this tick writes)


@dataclass(frozen=True)
class RoundSummary:
    """One finished round, kept as the run's metrics history."""

    round: int
    epoch: int
    selected: tuple[str, ...]
    counted: tuple[str, ...]
    refused: Mapping[str, str]
    dropped: Mapping[str, str]
    samples: int
    loss: float | None
    accuracy: float | None
    started: float
    ended: float
    aggregated: bool
    global_digest: str = ""  # filled in once the aggregate is written
    optimizer_digest: str = ""  # the server optimizer state after the round (likewise)
    witnesses: tuple[str, ...] = ()
    proofs: int = 0  # valid witness proofs received
    quorum: int = 0
    health: Mapping[str, int] = field(default_factory=dict)  # the scores members may be dropped on
    shares: Mapping[str, int] = field(default_factory=dict)  # each planned participant's weight (shared.sizing)
    finished: Mapping[str, float] = field(default_factory=dict)  # seconds from round start to each update's upload
    suspects: Mapping[str, str] = field(default_factory=dict)  # witnesses whose proof the others contradict, why

    @property
    def seconds(self) -> float:
        return self.ended - self.started


@dataclass(frozen=True)
class WriteCheckpoint:
    """Keep the global model that `round` trains from and the state under checkpoints/<round>/ (every
    `checkpoint_every` aggregated rounds, and at the end of each epoch)."""

    epoch: int
    round: int


@dataclass(frozen=True)
class RecordRound:
    summary: RoundSummary


@dataclass(frozen=True)
class Note:
    """A notable event for the logs (drops, phase changes)."""

    message: str


Effect = AdoptInitialModel | Aggregate | CarryGlobal | RecordRound | WriteCheckpoint | Note
