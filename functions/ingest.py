"""Lambda: an object was uploaded to the run's bucket. Validate and record it, then tick if it may close something
(`coordinator.service.on_upload`)."""

from __future__ import annotations

from typing import Any

from aws_lambda_powertools.metrics import MetricUnit

from coordinator.deps import Deps
from coordinator.service import on_upload
from functions.events import BadEvent, object_created
from functions.observability import lambda_handler, logger, metrics, tick_summary
from shared.naming import METRIC_UPDATES_ACCEPTED, METRIC_UPDATES_REFUSED


def ingest(deps: Deps, event: dict[str, Any]) -> dict[str, Any]:
    try:
        obj = object_created(event)
    except BadEvent as exc:
        logger.error("ignored event", reason=str(exc))
        return {"ignored": str(exc)}
    handled = on_upload(deps, obj)
    ingested = handled.ingested
    assert ingested is not None
    logger.info("ingested", kind=ingested.kind, key=obj.key, accepted=ingested.accepted, reason=ingested.reason,
                recorded=ingested.recorded)
    if ingested.kind == "update" and ingested.recorded:
        name = METRIC_UPDATES_ACCEPTED if ingested.accepted else METRIC_UPDATES_REFUSED
        metrics.add_metric(name=name, unit=MetricUnit.Count, value=1)
    result: dict[str, Any] = {"kind": ingested.kind, "accepted": ingested.accepted, "reason": ingested.reason,
                              "recorded": ingested.recorded}
    if handled.tick is not None or handled.deferred:
        result["tick"] = tick_summary(handled)
    return result


handler = lambda_handler(ingest)
