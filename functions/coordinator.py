"""A tick against the real stores: load, decide (pure), carry out what must precede the commit, commit.

Used by the tick handler and, after recording an object, by the ingest handler. Two ticks racing is
normal: the loser's conditional commit fails with `Conflict`, it re-reads, and finds nothing to do.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import numpy as np

from functions.settings import Deps
from shared import keys
from shared.aggregate import WeightedInput, aggregate_file
from shared.machine import Decision, resolve, tick
from shared.records import state_to_body
from shared.state import (
    AdoptInitialModel,
    Aggregate,
    CarryGlobal,
    Note,
    RecordRound,
    RoundSummary,
    RunState,
    WriteCheckpoint,
)
from shared.store import Conflict
from shared.wire import Manifest, WireError, decode, digest, parse_header

MAX_ATTEMPTS = 6


class TickContention(RuntimeError):
    """Every attempt lost its race; the next tick will try again (nothing is lost)."""


class CorruptInput(RuntimeError):
    """A stored object no longer matches what was recorded for it."""


@dataclass(frozen=True)
class TickResult:
    committed: bool
    state: RunState
    attempts: int
    fired: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    summaries: tuple[RoundSummary, ...] = ()
    aggregation_seconds: float = 0.0


def run_tick(deps: Deps, now: float | None = None) -> TickResult:
    now = time.time() if now is None else now
    for attempt in range(1, MAX_ATTEMPTS + 1):
        snap = deps.store.load_snapshot()
        decision = tick(snap, deps.config, now)
        first = snap.state.version == 0  # the run's first commit publishes its configuration
        if first:
            deps.bucket.put(keys.config_key(deps.config.run_id), deps.config.model_dump_json(indent=1).encode())
        if not decision.changed and not first:
            return TickResult(False, snap.state, attempt)
        started = time.perf_counter()
        decision = carry_out_before_commit(deps, decision)
        aggregation_seconds = time.perf_counter() - started
        summaries = tuple(e.summary for e in decision.effects if isinstance(e, RecordRound))
        try:
            version = deps.store.commit(decision.state, snap.state.version, summaries)
        except Conflict:
            continue
        notes = tuple(e.message for e in decision.effects if isinstance(e, Note))
        state = decision.state.evolve(version=version)
        return TickResult(True, state, attempt, decision.fired, notes, summaries, aggregation_seconds)
    raise TickContention(f"lost {MAX_ATTEMPTS} races in a row")


def carry_out_before_commit(deps: Deps, decision: Decision) -> Decision:
    """Write every object the new state will point to.

    Global models are content-addressed (`keys.global_key`): a tick that loses its commit leaves at most an
    orphan under its own digest, and can never replace the model the winner committed to.
    """
    run_id = deps.config.run_id
    written = ""  # digest of an aggregate written by this tick (a carry in the same tick copies it)
    for effect in decision.effects:
        if isinstance(effect, AdoptInitialModel):
            adopt_initial_model(deps, effect)
        elif isinstance(effect, Aggregate):
            data = aggregate_round(deps, effect)
            written = digest(data)
            deps.bucket.put(keys.global_key(run_id, effect.round + 1, written), data)
            decision = resolve(decision, written)
        elif isinstance(effect, CarryGlobal):
            carried = effect.digest or written
            deps.bucket.copy(keys.global_key(run_id, effect.round, carried),
                             keys.global_key(run_id, effect.round + 1, carried))
        elif isinstance(effect, WriteCheckpoint):
            write_checkpoint(deps, effect, decision.state)
    return decision


def write_checkpoint(deps: Deps, effect: WriteCheckpoint, state: RunState) -> None:
    """Global weights and the run's state at the end of an epoch, and a pointer to them."""
    run_id = deps.config.run_id
    source = keys.global_key(run_id, effect.round, state.global_digest)
    deps.bucket.copy(source, keys.checkpoint_global_key(run_id, effect.epoch))
    body = {
        "schema": 1,
        "epoch": effect.epoch,
        "round": effect.round,
        "global_key": keys.checkpoint_global_key(run_id, effect.epoch),
        "global_digest": state.global_digest,
        "state": state_to_body(state),
        "config": deps.config.to_json_dict(),
    }
    deps.bucket.put(keys.checkpoint_state_key(run_id, effect.epoch), json.dumps(body, indent=1).encode())
    pointer = {"epoch": effect.epoch, "state_key": keys.checkpoint_state_key(run_id, effect.epoch)}
    deps.bucket.put(keys.latest_checkpoint_key(run_id), json.dumps(pointer).encode())


def adopt_initial_model(deps: Deps, effect: AdoptInitialModel) -> None:
    run_id = deps.config.run_id
    blob = deps.bucket.get(keys.init_key(run_id, effect.participant))
    if digest(blob.data) != effect.digest:
        raise CorruptInput(f"initial model offer of {effect.participant} changed after it was recorded")
    manifest = Manifest.of(parse_header(blob.data))
    deps.bucket.put(keys.manifest_key(run_id), manifest.to_json().encode())
    deps.bucket.put(keys.global_key(run_id, effect.round, effect.digest), blob.data)


def load_manifest(deps: Deps) -> Manifest:
    return Manifest.from_json(deps.bucket.get(keys.manifest_key(deps.config.run_id)).data)


def aggregate_round(deps: Deps, effect: Aggregate) -> bytes:
    """Stream the counted updates of a round, one at a time, into the next global model's bytes."""
    run_id = deps.config.run_id
    manifest = load_manifest(deps)

    def loader(pid: str, version_id: str, want: str):  # type: ignore[no-untyped-def]
        def load():  # type: ignore[no-untyped-def]
            blob = deps.bucket.get(keys.update_key(run_id, effect.round, pid), version_id=version_id)
            if digest(blob.data) != want:
                raise CorruptInput(f"update of {pid} for round {effect.round} does not match its recorded digest")
            try:
                arrays, _ = decode(blob.data)
            except WireError as exc:  # it was validated on arrival; reaching here means the bucket changed
                raise CorruptInput(str(exc)) from None
            return arrays

        return load

    inputs = [
        WeightedInput(i.participant, i.samples, i.digest, loader(i.participant, i.version_id, i.digest))
        for i in effect.inputs
    ]
    def load_reference() -> dict[str, np.ndarray]:  # the round's global model (for clipped_fedavg)
        arrays, _ = decode(deps.bucket.get(keys.global_key(run_id, effect.round, effect.base_digest)).data)
        return arrays

    return aggregate_file(deps.config, manifest, effect.round + 1, inputs, load_reference)
