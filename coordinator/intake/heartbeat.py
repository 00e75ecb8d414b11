"""A heartbeat: its sender is alive, ready for an epoch, and this far into training.

Recorded for every member, but it ticks only when a tick could decide something new because of it
(`_heartbeat_matters_now`): a tick reads every participant record.
"""

from __future__ import annotations

import time
from typing import Any

from coordinator.deps import Deps
from coordinator.intake.common import Ingested, ObjectCreated, read, refuse, replayed, signed
from shared import keys
from shared.admission import bounded_info, staleness
from shared.messages import MAX_CONTROL_BYTES, Heartbeat, JoinRequest, parse_message
from shared.signing import verify
from shared.state import MemberStatus, Phase
from store.blobs import NotFound
from store.table import ParticipantRecord

EARLY = "early: sent before its join request was recorded, which takes it (not a refusal)"


def ingest(deps: Deps, obj: ObjectCreated, pid: str) -> Ingested:
    try:
        record = deps.store.participant(pid)
        if record is None and _signed_by_pending_join(deps, obj, pid):
            return Ingested("heartbeat", obj.key, False, EARLY, pid, recorded=False, ticks=False)
        beat = parse_message(Heartbeat, signed(deps, obj, pid, MAX_CONTROL_BYTES, record))
    except (ValueError, NotFound) as exc:
        return refuse(deps, obj, "heartbeat", f"heartbeat refused: {exc}", pid)
    if beat.participant != pid:
        return refuse(deps, obj, "heartbeat", "heartbeat names another participant than its key", pid)
    if reason := staleness(beat.sent_at, obj.time, deps.config.max_clock_skew):
        return refuse(deps, obj, "heartbeat", f"heartbeat refused: {reason}", pid)
    taken = deps.store.accept_message(pid, beat.sent_at, obj.time, beat.ready_epoch,
                                      bounded_info(beat.info) if beat.info else None, **_progress(beat, record))
    if taken == "unknown":
        return refuse(deps, obj, "heartbeat", "heartbeat from a participant that never joined", pid)
    if taken == "stale":
        return refuse(deps, obj, "heartbeat", replayed("heartbeat", beat.sent_at), pid)
    recorded = taken == "accepted"
    return Ingested("heartbeat", obj.key, True, participant=pid, recorded=recorded,
                   ticks=recorded and _heartbeat_matters_now(deps, beat, pid, record))


def _signed_by_pending_join(deps: Deps, obj: ObjectCreated, pid: str) -> bool:
    """Whether this heartbeat of a participant not registered yet is signed by the key of a join request of its
    waiting in the join lane: the ordinary start-up race (joins have a lane of their own), which the join function
    settles by taking the heartbeat it finds once the join is recorded (`intake.join`). A heartbeat no pending join
    vouches for (a forged one, or one that never joined) is refused as before."""
    try:
        request = parse_message(JoinRequest, deps.bucket.get(keys.join_key(deps.config.run_id, pid),
                                                             max_bytes=MAX_CONTROL_BYTES).data)
        blob = read(deps, obj, MAX_CONTROL_BYTES)
        verify(request.public_key, obj.key, blob.data, blob.metadata)
    except (ValueError, NotFound):  # (SignatureError and MessageError are ValueErrors)
        return False
    return request.participant == pid


def _progress(beat: Heartbeat, record: ParticipantRecord | None) -> dict[str, Any]:
    """What a heartbeat says about training: its progress (and whether it moved since the one recorded: a stuck
    participant's does not), and its measured rate."""
    out: dict[str, Any] = {"rate": beat.samples_per_second}
    if beat.progress is not None:
        p = beat.progress
        before = record.progress if record is not None else (-1, 0, 0)
        out["progress"] = {"round": p.round, "done": p.done, "total": p.total}
        out["progress_moved"] = (p.round, p.done) != before[:2]
    return out


def _heartbeat_matters_now(deps: Deps, beat: Heartbeat, pid: str, before: ParticipantRecord | None) -> bool:
    """Whether a tick could decide something new because of this heartbeat. While the run waits for members (and
    enough have registered): only if it made its sender eligible for an epoch, which may complete the admission.
    `before`, the sender's record as it was, shows it not heard from since it joined, or silent for the liveness
    timeout, or made eligible by the join function (the heartbeat its join request found), which never ticks. During
    warmup: only an active member's ready report (it may end the warmup). Elsewhere a heartbeat only keeps a member
    from being dropped as silent or stuck: the absence of heartbeats is what a tick acts on, and scheduled ticks look
    for that. (A tick reads every participant record. Ticking on each of a thousand joiners' heartbeats was
    quadratic; so was ticking on every heartbeat of a thousand eligible participants while an epoch could not start:
    the ingest queue of a 1,000-participant run grew to 4,713 events and never drained.)"""
    state = deps.store.read_state()
    if state.phase is Phase.WAITING:
        if before is not None and not before.unticked:
            was = before.view()
            if was.proven and was.alive(time.time(), deps.config.liveness_timeout):
                return False  # eligible already (through an ingest, which ticked if it mattered): nothing new
        return deps.store.participant_count() >= deps.config.min_clients
    member = state.members.get(pid)
    return (state.phase is Phase.WARMUP and member is not None and member.status is MemberStatus.ACTIVE
            and (beat.ready_epoch or 0) >= state.epoch)
