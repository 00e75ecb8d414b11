"""How a tick hands out its aggregation shards (`FED_SHARD_RUNNER`): on AWS, messages on the shard queue that feeds
the shard-worker function, whose outcomes the tick waits for in the bucket; locally, a pool of worker processes.
Each shard is retried on failure (its work is idempotent)."""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from functools import cache

import boto3

from coordinator.aggregation import from_outcome, mismatch, retried
from coordinator.deps import ShardRunner
from shared import keys
from shared.messages import MessageError, ShardDone, ShardOutcome, ShardTask, parse_message
from shared.naming import ENV_BUCKET, ENV_ENDPOINT, ENV_RUN_ID, ENV_SHARD_WAIT
from store.blobs import Bucket, NotFound, s3_client

log = logging.getLogger("fed-coordinator")

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
            return from_outcome(pool.submit(run_task_json, task.model_dump_json()).result(), task)
        except BrokenProcessPool:  # a worker died mid-shard: the next attempt gets a fresh pool
            _discard(key, pool)
            raise

    def run(tasks: Sequence[ShardTask]) -> list[ShardDone]:
        with ThreadPoolExecutor(max_workers=len(tasks)) as waiters:
            return list(waiters.map(lambda t: retried(lambda: attempt(t), t), tasks))

    return run


MAX_MESSAGE_BYTES = 256 * 1024  # SQS's limit on a message body
MAX_OUTCOME_BYTES = 4 * 1024 * 1024  # a shard's outcome: its pieces' part ETags and hashes
POLL_FIRST, POLL_MAX = 0.05, 1.0  # seconds between looks for the shard outcomes: doubling from the first to the most


class ShardWaitTimeout(RuntimeError):
    """A shard's outcome did not arrive in time (its message is being retried, or went to the dead letters)."""


def queue_runner(queue_url: str, bucket: Bucket, run_id: str, wait_seconds: float) -> ShardRunner:
    """Shards as messages on the shard queue (one each, all at once); the shard worker writes each outcome to
    `keys.shard_result_key`, and this waits until every one that answers its task is in (or `wait_seconds` pass).
    Whatever else lies at that key (an earlier attempt's outcome, or one written by anyone else) is not this
    task's outcome: it is passed over, with a warning when it claims this task's upload, and the wait goes on
    for the worker's (`coordinator.aggregation.mismatch`)."""
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
    client = boto3.client("sqs", endpoint_url=os.environ.get(ENV_ENDPOINT) or None, region_name=region)

    def run(tasks: Sequence[ShardTask]) -> list[ShardDone]:
        pending = {}
        for task in tasks:
            body = task.model_dump_json()
            if len(body.encode()) > MAX_MESSAGE_BYTES:
                raise ValueError(f"a shard task of {len(task.inputs)} inputs is {len(body.encode())} bytes, over the "
                                 f"shard queue's {MAX_MESSAGE_BYTES}-byte message limit")
            client.send_message(QueueUrl=queue_url, MessageBody=body)
            pending[task.first] = task
        done: dict[int, ShardDone] = {}
        passed_over: dict[int, str] = {}  # the last outcome each shard's wait passed over, warned of once
        deadline, pause = time.monotonic() + wait_seconds, POLL_FIRST
        while pending:
            for first, task in list(pending.items()):
                outcome = _outcome(bucket, result_key(run_id, task), task, passed_over)
                if outcome is not None:
                    done[first] = from_outcome(outcome, task)
                    del pending[first]
            if pending and time.monotonic() > deadline:
                raise ShardWaitTimeout(f"shards starting at pieces {sorted(pending)[:10]} did not report within "
                                       f"{wait_seconds:.0f}s (see the shard worker's logs and the dead-letter queue)")
            if pending:
                time.sleep(pause)  # waiting for other invocations' work, not for a race: backing off
                pause = min(POLL_MAX, pause * 2)
        return [done[t.first] for t in tasks]

    return run


def result_key(run_id: str, task: ShardTask) -> str:
    parsed = keys.parse_key(task.staging)
    assert parsed.round is not None and parsed.digest is not None
    return keys.shard_result_key(run_id, parsed.round, parsed.digest, task.first)


def _outcome(bucket: Bucket, key: str, task: ShardTask, passed_over: dict[int, str]) -> ShardOutcome | None:
    """The outcome stored for this task, or None while there is none that answers it."""
    try:
        stored = bucket.get(key, MAX_OUTCOME_BYTES)
    except NotFound:
        return None
    except ValueError as exc:  # over the size limit: no worker writes one
        _pass_over(key, task, passed_over, f"{exc}")
        return None
    try:
        outcome = parse_message(ShardOutcome, stored.data)
    except MessageError as exc:
        _pass_over(key, task, passed_over, f"not a shard outcome ({exc})")
        return None
    why = mismatch(outcome, task)
    if why and outcome.upload_id == task.upload_id:
        _pass_over(key, task, passed_over, why)
    return None if why else outcome


def _pass_over(key: str, task: ShardTask, passed_over: dict[int, str], why: str) -> None:
    if passed_over.get(task.first) != why:
        passed_over[task.first] = why
        log.warning("passed over what lies at %s: %s; waiting for the shard worker's outcome", key[-120:], why)
    return None


def write_outcome(bucket: Bucket, run_id: str, task: ShardTask, outcome: ShardOutcome) -> None:
    """What the queue-fed shard worker leaves for the waiting tick."""
    bucket.put(result_key(run_id, task), outcome.model_dump_json().encode())


@cache
def runner_for(spec: str) -> ShardRunner | None:
    """The runner `FED_SHARD_RUNNER` names: "queue:<url>" (with FED_BUCKET, FED_RUN_ID and FED_SHARD_WAIT),
    "processes:<n>", or "" (None: the tick's threads)."""
    kind, _, arg = spec.partition(":")
    if kind == "queue" and arg:
        bucket = Bucket(os.environ[ENV_BUCKET], s3_client(os.environ.get(ENV_ENDPOINT) or None,
                                                          os.environ.get("AWS_REGION") or "us-east-1"))
        return queue_runner(arg, bucket, os.environ[ENV_RUN_ID], float(os.environ.get(ENV_SHARD_WAIT) or 900))
    if kind == "processes":
        return processes_runner(int(arg or os.cpu_count() or 1))
    return None
