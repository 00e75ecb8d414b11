"""The local stack's shard-worker function: each task from the shard queue runs `functions.shard.handler` in a
worker process, so that K aggregation shards use up to K cores (threads of one process would share one
interpreter). As on AWS, the tick only sends its shard tasks to the queue and waits for their outcomes in the bucket
(`coordinator.shard_queue`); the dispatcher's shard lane delivers each message here, as the queue's event source
mapping invokes the function on AWS.

An invocation whose worker dies mid-shard breaks the pool: it is tried again on a fresh pool (its work is
idempotent), and after SHARD_ATTEMPTS such deaths the delivery fails and the queue delivers the task again. The
workers are spawned, not forked (the parent's threads, a server and a dispatcher, must not be copied), and inherit
this process's environment: the functions' settings.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import threading
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from coordinator.aggregation import SHARD_ATTEMPTS
from local.context import LocalContext, local_invocation
from store.trace import acting_as, function, install_from_env

log = logging.getLogger("fed.local.shards")

SHARD_FUNCTION = "fed-local-shard"


def invoke_in_worker(event_json: str) -> Any:
    """One invocation of the shard-worker function in a worker process, as its role (for the access check)."""
    from functions.shard import handler

    install_from_env()
    with acting_as(function("shard")):
        return local_invocation(handler)(json.loads(event_json), LocalContext(function_name=SHARD_FUNCTION))


class ShardPool:
    """`workers` worker processes, started at the first shard and kept warm (like warm functions) until `close`."""

    def __init__(self, workers: int) -> None:
        if workers < 1:
            raise ValueError("a shard pool needs at least one worker")
        self.workers = workers
        self._pool: ProcessPoolExecutor | None = None
        self._lock = threading.Lock()

    def _current(self) -> ProcessPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"))
            return self._pool

    def _discard(self, pool: ProcessPoolExecutor) -> None:
        with self._lock:
            if self._pool is pool:
                self._pool = None

    def worker_pids(self) -> list[int]:
        """The live workers' process ids (benchmarks measure them; a test kills one)."""
        with self._lock:
            return list(self._pool._processes) if self._pool is not None else []  # (no public accessor)

    def invoke(self, event: dict[str, Any], context: Any) -> Any:
        """A handler: the shard function's invocation with `event` (a batch from the shard queue) on a worker."""
        body = json.dumps(event)
        for attempt in range(1, SHARD_ATTEMPTS + 1):
            pool = self._current()
            try:
                return pool.submit(invoke_in_worker, body).result()
            except BrokenProcessPool:
                self._discard(pool)
                if attempt == SHARD_ATTEMPTS:
                    raise
                log.warning("a shard worker died mid-shard (attempt %d of %d); retrying on a fresh pool", attempt,
                            SHARD_ATTEMPTS)
        raise AssertionError("unreachable")

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
