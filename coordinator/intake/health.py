"""A health report: the members a member of the epoch names unhealthy after the last witnessed round."""

from __future__ import annotations

from coordinator.deps import Deps
from coordinator.intake.common import Ingested, ObjectCreated, refuse, signed
from shared.messages import MAX_CONTROL_BYTES, HealthReport, parse_message
from store.blobs import NotFound


def ingest(deps: Deps, obj: ObjectCreated, pid: str, round_no: int) -> Ingested:
    try:
        named = parse_message(HealthReport, signed(deps, obj, pid, MAX_CONTROL_BYTES)).unhealthy
    except (ValueError, NotFound) as exc:
        return refuse(deps, obj, "health", f"health report refused: {exc}", pid)
    state = deps.store.read_state()
    if round_no != state.health_round:
        return refuse(deps, obj, "health", f"health report about round {round_no}; the last witnessed round is "
                      f"{state.health_round}", pid)
    if pid not in state.members:
        return refuse(deps, obj, "health", f"{pid} is not a member of epoch {state.epoch}", pid)
    recorded = deps.store.record_health_report(round_no, pid, sorted(set(named)), obj.time)
    return Ingested("health", obj.key, True, participant=pid, recorded=recorded)
