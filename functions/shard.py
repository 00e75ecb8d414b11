"""Lambda: aggregation shards (pieces [first, stop) of a round's global model each), from the shard queue the
aggregating tick fills (`coordinator.shard_queue.queue_runner`).

Each message is one shard task. The shard is tried up to SHARD_ATTEMPTS times here (its work is idempotent); its
outcome — the pieces written, an input that cannot be read, or the failure, named by the digest of the task it
answers (`shared.messages.ShardOutcome`) — is left in the bucket for the tick waiting on it
(`keys.shard_result_key`). An invocation that dies (out of memory, timeout) leaves its message to
be delivered again, and after the queue's maximum receives to the dead-letter queue (alarmed); the waiting tick
then gives up and a later tick aggregates the round afresh. A task delivered again after that finds its upload
gone (S3 takes no part for it) and leaves no outcome: no tick waits for it, and the key is the one where the
later attempt's worker leaves its outcome for the same job (`infra.coordinator.Coordinator`).
"""

from __future__ import annotations

from typing import Any

from coordinator.aggregation import failed_outcome, shard_outcome
from coordinator.deps import Deps
from coordinator.shard_queue import write_outcome
from functions.observability import lambda_handler, logger
from shared.messages import ShardTask, parse_message
from store.blobs import UploadGone


def shards(deps: Deps, event: dict[str, Any]) -> dict[str, Any]:
    records = event.get("Records", [])
    for record in records:
        run_queued(deps, parse_message(ShardTask, record["body"]))
    return {"shards": len(records)}


def run_queued(deps: Deps, task: ShardTask) -> None:
    """One queued shard, its outcome (or, once retried, its failure) written for the waiting tick."""
    logger.info("shard", round=task.round, first=task.first, stop=task.stop)
    try:
        outcome = shard_outcome(deps, task, retry=True)
    except UploadGone:
        logger.warning("shard of a finished upload: nobody waits for it", round=task.round, first=task.first)
        return
    except Exception as exc:  # the tick fails now, and is retried as a tick, rather than wait for its deadline
        logger.exception("shard failed", round=task.round, first=task.first)
        write_outcome(deps.bucket, deps.config.run_id, task, failed_outcome(task, f"{type(exc).__name__}: {exc}"))
        return
    write_outcome(deps.bucket, deps.config.run_id, task, outcome)


handler = lambda_handler(shards)
