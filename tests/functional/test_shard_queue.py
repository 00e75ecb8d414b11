"""Aggregation shards fed by the shard queue, as deployed (`FED_SHARD_RUNNER = queue:<url>`): the tick sends one
message per shard and waits for the outcomes the shard-worker function leaves in the bucket. A consumer here
stands in for Lambda's SQS event source (receive, invoke the handler, delete on success). The global model is the
one the tick computes itself; a worker that dies mid-shard leaves its message to be delivered again and the round
still gets the same global; a shard that keeps failing fails the tick at once (it is retried as a tick); a task
delivered again after its tick gave up does no harm."""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Callable, Iterator
from typing import Any

import boto3
import numpy as np
import pytest

from coordinator.aggregation import write_aggregate
from coordinator.deps import Deps
from coordinator.shard_queue import ShardWaitTimeout, queue_runner, result_key
from functions import shard
from local.context import LocalContext
from shared.digest import PIECE_BYTES
from shared.messages import ShardDone, ShardTask
from shared.state import Aggregate, AggregateInput
from tests.functional.conftest import Harness
from tests.functional.test_large_models import PIDS, run_one_round

MB = 1024 * 1024


class EventSource:
    """Lambda's SQS event source in a thread: one message per invocation of `functions.shard.handler`; a message
    whose invocation raises is left on the queue (visible again after the visibility timeout)."""

    def __init__(self, url: str, before: Callable[[int], None] = lambda n: None) -> None:
        self.sqs, self.url, self.before = boto3.client("sqs", region_name="us-east-1"), url, before
        self.invocations, self.stop = 0, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            got = self.sqs.receive_message(QueueUrl=self.url, MaxNumberOfMessages=1, WaitTimeSeconds=1)
            for message in got.get("Messages", []):
                self.invocations += 1
                try:
                    self.before(self.invocations)
                    shard.handler({"Records": [{"body": message["Body"]}]}, LocalContext())
                except Exception:  # noqa: BLE001 (a dead invocation: the message stays)
                    continue
                self.sqs.delete_message(QueueUrl=self.url, ReceiptHandle=message["ReceiptHandle"])

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=10)


@pytest.fixture
def queued(harness_factory) -> Iterator[tuple[Harness, str, Aggregate]]:  # type: ignore[no-untyped-def]
    h = harness_factory(min_clients=3, min_per_round=3, min_updates=3, total_rounds=2, dataset_size=60,
                        max_update_bytes=256 * MB, shard_bytes=3 * PIECE_BYTES)
    run_one_round(h, np.dtype(np.float32))
    records = {u.pid: u for u in h.deps.store.all_updates() if u.round == 0}
    effect = Aggregate(0, tuple(AggregateInput(p, records[p].samples, records[p].digest, records[p].version_id,
                                               records[p].norm) for p in PIDS), h.global_digest(0))
    url = boto3.client("sqs", region_name="us-east-1").create_queue(
        QueueName="shards", Attributes={"VisibilityTimeout": "1"})["QueueUrl"]
    yield h, url, effect


def with_queue(h: Harness, url: str, wait: float = 60.0) -> Deps:
    return dataclasses.replace(h.deps, shard_runner=queue_runner(url, h.deps.bucket, h.config.run_id, wait))


def test_queued_shards_write_the_global_the_tick_computes_itself(queued: Any) -> None:
    h, url, effect = queued
    source = EventSource(url)
    try:
        got = write_aggregate(with_queue(h, url), effect)
    finally:
        source.close()
    assert source.invocations == 3  # 8 pieces in shards of 3: three messages
    assert got == write_aggregate(dataclasses.replace(h.deps, shard_runner=None), effect)
    assert got[0] == h.global_digest(1)


def test_a_worker_that_dies_mid_shard_is_delivered_again_and_the_global_is_the_same(queued: Any) -> None:
    h, url, effect = queued

    def die_once(n: int) -> None:
        if n == 2:
            raise MemoryError("the invocation died")  # its message is not deleted

    source = EventSource(url, die_once)
    try:
        got = write_aggregate(with_queue(h, url), effect)
    finally:
        source.close()
    assert source.invocations == 4 and got[0] == h.global_digest(1)


def break_the_shard_at_piece_3(monkeypatch: pytest.MonkeyPatch) -> None:
    """The shard starting at piece 3 fails every time it is tried; the others run as usual."""
    real = shard.shard_outcome

    def broken(deps: Deps, task: Any, retry: bool = False) -> dict[str, object]:
        if task.first == 3:
            raise OSError("the disk is on fire")
        return real(deps, task, retry)

    monkeypatch.setattr(shard, "shard_outcome", broken)


def test_a_shard_that_keeps_failing_fails_the_tick_at_once(queued: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    h, url, effect = queued
    break_the_shard_at_piece_3(monkeypatch)
    source = EventSource(url)
    try:
        with pytest.raises(RuntimeError, match="shard worker failed: OSError: the disk is on fire"):
            write_aggregate(with_queue(h, url, wait=600), effect)
    finally:
        source.close()


def test_an_abort_that_fails_does_not_hide_the_shard_failure(queued: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a shard that fails, and an abort of the staging upload that fails too (moto in process fails it when
    # another shard is still adding parts)
    h, url, effect = queued
    break_the_shard_at_piece_3(monkeypatch)

    def abort(key: str, upload_id: str) -> None:
        raise RuntimeError("dictionary changed size during iteration")

    monkeypatch.setattr(h.deps.bucket, "abort_multipart", abort)
    source = EventSource(url)
    try:
        # Then the tick fails with the shard's failure, not the abort's
        with pytest.raises(RuntimeError, match="shard worker failed: OSError: the disk is on fire"):
            write_aggregate(with_queue(h, url, wait=600), effect)
    finally:
        source.close()


def test_a_task_delivered_after_its_tick_gave_up_leaves_the_later_attempts_outcome_alone(queued: Any) -> None:
    # Given the shard tasks of an aggregation whose tick gave up waiting (its workers died; the staged upload was
    # aborted), and a later tick that aggregated the same job (the same outcome keys) with a new upload
    h, url, effect = queued
    sent: list[ShardTask] = []

    def gave_up(tasks: Any) -> list[ShardDone]:
        sent.extend(tasks)
        raise ShardWaitTimeout("the shards did not report in time")

    with pytest.raises(ShardWaitTimeout):
        write_aggregate(dataclasses.replace(h.deps, shard_runner=gave_up), effect)
    source = EventSource(url)
    try:
        assert write_aggregate(with_queue(h, url), effect)[0] == h.global_digest(1)
    finally:
        source.close()
    stale = sent[0]
    key = result_key(h.config.run_id, stale)
    current = h.deps.bucket.get(key).data
    assert json.loads(current)["upload_id"] != stale.upload_id
    # When an old task is delivered again (six worker timeouts after its worker died, on AWS)
    assert shard.handler({"Records": [{"body": stale.model_dump_json()}]}, LocalContext()) == {"shards": 1}
    # Then S3 takes no part for its upload, and it leaves no outcome: the later attempt's is still there
    assert h.deps.bucket.get(key).data == current
