"""What an operator does to a run: pause, resume, and restore from the latest checkpoint.

Pause and resume set a flag on the state with the same conditional write a tick uses, then tick, so
the change shows at once; the transition itself is a row of the state machine's table.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from coordinator.deps import Deps
from coordinator.service import run_tick
from coordinator.tick import TickResult, pace_schedule
from shared import keys
from shared.server_opt import MAX_INDEX_BYTES, StateError, index_pieces
from shared.state import Phase, RunState
from shared.wire import digest
from store.blobs import NotFound, Tampered
from store.records import state_from_body
from store.table import Conflict

MAX_ATTEMPTS = 6


class OperationError(RuntimeError):
    pass


def set_paused(deps: Deps, paused: bool) -> TickResult:
    """Request the pause (or resume) and tick: as the coordinator, which alone carries the request out."""
    request_pause(deps, paused)
    return run_tick(deps)


def request_pause(deps: Deps, paused: bool) -> None:
    """Record the operator's request on the run state (and switch the tick schedule on for a resume); the next tick
    carries it out: closes the open round and pauses, or starts waiting for members again."""
    for _ in range(MAX_ATTEMPTS):
        state = deps.store.read_state()
        if state.version == 0:
            raise OperationError("the run has no state yet: nothing to pause or resume")
        if state.phase is Phase.FINISHED:
            raise OperationError("the run is finished")
        if state.pause_requested == paused:
            break
        try:
            version = deps.store.commit(state.evolve(pause_requested=paused), state.version)
            pace_schedule(deps, state, state.evolve(pause_requested=paused, version=version))  # a resume needs ticks
            break
        except Conflict:
            continue
    else:
        raise OperationError("the state kept changing; try again")


@dataclass(frozen=True)
class Restored:
    epoch: int
    round: int
    aggregated: int
    global_digest: str


def restore(deps: Deps, force: bool = False) -> Restored:
    """Rebuild the run's state from its latest checkpoint (after the table's items were lost).

    The run restarts in WaitingForMembers at the checkpoint's round with its global model; the
    participants, still polling, join again and the next epoch admits them.
    """
    run_id = deps.config.run_id
    current = deps.store.read_state()
    if current.version and not force:
        raise OperationError(
            f"the run has state (phase {current.phase}, round {current.round}); use --force to replace it"
        )
    try:
        pointer = json.loads(deps.bucket.get(keys.latest_checkpoint_key(run_id)).data)
        body = json.loads(deps.bucket.get(pointer["state_key"]).data)
    except NotFound:
        raise OperationError("the run has no checkpoint yet (one is written at the end of each epoch)") from None
    saved = state_from_body(body["state"], 0)
    model = deps.bucket.get(body["global_key"]).data
    if digest(model) != body["global_digest"]:
        raise OperationError("the checkpoint's global model does not match its recorded digest")
    deps.bucket.put(keys.global_key(run_id, saved.round, body["global_digest"]), model)
    optimizer = str(body.get("optimizer_digest", ""))
    if optimizer:
        _restore_state(deps, saved.round, optimizer)
    state = RunState(
        run_id,
        phase=Phase.WAITING,
        epoch=saved.epoch,
        round=saved.round,
        aggregated=saved.aggregated,
        global_digest=body["global_digest"],
        optimizer_digest=optimizer,
        model_source=saved.model_source,
        phase_started=time.time(),
    )
    deps.store.commit(state, current.version)
    pace_schedule(deps, None, state)  # waiting for members again: ticks needed
    return Restored(saved.epoch, saved.round, saved.aggregated, body["global_digest"])


def _restore_state(deps: Deps, round_no: int, digest: str) -> None:
    """Copy the checkpoint's server optimizer state back beside the global model, each file authenticated by
    the digest the checkpoint's index lists."""
    run_id = deps.config.run_id
    try:
        index = deps.bucket.get_verified(keys.checkpoint_optimizer_key(run_id, round_no, digest), digest,
                                         MAX_INDEX_BYTES)
        files = [digest, *index_pieces(index)]
        for file in files:
            key = keys.checkpoint_optimizer_key(run_id, round_no, file)
            version, _ = deps.bucket.verified_version(key, file)
            deps.bucket.copy(key, keys.optimizer_key(run_id, round_no, file), version_id=version)
    except (NotFound, Tampered, StateError, ValueError) as exc:
        raise OperationError(f"the checkpoint's optimizer state cannot be read back: {exc}") from None
