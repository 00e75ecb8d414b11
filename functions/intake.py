"""What ingest does with one uploaded object: classify it by key, validate it, record the outcome.

Idempotent: an outcome is recorded once per object (conditional puts keyed on the round slot, or on
the object's key and ETag), so a duplicate or late S3 event changes nothing. Every refusal is recorded
with its reason and never raises: bad input must not stop the run.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from functions.coordinator import load_manifest
from functions.settings import Deps
from shared import keys
from shared.blobs import Blob, NotFound
from shared.keys import KeyError_, ObjectKind
from shared.selection import assigned_count
from shared.signing import verify
from shared.state import Phase, RunState
from shared.store import UpdateRecord
from shared.wire import UpdateMeta, WireError, decode, digest, non_finite, parse_header
from shared.witness import MAX_PROOF_BYTES, Proof, ProofError

MAX_CONTROL_BYTES = 64 * 1024  # join requests, heartbeats and health reports are small JSON documents


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


def _signed(deps: Deps, obj: ObjectCreated, pid: str, limit: int) -> bytes:
    """The object's bytes, once its size and its signature by `pid`'s registered key are checked."""
    record = deps.store.participant(pid)
    if record is None:
        raise ValueError("from a participant that never joined")
    blob = _read(deps, obj, limit)
    verify(record.public_key, obj.key, blob.data, blob.metadata)
    return blob.data


def _json_object(data: bytes) -> dict[str, Any]:
    try:
        body = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ValueError("not a JSON document") from None
    if not isinstance(body, dict):
        raise ValueError("not a JSON object")
    return body


def _join(deps: Deps, obj: ObjectCreated, pid: str) -> Outcome:
    try:  # a join is signed with the key it registers: proof that the joiner holds it
        blob = _read(deps, obj, MAX_CONTROL_BYTES)
        body = _json_object(blob.data)
        verify(str(body.get("public_key", "")), obj.key, blob.data, blob.metadata)
    except (ValueError, NotFound) as exc:
        return _refuse(deps, obj, "join", f"join request refused: {exc}", pid)
    if body.get("run_id") != deps.config.run_id:
        wrong = f"join request for run {body.get('run_id')!r}, this is {deps.config.run_id!r}"
        return _refuse(deps, obj, "join", wrong, pid)
    if body.get("participant") != pid:
        return _refuse(deps, obj, "join", "join request names another participant than its key", pid)
    info = body.get("info") if isinstance(body.get("info"), dict) else {}
    public_key = str(body.get("public_key", ""))
    existing = deps.store.participant(pid)
    if existing is None:
        created = deps.store.create_participant(pid, obj.time, public_key, _small(info), deps.config.max_participants)
        if created == "full":
            return _refuse(deps, obj, "join", f"the run is full: {deps.config.max_participants} participants", pid)
        if created == "created":
            return Outcome("join", obj.key, True, "", pid)
        existing = deps.store.participant(pid)
    if existing.public_key != public_key:
        return _refuse(deps, obj, "join", "join request with another key than the one registered", pid)
    deps.store.touch(pid, obj.time)
    return Outcome("join", obj.key, True, "rejoined", pid)


def _small(info: dict[str, Any]) -> dict[str, Any]:
    """Keep a bounded, flat copy of participant-supplied info (it is displayed, never trusted)."""
    return {str(k)[:40]: v if isinstance(v, int | float) else str(v)[:200] for k, v in list(info.items())[:20]}


def _heartbeat(deps: Deps, obj: ObjectCreated, pid: str) -> Outcome:
    try:
        body = _json_object(_signed(deps, obj, pid, MAX_CONTROL_BYTES))
    except (ValueError, NotFound) as exc:
        return _refuse(deps, obj, "heartbeat", f"heartbeat refused: {exc}", pid)
    ready = body.get("ready_epoch")
    info = body.get("info") if isinstance(body.get("info"), dict) else None
    ready_epoch = ready if isinstance(ready, int) else None
    known = deps.store.touch(pid, obj.time, ready_epoch, _small(info) if info else None)
    if not known:
        return _refuse(deps, obj, "heartbeat", "heartbeat from a participant that never joined", pid)
    return Outcome("heartbeat", obj.key, True, participant=pid)


def _init_offer(deps: Deps, obj: ObjectCreated, pid: str) -> Outcome:
    state = deps.store.read_state()
    if state.has_model:  # every participant offers; once one offer was adopted the others are moot
        return Outcome("init", obj.key, False, "the run already has a model", pid, recorded=False, refusal=True)
    try:
        data = _signed(deps, obj, pid, deps.config.max_update_bytes)
        header = parse_header(data)
        if not header.tensors:
            raise WireError("the file holds no tensors")
        arrays, _ = decode(data)
        if reason := non_finite(arrays):
            raise WireError(reason)
    except (WireError, ValueError, NotFound) as exc:
        return _refuse(deps, obj, "init", f"initial model refused: {exc}", pid)
    deps.store.set_init_offer(pid, digest(data))
    return Outcome("init", obj.key, True, participant=pid)


def _update(deps: Deps, obj: ObjectCreated, pid: str, round_no: int) -> Outcome:
    existing = deps.store.update_record(round_no, pid)
    if existing is not None:
        if existing.etag == obj.etag and existing.version_id == obj.version_id:  # the same event again
            return Outcome("update", obj.key, existing.accepted, existing.reason, pid, recorded=False)
        return _refuse(deps, obj, "update", f"duplicate: an update for round {round_no} was already received", pid)
    state = deps.store.read_state()
    if reason := _slot_problem(state, round_no, pid):
        return _refuse(deps, obj, "update", reason, pid)
    try:  # an unsigned, mis-signed or oversized object never takes the participant's slot
        data = _signed(deps, obj, pid, deps.config.max_update_bytes)
    except (ValueError, NotFound) as exc:
        return _refuse(deps, obj, "update", f"update refused: {exc}", pid)
    deps.store.touch(pid, obj.time)  # a signed upload shows the participant is alive
    record = _validate_update(deps, obj, data, pid, round_no, state)
    if not deps.store.record_update(record):  # a racing delivery of the same object got there first
        return Outcome("update", obj.key, record.accepted, record.reason, pid, recorded=False)
    return Outcome("update", obj.key, record.accepted, record.reason, pid)


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
    if (proof.run_id, proof.round, proof.witness) != (deps.config.run_id, round_no, pid):
        return _refuse(deps, obj, "witness", "witness proof names another run, round or witness than its key", pid)
    if proof.position != position:
        return _refuse(deps, obj, "witness", f"spoofed position: {proof.position}, {pid} is witness {position}", pid)
    if not deps.store.record_proof(round_no, pid, proof.to_json(), obj.etag, obj.time):
        return Outcome("witness", obj.key, True, participant=pid, recorded=False)
    return Outcome("witness", obj.key, True, participant=pid)


def _health_report(deps: Deps, obj: ObjectCreated, pid: str, round_no: int) -> Outcome:
    try:
        body = _json_object(_signed(deps, obj, pid, MAX_CONTROL_BYTES))
        named = body.get("unhealthy")
        if not isinstance(named, list) or len(named) > 1000:
            raise ValueError("'unhealthy' must be a list of at most 1000 participant ids")
        named = [keys.validate_participant_id(p) for p in named]
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


def _slot_problem(state: RunState, round_no: int, pid: str) -> str:
    """Why an update cannot belong to a round slot at all (recorded outside the slots), or ""."""
    if state.phase is Phase.FINISHED:
        return "the run is finished"
    if round_no != state.round:
        return f"wrong round: update for round {round_no}, the run is at round {state.round}"
    if state.phase is not Phase.TRAIN:
        return f"round {round_no} is not accepting updates (phase {state.phase})"
    if pid not in state.members:
        return f"{pid} is not a member of epoch {state.epoch}"
    return ""


def _validate_update(
    deps: Deps, obj: ObjectCreated, data: bytes, pid: str, round_no: int, state: RunState
) -> UpdateRecord:
    base = UpdateRecord(round_no, pid, obj.key, False, etag=obj.etag, version_id=obj.version_id,
                        size=obj.size, received_at=obj.time)
    if pid not in state.selected:
        return _replace(base, reason=f"not selected for round {round_no}")
    try:
        header = parse_header(data)
        manifest = load_manifest(deps)
        if reason := manifest.mismatch(header):
            raise WireError(reason)
        meta = UpdateMeta.from_metadata(header.metadata)
        _check_meta(deps, meta, pid, round_no, state)
        arrays, _ = decode(data)
        if reason := non_finite(arrays):
            raise WireError(reason)
    except (WireError, ValueError) as exc:
        return _replace(base, reason=str(exc))
    norm = _distance(arrays, _global_arrays(deps, state))
    return _replace(base, accepted=True, samples=meta.samples, digest=digest(data), metrics=dict(meta.metrics),
                    norm=norm)


_GLOBAL_CACHE: dict[str, dict[str, np.ndarray]] = {}


def _global_arrays(deps: Deps, state: RunState) -> dict[str, np.ndarray]:
    """The round's global model, kept across invocations of a warm function (one model at most)."""
    cached = _GLOBAL_CACHE.get(state.global_digest)  # one read: concurrent invocations may replace the entry
    if cached is None:
        blob = deps.bucket.get(keys.global_key(deps.config.run_id, state.round, state.global_digest))
        cached = decode(blob.data)[0]
        _GLOBAL_CACHE.clear()
        _GLOBAL_CACHE[state.global_digest] = cached
    return cached


def _distance(update: dict[str, np.ndarray], reference: dict[str, np.ndarray]) -> float:
    """L2 distance between an update and the global model over the float tensors."""
    total = 0.0
    for name, arr in update.items():
        if arr.dtype.kind == "f":
            diff = arr.astype(np.float64) - reference[name]
            total += float(np.dot(diff.ravel(), diff.ravel()))
    return math.sqrt(total)


def _check_meta(deps: Deps, meta: UpdateMeta, pid: str, round_no: int, state: RunState) -> None:
    if meta.run_id != deps.config.run_id or meta.round != round_no or meta.participant != pid:
        raise WireError("metadata names another run, round or participant than the key")
    if meta.samples <= 0:
        raise WireError(f"sample count must be positive, got {meta.samples}")
    if deps.config.dataset_size:
        assigned = assigned_count(deps.config.dataset_size, state.selected, pid)
        if meta.samples > assigned:
            raise WireError(f"claims {meta.samples} samples, more than the {assigned} it was assigned")


def _replace(rec: UpdateRecord, **changes: Any) -> UpdateRecord:
    return dataclasses.replace(rec, **changes)
