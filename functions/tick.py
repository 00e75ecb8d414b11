"""Lambda: the scheduled safety-net tick (deadlines, liveness) of the coordinator."""

from __future__ import annotations

from typing import Any

from aws_lambda_powertools.metrics import MetricUnit
from aws_lambda_powertools.utilities.typing import LambdaContext

from coordinator.tick import TickContention, TickResult, run_tick
from functions.observability import logger, metrics, traced
from functions.settings import Deps, deps_from_env
from shared.naming import (
    METRIC_AGGREGATION_SECONDS,
    METRIC_PHASE_CHANGES,
    METRIC_ROUND,
    METRIC_ROUND_SECONDS,
    METRIC_TICK_CONFLICTS,
)


def publish(result: TickResult) -> dict[str, Any]:
    """Log and measure a tick; return a small summary for the invocation's result."""
    for note in result.notes:
        logger.info(note)
    metrics.add_metric(name=METRIC_ROUND, unit=MetricUnit.Count, value=result.state.round)
    if result.attempts > 1:
        metrics.add_metric(name=METRIC_TICK_CONFLICTS, unit=MetricUnit.Count, value=result.attempts - 1)
    if result.fired:
        metrics.add_metric(name=METRIC_PHASE_CHANGES, unit=MetricUnit.Count, value=len(result.fired))
    for summary in result.summaries:
        metrics.add_metric(name=METRIC_ROUND_SECONDS, unit=MetricUnit.Seconds, value=summary.seconds)
    if any(s.aggregated for s in result.summaries):
        metrics.add_metric(name=METRIC_AGGREGATION_SECONDS, unit=MetricUnit.Seconds, value=result.aggregation_seconds)
    s = result.state
    return {"committed": result.committed, "phase": s.phase.value, "epoch": s.epoch, "round": s.round,
            "fired": list(result.fired)}


def tick_and_publish(deps: Deps) -> dict[str, Any]:
    """One tick (the schedule's, or right after ingest recorded something); contention defers it."""
    try:
        return publish(run_tick(deps))
    except TickContention as exc:
        logger.warning("tick deferred to the next one", reason=str(exc))
        return {"committed": False, "deferred": str(exc)}


@logger.inject_lambda_context
@metrics.log_metrics
@traced
def handler(event: dict[str, Any], context: LambdaContext) -> dict[str, Any]:
    deps = deps_from_env()
    metrics.add_dimension("run", deps.config.run_id)
    return tick_and_publish(deps)
