"""Aggregation shards through the local stack's shard queue, to the shard-worker function on worker processes, as
deployed: the same global model as the tick computing them itself, and a worker killed mid-shard is replaced and its
shard redone."""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
from collections.abc import Iterator

import boto3
import numpy as np
import pytest
from botocore.config import Config

from coordinator.aggregation import write_aggregate
from coordinator.deps import Deps
from functions.settings import deps_from_env
from local.stack import LocalStack
from shared import keys, wire
from shared.config import RunConfig
from shared.digest import PIECE_BYTES
from shared.naming import ENV_SHARD_RUNNER
from shared.state import Aggregate, AggregateInput

RUN = "shard-test"
PIDS = ["alice", "bob", "carol"]


@pytest.fixture(scope="module")
def stack() -> Iterator[LocalStack]:
    config = RunConfig(run_id=RUN, shard_bytes=2 * PIECE_BYTES, max_update_bytes=1 << 30)
    with LocalStack(config, tick_interval=3600, log_level="WARNING") as s:
        yield s


def model(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"a.weight": rng.standard_normal((4096, 1024), np.float32),  # 16 MiB
            "b.weight": rng.standard_normal(3 * 1024 * 1024 + 5, np.float32),  # 12 MiB and a bit
            "step": np.array([seed], np.int64)}


@pytest.fixture(scope="module")
def round_zero(stack: LocalStack) -> Aggregate:
    """A round-0 global model and three accepted updates in the stack's bucket (written directly: the round's
    records are what the tick would hand to the aggregation)."""
    c = stack.connection
    s3 = boto3.client("s3", endpoint_url=c.endpoint, region_name=c.region,
                      config=Config(request_checksum_calculation="when_required"))
    base = wire.encode(model(0))
    base_digest = wire.digest(base)
    s3.put_object(Bucket=c.bucket, Key=keys.global_key(RUN, 0, base_digest), Body=base)
    inputs = []
    for i, pid in enumerate(PIDS):
        meta = wire.UpdateMeta(RUN, 0, pid, 10 + i, {"loss": 1.0})
        data = wire.encode(model(i + 1), meta.to_metadata())
        put = s3.put_object(Bucket=c.bucket, Key=keys.update_key(RUN, 0, pid), Body=data)
        inputs.append(AggregateInput(pid, 10 + i, wire.digest(data), put["VersionId"]))
    return Aggregate(0, tuple(inputs), base_digest)


def threads_deps() -> Deps:
    return dataclasses.replace(deps_from_env(), shard_runner=None)


def pooled(stack: LocalStack) -> Deps:
    """What the stack's ingest and tick functions aggregate with: their shards as messages on the shard queue."""
    assert stack.dispatcher is not None
    return stack.dispatcher.functions.deps()


def test_worker_processes_write_the_same_global_as_the_tick_itself(stack: LocalStack, round_zero: Aggregate) -> None:
    deps = pooled(stack)
    assert deps.shard_runner is not None  # the ticks send their shards to the shard queue
    assert stack.resources is not None and os.environ[ENV_SHARD_RUNNER] == f"queue:{stack.resources.shard_queue_url}"
    assert write_aggregate(deps, round_zero) == write_aggregate(threads_deps(), round_zero)


def test_a_worker_killed_mid_shard_is_replaced_and_the_global_is_the_same(
    stack: LocalStack, round_zero: Aggregate, caplog: pytest.LogCaptureFixture
) -> None:
    want = write_aggregate(threads_deps(), round_zero)
    c = stack.connection
    s3 = boto3.client("s3", endpoint_url=c.endpoint, region_name=c.region)
    deps = pooled(stack)
    assert stack.dispatcher is not None and stack.dispatcher.functions.shards is not None
    shards = stack.dispatcher.functions.shards
    killed: list[int] = []
    done = threading.Event()

    def kill_a_worker_once_a_part_is_in() -> None:  # mid-shard: the upload has parts, the round is not done
        while not done.is_set() and not killed:
            for upload in s3.list_multipart_uploads(Bucket=c.bucket).get("Uploads", []):
                parts = s3.list_parts(Bucket=c.bucket, Key=upload["Key"], UploadId=upload["UploadId"])
                if parts.get("Parts"):
                    for pid in shards.worker_pids():
                        os.kill(pid, signal.SIGKILL)
                        killed.append(pid)
                    break

    killer = threading.Thread(target=kill_a_worker_once_a_part_is_in, daemon=True)
    with caplog.at_level(logging.WARNING):
        killer.start()
        got = write_aggregate(deps, round_zero)
        done.set()
        killer.join(10)
    assert killed, "no worker was killed: the shards finished before any part was listed"
    assert any("retrying" in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
    assert got == want
    assert s3.list_multipart_uploads(Bucket=c.bucket).get("Uploads", []) == []  # none left behind
