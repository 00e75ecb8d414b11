"""Aggregation shards as messages on the shard queue, as deployed: the tick sends one task per shard, the
shard-worker function (`functions.shard`) leaves each outcome in the bucket (`keys.shard_result_key`), and the tick
waits for them. (Without a shard queue, a tick runs its shards on its own threads: `coordinator.aggregation`.)"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence

import boto3

from coordinator.aggregation import from_outcome, mismatch
from coordinator.deps import ShardRunner
from shared import keys
from shared.messages import MessageError, ShardDone, ShardOutcome, ShardTask, parse_message
from shared.naming import ENV_ENDPOINT
from store.blobs import Bucket, NotFound

log = logging.getLogger("fed-coordinator")

MAX_MESSAGE_BYTES = 256 * 1024  # SQS's limit on a message body
MAX_OUTCOME_BYTES = 4 * 1024 * 1024  # a shard's outcome: its pieces' part ETags and hashes
POLL_FIRST, POLL_MAX = 0.05, 1.0  # seconds between looks for the shard outcomes: doubling from the first to the most


class ShardWaitTimeout(RuntimeError):
    """A shard's outcome did not arrive in time (its message is being retried, or went to the dead letters)."""


def queue_runner(queue_url: str, bucket: Bucket, run_id: str, wait_seconds: float, endpoint: str | None = None,
                 region: str | None = None) -> ShardRunner:
    """Shards as messages on the shard queue (one each, all at once); the shard worker writes each outcome to
    `keys.shard_result_key`, and this waits until every one that answers its task is in (or `wait_seconds` pass).
    Whatever else lies at that key (an earlier attempt's outcome, or one written by anyone else) is not this
    task's outcome: it is passed over, with a warning when it claims this task's upload, and the wait goes on
    for the worker's (`coordinator.aggregation.mismatch`). The endpoint and region default to the environment's."""
    region = region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
    client = boto3.client("sqs", endpoint_url=endpoint or os.environ.get(ENV_ENDPOINT) or None, region_name=region)

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
