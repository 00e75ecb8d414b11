"""Lambda: one aggregation shard (pieces [first, stop) of a round's global model), invoked by the tick that
aggregates the round (`functions.shard_runners`)."""

from __future__ import annotations

from typing import Any

from aws_lambda_powertools.utilities.typing import LambdaContext

from coordinator.aggregation import shard_outcome
from functions.observability import logger, traced
from functions.settings import deps_from_env
from shared.messages import ShardTask, parse_message


@logger.inject_lambda_context
@traced
def handler(event: dict[str, Any], context: LambdaContext) -> dict[str, object]:
    task = ShardTask.model_validate(event)
    logger.info("shard", round=task.round, first=task.first, stop=task.stop)
    return shard_outcome(deps_from_env(), task)


def run_task_json(task_json: str) -> dict[str, object]:
    """A shard in a worker process (the local stack's stand-in for the shard-worker function)."""
    return shard_outcome(deps_from_env(), parse_message(ShardTask, task_json))
