"""The coordinator's entry points, one per event: an uploaded object (intake, then a tick when the object may let
one decide something) and the schedule (a tick). The handlers in `functions/` call these and nothing else.

A tick first catches up: news the event queue has not delivered yet (a heartbeat or an update in the bucket, newer
than recorded, from a member the tick would otherwise drop as silent or close the round without:
`coordinator.catchup`) is ingested here, by the same intake as its own event, before the decision. Nothing calls
back: intake records, catch-up finds, the tick decides and commits.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from coordinator.catchup import WORKERS, late_objects
from coordinator.deps import Deps
from coordinator.intake import Ingested, ObjectCreated, ingest_object
from coordinator.tick import TickContention, TickResult, decide_and_commit


@dataclass(frozen=True)
class Handled:
    """What one event came to: the object ingested (None for the schedule), and the tick that followed (None: none
    was needed, or it was `deferred` to the next one because every attempt lost its race)."""

    ingested: Ingested | None = None
    tick: TickResult | None = None
    deferred: str = ""


def on_upload(deps: Deps, obj: ObjectCreated, may_tick: bool = True, now: float | None = None) -> Handled:
    """Validate and record one uploaded object; tick when it may close something (a round closes as soon as its
    last update lands), unless not `may_tick` (the join lane: a join request alone admits nobody). `now` fixes the
    tick's clock (tests)."""
    ingested = ingest_object(deps, obj)
    if not (may_tick and ingested.recorded and not ingested.refusal and ingested.ticks):
        return Handled(ingested)
    return _ticked(deps, ingested, now)


def on_schedule(deps: Deps, now: float | None = None) -> Handled:
    """The scheduled safety-net tick (deadlines, liveness)."""
    return _ticked(deps, None, now)


def run_tick(deps: Deps, now: float | None = None) -> TickResult:
    """Catch up with undelivered news, then tick; raises `TickContention` if every attempt lost its race. `now`
    fixes the clock (tests)."""
    snap = deps.store.load_snapshot()
    late = late_objects(deps, snap, time.time() if now is None else now)
    if not late:
        return decide_and_commit(deps, now, snap)
    with ThreadPoolExecutor(min(WORKERS, len(late))) as pool:
        list(pool.map(lambda obj: ingest_object(deps, obj), late))  # (or already, by a racing ingest of the same)
    return decide_and_commit(deps, now, caught_up=len(late))  # the snapshot is stale: read it again


def _ticked(deps: Deps, ingested: Ingested | None, now: float | None = None) -> Handled:
    try:
        return Handled(ingested, run_tick(deps, now))
    except TickContention as exc:  # nothing is lost: the next tick decides
        return Handled(ingested, deferred=str(exc))
