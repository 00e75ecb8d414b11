"""Lambda: an object was uploaded to the run's bucket. Validate and record it, then tick."""

from __future__ import annotations

from typing import Any

from aws_lambda_powertools.metrics import MetricUnit
from aws_lambda_powertools.utilities.typing import LambdaContext

from coordinator.intake import ingest_object
from functions.events import BadEvent, object_created
from functions.observability import logger, metrics, traced
from functions.settings import deps_from_env
from functions.tick import tick_and_publish
from shared.naming import METRIC_UPDATES_ACCEPTED, METRIC_UPDATES_REFUSED


@logger.inject_lambda_context
@metrics.log_metrics
@traced
def handler(event: dict[str, Any], context: LambdaContext) -> dict[str, Any]:
    deps = deps_from_env()
    metrics.add_dimension("run", deps.config.run_id)
    try:
        obj = object_created(event)
    except BadEvent as exc:
        logger.error("ignored event", reason=str(exc))
        return {"ignored": str(exc)}
    outcome = ingest_object(deps, obj)
    logger.info("ingested", kind=outcome.kind, key=obj.key, accepted=outcome.accepted,
                reason=outcome.reason, recorded=outcome.recorded)
    if outcome.kind == "update" and outcome.recorded:
        name = METRIC_UPDATES_ACCEPTED if outcome.accepted else METRIC_UPDATES_REFUSED
        metrics.add_metric(name=name, unit=MetricUnit.Count, value=1)
    result: dict[str, Any] = {"kind": outcome.kind, "accepted": outcome.accepted, "reason": outcome.reason,
                              "recorded": outcome.recorded}
    if outcome.recorded and not outcome.refusal and outcome.ticks:  # a round closes as soon as its last update lands
        result["tick"] = tick_and_publish(deps)
    return result
