"""A trained update: takes its sender's slot in the round, accepted or refused with its reason.

Four requests in the usual case: the state item, the object (streamed once), the record, the round's count.
Duplicates are found by the record's conditional write; the sender's registered record is held per warm function
(`registered`); its liveness is read from the record itself (`shared.state.heard_through_updates`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from coordinator.deps import Deps
from coordinator.intake.common import Ingested, ObjectCreated, refuse, registered, signed_model
from coordinator.model_files import GlobalModel, read_global
from coordinator.streamed import Streamed
from shared.admission import check_update_meta, slot_problem
from shared.config import DataMode
from shared.limits import MAX_REASON_CHARS, bounded
from shared.state import RunState
from shared.wire import UpdateMeta, WireError
from store.blobs import NotFound
from store.table import UpdateRecord


def ingest(deps: Deps, obj: ObjectCreated, pid: str, round_no: int) -> Ingested:
    state = deps.store.read_state()
    if reason := slot_problem(state, round_no, pid, obj.time):
        return _already_recorded(deps, obj, pid, round_no) or refuse(deps, obj, "update", reason, pid)
    selected = pid in state.selected
    try:  # an unsigned, mis-signed or oversized object never takes the participant's slot
        model = _global_model(deps, state) if selected else None  # its header is the manifest (not manifest.json)
        scanned = signed_model(deps, obj, pid, model, check=selected)
    except (ValueError, NotFound) as exc:
        return refuse(deps, obj, "update", f"update refused: {exc}", pid)
    record = _validate_update(deps, obj, scanned, pid, round_no, state)
    if not deps.store.record_update(record):  # this object's event again, or another object for the same slot
        return _already_recorded(deps, obj, pid, round_no) or refuse(
            deps, obj, "update", f"duplicate: an update for round {round_no} was already received", pid)
    # A tick reads every participant and update record: worth it only when this record can close the round (the
    # last of the selection's). A count lost to a crash here delays the close to the next scheduled tick.
    last = deps.store.count_update(round_no) >= len(state.selected)
    return Ingested("update", obj.key, record.accepted, record.reason, pid, ticks=last)


def _already_recorded(deps: Deps, obj: ObjectCreated, pid: str, round_no: int) -> Ingested | None:
    """The outcome recorded for this very object (its event delivered again: nothing to do), or None."""
    existing = deps.store.update_record(round_no, pid)
    if existing is None or (existing.etag, existing.version_id) != (obj.etag, obj.version_id):
        return None
    return Ingested("update", obj.key, existing.accepted, existing.reason, pid, recorded=False)


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
    record = registered(deps, pid)
    return record.samples if record is not None else 0


def _global_model(deps: Deps, state: RunState) -> GlobalModel:
    """The round's global model, authenticated by its digest (once per warm function: `read_global`)."""
    return read_global(deps, state.round, state.global_digest)


def _replace(rec: UpdateRecord, **changes: Any) -> UpdateRecord:
    if "reason" in changes:
        changes["reason"] = bounded(changes["reason"], MAX_REASON_CHARS)
    return dataclasses.replace(rec, **changes)
