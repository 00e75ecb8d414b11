"""What ingest does with one uploaded object: classify it by key, validate it, record the outcome.

Idempotent: an outcome is recorded once per object (conditional puts keyed on the round slot, or on
the object's key and ETag), so a duplicate or late S3 event changes nothing. Every refusal is recorded
with its reason and never raises: bad input must not stop the run.

One module per kind of object, each with its `ingest`: `join`, `heartbeat`, `offer` (the initial model), `update`,
`proof` (a witness's), `health`; what they share (the event, the outcome, refusals, signature checks) is in `common`.
"""

from __future__ import annotations

from coordinator.deps import Deps
from coordinator.intake import health, heartbeat, join, offer, proof, update
from coordinator.intake.budget import over_budget
from coordinator.intake.common import Ingested, ObjectCreated, refuse
from coordinator.intake.common import signed_model as _signed_model  # (benchmarks/big_loop.py: one ingest alone)
from coordinator.intake.offer import initial_model_problem, model_schema
from shared import keys
from shared.hosts import upload_refusal
from shared.keys import KeyError_, ObjectKind

__all__ = ["ObjectCreated", "Ingested", "ingest_object", "initial_model_problem", "model_schema", "_signed_model"]


def ingest_object(deps: Deps, obj: ObjectCreated) -> Ingested:
    if (dropped := over_budget(deps, obj)) is not None:  # first: a flood costs one write an object, whatever it is
        return dropped
    try:
        parsed = keys.parse_key(obj.key)
    except KeyError_ as exc:
        return refuse(deps, obj, "layout", str(exc))
    if parsed.run_id != deps.config.run_id:
        return refuse(deps, obj, "layout", f"object belongs to run {parsed.run_id!r}, not {deps.config.run_id!r}")
    pid = parsed.participant or ""
    host = deps.store.host(pid) if pid else None
    if (refused := upload_refusal(host, parsed.kind is ObjectKind.JOIN)) is not None:
        return refuse(deps, obj, parsed.kind.value, refused, pid)
    if parsed.kind is ObjectKind.JOIN:
        return join.ingest(deps, obj, pid, host)
    if parsed.kind is ObjectKind.HEARTBEAT:
        return heartbeat.ingest(deps, obj, pid)
    if parsed.kind is ObjectKind.INIT:
        return offer.ingest(deps, obj, pid)
    if parsed.kind is ObjectKind.UPDATE:
        assert parsed.round is not None
        return update.ingest(deps, obj, pid, parsed.round)
    if parsed.kind is ObjectKind.WITNESS:
        assert parsed.round is not None
        return proof.ingest(deps, obj, pid, parsed.round)
    if parsed.kind is ObjectKind.HEALTH:
        assert parsed.round is not None
        return health.ingest(deps, obj, pid, parsed.round)
    return Ingested(parsed.kind.value, obj.key, True, "written by the coordinator", recorded=False)
