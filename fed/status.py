"""`fed status`: the run at a glance, read from its table and bucket (local endpoint or AWS).

Collecting (I/O) and describing (pure, `describe`) are separate so the description is testable without
any store; rendering turns the description into rich tables, or JSON with `--json`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from fed.plot import points_from_summaries, write_png
from shared import keys, sizing
from shared.config import RunConfig, WorkSizing
from shared.limits import bounded
from shared.machine import stuck
from shared.state import (
    MemberStatus,
    ParticipantView,
    Phase,
    RoundSummary,
    RunState,
    Snapshot,
    UpdateView,
    heard_through_updates,
)
from shared.witness import Proof, quorum
from store.blobs import Bucket, NotFound, s3_client
from store.connection import Connection
from store.table import StateStore

RECENT_ROUNDS = 10


@dataclass(frozen=True)
class ParticipantLine:
    pid: str
    state: str  # pending | active | finished (the run is over, it was a member to the end) | dropped
    reason: str  # why it was dropped, why it is pending, or the round it last trained in
    selected: bool
    round_status: str  # this round: training | uploaded | refused | waiting | -
    round_detail: str  # refusal reason, or the update's training loss
    last_seen_ago: float | None
    silent: bool  # no sign of life for more than half the liveness timeout
    witness: str = ""  # this round: "" | "witness" | "proof in" | "proof in (incomplete)"
    health: int | None = None  # witnesses that attested it in the last witnessed round (None: not scored)
    strikes: int = 0  # witnessed rounds in a row it went unattested (a health report drops it at `strikes_needed`)
    # the fleet view (issue: which host computes, which is stuck, which is slow)
    condition: str = ""  # ok | slow (missed the last deadline, smaller share) | stuck | silent | finished | dropped | -
    activity: str = ""  # what its last heartbeat said it was doing
    progress: float | None = None  # % of its share of the round it trains (or trained last) done
    progress_round: int | None = None
    samples_per_second: float | None = None  # the coordinator's smoothed estimate
    reported_rate: float | None = None  # what its last heartbeat said (its last round)
    share: float | None = None  # its fraction of this round's work (throughput sizing)
    predicted_seconds: float | None = None  # its predicted time for this round's share
    host: str = ""
    device: str = ""  # cpu, cuda:0, ... and the GPU's name when it has one
    drops: list[str] = field(default_factory=list)  # every drop of it, "round N: reason"
    refusals: list[str] = field(default_factory=list)  # its refused uploads, "round N: reason" (the last few)


@dataclass(frozen=True)
class RefusalLine:
    round: int | None
    pid: str
    key: str
    reason: str
    at: float


@dataclass(frozen=True)
class RoundLine:
    round: int
    participants: int
    accepted: int
    refused: int
    dropped: int
    aggregated: bool
    loss: float | None
    accuracy: float | None
    seconds: float
    proofs: int = 0  # valid witness proofs received
    witnesses: int = 0  # elected


@dataclass(frozen=True)
class DropLine:
    round: int | None  # the round during which it was dropped; None: the current round
    pid: str
    reason: str


@dataclass(frozen=True)
class SuspectLine:
    round: int  # the round whose proofs contradicted its
    pid: str  # the witness
    reason: str


@dataclass(frozen=True)
class WitnessInfo:
    """The current round's witnesses and their proofs, and the last witnessed round's health scores."""

    witnesses: list[str]
    proofs: dict[str, bool]  # witness -> its proof says it saw every update (complete)
    quorum: int
    health_round: int  # -1: no witnessed round yet
    health: dict[str, int]
    health_quorum: int
    strikes: dict[str, int] = field(default_factory=dict)  # active members unattested in witnessed rounds in a row
    strikes_needed: int = 1  # how many such rounds make a health report drop a member


@dataclass(frozen=True)
class ResultLine:
    """Where the run's latest global model is, what its last round measured, and how to fetch it."""

    round: int  # the round it is the global model of
    key: str
    digest: str
    loss: float | None  # the last aggregated round's training loss and accuracy
    accuracy: float | None
    fetch: str  # the command that writes it to a file


@dataclass(frozen=True)
class Status:
    run_id: str
    phase: str
    epoch: int
    round: int
    aggregated: int
    total_rounds: int | None
    deadline_in: float | None  # seconds from now until the phase's deadline; None: no deadline
    participants: list[ParticipantLine]
    refusals: list[RefusalLine]
    rounds: list[RoundLine]
    round_seconds: float | None  # mean of the recent aggregated rounds
    eta_seconds: float | None  # remaining rounds x the predicted round time (measured throughput), else the mean
    endpoint: str | None = None
    notes: list[str] = field(default_factory=list)
    witnessing: WitnessInfo | None = None  # None: the run has no witnesses
    drops: list[DropLine] = field(default_factory=list)  # who was dropped and why, most recent last
    predicted_round_seconds: float | None = None  # from the throughput estimates and the round's plan
    work_sizing: str = ""
    suspects: list[SuspectLine] = field(default_factory=list)  # witnesses the others contradicted, most recent last
    result: ResultLine | None = None  # the latest global model (None: none yet)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def describe(
    state: RunState,
    participants: Mapping[str, ParticipantView],
    updates: Mapping[str, UpdateView],
    refused_updates: Sequence[RefusalLine],
    refusals: Sequence[RefusalLine],
    rounds: Sequence[RoundSummary],
    config: RunConfig | None,
    now: float,
    endpoint: str | None = None,
    proofs: Mapping[str, Proof] | None = None,
    info: Mapping[str, Mapping[str, Any]] | None = None,
    named: str = "",
) -> Status:
    """Everything `fed status` shows, from the run's records and the time now. Pure. `info`: what each participant
    said about itself (host, device, activity), displayed and never trusted. `named`: how commands shown name the
    run (`--connection FILE` or `--stack NAME`)."""
    records = _Records(
        state=state, participants=participants, updates=updates, config=config, now=now,
        refusals=sorted([*refused_updates, *refusals], key=lambda r: r.at),
        rounds=sorted(rounds, key=lambda r: r.round),
        proofs={w: p for w, p in (proofs or {}).items() if p.round == state.round},
        info=info or {},
        predicted=_predicted(state, config),
        scored=state.health_round >= 0 and bool(state.health),
        snap=Snapshot(state, participants, updates),
    )
    recent = records.rounds[-RECENT_ROUNDS:]
    done = [r.seconds for r in recent if r.aggregated]
    round_seconds = sum(done) / len(done) if done else None
    total = config.total_rounds if config else None
    prediction = _round_prediction(state, config, records.predicted)
    per_round = prediction or round_seconds
    eta = None
    if per_round is not None and total is not None and state.phase is not Phase.FINISHED:
        eta = max(0, total - state.aggregated) * per_round
    return Status(
        run_id=state.run_id,
        phase=state.phase.value,
        epoch=state.epoch,
        round=state.round,
        aggregated=state.aggregated,
        total_rounds=total,
        deadline_in=state.deadline - now if state.deadline and state.phase is not Phase.FINISHED else None,
        participants=[_participant_line(records, pid) for pid in sorted(set(participants) | set(state.members))],
        refusals=records.refusals,
        rounds=[_round_line(r) for r in recent],
        round_seconds=round_seconds,
        eta_seconds=eta,
        endpoint=endpoint,
        notes=_notes(state, participants, config, now),
        witnessing=_witnessing(records),
        drops=_drops(state, records.rounds),
        predicted_round_seconds=prediction,
        work_sizing=config.work_sizing.value if config is not None else "",
        suspects=[SuspectLine(r.round, pid, why) for r in records.rounds for pid, why in sorted(r.suspects.items())],
        result=_result(state, records.rounds, named),
    )


def _result(state: RunState, rounds: Sequence[RoundSummary], named: str) -> ResultLine | None:
    """`named`: how the fetch command names the run (`--connection FILE` or `--stack NAME`; "": the default file)."""
    if not state.global_digest:
        return None
    done = [r for r in rounds if r.aggregated]
    last = done[-1] if done else None
    return ResultLine(state.round, keys.global_key(state.run_id, state.round, state.global_digest),
                      state.global_digest, last.loss if last else None, last.accuracy if last else None,
                      " ".join(["fed export", f"--round {state.round}", *([named] if named else []),
                                "global.safetensors"]))


@dataclass(frozen=True)
class _Records:
    """What `describe` reads, gathered once for every part of the view: the run's records as `describe` got them
    (refusals oldest first, rounds in order, this round's proofs only), the time now, and what follows from them
    for every participant alike (the predicted seconds of this round's shares, whether health was scored)."""

    state: RunState
    participants: Mapping[str, ParticipantView]
    updates: Mapping[str, UpdateView]
    config: RunConfig | None
    now: float
    refusals: list[RefusalLine]
    rounds: list[RoundSummary]
    proofs: Mapping[str, Proof]
    info: Mapping[str, Mapping[str, Any]]
    predicted: Mapping[str, float]
    scored: bool  # a witnessed round's health scores are in
    snap: Snapshot


def _participant_line(records: _Records, pid: str) -> ParticipantLine:
    """One participant's row: its membership, this round's part, liveness, witnessing, the fleet view (condition,
    activity, progress, speed, share, host and device) and its history of drops and refusals."""
    state, config, now = records.state, records.config, records.now
    view = records.participants.get(pid)
    st, reason = _membership(state, pid, records.rounds)
    selected = pid in state.selected
    round_status, round_detail = _this_round(state, records.updates.get(pid), selected, st)
    ago = now - view.last_seen if view is not None else None
    timeout = config.liveness_timeout if config else None
    # (a member that uploaded this round is waiting for it to close, and one of a finished run has exited: neither
    # is silent)
    silent = bool(ago is not None and timeout and ago > timeout / 2 and st == "active" and round_status != "uploaded")
    about = records.info.get(pid, {})
    condition = _condition(records.snap, config, st, silent, pid, now)
    if condition == "stuck" and round_status == "training":
        round_status = "stuck"
    speed = state.speeds.get(pid)
    return ParticipantLine(
        pid, st, reason, selected, round_status, round_detail, ago, silent, _witness_mark(records, pid),
        state.health.get(pid) if records.scored else None,
        strikes=state.strikes.get(pid, 0) if st == "active" else 0,
        condition=condition, activity=str(about.get("activity", "")) if st != "finished" else "",
        progress=_progress(view),
        progress_round=view.progress_round if view is not None and view.progress_round >= 0 else None,
        samples_per_second=round(speed.rate, 3) if speed is not None else None,
        reported_rate=round(view.rate, 3) if view is not None and view.rate > 0 else None,
        share=round(sizing.fraction(state.plan, pid), 4) if sizing.share_of(state.plan, pid) else None,
        predicted_seconds=round(records.predicted[pid], 2) if pid in records.predicted else None,
        host=str(about.get("host", "")), device=_device(about),
        drops=[f"round {r.round}: {r.dropped[pid]}" for r in records.rounds if pid in r.dropped],
        refusals=[f"{'-' if x.round is None else f'round {x.round}'}: {bounded(x.reason, 200)}"
                  for x in records.refusals if x.pid == pid][-5:],
    )


def _membership(state: RunState, pid: str, rounds: Sequence[RoundSummary]) -> tuple[str, str]:
    """pending (joined, not yet admitted), active, finished (a member when the run finished) or dropped, and why it
    is pending or was dropped, or the round it last trained in."""
    member = state.members.get(pid)
    if member is None:
        return "pending", "joined; admitted at the next epoch" if state.phase is not Phase.FINISHED else ""
    if member.status is MemberStatus.DROPPED:
        return "dropped", member.reason
    if state.phase is Phase.FINISHED:
        trained = [r.round for r in rounds if pid in r.counted]
        return "finished", f"last trained round {trained[-1]}" if trained else "trained in no round"
    return "active", ""


def _this_round(state: RunState, update: UpdateView | None, selected: bool, st: str) -> tuple[str, str]:
    """Its part in this round: uploaded (with the update's training loss) or refused (with the reason), training,
    waiting (an active member not selected), or "-"."""
    if update is not None and update.round == state.round:
        if not update.accepted:
            return "refused", update.reason
        loss = update.metrics.get("loss")
        return "uploaded", f"loss {loss:.4f}" if loss is not None else ""
    if selected and state.phase is Phase.TRAIN:
        return "training", ""
    if st == "active" and state.phase in (Phase.TRAIN, Phase.WITNESS):
        return "waiting", "not selected this round"
    return "-", ""


def _witness_mark(records: _Records, pid: str) -> str:
    """The witness column: `witness` while its proof is not in, then `proof in` (or `proof in (incomplete)`); empty
    if it does not witness this round."""
    if pid not in records.state.witnesses:
        return ""
    proof = records.proofs.get(pid)
    return "witness" if proof is None else "proof in" if proof.complete else "proof in (incomplete)"


def _progress(view: ParticipantView | None) -> float | None:
    """The % of its share of the round its last heartbeat said was done."""
    if view is not None and view.progress_round >= 0 and view.progress_total > 0:
        return round(100.0 * view.progress_done / view.progress_total, 1)
    return None


def _device(about: Mapping[str, Any]) -> str:
    device = str(about.get("device", ""))
    if about.get("gpu"):
        device += f" ({about['gpu']})"
    return device


def _round_line(r: RoundSummary) -> RoundLine:
    return RoundLine(r.round, len(r.selected), len(r.counted), len(r.refused), len(r.dropped), r.aggregated,
                     r.loss, r.accuracy, r.seconds, r.proofs, len(r.witnesses))


def _drops(state: RunState, rounds: Sequence[RoundSummary]) -> list[DropLine]:
    """Every drop the round summaries recorded, in order; then members dropped now, not in a summary yet."""
    drops = [DropLine(r.round, pid, why) for r in rounds for pid, why in sorted(r.dropped.items())]
    recorded = {(d.pid, d.reason) for d in drops}
    return drops + [DropLine(None, pid, m.reason) for pid, m in sorted(state.members.items())
                    if m.status is MemberStatus.DROPPED and (pid, m.reason) not in recorded]


def _witnessing(records: _Records) -> WitnessInfo | None:
    """This round's witnesses and proofs, the last health scores and strikes; None where the run has no
    witnessing (none elected, none scored, none configured)."""
    state, config, scored = records.state, records.config, records.scored
    if not (state.witnesses or scored or (config is not None and config.witness_nodes > 0)):
        return None
    return WitnessInfo(
        witnesses=list(state.witnesses),
        proofs={w: p.complete for w, p in sorted(records.proofs.items())},
        quorum=quorum(len(state.witnesses)),
        health_round=state.health_round if scored else -1,
        health=dict(sorted(state.health.items())) if scored else {},
        health_quorum=state.health_quorum,
        strikes={p: n for p, n in sorted(state.strikes.items()) if n > 0 and p in state.active()},
        strikes_needed=state.strikes_needed,
    )


def _notes(state: RunState, participants: Mapping[str, ParticipantView], config: RunConfig | None,
           now: float) -> list[str]:
    """Why nothing moves yet: no tick so far, or members still awaited."""
    if state.version == 0:
        return ["the coordinator has not ticked yet: no run state"]
    if state.phase is Phase.WAITING and config is not None:
        live = sum(1 for p in participants.values() if p.alive(now, config.liveness_timeout))
        return [f"waiting for members: {live} live of the {config.min_clients} needed"]
    return []


def _predicted(state: RunState, config: RunConfig | None) -> dict[str, float]:
    """Each planned participant's predicted seconds for this round's share (shared.sizing)."""
    if config is None or not state.plan:
        return {}
    return sizing.predicted_seconds(state.plan, state.speeds, config.batch_size, state.round_units,
                                    config.max_speed_ratio, config.max_share_ratio)


def _round_prediction(state: RunState, config: RunConfig | None, predicted: Mapping[str, float]) -> float | None:
    """A round's predicted time: the latest predicted finish of the round in progress; between rounds, of a plan
    of the active members as the next round would size it."""
    if config is None:
        return None
    if not predicted and state.speeds:
        plan = sizing.make_plan(state.active(), state.speeds, steps=config.local_steps,
                                sized=config.work_sizing is WorkSizing.THROUGHPUT, max_ratio=config.max_speed_ratio,
                                max_share=config.max_share_ratio)
        predicted = sizing.predicted_seconds(plan, state.speeds, config.batch_size, state.round_units,
                                             config.max_speed_ratio, config.max_share_ratio)
    return round(max(predicted.values()), 2) if predicted else None


def _condition(snap: Snapshot, config: RunConfig | None, st: str, silent: bool, pid: str, now: float) -> str:
    """ok, slow (it missed the last deadline while progressing: a smaller share), stuck (heartbeats, but its training
    has not moved for stuck_timeout), silent (no sign of life for half the liveness timeout), dropped; "-" when not
    a member."""
    if st in ("dropped", "finished"):
        return st
    if st != "active":
        return "-"
    state = snap.state
    if config is not None and pid in state.selected and pid not in snap.updates and \
            stuck(snap, config, state, pid, now) is not None:
        return "stuck"
    if silent:
        return "silent"
    if pid in state.late:
        return "slow"
    return "ok"


def collect(connection: Connection, now: float | None = None, named: str = "") -> Status:
    """Read the run's records and describe them (`named`: how commands shown name the run)."""
    bucket = Bucket(connection.bucket, s3_client(connection.endpoint, connection.region))
    store = StateStore.of(connection, bucket)
    config = read_config(bucket, connection.run_id)
    state = store.read_state()
    records = store.participant_records()
    rounds = store.rounds()
    updates = store.updates(state.round)
    # (heard from by their updates too, as a tick sees them: a member uploading every round need not heartbeat)
    participants = heard_through_updates({pid: r.view() for pid, r in records.items()}, updates, state.members)
    refused_updates = [
        RefusalLine(int(u.round), u.pid, u.key, u.reason, float(u.received_at))
        for u in store.all_updates()
        if not u.accepted
    ]
    refusals = [RefusalLine(None, r.pid, r.key, r.reason, float(r.at)) for r in store.refusals()]
    budget = (config or RunConfig(run_id=connection.run_id)).upload_budget
    refusals += [RefusalLine(None, d.pid, "", f"{d.dropped} uploads dropped over the upload budget ({budget} a minute)",
                             d.last_at) for d in store.dropped_uploads().values()]  # one line each, however many
    proofs = store.proofs(state.round) if state.witnesses else {}
    return describe(state, participants, updates, refused_updates, refusals, rounds, config,
                    time.time() if now is None else now, connection.endpoint, proofs,
                    {pid: r.info for pid, r in records.items()}, named)


def write_plot(connection: Connection, path: Path) -> Path:
    """Every finished round's loss, accuracy and seconds as a PNG (raises fed.plot.PlotUnavailable)."""
    store = StateStore.of(connection)
    return write_png(points_from_summaries(store.rounds()), path, f"run {connection.run_id}")


def read_config(bucket: Bucket, run_id: str) -> RunConfig | None:
    """The run's configuration as its first tick published it; None before that."""
    try:
        return RunConfig.model_validate_json(bucket.get(keys.config_key(run_id)).data)
    except (NotFound, ValueError):
        return None


# --- rendering -----------------------------------------------------------------------------------------


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    value = max(0.0, value)
    if value < 120:
        return f"{value:.0f}s"
    if value < 7200:
        return f"{value / 60:.1f}min"
    return f"{value / 3600:.1f}h"


def _num(value: float | None, fmt: str = ".4f") -> str:
    return "-" if value is None else format(value, fmt)


STATE_STYLE = {"active": "green", "pending": "yellow", "finished": "green", "dropped": "red"}
MAX_SHOWN_REASON, MAX_SHOWN_KEY, MAX_SHOWN_ID = 240, 120, 64


def shown(text: str, limit: int = MAX_SHOWN_REASON, style: str = "") -> Text:
    """Text an uploader may have written, as the terminal shows it: bounded, control characters replaced,
    and never read as console markup (a reason may quote a tensor name or a key)."""
    clean = "".join(c if c.isprintable() else "?" for c in bounded(text, limit))
    return Text(clean, style=style)


ROUND_STYLE = {"uploaded": "green", "refused": "red", "training": "cyan", "stuck": "red"}
CONDITION_STYLE = {"ok": "green", "slow": "yellow", "stuck": "red", "silent": "red", "finished": "green",
                   "dropped": "red"}


def render(status: Status, width: int | None = None, wide: bool = False) -> RenderableType:
    """The status as `fed status` prints it: the run's heading and its result, the participants (the columns that
    fit `width`, or all if `wide`), then the tables that have rows (drops, suspect witnesses, refused uploads, recent
    rounds)."""
    parts: list[RenderableType] = [_heading(status), _participants_table(status, width, wide)]
    if status.drops:
        parts.append(_drops_table(status.drops, width))
    if status.suspects:
        parts.append(_suspects_table(status.suspects, width))
    if status.refusals:
        parts.append(_refusals_table(status.refusals, width))
    if status.rounds:
        parts.append(_rounds_table(status.rounds, status.witnessing is not None, width))
    return Group(*parts)


def _heading(status: Status) -> Text:
    """The run, its endpoint, phase, epoch, round and progress, the round time and ETA, notes, and witnessing."""
    head = Text()
    head.append(f"run {status.run_id}", style="bold")
    if status.endpoint:
        head.append(f"  ({status.endpoint})", style="dim")
    head.append(f"\nphase {status.phase}   epoch {status.epoch}   round {status.round}")
    total = f"/{status.total_rounds}" if status.total_rounds is not None else ""
    head.append(f"   aggregated {status.aggregated}{total}")
    head.append(f"   deadline in {_seconds(status.deadline_in)}" if status.deadline_in is not None else "")
    if status.round_seconds is not None or status.predicted_round_seconds is not None:
        measured = f"{status.round_seconds:.1f}s per round" if status.round_seconds is not None else ""
        predicted = (f"   predicted {status.predicted_round_seconds:.1f}s (measured throughput)"
                     if status.predicted_round_seconds is not None else "")
        head.append(f"\n{measured}{predicted}   ETA {_seconds(status.eta_seconds)}".replace("\n   ", "\n"))
    if status.result is not None:
        _append_result(head, status.result, finished=status.phase == Phase.FINISHED.value)
    for note in status.notes:
        head.append(f"\n{note}", style="yellow")
    if status.witnessing is not None:
        _append_witnessing(head, status.witnessing)
    return head


def _append_result(head: Text, r: ResultLine, finished: bool) -> None:
    """The latest global model: its round, metrics, key and digest, and the command that fetches it."""
    metrics = ", ".join(f"{name} {value:.4f}" for name, value in (("loss", r.loss), ("accuracy", r.accuracy))
                        if value is not None)
    head.append(f"\n{'final' if finished else 'latest'} global model: round {r.round}" +
                (f" ({metrics})" if metrics else ""), style="bold green" if finished else "")
    head.append(f"\n  key {r.key}\n  sha256 {r.digest}\n  fetch it: {r.fetch}")


def _append_witnessing(head: Text, w: WitnessInfo) -> None:
    """This round's witnesses and proofs, the last health scores against their quorum, and strikes so far."""
    if w.witnesses:
        head.append(f"\nwitnesses {', '.join(w.witnesses)}: {len(w.proofs)} of {len(w.witnesses)} proofs in "
                    f"({sum(w.proofs.values())} complete), quorum {w.quorum}")
    if w.health_round >= 0:
        low = [p for p, score in w.health.items() if score < w.health_quorum]
        scores = ", ".join(f"{p} {score}" for p, score in w.health.items())
        head.append(f"\nround {w.health_round} health (witnesses attesting; quorum {w.health_quorum}): {scores}")
        if low:
            head.append(f"\nbelow the quorum: {', '.join(low)}", style="red")
    if w.strikes:
        named = ", ".join(f"{p} {n} of {w.strikes_needed}" for p, n in w.strikes.items())
        head.append(f"\nunattested witnessed rounds in a row (a health report drops at {w.strikes_needed}): "
                    f"{named}", style="yellow")


# The participants table's columns in display order. On a terminal too narrow for all of them, the optional ones go,
# the least useful first (DROPPED_FIRST), until the rest fit; `fed status --wide` keeps them all, `--json` has all.
COLUMNS = ("participant", "state", "condition", "selected", "this round", "progress", "samples/s", "share",
           "last seen", "witness", "health", "host / device", "why")
DROPPED_FIRST = ("host / device", "share", "samples/s", "selected", "health", "witness", "state")
FLEXIBLE = frozenset({"why", "host / device", "key", "reason"})  # free text: cut to fit, the rest kept whole
MIN_CELL = 6  # a cell is never cut to fewer characters than this
MAX_FLEXIBLE = 80  # the widest a free-text column gets
Row = Mapping[str, RenderableType]


def _participants_table(status: Status, width: int | None = None, wide: bool = False) -> Table:
    """A row per participant; with witnessing, its witness duty and health columns too. Fitted to `width`."""
    w = status.witnessing
    rows: list[Row] = [_participant_cells(p, w) for p in status.participants]
    if not rows:
        rows = [{"participant": "(nobody has joined yet)"}]
    names = [c for c in COLUMNS if w is not None or c not in ("witness", "health")]
    return _table("participants", names, rows, None if wide else width, optional=DROPPED_FIRST)


def _table(title: str, names: Sequence[str], rows: Sequence[Row], width: int | None,
           right: frozenset[str] = frozenset(), optional: Sequence[str] = ()) -> Table:
    """A table whose rows never wrap. With a `width`: the `optional` columns go, the first first, until the rest fit
    with their headers whole; if they still do not, headers are cut (to MIN_CELL). Free text is cut to fit."""
    names = list(names)
    widths = None
    if width is not None:
        for drop in [None, *optional]:
            if drop in names:
                names.remove(drop)
            if (widths := _widths(names, rows, width, whole_headers=True)) is not None:
                break
        widths = widths or _widths(names, rows, width, whole_headers=False)
    table = Table(title=title, title_justify="left", expand=False)
    for k, name in enumerate(names):
        table.add_column(name, no_wrap=True, overflow="ellipsis", justify="right" if name in right else "left",
                         width=widths[k] if widths else None, max_width=MAX_FLEXIBLE if name in FLEXIBLE else None)
    for row in rows:
        table.add_row(*[row.get(name, "") for name in names])
    return table


def _widths(names: Sequence[str], rows: Sequence[Row], width: int, whole_headers: bool) -> list[int] | None:
    """Column widths that fit `width`, or None: fixed columns whole (and their headers, or those cut to MIN_CELL),
    free-text ones sharing what is left, each at least MIN_CELL."""
    cells = {n: max([0, *(_width(r.get(n, "")) for r in rows)]) for n in names}
    fixed = {n: max(cells[n], len(n) if whole_headers else min(len(n), MIN_CELL)) for n in names if n not in FLEXIBLE}
    free = [n for n in names if n in FLEXIBLE]
    left = width - (3 * len(names) + 1) - sum(fixed.values())
    if left < MIN_CELL * len(free):
        return None
    wanted = {n: min(MAX_FLEXIBLE, max(cells[n], MIN_CELL)) for n in free}
    if sum(wanted.values()) > left:  # shared in proportion to what each holds, MIN_CELL at least
        total = sum(wanted.values())
        wanted = {n: max(MIN_CELL, left * v // total) for n, v in wanted.items()}
    return [fixed[n] if n in fixed else wanted[n] for n in names]


def _width(cell: RenderableType) -> int:
    return len(cell.plain) if isinstance(cell, Text) else len(str(cell))


def _participant_cells(p: ParticipantLine, w: WitnessInfo | None) -> dict[str, RenderableType]:
    seen = "never" if p.last_seen_ago is None else f"{_seconds(p.last_seen_ago)} ago"
    progress = "-" if p.progress is None else f"{p.progress:.0f}% (r{p.progress_round})"
    rate = p.samples_per_second if p.samples_per_second is not None else p.reported_rate
    detail = p.reason or p.round_detail or p.activity
    if p.drops and p.state != "dropped":
        detail = f"{detail}; dropped before ({len(p.drops)}x)" if detail else f"dropped before ({len(p.drops)}x)"
    cells: dict[str, RenderableType] = {
        "participant": shown(p.pid, MAX_SHOWN_ID),
        "state": Text(p.state, style=STATE_STYLE.get(p.state, "")),
        "condition": Text(p.condition, style=CONDITION_STYLE.get(p.condition, "")),
        "selected": "yes" if p.selected else "",
        "this round": Text(p.round_status, style=ROUND_STYLE.get(p.round_status, "")),
        "progress": progress,
        "samples/s": "-" if rate is None else f"{rate:,.1f}",
        "share": "-" if p.share is None else f"{100 * p.share:.0f}%" + (
            f" (~{_seconds(p.predicted_seconds)})" if p.predicted_seconds is not None else ""),
        "last seen": Text(seen, style="red" if p.silent else ""),
        "host / device": shown(" ".join(x for x in (p.host, p.device) if x) or "-", MAX_SHOWN_ID),
        "why": shown(detail, MAX_SHOWN_REASON),
    }
    if w is not None:
        unhealthy = p.health is not None and p.health < w.health_quorum
        score = "-" if p.health is None else str(p.health)
        if p.strikes:
            score += f" (strike {p.strikes}/{w.strikes_needed})"
        cells["witness"] = p.witness
        cells["health"] = Text(score, style="red" if unhealthy else "")
    return cells


def _drops_table(drops: Sequence[DropLine], width: int | None) -> Table:
    rows: list[Row] = [{"round": "now" if d.round is None else str(d.round), "participant": shown(d.pid, MAX_SHOWN_ID),
             "why": shown(d.reason, style="red")} for d in drops[-RECENT_ROUNDS:]]
    return _table("dropped", ("round", "participant", "why"), rows, width)


def _suspects_table(suspects: Sequence[SuspectLine], width: int | None) -> Table:
    rows: list[Row] = [{"round": str(x.round), "witness": shown(x.pid, MAX_SHOWN_ID),
                        "why": shown(x.reason, style="yellow")} for x in suspects[-RECENT_ROUNDS:]]
    return _table("suspect witnesses", ("round", "witness", "why"), rows, width)


def _refusals_table(refusals: Sequence[RefusalLine], width: int | None) -> Table:
    rows: list[Row] = [{"round": "-" if x.round is None else str(x.round),
                        "participant": shown(x.pid or "?", MAX_SHOWN_ID), "key": shown(x.key, MAX_SHOWN_KEY),
                        "reason": shown(x.reason, style="red")} for x in refusals[-RECENT_ROUNDS:]]
    return _table("refused uploads", ("round", "participant", "key", "reason"), rows, width)


def _rounds_table(round_lines: Sequence[RoundLine], witnessed: bool, width: int | None) -> Table:
    """The recent rounds; with witnessing, the proofs each received of those elected."""
    names = ["round", "participants", "accepted", "refused", "dropped", "loss", "accuracy", "seconds"]
    if witnessed:
        names.insert(5, "proofs")
    rows: list[Row] = [{"round": str(r.round), "participants": str(r.participants),
             "accepted": str(r.accepted) if r.aggregated else f"{r.accepted} (not counted)",
             "refused": str(r.refused), "dropped": str(r.dropped), "loss": _num(r.loss),
             "accuracy": _num(r.accuracy), "seconds": f"{r.seconds:.1f}",
             "proofs": f"{r.proofs}/{r.witnesses}" if r.witnesses else "-"} for r in round_lines]
    return _table("recent rounds", names, rows, width, right=frozenset(names), optional=("dropped", "refused"))


def render_json(status: Status) -> str:
    return json.dumps(status.to_json(), indent=1)
