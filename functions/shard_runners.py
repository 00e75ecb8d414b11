"""How a tick hands out its aggregation shards (`FED_SHARD_RUNNER`): synchronous invocations of the shard-worker
function on AWS, a pool of worker processes locally. Each shard is retried on failure (its work is idempotent)."""

from __future__ import annotations

import json
import multiprocessing
import os
import threading
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from functools import cache

import boto3
from botocore.config import Config

from coordinator.aggregation import from_outcome, retried
from coordinator.deps import ShardRunner
from shared.messages import ShardDone, ShardTask

# Kept warm between aggregations (like warm functions), by size and by the environment the workers inherited
# at their start (a pool started for one local stack must not serve another's endpoint).
POOLS: dict[tuple[int, str], ProcessPoolExecutor] = {}
_POOLS_LOCK = threading.Lock()


def _pool_key(workers: int) -> tuple[int, str]:
    return workers, json.dumps(sorted((k, v) for k, v in os.environ.items() if k.startswith(("FED_", "AWS_"))))


def _pool(key: tuple[int, str]) -> ProcessPoolExecutor:
    with _POOLS_LOCK:
        if key not in POOLS:  # spawned, not forked: the parent's threads (server, dispatcher) must not be copied
            POOLS[key] = ProcessPoolExecutor(max_workers=key[0], mp_context=multiprocessing.get_context("spawn"))
        return POOLS[key]


def _discard(key: tuple[int, str], pool: ProcessPoolExecutor) -> None:
    with _POOLS_LOCK:
        if POOLS.get(key) is pool:
            del POOLS[key]


def processes_runner(workers: int) -> ShardRunner:
    """Shards on a pool of `workers` worker processes (they inherit this process's environment): K shards use
    up to K cores."""

    def attempt(task: ShardTask) -> ShardDone:
        from functions.shard import run_task_json  # (the worker's entry point; it imports the settings)

        key = _pool_key(workers)
        pool = _pool(key)
        try:
            return from_outcome(pool.submit(run_task_json, task.model_dump_json()).result())
        except BrokenProcessPool:  # a worker died mid-shard: the next attempt gets a fresh pool
            _discard(key, pool)
            raise

    def run(tasks: Sequence[ShardTask]) -> list[ShardDone]:
        with ThreadPoolExecutor(max_workers=len(tasks)) as waiters:
            return list(waiters.map(lambda t: retried(lambda: attempt(t), t), tasks))

    return run


def lambda_runner(function_name: str) -> ShardRunner:
    """Shards as synchronous invocations of the shard-worker function, all at once (each retried on failure)."""
    client = boto3.client("lambda", config=Config(read_timeout=900, retries={"max_attempts": 0}))

    def invoke(task: ShardTask) -> ShardDone:
        resp = client.invoke(FunctionName=function_name, Payload=task.model_dump_json().encode())
        body = json.loads(resp["Payload"].read() or b"{}")
        if resp.get("FunctionError"):
            raise RuntimeError(f"shard worker failed: {str(body)[:500]}")
        return from_outcome(body)

    def run(tasks: Sequence[ShardTask]) -> list[ShardDone]:
        with ThreadPoolExecutor(max_workers=len(tasks)) as waiters:
            return list(waiters.map(lambda t: retried(lambda: invoke(t), t), tasks))

    return run


@cache
def runner_for(spec: str) -> ShardRunner | None:
    """The runner `FED_SHARD_RUNNER` names: "lambda:<function>", "processes:<n>", or "" (None: the tick's threads)."""
    kind, _, arg = spec.partition(":")
    if kind == "lambda" and arg:
        return lambda_runner(arg)
    if kind == "processes":
        return processes_runner(int(arg or os.cpu_count() or 1))
    return None
