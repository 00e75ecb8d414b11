"""What ingest does with one uploaded object: classify it by key, validate it, record the outcome.

Idempotent: an outcome is recorded once per object (conditional puts keyed on the round slot, or on
the object's key and ETag), so a duplicate or late S3 event changes nothing. Every refusal is recorded
with its reason and never raises: bad input must not stop the run.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

from coordinator.deps import Deps
from coordinator.models import GlobalModel, read_global
from coordinator.streamed import Streamed, stream_model
from shared import keys
from shared.admission import bounded_info, check_update_meta, slot_problem, staleness
from shared.config import DataMode, RunConfig
from shared.digest import digest
from shared.keys import KeyError_, ObjectKind
from shared.limits import MAX_REASON_CHARS, bounded
from shared.messages import MAX_CONTROL_BYTES, HealthReport, Heartbeat, JoinRequest, parse_message
from shared.signing import SignatureError, verify, verify_digest
from shared.state import MemberStatus, Phase, RunState
from shared.wire import TensorSpec, UpdateMeta, WireError, encode_header
from shared.witness import MAX_PROOF_BYTES, MAX_PROOF_RECORD_BYTES, Proof, ProofError, overclaim
from store.blobs import Blob, NotFound
from store.table import ParticipantRecord, UpdateRecord


@dataclass(frozen=True)
class ObjectCreated:
    """The parts of an S3 "Object Created" event that ingest uses."""

    bucket: str
    key: str
    size: int
    etag: str
    version_id: str
    time: float


@dataclass(frozen=True)
class Outcome:
    kind: str
    key: str
    accepted: bool
    reason: str = ""
    participant: str = ""
    recorded: bool = True  # False: this object had been handled before (a duplicate event)
    refusal: bool = False  # refused before reaching any record the coordinator reads: no need to tick
    # False: recorded, but nothing a tick decides on now: a heartbeat outside admission and warmup, an update that
    # is not the round's last. A tick reads every participant record, so this spares the run one per upload.
    ticks: bool = True

    def __post_init__(self) -> None:  # a reason may quote the refused object: bounded wherever it goes
        object.__setattr__(self, "reason", bounded(self.reason, MAX_REASON_CHARS))


def ingest_object(deps: Deps, obj: ObjectCreated) -> Outcome:
    try:
        parsed = keys.parse_key(obj.key)
    except KeyError_ as exc:
        return _refuse(deps, obj, "layout", str(exc))
    if parsed.run_id != deps.config.run_id:
        return _refuse(deps, obj, "layout", f"object belongs to run {parsed.run_id!r}, not {deps.config.run_id!r}")
    pid = parsed.participant or ""
    if parsed.kind is ObjectKind.JOIN:
        return _join(deps, obj, pid)
    if parsed.kind is ObjectKind.HEARTBEAT:
        return _heartbeat(deps, obj, pid)
    if parsed.kind is ObjectKind.INIT:
        return _init_offer(deps, obj, pid)
    if parsed.kind is ObjectKind.UPDATE:
        assert parsed.round is not None
        return _update(deps, obj, pid, parsed.round)
    if parsed.kind is ObjectKind.WITNESS:
        assert parsed.round is not None
        return _proof(deps, obj, pid, parsed.round)
    if parsed.kind is ObjectKind.HEALTH:
        assert parsed.round is not None
        return _health_report(deps, obj, pid, parsed.round)
    return Outcome(parsed.kind.value, obj.key, True, "written by the coordinator", recorded=False)


def _refuse(deps: Deps, obj: ObjectCreated, kind: str, reason: str, pid: str = "") -> Outcome:
    # keyed on the object's version too: the same bytes uploaded twice (say unsigned, then forged) are two uploads
    recorded = deps.store.record_refusal(obj.key, f"{obj.etag}:{obj.version_id}", reason, obj.time, pid)
    return Outcome(kind, obj.key, False, reason, pid, recorded, refusal=True)


def _read(deps: Deps, obj: ObjectCreated, limit: int) -> Blob:
    if obj.size > limit:
        raise ValueError(f"over the size limit: {obj.size} bytes > {limit}")
    return deps.bucket.get(obj.key, max_bytes=limit, version_id=obj.version_id)


def _signed(deps: Deps, obj: ObjectCreated, pid: str, limit: int, record: ParticipantRecord | None = None) -> bytes:
    """The object's bytes, once its size and its signature by `pid`'s registered key are checked."""
    record = record or deps.store.participant(pid)
    if record is None:
        raise ValueError("from a participant that never joined")
    blob = _read(deps, obj, limit)
    verify(record.public_key, obj.key, blob.data, blob.metadata)
    return blob.data


def _join(deps: Deps, obj: ObjectCreated, pid: str) -> Outcome:
    try:  # a join is signed with the key it registers: proof that the joiner holds it
        blob = _read(deps, obj, MAX_CONTROL_BYTES)
        request = parse_message(JoinRequest, blob.data)
        verify(request.public_key, obj.key, blob.data, blob.metadata)
    except (ValueError, NotFound) as exc:
        return _refuse(deps, obj, "join", f"join request refused: {exc}", pid)
    if request.run_id != deps.config.run_id:
        wrong = f"join request for run {request.run_id!r}, this is {deps.config.run_id!r}"
        return _refuse(deps, obj, "join", wrong, pid)
    if request.participant != pid:
        return _refuse(deps, obj, "join", "join request names another participant than its key", pid)
    if reason := staleness(request.sent_at, obj.time, deps.config.max_clock_skew):
        return _refuse(deps, obj, "join", f"join request refused: {reason}", pid)
    if deps.config.data_mode is DataMode.LOCAL and request.samples is None:
        return _refuse(deps, obj, "join", "join request refused: the run trains on local data, and the request "
                       "does not say how many samples the participant holds (field 'samples')", pid)
    info = bounded_info(request.info)
    public_key = request.public_key
    existing = deps.store.participant(pid)
    if existing is None:
        created = deps.store.create_participant(pid, obj.time, public_key, info, deps.config.max_participants,
                                                request.sent_at, request.samples or 0)
        if created == "full":
            return _refuse(deps, obj, "join", f"the run is full: {deps.config.max_participants} participants", pid)
        if created == "created":
            _heartbeat_that_overtook_the_join(deps, pid, public_key)
            _offer_that_overtook_the_join(deps, pid, public_key)
            return Outcome("join", obj.key, True, "", pid)
        existing = deps.store.participant(pid)  # a racing join registered pid first
        if existing is None:  # lost the race, yet no record to read back: nothing to compare the key with
            return _refuse(deps, obj, "join", f"join request raced with another registration of {pid} whose "
                           "record could not be read back; join again", pid)
    if existing.public_key != public_key:
        return _refuse(deps, obj, "join", "join request with another key than the one registered", pid)
    taken = deps.store.accept_message(pid, request.sent_at, obj.time)
    if taken == "stale":
        return _refuse(deps, obj, "join", _replayed("join request", request.sent_at), pid)
    return Outcome("join", obj.key, True, "rejoined", pid, recorded=taken == "accepted")


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


def _replayed(what: str, sent_at: float) -> str:
    return (f"{what} refused: replayed or out of order: sent at {sent_at:.3f}, not after the last message "
            "accepted from this participant")


def _heartbeat(deps: Deps, obj: ObjectCreated, pid: str) -> Outcome:
    try:
        record = deps.store.participant(pid)
        beat = parse_message(Heartbeat, _signed(deps, obj, pid, MAX_CONTROL_BYTES, record))
    except (ValueError, NotFound) as exc:
        return _refuse(deps, obj, "heartbeat", f"heartbeat refused: {exc}", pid)
    if beat.participant != pid:
        return _refuse(deps, obj, "heartbeat", "heartbeat names another participant than its key", pid)
    if reason := staleness(beat.sent_at, obj.time, deps.config.max_clock_skew):
        return _refuse(deps, obj, "heartbeat", f"heartbeat refused: {reason}", pid)
    taken = deps.store.accept_message(pid, beat.sent_at, obj.time, beat.ready_epoch,
                                      bounded_info(beat.info) if beat.info else None, **_progress(beat, record))
    if taken == "unknown":
        return _refuse(deps, obj, "heartbeat", "heartbeat from a participant that never joined", pid)
    if taken == "stale":
        return _refuse(deps, obj, "heartbeat", _replayed("heartbeat", beat.sent_at), pid)
    recorded = taken == "accepted"
    return Outcome("heartbeat", obj.key, True, participant=pid, recorded=recorded,
                   ticks=recorded and _heartbeat_matters_now(deps, beat, pid, record))


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


def _init_offer(deps: Deps, obj: ObjectCreated, pid: str) -> Outcome:
    state = deps.store.read_state()
    if state.has_model:  # every participant offers; once one offer was adopted the others are moot
        return Outcome("init", obj.key, False, "the run already has a model", pid, recorded=False, refusal=True)
    registered = _registered(deps, pid)
    key = ""
    try:
        if registered is not None:
            scanned = _signed_model(deps, obj, pid, None, check=True)
        else:  # from a joiner not registered yet: signed by the key its join request registers
            key = _join_request_key(deps, pid)
            scanned = _streamed(deps, obj, None, check=True)
            verify_digest(key, obj.key, scanned.digest, scanned.metadata)
        if scanned.problem:
            raise WireError(scanned.problem)
    except (WireError, ValueError, NotFound) as exc:
        return _refuse(deps, obj, "init", f"initial model refused: {exc}", pid)
    if reason := initial_model_problem(deps.config, scanned):
        return _refuse(deps, obj, "init", f"initial model refused: {reason}", pid)
    if registered is None:
        # Kept for the join function, which takes it when it registers the joiner. It may have registered it since
        # we looked (and looked for a kept offer before this one was kept): look again, after keeping it.
        deps.store.keep_offer(pid, scanned.digest, key, obj.version_id)
        record = deps.store.participant(pid)
        if record is None or record.public_key != key:
            return Outcome("init", obj.key, True, "kept until its join request is registered", pid, ticks=False)
    deps.store.set_init_offer(pid, scanned.digest, obj.version_id)
    # An offer can start the first epoch only once enough participants registered (as a heartbeat, a tick reads
    # every participant: a tick on each of a thousand joiners' offers was quadratic)
    return Outcome("init", obj.key, True, participant=pid,
                   ticks=deps.store.participant_count() >= deps.config.min_clients)


def initial_model_problem(config: RunConfig, scanned: Streamed) -> str:
    """Why a well-formed offer cannot be round 0's global model of this run ("" if it can): the run names the
    initial model by its digest (`initial_model_digest`) or by its tensors (`initial_model_schema`). The first
    eligible offer recorded is adopted, so an unchecked offer lets whoever offers first pick round 0's global: one
    the honest participants' task cannot load trains no round."""
    want = config.initial_model_digest
    if want and scanned.digest != want:
        return f"its digest {scanned.digest[:16]} is not the run's initial_model_digest {want[:16]}"
    schema = config.initial_model_schema
    if schema and scanned.header is not None and (got := model_schema(scanned.header.tensors)) != schema:
        tensors = sorted(scanned.header.tensors.items())
        listed = ", ".join(f"{name} {spec.dtype} {list(spec.shape)}" for name, spec in tensors[:3])
        more = f" and {len(tensors) - 3} more" if len(tensors) > 3 else ""
        return (f"its tensors ({listed}{more}; schema {got[:16]}) are not the ones the run's task declares "
                f"(initial_model_schema {schema[:16]})")
    return ""


def model_schema(tensors: dict[str, TensorSpec]) -> str:
    """A model's tensors (names, dtypes, shapes) as `initial_model_schema` names them: the content digest of their
    canonical header without metadata, whatever the file's metadata or layout."""
    return digest(encode_header(tensors))


def _join_request_key(deps: Deps, pid: str) -> str:
    """The public key `pid`'s join request registers (the request checked as the join function checks it)."""
    key = keys.join_key(deps.config.run_id, pid)
    try:
        blob = deps.bucket.get(key, max_bytes=MAX_CONTROL_BYTES)
    except NotFound:
        raise ValueError("from a participant that never joined") from None
    request = parse_message(JoinRequest, blob.data)
    verify(request.public_key, key, blob.data, blob.metadata)
    if request.participant != pid or request.run_id != deps.config.run_id:
        raise ValueError("its join request names another participant or run")
    return request.public_key


def _signed_model(deps: Deps, obj: ObjectCreated, pid: str, model: GlobalModel | None, check: bool) -> Streamed:
    """Stream a model file once: its size limit, then its digest, its signature by `pid`'s registered key and
    (if `check`) its validity. Raises ValueError (SignatureError among them) for an unusable upload."""
    record = _registered(deps, pid)
    if record is None:
        raise ValueError("from a participant that never joined")
    scanned = _streamed(deps, obj, model, check)
    try:
        verify_digest(record.public_key, obj.key, scanned.digest, scanned.metadata)
    except SignatureError:
        fresh = _registered(deps, pid, again=True)  # the key we held may be of a record since replaced
        if fresh is None:
            raise ValueError("from a participant that never joined") from None
        if fresh.public_key == record.public_key:
            raise
        verify_digest(fresh.public_key, obj.key, scanned.digest, scanned.metadata)
    return scanned


def _streamed(deps: Deps, obj: ObjectCreated, model: GlobalModel | None, check: bool) -> Streamed:
    """A model file streamed once, within the size limit (`stream_model`); its signature is the caller's to check."""
    if obj.size > deps.config.max_update_bytes:
        raise ValueError(f"over the size limit: {obj.size} bytes > {deps.config.max_update_bytes}")
    return stream_model(deps, obj.key, obj.version_id, obj.size, model, check)


# A participant's record as read for what stays fixed while the record exists (its public key: a join with another
# key is refused; its registered sample count), per warm function: one read per participant, not one per update.
# A record replaced since (a run restored from its checkpoint re-registers everyone) is read again when a
# signature does not verify with the key held.
_REGISTERED: dict[tuple[str, str], ParticipantRecord] = {}
MAX_REGISTERED = 20_000


def forget_registered() -> None:
    """Drop every record held (a cold start: tests that start a new moto world)."""
    _REGISTERED.clear()


def _registered(deps: Deps, pid: str, again: bool = False) -> ParticipantRecord | None:
    key = (deps.store.pk, pid)
    if not again and (held := _REGISTERED.get(key)) is not None:
        return held
    record = deps.store.participant(pid)
    if record is None:
        _REGISTERED.pop(key, None)
        return None
    if len(_REGISTERED) >= MAX_REGISTERED:
        _REGISTERED.clear()
    _REGISTERED[key] = record
    return record


def _update(deps: Deps, obj: ObjectCreated, pid: str, round_no: int) -> Outcome:
    # Four requests in the usual case: the state item, the object (streamed once), the record, the round's count.
    # Duplicates are found by the record's conditional write; the participant's key is cached (`_participant`);
    # its liveness is read from the record itself (`shared.state.heard_through_updates`).
    state = deps.store.read_state()
    if reason := slot_problem(state, round_no, pid, obj.time):
        return _already_recorded(deps, obj, pid, round_no) or _refuse(deps, obj, "update", reason, pid)
    selected = pid in state.selected
    try:  # an unsigned, mis-signed or oversized object never takes the participant's slot
        model = _global_model(deps, state) if selected else None  # its header is the manifest (not manifest.json)
        scanned = _signed_model(deps, obj, pid, model, check=selected)
    except (ValueError, NotFound) as exc:
        return _refuse(deps, obj, "update", f"update refused: {exc}", pid)
    record = _validate_update(deps, obj, scanned, pid, round_no, state)
    if not deps.store.record_update(record):  # this object's event again, or another object for the same slot
        return _already_recorded(deps, obj, pid, round_no) or _refuse(
            deps, obj, "update", f"duplicate: an update for round {round_no} was already received", pid)
    # A tick reads every participant and update record: worth it only when this record can close the round (the
    # last of the selection's). A count lost to a crash here delays the close to the next scheduled tick.
    last = deps.store.count_update(round_no) >= len(state.selected)
    return Outcome("update", obj.key, record.accepted, record.reason, pid, ticks=last)


def _already_recorded(deps: Deps, obj: ObjectCreated, pid: str, round_no: int) -> Outcome | None:
    """The outcome recorded for this very object (its event delivered again: nothing to do), or None."""
    existing = deps.store.update_record(round_no, pid)
    if existing is None or (existing.etag, existing.version_id) != (obj.etag, obj.version_id):
        return None
    return Outcome("update", obj.key, existing.accepted, existing.reason, pid, recorded=False)


def _proof(deps: Deps, obj: ObjectCreated, pid: str, round_no: int) -> Outcome:
    existing = deps.store.proof_record(round_no, pid)
    if existing is not None:
        if existing.etag == obj.etag:
            return Outcome("witness", obj.key, True, participant=pid, recorded=False)
        return _refuse(deps, obj, "witness", f"duplicate: {pid} already sent its proof for round {round_no}", pid)
    state = deps.store.read_state()
    if round_no != state.round or state.phase not in (Phase.TRAIN, Phase.WITNESS):
        return _refuse(deps, obj, "witness", f"proof for round {round_no}, which is not being witnessed", pid)
    if pid not in state.witnesses:
        return _refuse(deps, obj, "witness", f"{pid} is not an elected witness of round {round_no}", pid)
    try:
        proof = Proof.from_json(_signed(deps, obj, pid, MAX_PROOF_BYTES))
    except (ProofError, ValueError, NotFound) as exc:
        return _refuse(deps, obj, "witness", f"witness proof refused: {exc}", pid)
    position = state.witnesses.index(pid)
    recorded = sum(1 for u in deps.store.updates(round_no).values() if u.accepted)
    body = proof.to_json()
    why = ""
    if (proof.run_id, proof.round, proof.witness) != (deps.config.run_id, round_no, pid):
        why = "witness proof names another run, round or witness than its key"
    elif proof.position != position:
        why = f"spoofed position: {proof.position}, {pid} is witness {position}"
    elif reason := overclaim(proof, recorded):
        why = f"witness proof refused: {reason}"
    elif len(body.encode()) > MAX_PROOF_RECORD_BYTES:  # its numbers and keys written out longer than they came in
        why = (f"witness proof refused: {len(body.encode())} bytes as recorded, over the record limit of "
               f"{MAX_PROOF_RECORD_BYTES}")
    if why:  # signed by the elected witness and well-formed, but refused: its seat's proof, a strike (the tick)
        deps.store.record_proof(round_no, pid, "", obj.etag, obj.time, refused=why)
        return _refuse(deps, obj, "witness", why, pid)
    if not deps.store.record_proof(round_no, pid, body, obj.etag, obj.time):
        return Outcome("witness", obj.key, True, participant=pid, recorded=False)
    return Outcome("witness", obj.key, True, participant=pid)


def _health_report(deps: Deps, obj: ObjectCreated, pid: str, round_no: int) -> Outcome:
    try:
        named = parse_message(HealthReport, _signed(deps, obj, pid, MAX_CONTROL_BYTES)).unhealthy
    except (ValueError, NotFound) as exc:
        return _refuse(deps, obj, "health", f"health report refused: {exc}", pid)
    state = deps.store.read_state()
    if round_no != state.health_round:
        return _refuse(deps, obj, "health", f"health report about round {round_no}; the last witnessed round is "
                       f"{state.health_round}", pid)
    if pid not in state.members:
        return _refuse(deps, obj, "health", f"{pid} is not a member of epoch {state.epoch}", pid)
    recorded = deps.store.record_health_report(round_no, pid, sorted(set(named)), obj.time)
    return Outcome("health", obj.key, True, participant=pid, recorded=recorded)


def _validate_update(
    deps: Deps, obj: ObjectCreated, scanned: Streamed, pid: str, round_no: int, state: RunState
) -> UpdateRecord:
    base = UpdateRecord(round_no, pid, obj.key, False, etag=obj.etag, version_id=obj.version_id,
                        size=obj.size, received_at=obj.time)
    if pid not in state.selected:
        return _replace(base, reason=f"not selected for round {round_no}")
    try:
        if scanned.problem or scanned.header is None:
            raise WireError(scanned.problem or "no header")
        meta = UpdateMeta.from_metadata(scanned.header.metadata)
        check_update_meta(meta, deps.config, state, pid, round_no, _registered_samples(deps, pid))
    except (WireError, ValueError) as exc:
        return _replace(base, reason=str(exc))
    return _replace(base, accepted=True, samples=meta.samples, digest=scanned.digest, metrics=dict(meta.metrics),
                    norm=scanned.distance, data_offset=scanned.header.data_offset)



def _registered_samples(deps: Deps, pid: str) -> int:
    """Local data mode: the sample count `pid` registered when it joined (0 otherwise, or if unknown)."""
    if deps.config.data_mode is not DataMode.LOCAL:
        return 0
    record = _registered(deps, pid)
    return record.samples if record is not None else 0


def _global_model(deps: Deps, state: RunState) -> GlobalModel:
    """The round's global model, authenticated by its digest (once per warm function: `read_global`)."""
    return read_global(deps, state.round, state.global_digest)


def _replace(rec: UpdateRecord, **changes: Any) -> UpdateRecord:
    if "reason" in changes:
        changes["reason"] = bounded(changes["reason"], MAX_REASON_CHARS)
    return dataclasses.replace(rec, **changes)
