"""The functions as the local stack invokes them: each handler made from the same work as on AWS
(`functions.observability.lambda_handler`) with this process's `Deps`, and the shard-worker function on worker
processes (`local.shard_pool`), fed from the shard queue as on AWS.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Callable
from typing import Any

from coordinator.deps import Deps
from local.context import Handler, local_invocation
from local.shard_pool import ShardPool

__all__ = ["Handler", "LocalFunctions"]


def _as_queue_batch(handler: Handler) -> Handler:
    """The join and shard functions take SQS batches (their event source mappings'); deliver one event as a batch
    of one, and raise if the handler reports it failed, as the queue would deliver it again."""

    def invoke(event: dict[str, Any], context: Any) -> Any:
        record = {"messageId": str(uuid.uuid4()), "body": json.dumps(event), "eventSource": "aws:sqs"}
        result = handler({"Records": [record]}, context)
        if isinstance(result, dict) and result.get("batchItemFailures"):
            raise RuntimeError("the function reported the queued event as failed")
        return result

    return invoke


class LocalFunctions:
    """The ingest, join and tick handlers, and the shard-worker function on `shard_workers` processes (default: one
    a core; 0: none, and the ticks aggregate on their own threads). The functions read their settings from the
    environment on first call, which the caller sets up before the first event."""

    def __init__(self, shard_workers: int | None = None) -> None:
        workers = (os.cpu_count() or 1) if shard_workers is None else shard_workers
        self.shards = ShardPool(workers) if workers > 0 else None

    @staticmethod
    def deps() -> Deps:
        from functions.settings import deps_from_env

        return deps_from_env()

    def _handler(self, work: Callable[[Deps, dict[str, Any]], dict[str, Any]]) -> Handler:
        from functions.observability import lambda_handler

        return local_invocation(lambda_handler(work, self.deps))

    def ingest(self) -> Handler:
        from functions.ingest import ingest

        return self._handler(ingest)

    def join(self) -> Handler:
        from functions.join import join_batch

        return _as_queue_batch(self._handler(join_batch))

    def tick(self) -> Handler:
        from functions.tick import tick

        return self._handler(tick)

    def shard(self) -> Handler:
        if self.shards is None:
            raise RuntimeError("no shard workers: the ticks aggregate on their own threads")
        return _as_queue_batch(self.shards.invoke)

    def close(self) -> None:
        if self.shards is not None:
            self.shards.close()
