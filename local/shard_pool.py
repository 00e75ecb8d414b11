"""The local stack's stand-in for the shard-worker function: a pool of worker processes, so that K aggregation shards
use up to K cores (threads of one process would share one interpreter). On AWS the tick hands its shards to the
shard queue instead (`coordinator.shard_queue`); the work each shard does is the same (`coordinator.aggregation`).

Each shard is retried on failure (its work is idempotent). A worker that dies mid-shard breaks the pool: the attempt
fails, and the next one gets a fresh pool. The workers are spawned, not forked (the parent's threads, a server and a
dispatcher, must not be copied), and inherit this process's environment: the functions' settings.
"""

from __future__ import annotations

import multiprocessing
import threading
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from coordinator.aggregation import from_outcome, retried, shard_outcome
from functions.settings import deps_from_env
from shared.messages import ShardDone, ShardTask, parse_message
from store.trace import acting_as, function, install_from_env


def run_task_json(task_json: str) -> str:
    """One shard in a worker process, as the shard-worker function (its role, for the access check): its outcome's
    JSON."""
    install_from_env()
    with acting_as(function("shard")):
        return shard_outcome(deps_from_env(), parse_message(ShardTask, task_json)).model_dump_json()


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

    def _attempt(self, task: ShardTask) -> ShardDone:
        pool = self._current()
        try:
            return from_outcome(pool.submit(run_task_json, task.model_dump_json()).result(), task)
        except BrokenProcessPool:  # a worker died mid-shard: the next attempt gets a fresh pool
            self._discard(pool)
            raise

    def run(self, tasks: Sequence[ShardTask]) -> list[ShardDone]:
        """Every task on the pool at once, each retried on failure; their results in order (a `ShardRunner`)."""
        with ThreadPoolExecutor(max_workers=len(tasks)) as waiters:
            return list(waiters.map(lambda t: retried(lambda: self._attempt(t), t), tasks))

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
