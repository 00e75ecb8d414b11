"""The coordinator: a pure `tick(snapshot, config, now) -> Decision` over a transition table.

A tick first drops members that went silent, then fires transitions of the table until none applies
(so one tick can close a round, aggregate it and open the next). The table is data: `TRANSITIONS`
lists every (source, target, name, guard, action), `transition_table()` renders it for the docs,
and a test fires each row.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from shared import sizing
from shared.config import DataMode, RunConfig, WorkSizing
from shared.limits import MAX_SUMMARY_REASON_CHARS, bounded
from shared.selection import round_seed, select
from shared.state import (
    LIVE_PHASES,
    AdoptInitialModel,
    Aggregate,
    AggregateInput,
    CarryGlobal,
    Effect,
    Member,
    MemberStatus,
    Note,
    ParticipantView,
    Phase,
    RecordRound,
    RoundSummary,
    RunState,
    Snapshot,
    UpdateView,
    WriteCheckpoint,
)
from shared.witness import Proof, elect, evidence, health_scores, quorum, suspects, verdicts

MAX_STEPS = 16


@dataclass
class TickInProgress:
    """One tick in progress: the inputs, the state being built and the effects asked for."""

    snap: Snapshot
    config: RunConfig
    now: float
    state: RunState
    effects: list[Effect] = field(default_factory=list)
    fired: list[str] = field(default_factory=list)

    def eligible(self) -> list[ParticipantView]:
        """Who a new epoch admits, sorted by id: participants alive now that were heard from after their join
        (a join request alone admits nobody), namely every member of the epoch that just ended among them and
        at most `max_admissions_per_epoch` others, the earliest joined first (ties by id)."""
        timeout = self.config.liveness_timeout
        live = [p for p in self.snap.participants.values() if p.alive(self.now, timeout) and p.proven]
        previous = self.state.members  # the epoch that just ended (active or dropped); empty once waiting
        returning = [p for p in live if p.pid in previous]
        new = sorted((p for p in live if p.pid not in previous), key=lambda p: (p.joined_at, p.pid))
        admitted = returning + new[: self.config.max_admissions_per_epoch]
        return sorted(admitted, key=lambda p: p.pid)

    def updates(self) -> dict[str, UpdateView]:
        """Updates recorded for the round the state is in now (a tick can move past the snapshot's)."""
        return {pid: u for pid, u in self.snap.updates.items() if u.round == self.state.round}

    def proofs(self) -> dict[str, Proof]:
        """Proofs of the current round from its elected witnesses (ingest admits no others)."""
        s = self.state
        return {w: p for w, p in self.snap.proofs.items() if p.round == s.round and w in s.witnesses}

    def drop(self, pid: str, reason: str) -> None:
        members = dict(self.state.members)
        members[pid] = Member(MemberStatus.DROPPED, self.now, reason)
        self.state = self.state.evolve(
            members=members, selected=tuple(p for p in self.state.selected if p != pid)
        )
        self.effects.append(Note(f"dropped {pid}: {reason}"))


@dataclass(frozen=True)
class Transition:
    source: Phase
    target: Phase
    name: str
    guard: Callable[[TickInProgress], bool]
    action: Callable[[TickInProgress], None]
    doc: str


@dataclass(frozen=True)
class Decision:
    state: RunState
    effects: tuple[Effect, ...]
    fired: tuple[str, ...]
    changed: bool


# --- guards --------------------------------------------------------------------------------------------


def _deadline_passed(c: TickInProgress) -> bool:
    return c.now >= c.state.deadline


def _too_few_members(c: TickInProgress) -> bool:
    return len(c.state.active()) < c.config.min_clients


def _can_start_epoch(c: TickInProgress) -> bool:
    eligible = c.eligible()
    has_model = c.state.has_model or any(p.init_digest for p in eligible)
    return len(eligible) >= c.config.min_clients and has_model and not _joiners_awaited(c, eligible)


def _joiners_awaited(c: TickInProgress, eligible: list[ParticipantView]) -> bool:
    """While the run waits for members, within `start_grace` seconds of the join of the min_clients-th participant
    the epoch would admit: is a live joiner not yet heard from since its join (and room for it among the epoch's
    admissions)? Its heartbeat may be queued behind the others' (ingest runs behind the uploads), or on its way.
    Counted from a join time, not from when news was ingested, so no stream of new joins can hold it longer."""
    grace = c.config.start_grace
    if grace <= 0 or c.state.phase is not Phase.WAITING:
        return False
    if c.now >= sorted(p.joined_at for p in eligible)[c.config.min_clients - 1] + grace:
        return False
    if sum(p.pid not in c.state.members for p in eligible) >= c.config.max_admissions_per_epoch:
        return False
    timeout = c.config.liveness_timeout
    return any(not p.proven and p.alive(c.now, timeout) for p in c.snap.participants.values())


def _warmup_over(c: TickInProgress) -> bool:
    ready = all(
        (p := c.snap.participants.get(pid)) is not None and p.ready_epoch >= c.state.epoch
        for pid in c.state.active()
    )
    return ready or _deadline_passed(c)


def stuck(snap: Snapshot, config: RunConfig, state: RunState, pid: str, now: float) -> float | None:
    """Seconds a selected participant without an update has shown no training progress in the current round, if that
    makes it stuck (it reported progress in this round, then none for `stuck_timeout`); None otherwise."""
    view = snap.participants.get(pid)
    if (config.stuck_timeout <= 0 or state.phase is not Phase.TRAIN or view is None
            or view.progress_round != state.round or view.progress_done >= view.progress_total):
        return None  # no progress reported in this round yet, or its training is done (it is uploading)
    still = view.stalled_for(state.round, state.round_started, now)
    return still if still >= config.stuck_timeout else None


def _stuck(c: TickInProgress, pid: str) -> float | None:
    return stuck(c.snap, c.config, c.state, pid, c.now)


def _round_closed(c: TickInProgress) -> bool:
    updates = c.updates()
    recorded = all(pid in updates or _stuck(c, pid) is not None for pid in c.state.selected)
    if c.state.witnesses:  # opportunistic witnessing: a quorum has checked everything recorded
        complete = sum(1 for p in c.proofs().values() if p.complete)
        recorded = recorded and complete >= quorum(len(c.state.witnesses))
    return recorded or _deadline_passed(c)


def _witness_over(c: TickInProgress) -> bool:
    """Every elected witness's proof is in, or a quorum of proofs is in and every one of them attests every
    counted update (nothing a later proof could dispute), or the witness deadline passed. Proofs that disagree
    wait for the others: one early empty proof and one honest proof must not decide the round between them; and
    a refusal waits for every witness, so that it can count as evidence (shared.witness.evidence)."""
    seats, proofs, counted = len(c.state.witnesses), c.proofs(), _counted_digests(c)
    if not seats:  # no witnesses: nothing to wait for
        return True
    refused = sum(1 for w in c.snap.refused_proofs if w in c.state.witnesses)  # a seat's proof, though refused
    every_proof_in = len(proofs) + refused == seats
    all_attested = (len(proofs) >= quorum(seats)
                    and all(got == set(counted) for got in verdicts(proofs, counted).values()))
    return every_proof_in or all_attested or _deadline_passed(c)


def _counted_digests(c: TickInProgress) -> dict[str, str]:
    updates = c.updates()
    return {pid: updates[pid].digest for pid in c.state.counted if pid in updates}


def _health(c: TickInProgress) -> dict[str, int]:
    """Each counted update's health score: the proofs that attest exactly its bytes."""
    return health_scores(c.proofs().values(), _counted_digests(c))


def _attested(c: TickInProgress) -> tuple[str, ...]:
    """The counted updates that will be aggregated: all of them, or those a witness quorum attested."""
    if not c.state.witnesses:
        return c.state.counted
    need = quorum(len(c.state.witnesses))
    return tuple(pid for pid, score in sorted(_health(c).items()) if score >= need)


def _quorum_missed(c: TickInProgress) -> bool:
    return bool(c.state.witnesses) and len(c.proofs()) < quorum(len(c.state.witnesses))


def _seatable(c: TickInProgress, candidates: Iterable[str]) -> list[str]:
    """Who may hold a witness seat: not a participant whose proofs were refused `witness_strikes` times."""
    barred = c.config.witness_strikes
    return [p for p in candidates if c.state.witness_strikes.get(p, 0) < barred]


def _refused_proofs(c: TickInProgress) -> dict[str, str]:
    """The round's elected witnesses whose proof is refused, with why: refused by ingest (over-full, malformed,
    spoofed), or empty against the records (it attests none of the round's counted updates while another witness
    attests some of them). A witness that withholds every attestation cannot be told from one that found every
    update bad, except by the others: one that attests nothing beside one that attests something contradicts
    it. (A proof that refuses some updates others attest is not struck: which side is right is what witnessing
    cannot know without a quorum; such a witness is recorded as a suspect.)"""
    counted = _counted_digests(c)
    out = _refused_by_ingest(c)
    seen = verdicts(c.proofs(), counted)
    attesting = sorted(w for w, got in seen.items() if got)
    for w, got in sorted(seen.items()):
        if counted and not got and (others := [x for x in attesting if x != w]):
            out[w] = (f"it attests none of the round's {len(counted)} counted update(s), which {', '.join(others)} "
                      "attest")
    return out


def _replacements(c: TickInProgress, count: int) -> list[str]:
    """Up to `count` new witnesses for the round, in the order its seed shuffles the selected participants: not
    one of its witnesses now or before, and not barred."""
    s = c.state
    taken = set(s.witnesses) | set(s.unseated)
    order = elect(s.seed, _seatable(c, s.selected), len(s.selected))
    return [p for p in order if p not in taken][:count]


def _refused_by_ingest(c: TickInProgress) -> dict[str, str]:
    return {w: f"ingest refused it: {why}" for w, why in sorted(c.snap.refused_proofs.items())
            if w in c.state.witnesses}


def _seats_to_redraw(c: TickInProgress) -> bool:
    """A proof ingest refused takes its seat's proof away at once: redraw it now. One empty against the records is
    judged once the witness phase is over, and only if the round cannot aggregate without redrawing: a round that
    aggregates strikes it at close."""
    if _refused_by_ingest(c):
        return True
    return _witness_over(c) and bool(_refused_proofs(c)) and (_quorum_missed(c) or not _enough_updates(c))


def _enough_updates(c: TickInProgress) -> bool:
    return not _quorum_missed(c) and len(_attested(c)) >= c.config.min_updates


def _epoch_ends_after_this_round(c: TickInProgress) -> bool:
    s, cfg = c.state, c.config
    timed_out = cfg.epoch_time > 0 and c.now - s.epoch_started >= cfg.epoch_time
    return s.aggregated + 1 >= cfg.total_rounds or s.rounds_in_epoch + 1 >= cfg.epoch_rounds or timed_out


def _pause_requested(c: TickInProgress) -> bool:
    return c.state.pause_requested


def _resume_requested(c: TickInProgress) -> bool:
    return not c.state.pause_requested


def _run_complete(c: TickInProgress) -> bool:
    return c.state.aggregated >= c.config.total_rounds


# --- actions -------------------------------------------------------------------------------------------


def _start_epoch(c: TickInProgress) -> None:
    eligible = c.eligible()
    s = c.state.evolve(
        epoch=c.state.epoch + 1,
        members={p.pid: Member(MemberStatus.ACTIVE, c.now, heard=p.last_seen) for p in eligible},
        selected=(),
        counted=(),
        rounds_in_epoch=0,
        epoch_started=c.now,
        health={},  # last epoch's health records cannot drop anyone just admitted again
        strikes={},
        deadline=c.now + c.config.warmup_time,
        # estimates of registered participants only (a participant record lost with the table takes its own)
        speeds={p: v for p, v in c.state.speeds.items() if p in c.snap.participants},
        late=(),
    )
    if not s.has_model:
        source = _initial_offer(eligible)
        s = s.evolve(global_digest=source.init_digest, model_source=source.pid)
        c.effects.append(AdoptInitialModel(source.pid, source.init_digest, s.round, source.init_version))
    new = sum(1 for p in eligible if p.pid not in c.state.members)
    waiting = _waiting_for_admission(c, eligible)
    c.state = s
    c.effects.append(Note(f"epoch {s.epoch} starts with {len(eligible)} members ({new} new)"))
    if waiting:
        c.effects.append(Note(f"{waiting} live participants wait for a later epoch: at most "
                              f"{c.config.max_admissions_per_epoch} new members an epoch"))


def _initial_offer(eligible: list[ParticipantView]) -> ParticipantView:
    """Whose initial-model offer becomes round 0's global: the model most of the eligible offered (honest
    participants of a task build the same one from the run's seed, so an attacker's model that fits the run's
    schema must outnumber them), the first offerer by id among equals. Ingest already refused offers that do not
    fit the run's `initial_model_schema` / `initial_model_digest`."""
    offers = [p for p in eligible if p.init_digest]
    votes = Counter(p.init_digest for p in offers)
    best = max(votes.values())
    return next(p for p in offers if votes[p.init_digest] == best)


def _waiting_for_admission(c: TickInProgress, admitted: list[ParticipantView]) -> int:
    """Live participants heard from since they joined that the admission bound left out of this epoch."""
    timeout, chosen = c.config.liveness_timeout, {p.pid for p in admitted}
    return sum(1 for p in c.snap.participants.values()
               if p.alive(c.now, timeout) and p.proven and p.pid not in chosen)


def _back_to_waiting(c: TickInProgress) -> None:
    _leave_epoch(c)
    c.effects.append(Note(f"fewer than {c.config.min_clients} members: waiting for members"))


def _leave_epoch(c: TickInProgress) -> None:
    if c.state.phase in (Phase.TRAIN, Phase.WITNESS):  # the round was started: close it unaggregated
        _close_round(c, aggregated=False)
    c.state = c.state.evolve(members={}, selected=(), counted=(), witnesses=(), deadline=0.0)


def _pause(c: TickInProgress) -> None:
    _leave_epoch(c)
    c.effects.append(Note("paused by the operator"))


def _resume(c: TickInProgress) -> None:
    c.effects.append(Note("resumed by the operator: waiting for members"))


def _begin_round(c: TickInProgress) -> None:
    s, cfg = c.state, c.config
    seed = round_seed(cfg.seed, s.epoch, s.round)
    chosen = select(seed, s.active(), cfg.fraction_per_round, cfg.min_per_round)
    plan = _plan(c, chosen)
    predicted = sizing.predicted_seconds(plan, s.speeds, cfg.batch_size, s.round_units, cfg.max_speed_ratio,
                                         cfg.max_share_ratio)
    sized = cfg.work_sizing is WorkSizing.THROUGHPUT
    limit = sizing.deadline_seconds(predicted, len(plan), cfg.deadline_margin if sized else 0.0,
                                    cfg.min_round_train_time, cfg.max_round_train_time)
    c.state = s.evolve(
        seed=seed,
        selected=chosen,
        plan=plan,
        witnesses=elect(seed, _seatable(c, chosen), cfg.witness_nodes),
        unseated=(),
        counted=(),
        round_started=c.now,
        deadline=c.now + limit,
    )


def _plan(c: TickInProgress, chosen: tuple[str, ...]) -> sizing.WorkPlan:
    """The round's shares (shared.sizing): weights from the throughput estimates, and local steps."""
    cfg = c.config
    steps: int | dict[str, int] = cfg.local_steps
    if cfg.data_mode is DataMode.LOCAL:  # each its own passes (or local_steps), scaled by its speed
        own = {p: v.samples for p in chosen if (v := c.snap.participants.get(p)) is not None}
        steps = {p: cfg.local_steps or cfg.local_epochs * -(-own.get(p, 0) // cfg.batch_size) for p in chosen}
        if cfg.work_sizing is WorkSizing.EQUAL or not all(steps.values()):
            steps = cfg.local_steps  # everyone its local_epochs passes (or local_steps), as without sizing
    return sizing.make_plan(chosen, c.state.speeds, steps=steps, sized=cfg.work_sizing is WorkSizing.THROUGHPUT,
                            max_ratio=cfg.max_speed_ratio, max_share=cfg.max_share_ratio)


def _freeze_round(c: TickInProgress) -> None:
    updates = c.updates()
    late: list[str] = []
    for pid in c.state.selected:  # with witnesses, the health checks deal with those who did not deliver
        if pid in updates:
            continue
        if (still := _stuck(c, pid)) is not None:  # stuck even with witnesses: it is treated as missing
            c.drop(pid, f"stuck: its training progress in round {c.state.round} did not move for {still:.0f}s "
                        f"(stuck_timeout {c.config.stuck_timeout:g}s)")
        elif not c.state.witnesses:
            if _slow_but_progressing(c, pid):
                late.append(pid)
            else:
                c.drop(pid, f"missed the deadline of round {c.state.round}")
    accepted = sorted(pid for pid in c.state.selected if (u := updates.get(pid)) is not None and u.accepted)
    _measure(c, updates, accepted, late)
    weights = {share.pid: share.weight for share in c.state.plan}
    # Inputs excluded earlier in the round (unreadable as recorded: `exclude_input`) stay excluded.
    excluded = {
        **c.state.excluded,
        **_sample_outliers(c.config, {pid: updates[pid].samples for pid in accepted}, weights),
        **_norm_outliers(c.config, {pid: updates[pid].norm for pid in accepted}),
    }
    counted = tuple(pid for pid in accepted if pid not in excluded)
    c.state = c.state.evolve(counted=counted, excluded=excluded, deadline=c.now + c.config.round_witness_time)


def _slow_but_progressing(c: TickInProgress, pid: str) -> bool:
    """A participant that missed the deadline while its training was still moving, for the first time in a row: kept,
    with a smaller share next time (throughput sizing only; a second miss in a row drops it)."""
    view = c.snap.participants.get(pid)
    return (c.config.work_sizing is WorkSizing.THROUGHPUT and pid not in c.state.late and view is not None
            and view.progress_round == c.state.round and view.progress_total > 0)


def _measure(c: TickInProgress, updates: dict[str, UpdateView], accepted: list[str], late: list[str]) -> None:
    """Fold the round's measurements into the throughput estimates: each accepted update's training rate (what it
    trained over the `train_seconds` its metrics report, taken within what its arrival shows:
    `sizing.observed_seconds`, against the round's median overhead, which a minority cannot move) and the seconds
    it took beyond training as it reports them (overhead); a late participant's rate cut to what it achieved. A
    measurement is believed at most RATE_GROWTH x the estimate before this round (a first one, x the fleet's
    median rate before it)."""
    s, cfg = c.state, c.config
    speeds = dict(s.speeds)
    fleet_rate = sizing.median_rate(s.speeds.values()) if s.speeds else None
    # (reported training seconds, seconds from round start to arrival; 0: not observed) of each accepted update
    timing = {pid: (updates[pid].metrics.get("train_seconds", 0.0),
                    (updates[pid].received_at - s.round_started) if updates[pid].received_at else 0.0)
              for pid in accepted}
    reported = [(claimed, elapsed) for claimed, elapsed in timing.values() if claimed > 0 and elapsed > 0]
    overheads = [max(0.0, elapsed - claimed) for claimed, elapsed in reported]
    fleet_overhead = statistics.median(overheads) if overheads else sizing.median_overhead(s.speeds.values())
    typical = statistics.median(claimed for claimed, _ in reported) if reported else 0.0
    units_seen, fraction_seen = 0.0, 0.0
    for pid in accepted:
        u = updates[pid]
        share = sizing.share_of(s.plan, pid)
        trained = trained_units(cfg, share, u.samples)
        claimed, elapsed = timing[pid]
        if not claimed > 0 or not trained > 0:
            continue
        seconds = sizing.observed_seconds(claimed, elapsed, fleet_overhead)
        if seconds > 2 * claimed and 10 * claimed < typical:  # far below the others' and what its arrival shows
            c.effects.append(Note(f"{pid} reported training {claimed:.3g}s of the {elapsed:.3g}s between round "
                                  f"{s.round}'s start and its update (the round's median report {typical:.3g}s): "
                                  f"measured at {seconds:.3g}s"))
        rate = sizing.clamp_rate(trained / seconds)
        overhead = max(0.0, elapsed - claimed) if elapsed > 0 else 0.0
        speeds[pid] = sizing.smoothed(speeds.get(pid), rate, overhead, cfg.throughput_smoothing, fleet_rate)
        if share is not None and not share.steps:
            units_seen += trained
            fraction_seen += sizing.fraction(s.plan, pid)
    planned = sizing.rates([share.pid for share in s.plan], s.speeds, cfg.max_speed_ratio, cfg.max_share_ratio)
    for pid in late:
        view = c.snap.participants[pid]
        done = view.progress_done / view.progress_total
        share = sizing.share_of(s.plan, pid)
        expected = planned.get(pid, sizing.median_rate(s.speeds.values()))
        old = speeds.get(pid)
        spent = max(1e-3, c.now - s.round_started - (old.overhead if old else 0.0))
        owed = sizing.units(s.plan, share, cfg.batch_size, s.round_units) if share is not None else 0.0
        achieved = done * owed / spent if owed > 0 else 0.0
        rate = min(expected * 0.5, achieved) if achieved > 0 else expected * 0.5
        speeds[pid] = sizing.Speed(sizing.clamp_rate(rate), old.overhead if old else 0.0, old.rounds if old else 1)
        c.effects.append(Note(f"{pid} missed the deadline of round {s.round} at {100 * done:.0f}% of its share: "
                              f"kept, with a smaller share (estimate {rate:.3g} samples/s)"))
    round_units = units_seen / fraction_seen if fraction_seen > 0 else s.round_units
    c.state = s.evolve(speeds=speeds, late=tuple(sorted(late)), round_units=round_units)


def trained_units(config: RunConfig, share: sizing.Share | None, samples: int) -> int:
    """What an update's training time grew with: its steps x batch (a share with steps, or local_steps), else its
    samples x local_epochs passes. With the `train_seconds` its metrics report, its rate (samples per second)."""
    steps = (share.steps if share is not None else 0) or config.local_steps
    return steps * config.batch_size if steps else samples * config.local_epochs


def exclude_input(state: RunState, pid: str, reason: str) -> RunState:
    """Leave one recorded input out of the open round, with the reason: an update the coordinator can no
    longer read back as it was recorded must not stop the round (the others are aggregated without it)."""
    return state.evolve(counted=tuple(p for p in state.counted if p != pid), excluded={**state.excluded, pid: reason})


def _sample_outliers(config: RunConfig, claims: dict[str, int],
                     weights: dict[str, int] | None = None) -> dict[str, str]:
    """Updates claiming far more samples than the median of the round's other claims (leave-one-out, so one
    huge claim cannot raise the median it is judged against). Claims are compared per unit of plan weight: a
    participant sized to a larger share may claim proportionally more."""
    if not config.max_sample_ratio or len(claims) < 2:
        return {}
    w = {pid: (weights or {}).get(pid, 1) or 1 for pid in claims}
    equal = len(set(w.values())) == 1
    out = {}
    for pid, n in claims.items():
        others = statistics.median(v / w[p] for p, v in claims.items() if p != pid) * w[pid]
        if n > config.max_sample_ratio * others:
            out[pid] = (f"claims {n} samples, more than {config.max_sample_ratio:g} x the median "
                        f"{others:g} of the round's other updates" + ("" if equal else " (per its share)"))
    return out


def _norm_outliers(config: RunConfig, norms: dict[str, float]) -> dict[str, str]:
    """Updates whose distance from the global model is far beyond the round's median distance."""
    measured = {p: n for p, n in norms.items() if n >= 0}
    if config.norm_outlier_factor <= 0 or len(measured) < 3:
        return {}
    median = statistics.median(measured.values())
    bound = config.norm_outlier_factor * max(median, 1e-12)
    return {
        p: f"update norm {n:.3g} is {n / max(median, 1e-12):.0f}x the round's median {median:.3g}"
        for p, n in sorted(measured.items())
        if n > bound
    }


def _weighted_metric(c: TickInProgress, name: str) -> float | None:
    updates = c.updates()
    pairs = [
        (u.samples, u.metrics[name])
        for pid in _attested(c)
        if (u := updates.get(pid)) is not None and name in u.metrics
    ]
    total = sum(w for w, _ in pairs)
    return sum(w * v for w, v in pairs) / total if total else None


def _heard_from(members: Mapping[str, Member], updates: Mapping[str, UpdateView]) -> dict[str, Member]:
    """The members, each heard from when its update of the round closing was uploaded (`Member.heard`)."""
    return {pid: dataclasses.replace(m, heard=max(m.heard, u.received_at)) if (u := updates.get(pid)) else m
            for pid, m in members.items()}


def _close_round(c: TickInProgress, aggregated: bool) -> None:
    s = c.state
    updates = c.updates()
    counted = _attested(c) if aggregated else ()
    proofs = len(c.proofs())
    # Health scores only from a round whose proofs reached the quorum (otherwise everyone would score low and
    # one member's report could drop them all), and only where the witnesses agree (shared.witness.evidence).
    witnessed = bool(s.witnesses) and proofs >= quorum(len(s.witnesses))
    health = evidence(c.proofs(), _counted_digests(c), s.selected, len(s.witnesses)) if witnessed else {}
    suspected = {w: bounded(why, MAX_SUMMARY_REASON_CHARS)
                 for w, why in suspects(c.proofs(), _counted_digests(c), len(s.witnesses)).items()}
    for w, why in suspected.items():
        c.effects.append(Note(f"round {s.round}: witness {w} is a suspect: {why}"))
    _strike_witnesses(c, _refused_proofs(c))
    s = c.state
    dropped = {
        pid: m.reason
        for pid, m in s.members.items()
        if m.status is MemberStatus.DROPPED and m.since > s.round_started
    }
    summary = RoundSummary(
        round=s.round,
        epoch=s.epoch,
        selected=tuple(sorted(set(s.selected) | set(dropped))),
        counted=counted,
        refused={pid: bounded(reason, MAX_SUMMARY_REASON_CHARS) for pid, reason in (
            {pid: u.reason for pid, u in sorted(updates.items()) if not u.accepted} | dict(s.excluded)).items()},
        dropped=dropped,
        samples=sum(updates[p].samples for p in counted),
        loss=_weighted_metric(c, "loss") if aggregated else None,
        accuracy=_weighted_metric(c, "test_accuracy") if aggregated else None,
        started=s.round_started,
        ended=c.now,
        aggregated=aggregated,
        global_digest="" if aggregated else s.global_digest,  # the aggregate's is filled in by resolve()
        optimizer_digest="" if aggregated else s.optimizer_digest,
        witnesses=s.witnesses,
        proofs=proofs,
        quorum=quorum(len(s.witnesses)),
        health=health,
        shares={share.pid: share.weight for share in s.plan},
        finished={pid: round(u.received_at - s.round_started, 3) for pid, u in sorted(updates.items())
                  if u.accepted and u.received_at},
        suspects=suspected,
    )
    if aggregated:
        weights = sizing.fedavg_weights({p: updates[p].samples for p in counted}, c.config.max_share_ratio)
        inputs = tuple(AggregateInput(p, weights[p], updates[p].digest, updates[p].version_id, updates[p].norm,
                                      updates[p].data_offset)
                       for p in counted)
        c.effects.append(Aggregate(s.round, inputs, s.global_digest, s.optimizer_digest))
    else:
        c.effects.append(CarryGlobal(s.round, s.global_digest, s.optimizer_digest))
    c.effects.append(RecordRound(summary))
    c.state = s.evolve(
        members=_heard_from(s.members, updates),
        round=s.round + 1,
        aggregated=s.aggregated + (1 if aggregated else 0),
        rounds_in_epoch=s.rounds_in_epoch + (1 if aggregated else 0),
        selected=(),
        plan=(),
        counted=(),
        counted_last=counted,
        excluded={},
        witnesses=(),
        health_round=s.round,
        health=health,
        health_quorum=quorum(len(s.witnesses)),
        strikes=count_strikes(s.strikes, health, quorum(len(s.witnesses))),
        strikes_needed=c.config.health_strikes,
        # The aggregate's digest is known only once it is written: Decision.resolve fills it in.
        global_digest="" if aggregated else s.global_digest,
        optimizer_digest="" if aggregated else s.optimizer_digest,
    )


def count_strikes(before: Mapping[str, int], health: Mapping[str, int], need: int) -> dict[str, int]:
    """Each member's witnessed rounds in a row under the quorum: one more for a low score, none after a good one;
    a member the round's evidence does not cover keeps its count."""
    out = {p: n for p, n in before.items() if p not in health}
    out.update({p: before.get(p, 0) + 1 for p, score in health.items() if score < need})
    return out


def _aggregate_and_continue(c: TickInProgress) -> None:
    _close_round(c, aggregated=True)
    every = c.config.checkpoint_every
    if every and c.state.aggregated % every == 0:  # a run that loses its table mid-epoch loses at most these
        c.effects.append(WriteCheckpoint(c.state.epoch, c.state.round))
    _begin_round(c)


def _aggregate_and_cool_down(c: TickInProgress) -> None:
    _close_round(c, aggregated=True)
    _cool_down(c)


def _cool_down(c: TickInProgress) -> None:
    c.state = c.state.evolve(deadline=c.now + c.config.cooldown_time)
    c.effects.append(WriteCheckpoint(c.state.epoch, c.state.round))


def _quorum_missed_cool_down(c: TickInProgress) -> None:
    n = len(c.state.witnesses)
    c.effects.append(Note(f"round {c.state.round}: {len(c.proofs())} of {n} witness proofs, quorum {quorum(n)}"))
    _close_round(c, aggregated=False)
    _cool_down(c)


def _strike_witnesses(c: TickInProgress, struck: Mapping[str, str]) -> None:
    """One strike for each witness whose proof was refused; `witness_strikes` of them drop it (and bar it from
    witness seats for the rest of the run)."""
    s, need = c.state, c.config.witness_strikes
    counts = {**s.witness_strikes, **{w: s.witness_strikes.get(w, 0) + 1 for w in struck}}
    c.state = s.evolve(witness_strikes=counts)
    for w, why in sorted(struck.items()):
        reason = f"its witness proof of round {s.round} was refused ({counts[w]} of {need}): {why}"
        if counts[w] >= need and (m := c.state.members.get(w)) is not None and m.status is MemberStatus.ACTIVE:
            c.drop(w, reason)
        else:
            c.effects.append(Note(f"round {s.round}: witness {w}: {reason}"))


def _redraw_witnesses(c: TickInProgress) -> None:
    _redraw(c, _refused_proofs(c))
    c.state = c.state.evolve(deadline=c.now + c.config.round_witness_time)


def _redraw_while_training(c: TickInProgress) -> None:
    _redraw(c, _refused_by_ingest(c))


def _redraw(c: TickInProgress, struck: Mapping[str, str]) -> None:
    """Unseat the witnesses whose proofs were refused (a strike each) and draw others in their seats from the
    round's seed; the round is witnessed again, not given up. The other witnesses' proofs stand. A seat nobody is
    left to fill is given up (the quorum is of the seats that remain)."""
    _strike_witnesses(c, struck)
    s = c.state
    fresh = iter(_replacements(c, len(struck)))
    seats = tuple(w for w in (next(fresh, "") if w in struck else w for w in s.witnesses) if w)
    c.state = s.evolve(witnesses=seats, unseated=tuple(sorted({*s.unseated, *struck})))
    c.effects.append(Note(f"round {s.round}: witnesses {', '.join(sorted(struck))} unseated (refused proofs); "
                          f"witnessed again by {', '.join(seats)}"))


def _retry_round(c: TickInProgress) -> None:
    c.effects.append(Note(f"round {c.state.round}: {len(c.state.counted)} accepted updates, retrying"))
    _close_round(c, aggregated=False)
    _begin_round(c)


def _close_and_wait(c: TickInProgress) -> None:
    _close_round(c, aggregated=_enough_updates(c))
    c.state = c.state.evolve(members={}, selected=(), counted=(), witnesses=(), deadline=0.0)
    c.effects.append(Note(f"fewer than {c.config.min_clients} members: waiting for members"))


def _finish(c: TickInProgress) -> None:
    c.state = c.state.evolve(deadline=0.0, selected=(), counted=())
    c.effects.append(Note("run finished"))


def _nothing(c: TickInProgress) -> None:
    c.state = c.state.evolve(deadline=0.0)


def _all(*guards: Callable[[TickInProgress], bool]) -> Callable[[TickInProgress], bool]:
    return lambda c: all(g(c) for g in guards)


def _not(guard: Callable[[TickInProgress], bool]) -> Callable[[TickInProgress], bool]:
    return lambda c: not guard(c)


# Order matters within a source phase: the first row whose guard holds fires.
TRANSITIONS: tuple[Transition, ...] = (
    *(
        Transition(source, Phase.PAUSED, f"pause_{source.name.lower()}", _pause_requested, _pause,
                   "the operator paused the run (`fed run pause`): an open round closes unaggregated")
        for source in (Phase.WAITING, Phase.WARMUP, Phase.TRAIN, Phase.WITNESS, Phase.COOLDOWN)
    ),
    Transition(Phase.PAUSED, Phase.WAITING, "resume", _resume_requested, _resume,
               "the operator resumed the run (`fed run resume`)"),
    Transition(Phase.WAITING, Phase.FINISHED, "finish_waiting", _run_complete, _finish,
               "total_rounds aggregated before the epoch could cool down (members left, or a pause)"),
    Transition(Phase.WAITING, Phase.WARMUP, "epoch_start", _can_start_epoch, _start_epoch,
               "min_clients live participants heard from since joining (and a model or an offer of one), and no "
               "live joiner still awaited within start_grace: admit them, at most max_admissions_per_epoch"),
    Transition(Phase.WARMUP, Phase.WAITING, "warmup_too_few", _too_few_members, _back_to_waiting,
               "members dropped below min_clients during warmup"),
    Transition(Phase.WARMUP, Phase.TRAIN, "warmup_done", _warmup_over, _begin_round,
               "every member reported ready, or warmup_time passed: select the round's trainers and size their shares"),
    Transition(Phase.TRAIN, Phase.WAITING, "train_too_few", _too_few_members, _back_to_waiting,
               "members dropped below min_clients: the round closes unaggregated"),
    Transition(Phase.TRAIN, Phase.TRAIN, "witness_redraw_training",
               lambda c: bool(_refused_by_ingest(c)), _redraw_while_training,
               "ingest refused an elected witness's proof: strike it and draw another in its seat"),
    Transition(Phase.TRAIN, Phase.WITNESS, "round_closed", _round_closed, _freeze_round,
               "every selected participant uploaded (or is stuck), or the round's deadline passed: freeze the count"),
    Transition(Phase.WITNESS, Phase.WITNESS, "witness_redraw", _seats_to_redraw, _redraw_witnesses,
               "a proof was refused by ingest, or proofs empty against the records leave the round unable to "
               "aggregate: strike their witnesses and draw others in their seats from the round's seed"),
    Transition(Phase.WITNESS, Phase.COOLDOWN, "witness_quorum_missed",
               _all(_witness_over, _quorum_missed), _quorum_missed_cool_down,
               "fewer witness proofs than the quorum: no aggregation, the epoch ends"),
    Transition(Phase.WITNESS, Phase.COOLDOWN, "aggregate_epoch_end",
               _all(_witness_over, _enough_updates, _epoch_ends_after_this_round), _aggregate_and_cool_down,
               "aggregate; the epoch (or the run) has had its rounds"),
    Transition(Phase.WITNESS, Phase.WAITING, "witness_too_few", _all(_witness_over, _too_few_members), _close_and_wait,
               "aggregate if enough updates arrived, then wait: members dropped below min_clients"),
    Transition(Phase.WITNESS, Phase.TRAIN, "aggregate_next_round",
               _all(_witness_over, _enough_updates), _aggregate_and_continue,
               "aggregate and start the next round"),
    Transition(Phase.WITNESS, Phase.TRAIN, "round_retry", _all(_witness_over, _not(_enough_updates)), _retry_round,
               "fewer than min_updates accepted: carry the model over and train a new round"),
    Transition(Phase.COOLDOWN, Phase.FINISHED, "run_complete", _all(_deadline_passed, _run_complete), _finish,
               "total_rounds aggregated"),
    Transition(Phase.COOLDOWN, Phase.WARMUP, "next_epoch", _all(_deadline_passed, _can_start_epoch), _start_epoch,
               "cooldown over: admit the live members and at most max_admissions_per_epoch new participants "
               "heard from since joining"),
    Transition(Phase.COOLDOWN, Phase.WAITING, "next_epoch_waiting", _deadline_passed, _back_to_waiting,
               "cooldown over but too few live participants"),
)


def _apply_health_reports(c: TickInProgress) -> None:
    """Drop a participant named by a member's health report only if the witness records agree: it was attested by
    fewer than a quorum in the last `health_strikes` witnessed rounds that scored it (RunState.unhealthy)."""
    s = c.state
    if s.phase not in LIVE_PHASES or not s.health:
        return
    reporters = set(s.active())
    named = {pid for reporter, pids in c.snap.health_reports.items() if reporter in reporters for pid in pids}
    for pid in sorted(named & set(s.unhealthy())):
        in_a_row = f", {s.strikes[pid]} witnessed rounds in a row" if s.strikes[pid] > 1 else ""
        c.drop(pid, f"health check: round {s.health_round} attested by {s.health[pid]} of {s.health_quorum} "
                    f"witnesses needed{in_a_row}")


def _silent(snap: Snapshot, config: RunConfig, now: float) -> list[str]:
    """The active members not heard from within the liveness timeout."""
    if snap.state.phase not in LIVE_PHASES:
        return []
    return [pid for pid in snap.state.active()
            if (view := snap.participants.get(pid)) is None or not view.alive(now, config.liveness_timeout)]


def _drop_silent(c: TickInProgress) -> None:
    timeout = c.config.liveness_timeout
    for pid in _silent(c.snap, c.config, c.now):
        view = c.snap.participants.get(pid)
        silent = c.now - view.last_seen if view else float("inf")
        c.drop(pid, f"silent for {silent:.0f}s (liveness timeout {timeout:.0f}s)")


@dataclass(frozen=True)
class Overdue:
    """What a tick at some time would decide from the absence of news: members it would drop as silent, and
    selected members whose update the round would close without (its deadline passed). Before deciding that,
    the service looks in the bucket for news the event queue has not delivered yet (`coordinator.catchup`)."""

    silent: tuple[str, ...] = ()
    missing_updates: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.silent or self.missing_updates)


def overdue(snap: Snapshot, config: RunConfig, now: float) -> Overdue:
    s = snap.state
    missing: tuple[str, ...] = ()
    if s.phase is Phase.TRAIN and now >= s.deadline:
        missing = tuple(pid for pid in s.selected if pid not in snap.updates)
    return Overdue(tuple(_silent(snap, config, now)), missing)


def tick(snap: Snapshot, config: RunConfig, now: float) -> Decision:
    """Advance the run as far as `now` allows. Pure: the same inputs always give the same decision.

    A tick decides after every decision it builds on: an invocation that read the clock before another committed
    (it lost a race, or caught up on uploads for a while) or whose host's clock is behind decides just after the
    state's last change, never before it. Otherwise a member it drops would be dated before the round it was
    dropped in, and that round's record would miss the drop."""
    now = max(now, math.nextafter(max(snap.state.phase_started, snap.state.round_started), math.inf))
    c = TickInProgress(snap, config, now, snap.state)
    _drop_silent(c)
    _apply_health_reports(c)
    for _ in range(MAX_STEPS):
        row = next((t for t in TRANSITIONS if t.source is c.state.phase and t.guard(c)), None)
        if row is None:
            break
        row.action(c)
        c.state = c.state.evolve(phase=row.target, phase_started=now)
        c.fired.append(row.name)
        c.effects.append(Note(f"{row.source} -> {row.target} ({row.name})"))
    return Decision(c.state, tuple(c.effects), tuple(c.fired), c.state != snap.state)


def resolve(decision: Decision, aggregate_digest: str, optimizer_digest: str = "") -> Decision:
    """Fill in the digests of the aggregate an `Aggregate` effect wrote and of the server optimizer state it
    made (known only after writing them)."""
    effects = tuple(
        RecordRound(dataclasses.replace(e.summary, global_digest=aggregate_digest, optimizer_digest=optimizer_digest))
        if isinstance(e, RecordRound) and not e.summary.global_digest
        else e
        for e in decision.effects
    )
    state = decision.state.evolve(global_digest=aggregate_digest, optimizer_digest=optimizer_digest)
    return Decision(state, effects, decision.fired, decision.changed)


def transition_table() -> str:
    """The table as Markdown, for the docs."""
    rows = ["| from | to | name | when |", "|---|---|---|---|"]
    rows += [f"| {t.source} | {t.target} | `{t.name}` | {t.doc} |" for t in TRANSITIONS]
    return "\n".join(rows)
