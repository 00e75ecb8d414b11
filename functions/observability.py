"""What every handler shares: the powertools logger and metrics (module-level, cheap to import, no AWS calls), the
handler each function's work is wrapped in, and the summary of a tick.

No X-Ray tracer: the deployed functions do not turn tracing on and their asset does not ship aws-xray-sdk, and
where it is installed (moto brings it) its import alone took 0.15-0.18 s of every cold start."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from aws_lambda_powertools import Logger, Metrics
from aws_lambda_powertools.metrics import MetricUnit
from aws_lambda_powertools.utilities.typing import LambdaContext

from functions.settings import deps_from_env
from shared.naming import (
    METRIC_AGGREGATION_SECONDS,
    METRIC_PHASE_CHANGES,
    METRIC_ROUND,
    METRIC_ROUND_SECONDS,
    METRIC_TICK_CONFLICTS,
    METRICS_NAMESPACE,
)

logger = Logger(service="fed-coordinator")
metrics = Metrics(namespace=METRICS_NAMESPACE, service="fed-coordinator")
# An invocation with nothing to count (a heartbeat, a join) is normal here, not a mistake worth a log line each time.
warnings.filterwarnings("ignore", message="No application metrics to publish", category=UserWarning)

if TYPE_CHECKING:  # (the credential endpoint's handler imports this module, and needs none of the coordinator)
    from coordinator.deps import Deps
    from coordinator.service import Handled

    FunctionWork = Callable[[Deps, dict[str, Any]], dict[str, Any]]
    LambdaHandler = Callable[[dict[str, Any], LambdaContext], dict[str, Any]]


def lambda_handler(work: FunctionWork, deps: Callable[[], Deps] | None = None) -> LambdaHandler:
    """The Lambda handler that does `work` with the function's `Deps` (from its environment, or `deps`: the local
    stack's, with its shard workers), logged and measured as every handler is."""

    @logger.inject_lambda_context
    @metrics.log_metrics
    def handler(event: dict[str, Any], context: LambdaContext) -> dict[str, Any]:
        bound = deps() if deps is not None else deps_from_env()
        metrics.add_dimension("run", bound.config.run_id)
        return work(bound, event)

    return handler


def tick_summary(handled: Handled) -> dict[str, Any]:
    """Log and measure the tick an event led to; a small summary of it for the invocation's result."""
    if handled.tick is None:
        logger.warning("tick deferred to the next one", reason=handled.deferred)
        return {"committed": False, "deferred": handled.deferred}
    result = handled.tick
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
