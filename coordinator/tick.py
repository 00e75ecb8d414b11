"""A tick against the real stores: load, decide (pure), carry out what must precede the commit, commit.

`coordinator.service` runs it, after catching up with news the event queue has not delivered. Two ticks racing is
normal: the loser's conditional commit fails with `Conflict`, it re-reads, and finds nothing to do.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass

from coordinator.aggregation import AggregationBusy, RoundLease, write_aggregate
from coordinator.deps import Deps
from coordinator.model_files import copy_global, read_header
from coordinator.optimizer_state import copy_state
from shared import keys
from shared.machine import Decision, exclude_input, resolve, tick
from shared.state import (
    AdoptInitialModel,
    Aggregate,
    CarryGlobal,
    Note,
    RecordRound,
    RoundSummary,
    RunState,
    Snapshot,
    WriteCheckpoint,
)
from shared.wire import Manifest, WireError
from store.blobs import NotFound, Tampered
from store.ranges import CorruptInput
from store.records import state_to_body
from store.table import Conflict

MAX_ATTEMPTS = 6


class TickContention(RuntimeError):
    """Every attempt lost its race; the next tick will try again (nothing is lost)."""


@dataclass(frozen=True)
class TickResult:
    committed: bool
    state: RunState
    attempts: int
    fired: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    summaries: tuple[RoundSummary, ...] = ()
    aggregation_seconds: float = 0.0


def decide_and_commit(deps: Deps, now: float | None = None, snap: Snapshot | None = None,
                      caught_up: int = 0) -> TickResult:
    """One tick, retried on a lost race; `now` fixes the clock (tests), otherwise each attempt reads it anew. `snap`:
    the snapshot the first attempt decides on (already loaded); `caught_up`: uploads ingested just before, noted."""
    lease = RoundLease()  # held from an aggregation until the commit that records it is in or lost
    try:
        return _attempts(deps, now, lease, snap, caught_up)
    finally:
        lease.release(deps)


def _attempts(deps: Deps, at: float | None, lease: RoundLease, loaded: Snapshot | None, caught_up: int
              ) -> TickResult:
    withdrawn: list[str] = []
    for attempt in range(1, MAX_ATTEMPTS + 1):
        now = time.time() if at is None else at
        snap, loaded = loaded or deps.store.load_snapshot(), None
        lease.decided_on = snap.state.version
        decision = tick(snap, deps.config, now)
        first = snap.state.version == 0  # the run's first commit publishes its configuration
        if first and deps.bucket.head(keys.latest_checkpoint_key(deps.config.run_id)) is not None:
            # An empty table beside a checkpoint is a run that lost its table, not a new run: starting over
            # would overwrite the checkpoint with a new run's. Wait for the operator's `fed run restore`.
            return TickResult(False, snap.state, attempt, notes=(
                "the table holds no run state but the bucket holds a checkpoint: waiting for `fed run restore`",))
        if first:
            deps.bucket.put(keys.config_key(deps.config.run_id), deps.config.model_dump_json(indent=1).encode())
        if not decision.changed and not first:
            return TickResult(False, snap.state, attempt)
        started = time.perf_counter()
        try:
            decision = carry_out_before_commit(deps, decision, lease=lease)
        except AggregationBusy as exc:  # the invocation aggregating the round commits it
            return TickResult(False, snap.state, attempt, notes=(str(exc),))
        except CorruptInput as exc:
            if not exc.participant:
                raise
            _exclude(deps, snap.state, exc)  # the round goes on without that input: decide again
            continue
        except OfferGone as exc:  # withdraw it: the next decision adopts another offer
            withdrawn.append(f"{exc}: withdrawn, another offer is adopted")
            deps.store.set_init_offer(exc.participant, "")
            continue
        aggregation_seconds = time.perf_counter() - started
        summaries = tuple(e.summary for e in decision.effects if isinstance(e, RecordRound))
        try:
            version = deps.store.commit(decision.state, snap.state.version, summaries)
        except Conflict:
            continue
        notes = tuple(e.message for e in decision.effects if isinstance(e, Note))
        if caught_up:
            notes = (f"ingested {caught_up} upload(s) the event queue had not delivered yet", *notes)
        notes = (*withdrawn, *notes)
        state = decision.state.evolve(version=version)
        pace_schedule(deps, snap.state, state)
        announce(deps, snap.state, state)
        return TickResult(True, state, attempt, decision.fired, notes, summaries, aggregation_seconds)
    raise TickContention(f"lost {MAX_ATTEMPTS} races in a row")


def pace_schedule(deps: Deps, before: RunState | None, after: RunState) -> None:
    """The tick schedule on while the run needs ticks, off while it is idle (finished, or paused): an idle run is
    billed for nothing but storage. Switched by the commit that changes it (`before` None: set it anyway)."""
    if deps.schedule is not None and (before is None or before.needs_ticks != after.needs_ticks):
        deps.schedule.set_enabled(after.needs_ticks)


def announce(deps: Deps, before: RunState, after: RunState) -> None:
    """Publish a committed state whose phase, round, epoch or model changed: what a waiting participant acts on,
    with the roster it names when that is small enough to ride along (`store.push`). One message a few times a
    round."""
    if deps.topic is None:
        return
    if (before.phase, before.round, before.epoch, before.global_digest) != (
            after.phase, after.round, after.epoch, after.global_digest):
        deps.topic.publish(deps.config.run_id, after.version, *deps.store.item_and_roster(after))


def _exclude(deps: Deps, state: RunState, exc: CorruptInput) -> None:
    """Commit the open round without one unreadable input, with the reason (a lost race re-reads)."""
    reason = f"unreadable as recorded, left out: {str(exc)[:300]}"
    with contextlib.suppress(Conflict):
        deps.store.commit(exclude_input(state, exc.participant, reason), state.version)


def carry_out_before_commit(deps: Deps, decision: Decision, lease: RoundLease | None = None) -> Decision:
    """Write every object the new state will point to (an aggregation under `lease`, if given: see `RoundLease`).

    Global models are content-addressed (`keys.global_key`): a tick that loses its commit leaves at most an
    orphan under its own digest, and can never replace the model the winner committed to.
    """
    run_id = deps.config.run_id
    written, written_state = "", ""  # an aggregate and optimizer state written by this tick (a carry copies them)
    for effect in decision.effects:
        if isinstance(effect, AdoptInitialModel):
            adopt_initial_model(deps, effect)
        elif isinstance(effect, Aggregate):
            written, written_state = write_aggregate(deps, effect, lease)
            decision = resolve(decision, written, written_state)
        elif isinstance(effect, CarryGlobal):
            carried = effect.digest or written
            copy_global(deps, effect.round, carried, keys.global_key(run_id, effect.round + 1, carried))
            if carried_state := effect.optimizer_digest if effect.digest else written_state:
                carry_state(deps, effect.round, carried_state)
        elif isinstance(effect, WriteCheckpoint):
            write_checkpoint(deps, effect, decision.state)
    return decision


def carry_state(deps: Deps, round_no: int, digest: str) -> None:
    """The optimizer state goes on unchanged with the global model of a round that was not aggregated."""
    copy_state(deps, round_no, digest, lambda file: keys.optimizer_key(deps.config.run_id, round_no + 1, file))


def write_checkpoint(deps: Deps, effect: WriteCheckpoint, state: RunState) -> None:
    """Global weights and the run's state (every `checkpoint_every` rounds and at each epoch's end), then a
    pointer to them: written last, so the pointer only ever names a complete checkpoint."""
    run_id = deps.config.run_id
    copy_global(deps, effect.round, state.global_digest, keys.checkpoint_global_key(run_id, effect.round))
    if state.optimizer_digest:
        copy_state(deps, effect.round, state.optimizer_digest,
                   lambda d: keys.checkpoint_optimizer_key(run_id, effect.round, d))
    body = {
        "schema": 1,
        "epoch": effect.epoch,
        "round": effect.round,
        "global_key": keys.checkpoint_global_key(run_id, effect.round),
        "global_digest": state.global_digest,
        "optimizer_digest": state.optimizer_digest,
        "state": state_to_body(state),
        "config": deps.config.to_json_dict(),
    }
    deps.bucket.put(keys.checkpoint_state_key(run_id, effect.round), json.dumps(body, indent=1).encode())
    pointer = {"epoch": effect.epoch, "state_key": keys.checkpoint_state_key(run_id, effect.round)}
    deps.bucket.put(keys.latest_checkpoint_key(run_id), json.dumps(pointer).encode())


class OfferGone(Exception):
    """The initial-model offer a tick would adopt cannot be read as ingest recorded it."""

    def __init__(self, participant: str) -> None:
        super().__init__(f"initial model offer of {participant} cannot be read as it was recorded")
        self.participant = participant


def adopt_initial_model(deps: Deps, effect: AdoptInitialModel) -> None:
    """Copy the recorded version of the offer (hashed as it streams) to round 0's global key."""
    run_id = deps.config.run_id
    key = keys.init_key(run_id, effect.participant)
    try:
        version_id, size = deps.bucket.verified_version(key, effect.digest, effect.version_id)
        manifest = Manifest.of(read_header(deps.bucket, key, version_id, size))
    except (NotFound, Tampered, WireError):
        raise OfferGone(effect.participant) from None
    deps.bucket.put(keys.manifest_key(run_id), manifest.to_json().encode())
    deps.bucket.copy(key, keys.global_key(run_id, effect.round, effect.digest), version_id=version_id)
