"""What every kind of upload shares: the event, the outcome, refusals, and reads checked against the sender's key.

A refusal is recorded, never raised: bad input must not stop the run. A model's signature is checked against the key
its sender registered when it joined, as the warm function holds it (`registered`): the participant's record is read
once per participant, not once per update.
"""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.deps import Deps
from coordinator.model_files import GlobalModel
from coordinator.streamed import Streamed, stream_model
from shared.limits import MAX_REASON_CHARS, bounded
from shared.signing import SignatureError, verify, verify_digest
from store.blobs import Blob
from store.table import ParticipantRecord


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
class Ingested:
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


def refuse(deps: Deps, obj: ObjectCreated, kind: str, reason: str, pid: str = "") -> Ingested:
    # keyed on the object's version too: the same bytes uploaded twice (say unsigned, then forged) are two uploads
    recorded = deps.store.record_refusal(obj.key, f"{obj.etag}:{obj.version_id}", reason, obj.time, pid)
    return Ingested(kind, obj.key, False, reason, pid, recorded, refusal=True)


def replayed(what: str, sent_at: float) -> str:
    return (f"{what} refused: replayed or out of order: sent at {sent_at:.3f}, not after the last message "
            "accepted from this participant")


def read(deps: Deps, obj: ObjectCreated, limit: int) -> Blob:
    if obj.size > limit:
        raise ValueError(f"over the size limit: {obj.size} bytes > {limit}")
    return deps.bucket.get(obj.key, max_bytes=limit, version_id=obj.version_id)


def signed(deps: Deps, obj: ObjectCreated, pid: str, limit: int, record: ParticipantRecord | None = None) -> bytes:
    """The object's bytes, once its size and its signature by `pid`'s registered key are checked."""
    record = record or deps.store.participant(pid)
    if record is None:
        raise ValueError("from a participant that never joined")
    blob = read(deps, obj, limit)
    verify(record.public_key, obj.key, blob.data, blob.metadata)
    return blob.data


def signed_model(deps: Deps, obj: ObjectCreated, pid: str, model: GlobalModel | None, check: bool) -> Streamed:
    """Stream a model file once: its size limit, then its digest, its signature by `pid`'s registered key and
    (if `check`) its validity. Raises ValueError (SignatureError among them) for an unusable upload."""
    record = registered(deps, pid)
    if record is None:
        raise ValueError("from a participant that never joined")
    scanned = streamed(deps, obj, model, check)
    try:
        verify_digest(record.public_key, obj.key, scanned.digest, scanned.metadata)
    except SignatureError:
        fresh = registered(deps, pid, again=True)  # the key we held may be of a record since replaced
        if fresh is None:
            raise ValueError("from a participant that never joined") from None
        if fresh.public_key == record.public_key:
            raise
        verify_digest(fresh.public_key, obj.key, scanned.digest, scanned.metadata)
    return scanned


def streamed(deps: Deps, obj: ObjectCreated, model: GlobalModel | None, check: bool) -> Streamed:
    """A model file streamed once, within the size limit (`stream_model`); its signature is the caller's to check."""
    if obj.size > deps.config.max_update_bytes:
        raise ValueError(f"over the size limit: {obj.size} bytes > {deps.config.max_update_bytes}")
    return stream_model(deps, obj.key, obj.version_id, obj.size, model, check)


MAX_REGISTERED = 20_000  # records held by one warm function (`Deps.registered`) before it forgets them all


def registered(deps: Deps, pid: str, again: bool = False) -> ParticipantRecord | None:
    """`pid`'s record as read for what stays fixed while the record exists (its public key: a join with another key
    is refused; its registered sample count), held by the warm function (`Deps.registered`): one read per
    participant, not one per update. A record replaced since (a run restored from its checkpoint re-registers
    everyone) is read again (`again`) when a signature does not verify with the key held."""
    held_records = deps.registered
    key = (deps.store.pk, pid)
    if not again and (held := held_records.get(key)) is not None:
        return held
    record = deps.store.participant(pid)
    if record is None:
        held_records.pop(key, None)
        return None
    if len(held_records) >= MAX_REGISTERED:
        held_records.clear()
    held_records[key] = record
    return record
