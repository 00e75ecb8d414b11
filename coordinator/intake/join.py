"""A join request: registers its sender and the key it signs with, or finds it registered with that same key.

A join is signed with the key it registers: proof that the joiner holds it. Join requests have a lane of their own
(the join function), so what a joiner sent right after its request, a heartbeat or an initial-model offer, may have
reached ingest first; registering takes it then.
"""

from __future__ import annotations

from coordinator.deps import Deps
from coordinator.intake.common import Ingested, ObjectCreated, read, refuse, replayed
from shared import keys
from shared.admission import bounded_info, staleness
from shared.config import DataMode
from shared.hosts import HostRecord
from shared.messages import MAX_CONTROL_BYTES, Heartbeat, JoinRequest, parse_message
from shared.signing import verify
from store.blobs import NotFound


def ingest(deps: Deps, obj: ObjectCreated, pid: str, host: HostRecord | None = None) -> Ingested:
    """`host`: the invited host of that id (its current generation, active), whose join must carry the upload key
    it bound at redemption."""
    try:  # a join is signed with the key it registers: proof that the joiner holds it
        blob = read(deps, obj, MAX_CONTROL_BYTES)
        request = parse_message(JoinRequest, blob.data)
        verify(request.public_key, obj.key, blob.data, blob.metadata)
    except (ValueError, NotFound) as exc:
        return refuse(deps, obj, "join", f"join request refused: {exc}", pid)
    if request.run_id != deps.config.run_id:
        wrong = f"join request for run {request.run_id!r}, this is {deps.config.run_id!r}"
        return refuse(deps, obj, "join", wrong, pid)
    if request.participant != pid:
        return refuse(deps, obj, "join", "join request names another participant than its key", pid)
    if reason := staleness(request.sent_at, obj.time, deps.config.max_clock_skew):
        return refuse(deps, obj, "join", f"join request refused: {reason}", pid)
    if deps.config.data_mode is DataMode.LOCAL and request.samples is None:
        return refuse(deps, obj, "join", "join request refused: the run trains on local data, and the request "
                      "does not say how many samples the participant holds (field 'samples')", pid)
    info = bounded_info(request.info)
    public_key = request.public_key
    if host is not None and host.upload_key and public_key != host.upload_key:
        return refuse(deps, obj, "join", f"join request signed with another key than the one host {pid} bound for "
                      f"its generation {host.generation}", pid)
    existing = deps.store.participant(pid)
    if existing is None:
        created = deps.store.create_participant(pid, obj.time, public_key, info, deps.config.max_participants,
                                                request.sent_at, request.samples or 0)
        if created == "full":
            return refuse(deps, obj, "join", f"the run is full: {deps.config.max_participants} participants", pid)
        if created == "created":
            _note_host_join(deps, pid, host)
            _heartbeat_that_overtook_the_join(deps, pid, public_key)
            _offer_that_overtook_the_join(deps, pid, public_key)
            return Ingested("join", obj.key, True, "", pid)
        existing = deps.store.participant(pid)  # a racing join registered pid first
        if existing is None:  # lost the race, yet no record to read back: nothing to compare the key with
            return refuse(deps, obj, "join", f"join request raced with another registration of {pid} whose "
                          "record could not be read back; join again", pid)
    rekeyed = False
    if existing.public_key != public_key:
        if not _new_generation(host, existing.public_key):
            return refuse(deps, obj, "join", "join request with another key than the one registered", pid)
        if not deps.store.rekey_participant(pid, existing.public_key, public_key):
            return refuse(deps, obj, "join", f"join request raced with another registration of {pid}; join again",
                          pid)
        rekeyed = True
    taken = deps.store.accept_message(pid, request.sent_at, obj.time)
    if taken == "stale" and not rekeyed:
        return refuse(deps, obj, "join", replayed("join request", request.sent_at), pid)
    _note_host_join(deps, pid, host)
    if rekeyed:
        return Ingested("join", obj.key, True, f"registered the key of host generation {_generation(host)}", pid)
    return Ingested("join", obj.key, True, "rejoined", pid, recorded=taken == "accepted")


def _new_generation(host: HostRecord | None, registered: str) -> bool:
    """Whether a join whose key differs from the registered one is a reinstated host's new generation (its key
    already checked against the one bound at redemption): the registered key is not this generation's."""
    return host is not None and bool(host.upload_key) and registered != host.upload_key


def _generation(host: HostRecord | None) -> int:
    return host.generation if host is not None else 0


def _note_host_join(deps: Deps, pid: str, host: HostRecord | None) -> None:
    """Tell the host record that the participant record holds this generation's key (ingest lets the generation's
    other uploads in from then on); written once per generation."""
    if host is not None and host.upload_key and host.registered_key != host.upload_key:
        deps.store.note_host_join(pid, host.generation, host.upload_key)


def _heartbeat_that_overtook_the_join(deps: Deps, pid: str, public_key: str) -> None:
    """Take the participant's latest heartbeat now that it is registered, if it was sent after the join request.

    Join requests have a lane of their own, so a participant's first heartbeat often reaches ingest before its
    join request is registered, and is refused as coming from a participant that never joined. An epoch admits
    only participants heard from after their join: without this, an honest joiner would wait a whole heartbeat
    interval more. The heartbeat is checked as ingest checks any (signed by the key just registered, fresh,
    sent after the last message accepted from it); anything wrong with it leaves the record as it is."""
    try:
        blob = deps.bucket.get(keys.heartbeat_key(deps.config.run_id, pid), max_bytes=MAX_CONTROL_BYTES)
        verify(public_key, keys.heartbeat_key(deps.config.run_id, pid), blob.data, blob.metadata)
        beat = parse_message(Heartbeat, blob.data)
    except (ValueError, NotFound):
        return
    if beat.participant != pid or not blob.last_modified:
        return
    if staleness(beat.sent_at, blob.last_modified, deps.config.max_clock_skew):
        return
    deps.store.accept_message(pid, beat.sent_at, blob.last_modified, beat.ready_epoch,
                              bounded_info(beat.info) if beat.info else None, unticked=True)


def _offer_that_overtook_the_join(deps: Deps, pid: str, public_key: str) -> None:
    """Take the initial-model offer ingest kept for the participant (checked against the key of the join request
    just registered): a joiner of a run without a model offers one right after its join request and then listens,
    rather than polling its record until the join lane registers it. One read of a small item: no model here."""
    digest, version_id = deps.store.kept_offer(pid, public_key)
    if digest:
        deps.store.set_init_offer(pid, digest, version_id)
