"""The dispatcher's fault hooks (late, duplicated and racing deliveries) and the server's request counter.

These are the levers of the chaos and load tests in tests/e2e; here each is checked on its own with a
recording ingest handler, so a chaos run's figures can be trusted to mean what they say.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import boto3
import pytest

from fed.localrun import wait_until
from local.dispatcher import Delivery, Dispatcher
from local.stack import LocalStack
from shared import keys
from shared.config import RunConfig

RUN = "faults-test"


@pytest.fixture()
def stack() -> Iterator[LocalStack]:
    config = RunConfig(run_id=RUN, min_clients=2, min_per_round=1, total_rounds=1)
    with LocalStack(config, dispatch=False, count_requests=True, log_level="WARNING") as s:
        yield s


class Recorder:
    """An ingest handler that records which object keys it saw, when, and how many ran at once."""

    def __init__(self, slow: float = 0.0, fail: Callable[[str, int], bool] | None = None) -> None:
        self.seen: list[str] = []
        self.running = 0
        self.most_at_once = 0
        self.slow, self.fail = slow, fail
        self._lock = threading.Lock()

    def __call__(self, event: dict[str, Any], context: Any) -> None:
        key = event["detail"]["object"]["key"]
        if not key.startswith((keys.join_prefix(RUN), keys.run_prefix(RUN) + "heartbeat/")):
            return  # e.g. objects the stack itself wrote
        with self._lock:
            self.seen.append(key)
            n = self.seen.count(key)
            self.running += 1
            self.most_at_once = max(self.most_at_once, self.running)
        try:
            if self.slow:
                time.sleep(self.slow)  # a slow handler, so concurrent copies overlap
            if self.fail is not None and self.fail(key, n):
                raise RuntimeError("injected failure")
        finally:
            with self._lock:
                self.running -= 1


class Script:
    """A fault plan that applies a fixed Delivery to the first receipt of chosen keys."""

    def __init__(self, plans: dict[str, Delivery]) -> None:
        self.plans = plans
        self.used: set[str] = set()

    def delivery(self, event: dict[str, Any], receive_count: int) -> Delivery:
        key = event["detail"]["object"]["key"]
        if key in self.plans and key not in self.used:
            self.used.add(key)
            return self.plans[key]
        return Delivery()


def put(stack: LocalStack, name: str, key_of: Callable[[str, str], str] = keys.join_key) -> str:
    key = key_of(RUN, name)
    assert stack.resources is not None
    boto3.client("s3", endpoint_url=stack.endpoint, region_name="us-east-1").put_object(
        Bucket=stack.resources.bucket, Key=key, Body=b"{}"
    )
    return key


def dispatcher(stack: LocalStack, ingest: Recorder, plan: Script, **kwargs: Any) -> Dispatcher:
    """The recorder on both lanes (these tests' objects are join requests: the join lane)."""
    assert stack.resources is not None
    return Dispatcher(stack.resources, tick_interval=5, ingest=ingest, join=ingest, tick=lambda e, c: None,
                      faults=plan, **kwargs)


def until(predicate: Callable[[], bool], timeout: float = 15.0) -> None:
    assert wait_until(predicate, timeout, 0.05), "condition not reached in time"


def queue_empty(stack: LocalStack) -> bool:
    """Both lanes' queues."""
    assert stack.resources is not None
    sqs = boto3.client("sqs", endpoint_url=stack.endpoint, region_name="us-east-1")
    for url in stack.resources.queue_urls:
        attrs = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["All"])["Attributes"]
        if attrs["ApproximateNumberOfMessages"] != "0" or attrs["ApproximateNumberOfMessagesNotVisible"] != "0":
            return False
    return True


@pytest.mark.parametrize("key_of", [keys.join_key, keys.heartbeat_key], ids=["join lane", "main lane"])
def test_a_held_event_is_delivered_late_after_later_ones(stack: LocalStack, key_of: Callable[[str, str], str]) -> None:
    # Given a plan that holds the first object's event back for 2 seconds
    first, second = key_of(RUN, "first"), key_of(RUN, "second")
    ingest = Recorder()
    plan = Script({first: Delivery(hold=2)})
    with dispatcher(stack, ingest, plan):
        # When two objects are uploaded in order (the second once the first was received and held)
        put(stack, "first", key_of)
        until(lambda: first in plan.used)
        put(stack, "second", key_of)
        # Then the second is delivered first, and the held one still arrives, once
        until(lambda: len(ingest.seen) == 2)
        until(lambda: queue_empty(stack))
    assert ingest.seen == [second, first]


def test_copies_are_delivered_at_once_and_the_message_then_deleted(stack: LocalStack) -> None:
    # Given a plan that delivers one event to three invocations at once, and a slow handler
    key = keys.join_key(RUN, "dup")
    ingest = Recorder(slow=0.3)
    with dispatcher(stack, ingest, Script({key: Delivery(copies=3)})) as d:
        # When the object is uploaded
        put(stack, "dup")
        # Then three invocations ran concurrently, and the event is not delivered a fourth time
        until(lambda: d.stats.delivered == 1)
        until(lambda: queue_empty(stack))
    assert ingest.seen == [key] * 3 and ingest.most_at_once == 3


def test_an_event_is_delivered_again_after_it_succeeded(stack: LocalStack) -> None:
    # Given a plan that leaves a delivered event on the queue for one more delivery a second later
    key = keys.join_key(RUN, "again")
    ingest = Recorder()
    with dispatcher(stack, ingest, Script({key: Delivery(again_after=1)})) as d:
        put(stack, "again")
        # Then it is delivered twice, and then removed
        until(lambda: d.stats.delivered == 2)
        until(lambda: queue_empty(stack))
    assert ingest.seen == [key, key]


def test_receives_caused_by_faults_are_not_counted_as_failed_attempts(stack: LocalStack) -> None:
    # Given an event held back once, and a handler that fails on every delivery of it, with 2 attempts allowed
    key = keys.join_key(RUN, "held-failing")
    ingest = Recorder(fail=lambda k, n: True)
    with dispatcher(stack, ingest, Script({key: Delivery(hold=1)}), visibility_timeout=1, max_attempts=2) as d:
        put(stack, "held-failing")
        # Then it is still tried twice (the hold was no attempt) before it is dropped
        until(lambda: d.stats.dropped == 1)
    assert ingest.seen == [key, key]


def test_the_server_counts_requests_by_service_and_operation(stack: LocalStack) -> None:
    # Given the server counting requests
    assert stack.server is not None and stack.server.requests is not None and stack.resources is not None
    before = stack.server.requests.snapshot()

    # When a client puts and gets an object and reads an item
    s3 = boto3.client("s3", endpoint_url=stack.endpoint, region_name="us-east-1")
    s3.put_object(Bucket=stack.resources.bucket, Key="x", Body=b"1")
    s3.get_object(Bucket=stack.resources.bucket, Key="x")
    s3.head_object(Bucket=stack.resources.bucket, Key="x")
    ddb = boto3.client("dynamodb", endpoint_url=stack.endpoint, region_name="us-east-1")
    ddb.get_item(TableName=stack.resources.table, Key={"pk": {"S": "a"}, "sk": {"S": "b"}})

    # Then each is counted once, under its service and operation
    counted = stack.server.requests.snapshot() - before
    assert counted[("s3", "PutObject")] == 1 and counted[("s3", "GetObject")] == 1
    assert counted[("s3", "HeadObject")] == 1 and counted[("dynamodb", "GetItem")] == 1
    assert sum(counted.values()) == 4
    # and another process can read the counts from the endpoint, without that read being counted
    with urllib.request.urlopen(f"{stack.endpoint}/_fed/requests", timeout=10) as resp:  # noqa: S310 - loopback
        served = {(svc, op): n for svc, op, n in json.loads(resp.read())}
    assert served == dict(stack.server.requests.snapshot())
    assert stack.server.requests.snapshot() == served
