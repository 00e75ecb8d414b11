"""Before a tick decides anything from the absence of news, look in the bucket for news not yet delivered.

A member is dropped when it has been silent for the liveness timeout, and a round closes at its deadline
without the updates that have not arrived. "Silent" and "not arrived" are what ingest has recorded — and
ingest runs behind the uploads whenever the event queue has a backlog: a burst of hostile heartbeats on the
local dispatcher's few workers, throttled Lambda concurrency, an S3 event delivered late. A member that
heartbeats on time, or uploaded its update before the deadline, must not lose its place to the queue.

So the tick first asks the bucket: for each member it would drop as silent, its heartbeat object (and its
update object if it is selected: an update upload stands in for heartbeats); for each selected member whose update
it would close the round without, its update object. Whatever is there and
newer than what was recorded is ingested now, by the same path as its event (`coordinator.service`: every check
applies; ingest is idempotent, so the event arriving later changes nothing). One HEAD per such member, only on the
ticks that would otherwise decide from silence: nothing in the usual case. This module only finds them.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from coordinator.deps import Deps
from coordinator.intake.common import ObjectCreated
from shared import keys
from shared.machine import overdue
from shared.state import Snapshot

WORKERS = 4  # HEADs in flight at once (the S3 client keeps 10 connections)


def late_objects(deps: Deps, snap: Snapshot, now: float) -> list[ObjectCreated]:
    """The heartbeats and updates in the bucket, newer than recorded, that the decision at `now` would miss."""
    due = overdue(snap, deps.config, now)
    if not due:
        return []
    run_id = deps.config.run_id
    looks = [(keys.heartbeat_key(run_id, pid), _last_seen(snap, pid)) for pid in due.silent]
    # (a member uploading its update sends no heartbeat for a while: that upload is its sign of life)
    updates = set(due.missing_updates) | {p for p in due.silent if p in snap.state.selected and p not in snap.updates}
    looks += [(keys.update_key(run_id, snap.state.round, pid), 0.0) for pid in sorted(updates)]
    with ThreadPoolExecutor(min(WORKERS, len(looks))) as pool:
        return [obj for obj in pool.map(lambda look: _newer(deps, *look), looks) if obj is not None]


def _last_seen(snap: Snapshot, pid: str) -> float:
    view = snap.participants.get(pid)
    return view.last_seen if view is not None else 0.0


def _newer(deps: Deps, key: str, recorded_at: float) -> ObjectCreated | None:
    head = deps.bucket.head(key)
    if head is None:
        return None
    uploaded_at = head["LastModified"].timestamp()
    if uploaded_at <= recorded_at:  # (S3 keeps whole seconds: a heartbeat within the same second is no news)
        return None
    return ObjectCreated(deps.bucket.name, key, int(head["ContentLength"]), str(head["ETag"]).strip('"'),
                         str(head.get("VersionId") or ""), uploaded_at)
