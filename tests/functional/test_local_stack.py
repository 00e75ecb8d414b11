"""The local stack (moto's server, resources, dispatcher) delivering real S3 events to the real handlers.

Participants are simulated here with numpy uploads, so these tests need no torch and take seconds; the
end-to-end tests in tests/e2e run the real participant processes.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import boto3
import numpy as np
import pytest

from fed.localrun import wait_until
from fed.status import collect
from local.dispatcher import MAIN_LANE, Dispatcher
from local.stack import LocalStack
from shared import keys, wire
from shared.config import RunConfig
from shared.naming import tick_rule_name
from shared.selection import assigned_count
from shared.signing import Signer
from shared.state import Phase
from store.table import StateStore

MODEL = {"w": np.ones((3, 2), np.float32), "b": np.zeros(2, np.float32)}


def config(**overrides: Any) -> RunConfig:
    values: dict[str, Any] = dict(
        run_id="stack-test", min_clients=2, min_per_round=2, min_updates=1, total_rounds=3, warmup_time=0,
        max_round_train_time=30, cooldown_time=0, liveness_timeout=60, dataset_size=100,
        # no built-in task's (whose initial model's schema the config would take, `shared.initial_models`): the
        # simulated participants offer and train MODEL
        task="tests.functional.test_local_stack:MODEL",
    )
    values.update(overrides)
    return RunConfig(**values)


@pytest.fixture()
def stack() -> Iterator[LocalStack]:
    with LocalStack(config(), tick_interval=0.2, log_level="WARNING") as s:
        yield s


class Sim:
    def __init__(self, stack: LocalStack) -> None:
        c = stack.connection
        self.run_id, self.bucket = c.run_id, c.bucket
        self.s3 = boto3.client("s3", endpoint_url=c.endpoint, region_name=c.region)
        self.store = StateStore.of(c)
        self.signers: dict[str, Signer] = {}

    def put(self, key: str, body: bytes) -> None:
        signer = self.signers.setdefault(key.rsplit("/", 1)[-1], Signer.generate())
        self.s3.put_object(Bucket=self.bucket, Key=key, Body=body, Metadata=signer.metadata(key, body))

    def join(self, pid: str) -> None:
        public_key = self.signers.setdefault(pid, Signer.generate()).public_key
        body = {"run_id": self.run_id, "participant": pid, "public_key": public_key, "sent_at": time.time()}
        self.put(keys.join_key(self.run_id, pid), json.dumps(body).encode())

    def heartbeat(self, pid: str) -> None:
        body = {"participant": pid, "sent_at": time.time()}
        self.put(keys.heartbeat_key(self.run_id, pid), json.dumps(body).encode())

    def join_and_beat(self, *pids: str) -> None:
        """Join, then (once registered) send a heartbeat, as the daemon does: an epoch admits only participants
        heard from after their join."""
        for pid in pids:
            self.join(pid)
        until(lambda: set(pids) <= set(self.store.participants()))
        for pid in pids:
            self.heartbeat(pid)
        until(lambda: all(self.store.participants()[p].proven for p in pids))

    def upload(self, pid: str, round_no: int, selected: tuple[str, ...], value: float) -> None:
        meta = wire.UpdateMeta(self.run_id, round_no, pid, assigned_count(100, selected, pid), {"loss": value})
        arrays = {k: v + value for k, v in MODEL.items()}
        self.put(keys.update_key(self.run_id, round_no, pid), wire.encode(arrays, meta.to_metadata()))


def until(predicate: Callable[[], bool], timeout: float = 20.0) -> None:
    assert wait_until(predicate, timeout, 0.05), "condition not reached in time"


def test_a_run_finishes_through_queued_events_and_ticks(stack: LocalStack) -> None:
    # Given two participants that join and offer a model through S3 uploads only
    sim = Sim(stack)
    sim.join_and_beat("alice", "bob")
    sim.put(keys.init_key(sim.run_id, "alice"), wire.encode(MODEL))

    # When each selected participant uploads an update every round
    for round_no in range(3):
        until(lambda r=round_no: (s := sim.store.read_state()).phase is Phase.TRAIN and s.round == r)
        selected = sim.store.read_state().selected
        for i, pid in enumerate(selected):
            sim.upload(pid, round_no, selected, float(i + 1))

    # Then the dispatcher delivered them all and the run finished with three aggregated rounds
    until(lambda: sim.store.read_state().phase is Phase.FINISHED)
    rounds = sorted(sim.store.rounds(), key=lambda r: r.round)
    assert [r.round for r in rounds] == [0, 1, 2]
    assert all(r.aggregated and len(r.counted) == 2 for r in rounds)
    assert stack.dispatcher is not None and stack.dispatcher.stats.failed == 0
    # And ingest was invoked for the participants' uploads only, never for the objects the coordinator wrote
    # (rosters, global models, manifest, config, checkpoints: each an invocation for nothing)
    ingested = {kind for (lane, kind), _ in stack.dispatcher.stats.kinds.items() if lane == MAIN_LANE}
    assert {"heartbeat", "init", "update"} <= ingested <= set(keys.UPLOADED_KINDS), ingested
    status = collect(stack.connection)
    assert status.phase == "Finished" and status.aggregated == 3
    assert {p.pid: p.state for p in status.participants} == {"alice": "finished", "bob": "finished"}
    # And the finished run switched its tick schedule off: nothing fires while it is idle
    c = stack.connection
    events = boto3.client("events", endpoint_url=c.endpoint, region_name=c.region)
    assert events.describe_rule(Name=tick_rule_name(c.run_id))["State"] == "DISABLED"
    stats = stack.dispatcher.stats
    # (the tick that finished the run is counted when it returns, which may be after the phase is seen: the
    # ticks are made one after another, so once one is skipped the count is final)
    until(lambda: stats.ticks_skipped >= 1)
    ticked, skipped = stats.ticks, stats.ticks_skipped
    until(lambda: stats.ticks_skipped >= skipped + 5)  # five more schedule periods
    assert stats.ticks == ticked


def test_a_bad_upload_is_refused_and_shown_in_status(stack: LocalStack) -> None:
    # Given a running round
    sim = Sim(stack)
    sim.join_and_beat("alice", "bob")
    sim.put(keys.init_key(sim.run_id, "alice"), wire.encode(MODEL))
    until(lambda: sim.store.read_state().phase is Phase.TRAIN)

    # When a participant uploads something that is not a safetensors file
    sim.put(keys.update_key(sim.run_id, 0, "bob"), b"not a model")

    # Then fed status shows bob's refusal with its reason
    def refused() -> bool:
        lines = {p.pid: p for p in collect(stack.connection).participants}
        return lines["bob"].round_status == "refused"

    until(refused)
    status = collect(stack.connection)
    assert any(r.pid == "bob" and "safetensors" in r.reason for r in status.refusals)


# Each lane keeps the dispatcher's retries: a join request goes down the join lane, a heartbeat down the main one.
LANES = {"join": (keys.join_key, "join", Sim.join), "ingest": (keys.heartbeat_key, "ingest", Sim.heartbeat)}


def lane_dispatcher(stack: LocalStack, lane: str, handler: Callable[[dict[str, Any], Any], None],
                    **kwargs: Any) -> Dispatcher:
    """A dispatcher whose `lane` calls `handler`, the other lane nothing."""
    assert stack.resources is not None

    def nothing(event: dict[str, Any], context: Any) -> None:
        return None

    handlers = {"ingest": nothing, "join": nothing, lane: handler}
    return Dispatcher(stack.resources, ingest=handlers["ingest"], join=handlers["join"], **kwargs)


@pytest.mark.parametrize("lane", sorted(LANES))
def test_a_failing_delivery_is_retried(stack: LocalStack, lane: str) -> None:
    # Given a dispatcher whose handler fails the first time it sees an event of this lane
    assert stack.dispatcher is not None and stack.resources is not None
    stack.dispatcher.stop()
    seen: list[str] = []
    lock = threading.Lock()
    key_of, _, send = LANES[lane]
    carol = key_of("stack-test", "carol")

    def flaky(event: dict[str, Any], context: Any) -> None:
        key = event["detail"]["object"]["key"]
        with lock:
            if key != carol:  # e.g. the config the first tick published: not this test's object
                return
            seen.append(key)
            if len(seen) == 1:
                raise RuntimeError("transient")

    ticks: list[float] = []
    retrying = lane_dispatcher(stack, lane, flaky, tick_interval=0.1, visibility_timeout=1,
                               tick=lambda e, c: ticks.append(time.time()))
    with retrying:
        # When one object is uploaded
        send(Sim(stack), "carol")
        # Then it is delivered again after the failure, and scheduled ticks keep coming
        until(lambda: len(seen) >= 2, timeout=10)
        until(lambda: len(ticks) >= 3, timeout=5)
    assert seen[:2] == [carol, carol]
    assert retrying.stats.failed == 1


@pytest.mark.parametrize("lane", sorted(LANES))
def test_an_invocation_longer_than_the_visibility_timeout_is_not_delivered_again_meanwhile(
        stack: LocalStack, lane: str) -> None:
    # Given a dispatcher with a 1 s visibility timeout whose handler runs for 3.5 s on this test's event
    assert stack.dispatcher is not None and stack.resources is not None
    stack.dispatcher.stop()
    key_of, _, send = LANES[lane]
    carol = key_of("stack-test", "carol")
    calls: list[float] = []
    finished = threading.Event()

    def slow(event: dict[str, Any], context: Any) -> None:
        if event["detail"]["object"]["key"] != carol:
            return
        calls.append(time.monotonic())
        threading.Event().wait(3.5)  # the invocation's own length (an ingest aggregating a large model)
        finished.set()

    sqs = boto3.client("sqs", endpoint_url=stack.endpoint, region_name="us-east-1")

    def drained() -> bool:
        return all(v == "0" for url in stack.resources.queue_urls for v in sqs.get_queue_attributes(
            QueueUrl=url, AttributeNames=["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"],
        )["Attributes"].values())

    with lane_dispatcher(stack, lane, slow, tick_interval=5, visibility_timeout=1, tick=lambda e, c: None):
        # When the object is uploaded
        send(Sim(stack), "carol")
        until(finished.is_set, timeout=15)
        # Then its message is deleted once the invocation returns, and it was invoked once meanwhile (as Lambda
        # does not re-invoke a running event)
        until(drained, timeout=5)
    assert len(calls) == 1


@pytest.mark.parametrize("lane", sorted(LANES))
def test_an_event_that_keeps_failing_is_dropped_after_its_retries(stack: LocalStack, lane: str) -> None:
    # Given a dispatcher whose handler always fails for one object, and at most 2 attempts
    assert stack.dispatcher is not None and stack.resources is not None
    stack.dispatcher.stop()
    key_of, _, send = LANES[lane]
    poison = key_of("stack-test", "mallory")
    attempts: list[str] = []

    def failing(event: dict[str, Any], context: Any) -> None:
        if event["detail"]["object"]["key"] == poison:
            attempts.append(poison)
            raise RuntimeError("always")

    retrying = lane_dispatcher(stack, lane, failing, tick_interval=5, visibility_timeout=1, max_attempts=2,
                               tick=lambda e, c: None)
    with retrying:
        # When the object is uploaded
        send(Sim(stack), "mallory")
        # Then it is tried twice, then removed from its queue
        until(lambda: retrying.stats.dropped == 1, timeout=10)
    assert attempts == [poison, poison]
    sqs = boto3.client("sqs", endpoint_url=stack.endpoint, region_name="us-east-1")
    for url in stack.resources.queue_urls:
        attrs = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["All"])["Attributes"]
        assert attrs["ApproximateNumberOfMessages"] == "0" and attrs["ApproximateNumberOfMessagesNotVisible"] == "0"


def test_the_join_function_reports_a_failed_record_for_the_queue_to_deliver_again(stack: LocalStack) -> None:
    # Given the join function as the join lane's queue hands it a batch: one join request, and one record
    # whose body is no event at all
    from functions import join
    from local.context import LocalContext

    assert stack.resources is not None and stack.dispatcher is not None
    stack.dispatcher.stop()
    sim = Sim(stack)
    sim.join("dora")
    good = receive_one(stack, stack.resources.join_queue_url)["Body"]
    batch = {"Records": [{"messageId": "m-good", "body": good}, {"messageId": "m-broken", "body": "{not json"}]}
    version = sim.store.read_state().version
    # When it handles the batch
    result = join.handler(batch, LocalContext(function_name="fed-local-join"))
    # Then dora is registered (not yet heard from since), no tick ran, and only the broken record is reported
    # failed, for the queue to deliver again
    assert result == {"batchItemFailures": [{"itemIdentifier": "m-broken"}]}
    assert not sim.store.participants()["dora"].proven
    assert sim.store.read_state().version == version


def receive_one(stack: LocalStack, url: str) -> dict[str, Any]:
    sqs = boto3.client("sqs", endpoint_url=stack.endpoint, region_name="us-east-1")
    for _ in range(50):
        messages = sqs.receive_message(QueueUrl=url, MaxNumberOfMessages=1, WaitTimeSeconds=1).get("Messages", [])
        if messages:
            return dict(messages[0])
    raise AssertionError("no message arrived")
