"""The functions as the local stack invokes them: each handler made from the same work as on AWS
(`functions.observability.lambda_handler`), with this process's `Deps` and, for the aggregation shards a tick hands
out, the local stand-in for the shard-worker function (`local.shard_pool`), called as one Lambda invocation would be.
"""

from __future__ import annotations

import dataclasses
import json
import os
import uuid
from collections.abc import Callable
from typing import Any

from coordinator.deps import Deps
from local.shard_pool import ShardPool

Handler = Callable[[dict[str, Any], Any], Any]


def _local_invocation(handler: Handler) -> Handler:
    """Call a handler as one Lambda invocation would, in a process that serves many at once.

    With POWERTOOLS_METRICS_DISABLED, powertools neither prints nor clears the metric set at the end of an
    invocation, so it grows across invocations until, at 100 values, it prints them to stdout anyway.
    Each Lambda process starts empty; clearing after each call keeps it that way here.
    """
    from functions.observability import metrics

    def invoke(event: dict[str, Any], context: Any) -> Any:
        try:
            return handler(event, context)
        finally:
            if os.environ.get("POWERTOOLS_METRICS_DISABLED", "").lower() == "true":
                metrics.clear_metrics()

    return invoke


def _as_queue_batch(handler: Handler) -> Handler:
    """The join function takes SQS batches (its event source mapping's); deliver one event as a batch of one,
    and raise if the handler reports it failed, as the queue would deliver it again."""

    def invoke(event: dict[str, Any], context: Any) -> Any:
        record = {"messageId": str(uuid.uuid4()), "body": json.dumps(event), "eventSource": "aws:sqs"}
        result = handler({"Records": [record]}, context)
        if result.get("batchItemFailures"):
            raise RuntimeError("the join function reported the join request as failed")
        return result

    return invoke


class LocalFunctions:
    """The ingest, join and tick handlers, and the shard workers their ticks use (`shard_workers` processes; 0: the
    tick's own threads). The functions read their settings from the environment on first call, which the caller
    sets up before the first event."""

    def __init__(self, shard_workers: int | None = None) -> None:
        workers = (os.cpu_count() or 1) if shard_workers is None else shard_workers
        self.shards = ShardPool(workers) if workers > 0 else None

    def deps(self) -> Deps:
        from functions.settings import deps_from_env

        deps = deps_from_env()
        return dataclasses.replace(deps, shard_runner=self.shards.run) if self.shards is not None else deps

    def _handler(self, work: Callable[[Deps, dict[str, Any]], dict[str, Any]]) -> Handler:
        from functions.observability import lambda_handler

        return _local_invocation(lambda_handler(work, self.deps))

    def ingest(self) -> Handler:
        from functions.ingest import ingest

        return self._handler(ingest)

    def join(self) -> Handler:
        from functions.join import join_batch

        return _as_queue_batch(self._handler(join_batch))

    def tick(self) -> Handler:
        from functions.tick import tick

        return self._handler(tick)

    def close(self) -> None:
        if self.shards is not None:
            self.shards.close()
