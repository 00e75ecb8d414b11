"""The local stand-in for Lambda's triggers: deliver queued S3 events to `ingest` and `join`, scheduled ticks to `tick`.

On AWS, EventBridge invokes the ingest function for every "Object Created" event of a participant's upload but
join requests (the main lane; the coordinator's own objects go nowhere), sends join requests to a queue that the
join function drains at a bounded concurrency (the join lane), and a schedule invokes the tick function every
minute. Locally the same two rules target two SQS queues; the dispatcher long-polls each with its own workers
(`workers` for the main lane, `join_workers` for the join lane, so a backlog of joins never occupies a worker
heartbeats and updates need) and hands each envelope (the message body is exactly the EventBridge event) to the
very same handler, on thread pools so that deliveries race as Lambda invocations do. A message is deleted only after
its handler returned; a handler that raises leaves it on the queue, and it is delivered again once its
visibility timeout passes (Lambda's retry of a failed async invocation, or the join queue's redelivery).
While a handler runs, its message's visibility is extended, so a long invocation (an ingest that aggregates a
large model) is not delivered a second time meanwhile; a dispatcher that dies stops extending, and its
messages come back within one visibility timeout.

A `FaultPlan` (tests, chaos runs) can make the dispatcher misbehave as EventBridge and Lambda are allowed
to: deliver an event late (hold it back in the queue, so later events overtake it), deliver it to two
invocations at once, or deliver it again a while after it succeeded.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol

import boto3
from botocore.config import Config

from local.context import LocalContext
from local.invocations import Handler, LocalFunctions
from local.resources import LocalResources
from shared import keys
from shared.naming import tick_rule_name
from store.schedule import Schedule
from store.trace import acting_as, function

FUNCTION_TICK, FUNCTION_INGEST, FUNCTION_JOIN = function("tick"), function("ingest"), function("join")
FUNCTION_SHARD = function("shard")

log = logging.getLogger("fed.local.dispatcher")

MAIN_LANE, JOIN_LANE, SHARD_LANE = "ingest", "join", "shard"


def scheduled_event(region: str, rule: str, at: float | None = None) -> dict[str, Any]:
    """An EventBridge "Scheduled Event", as the tick schedule delivers it on AWS."""
    when = datetime.fromtimestamp(time.time() if at is None else at, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "version": "0",
        "id": str(uuid.uuid4()),
        "detail-type": "Scheduled Event",
        "source": "aws.events",
        "account": "123456789012",
        "time": when,
        "region": region,
        "resources": [f"arn:aws:events:{region}:123456789012:rule/{rule}"],
        "detail": {},
    }


def _polling_as(lane: Lane) -> contextlib.AbstractContextManager[None]:
    return acting_as(lane.polls_as) if lane.polls_as else contextlib.nullcontext()


def _object_key(event: Any) -> str:
    """The key an "Object Created" event announces ("" where it names none)."""
    try:
        return str(event["detail"]["object"]["key"])
    except (KeyError, TypeError):
        return ""


@dataclass(frozen=True)
class Delivery:
    """What to do with one received message. The default: deliver it once, then delete it."""

    hold: int = 0  # > 0: deliver nothing now; the message becomes visible again after this many seconds
    copies: int = 1  # deliver it to this many invocations at once (duplicate events racing each other)
    again_after: int = 0  # > 0: after delivering, leave it queued: it is delivered again after this many seconds


DELIVER_ONCE = Delivery()


class FaultPlan(Protocol):
    """Consulted for every received message; what it returns is carried out (see `Delivery`)."""

    def delivery(self, event: dict[str, Any], receive_count: int) -> Delivery: ...


# One invocation: the function (its local name), the object key its event announced ("" for a scheduled tick or a
# shard task), and when it began and ended (epoch seconds)
Span = tuple[str, str, float, float]


@dataclass
class DispatchStats:
    """What the dispatcher has done so far (read by tests and `fed local`'s shutdown line)."""

    delivered: int = 0  # both lanes
    joins_delivered: int = 0  # of which by the join lane
    failed: int = 0
    dropped: int = 0  # events given up on after max_attempts failed deliveries
    ticks: int = 0
    ticks_skipped: int = 0  # scheduled ticks not made: the run had switched its schedule off (idle)
    tick_failures: int = 0
    errors: list[str] = field(default_factory=list)
    # Events delivered, by lane and by the kind of object they announce ("layout": a key outside the layout): what
    # each function was invoked for (`shared.keys.UPLOADED_KINDS` only, if the rules route as they should)
    kinds: Counter[tuple[str, str]] = field(default_factory=Counter)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, name: str, error: str = "") -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + 1)
            if error:
                self.errors.append(error)
                del self.errors[:-20]  # the last few are enough to diagnose

    def delivered_kind(self, lane: str, key: str) -> None:
        try:
            kind = keys.parse_key(key).kind.value
        except keys.KeyError_:
            kind = "layout"
        with self._lock:
            self.kinds[lane, kind] += 1


@dataclass
class Lane:
    """One queue, its workers and the handler its events go to."""

    name: str
    queue_url: str
    workers: int
    function: str  # the Lambda function it stands in for (the invocation context's name)
    handler: Handler | None = None
    principal: str = ""  # whom the handler runs as (its role on AWS: `store.trace`)
    polls_as: str | None = None  # whom its queue is polled as: on AWS, an event source mapping uses the function's role
    faulty: bool = True  # whether the fault plan applies (it stands for EventBridge's and Lambda's liberties with
    # uploads' events; the shard queue is the coordinator's own)
    slots: threading.Semaphore = field(init=False, repr=False)
    delivering: threading.Event = field(default_factory=threading.Event, repr=False)
    pool: ThreadPoolExecutor | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"the {self.name} lane needs at least one worker")
        self.slots = threading.Semaphore(self.workers)


def invoke(lane: Lane, event: dict[str, Any], copies: int) -> None:
    """Call the lane's handler with the event in `copies` invocations at once; raise the first failure."""
    handler = lane.handler
    assert handler is not None
    if copies <= 1:
        with acting_as(lane.principal):
            handler(event, LocalContext(function_name=lane.function))
        return
    errors: list[BaseException] = []

    def one() -> None:
        try:
            with acting_as(lane.principal):
                handler(event, LocalContext(function_name=lane.function))
        except BaseException as exc:  # re-raised in the delivering thread
            errors.append(exc)

    extra = [threading.Thread(target=one, name="ingest-duplicate", daemon=True) for _ in range(copies - 1)]
    for t in extra:
        t.start()
    one()
    for t in extra:
        t.join()
    if errors:
        raise errors[0]


class InFlight:
    """The messages being delivered, as Lambda's poller keeps them: invisible while their invocation runs (extended
    every third of the visibility timeout), deleted once it returned, left for redelivery otherwise. Receives the
    fault plan caused (a hold, a duplicate later) are counted apart, so they are not taken for failed attempts."""

    def __init__(self, sqs: Any, visibility_timeout: int) -> None:
        self._sqs = sqs
        self.visibility_timeout = visibility_timeout
        self._injected: dict[str, int] = {}  # message id -> receives caused by the fault plan, not by failures
        self._injected_lock = threading.Lock()
        self._running: dict[str, tuple[Lane, str, float]] = {}  # message id -> lane, receipt, monotonic start
        self._running_lock = threading.Lock()  # also held while their visibility is extended

    def begin(self, lane: Lane, message: dict[str, Any]) -> int:
        """Track a message whose delivery starts; which attempt of its event this is (fault-plan receives aside)."""
        with self._running_lock:
            self._running[message.get("MessageId", "")] = (lane, message["ReceiptHandle"], time.monotonic())
        received = int(message.get("Attributes", {}).get("ApproximateReceiveCount", "1"))
        with self._injected_lock:
            return received - self._injected.get(message.get("MessageId", ""), 0)

    def done(self, message: dict[str, Any]) -> None:
        """Stop extending the message's visibility (before anything else changes it)."""
        with self._running_lock:
            self._running.pop(message.get("MessageId", ""), None)

    def extend_due(self) -> None:
        """Extend the visibility of every message running for a third of the timeout or more."""
        period = max(0.2, self.visibility_timeout / 3)
        with self._running_lock:
            for lane, receipt, began in list(self._running.values()):
                if time.monotonic() - began >= period:
                    try:
                        with _polling_as(lane):
                            self._sqs.change_message_visibility(QueueUrl=lane.queue_url, ReceiptHandle=receipt,
                                                                VisibilityTimeout=self.visibility_timeout)
                    except Exception as exc:  # it may come back while running: ingest is idempotent
                        log.warning("could not extend a running message's visibility: %s", exc)

    def requeue(self, lane: Lane, message: dict[str, Any], seconds: int) -> None:
        """Leave a message on the queue, visible again in `seconds`; the receive this causes is no retry."""
        self.done(message)
        with self._injected_lock:
            mid = message.get("MessageId", "")
            self._injected[mid] = self._injected.get(mid, 0) + 1
        try:
            with _polling_as(lane):
                self._sqs.change_message_visibility(
                    QueueUrl=lane.queue_url, ReceiptHandle=message["ReceiptHandle"], VisibilityTimeout=seconds
                )
        except Exception as exc:  # it comes back after the visibility timeout anyway
            log.warning("could not requeue a message: %s", exc)

    def delete(self, lane: Lane, message: dict[str, Any]) -> None:
        self.done(message)
        with self._injected_lock:
            self._injected.pop(message.get("MessageId", ""), None)
        try:
            with _polling_as(lane):
                self._sqs.delete_message(QueueUrl=lane.queue_url, ReceiptHandle=message["ReceiptHandle"])
        except Exception as exc:  # a duplicate delivery later is harmless: ingest is idempotent
            log.warning("could not delete a delivered message: %s", exc)


class Dispatcher:
    """Poll the run's two queues and the clock; call the handlers. `start()` / `stop()`; a context manager."""

    def __init__(
        self,
        resources: LocalResources,
        tick_interval: float = 1.0,
        workers: int = 3,
        visibility_timeout: int = 15,
        max_attempts: int = 3,
        poll_wait: int = 1,
        ingest: Handler | None = None,
        tick: Handler | None = None,
        faults: FaultPlan | None = None,
        join_workers: int = 1,
        join: Handler | None = None,
        shard_workers: int | None = None,
        record_spans: bool = False,
    ) -> None:
        """`ingest` and `join` take one "Object Created" event each (default: the ingest function, and the join
        function given it as a batch of one); `faults` applies to both lanes. The shard lane delivers the shard
        queue's tasks to the shard-worker function on `shard_workers` worker processes (default: one a core; 0: no
        shard lane, for functions whose environment names no shard queue: their ticks aggregate on their own
        threads). With `record_spans`, every invocation is kept in `spans` (`make bench-rounds` times a round's
        steps with them)."""
        if tick_interval <= 0:
            raise ValueError("tick_interval must be positive")
        self.resources = resources
        self.tick_interval = tick_interval
        self.workers = workers
        self.join_workers = join_workers
        self.visibility_timeout = visibility_timeout
        self.max_attempts = max_attempts
        self.poll_wait = poll_wait
        self._tick = tick
        self.functions = LocalFunctions(shard_workers)
        # The main lane stands in for EventBridge invoking ingest (AWS's own doing); the join lane for the join
        # function's event source mapping, which polls the join queue with the join function's role.
        self.lanes = [Lane(MAIN_LANE, resources.queue_url, workers, "fed-local-ingest", ingest,
                           principal=FUNCTION_INGEST)]
        if resources.join_queue_url:
            self.lanes.append(Lane(JOIN_LANE, resources.join_queue_url, join_workers, "fed-local-join", join,
                                   principal=FUNCTION_JOIN, polls_as=FUNCTION_JOIN))
        if resources.shard_queue_url and self.functions.shards is not None:
            self.lanes.append(Lane(SHARD_LANE, resources.shard_queue_url, self.functions.shards.workers,
                                   "fed-local-shard", principal=FUNCTION_SHARD, polls_as=FUNCTION_SHARD, faulty=False))
        self.faults = faults
        self.stats = DispatchStats()
        self.spans: list[Span] | None = [] if record_spans else None
        self._stop = threading.Event()
        self._tick_lock = threading.Lock()  # held by each tick, and by `release` while held joins are drained
        self._threads: list[threading.Thread] = []
        self._sqs = boto3.client(
            "sqs",
            endpoint_url=resources.endpoint,
            region_name=resources.region,
            config=Config(retries={"max_attempts": 4, "mode": "standard"}, read_timeout=poll_wait + 10,
                          max_pool_connections=max(10, workers + join_workers + 4)),
        )
        self.in_flight = InFlight(self._sqs, visibility_timeout)

    # --- lifecycle -------------------------------------------------------------------------------------

    def start(self, deliver: bool = True) -> Dispatcher:
        """Start ticking, and delivering queued events unless `deliver` is False (then: `release()`)."""
        defaults = {MAIN_LANE: self.functions.ingest, JOIN_LANE: self.functions.join, SHARD_LANE: self.functions.shard}
        for lane in self.lanes:
            lane.handler = lane.handler or defaults[lane.name]()
        self._tick = self._tick or self.functions.tick()
        self._stop.clear()
        for lane in self.lanes:
            lane.delivering.clear()
            if deliver or lane.name == SHARD_LANE:  # held: the uploads' events, not the ticks' own shards
                lane.delivering.set()
        self._threads = [threading.Thread(target=self._tick_loop, name="dispatch-tick", daemon=True),
                         threading.Thread(target=self._extend_loop, name="dispatch-extend", daemon=True)]
        for lane in self.lanes:
            lane.pool = ThreadPoolExecutor(lane.workers, thread_name_prefix=lane.name)
            self._threads.append(
                threading.Thread(target=self._poll_loop, args=(lane,), name=f"dispatch-poll-{lane.name}", daemon=True)
            )
        for t in self._threads:
            t.start()
        return self

    def release(self, joins_first: float = 30.0) -> None:
        """Begin delivering the events held back by `start(deliver=False)`; they wait in the queue till then.

        The held join requests go first, with ticks paused (after the one in flight, if any) until the join
        queue is drained or `joins_first` seconds pass: everyone who asked to join while events were held is
        registered (and proven live by the heartbeat it sent meanwhile) before a tick can start the first
        epoch, so that epoch admits them all instead of whoever the join lane happened to register first."""
        with self._tick_lock:
            for lane in self.lanes:
                if lane.name == JOIN_LANE:
                    lane.delivering.set()
                    deadline = time.monotonic() + joins_first
                    while self._queued(lane) and time.monotonic() < deadline and not self._stop.wait(0.1):
                        pass
            for lane in self.lanes:
                lane.delivering.set()

    def _queued(self, lane: Lane) -> int:
        """Messages in a lane's queue, visible or in flight (0 once it is drained)."""
        attrs = self._sqs.get_queue_attributes(
            QueueUrl=lane.queue_url,
            AttributeNames=["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"],
        )["Attributes"]
        return sum(int(v) for v in attrs.values())

    def stop(self, timeout: float = 15.0) -> None:
        """Stop polling and ticking; wait for deliveries in flight (undelivered messages stay queued)."""
        self._stop.set()
        for t in self._threads:
            t.join(timeout)
        for lane in self.lanes:
            if lane.pool is not None:
                lane.pool.shutdown(wait=True, cancel_futures=True)
                lane.pool = None
        self._threads = []
        self.functions.close()

    def __enter__(self) -> Dispatcher:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- ingest ------------------------------------------------------------------------------------------

    def _poll_loop(self, lane: Lane) -> None:
        while not self._stop.is_set():
            if not lane.delivering.wait(0.2):
                continue
            free = self._acquire_slots(lane)
            if not free:
                continue
            try:
                messages = self._receive(lane, free)
            except Exception as exc:  # the server going away at shutdown, or a transient error
                self._release(lane, free)
                if not self._stop.is_set():
                    log.warning("receiving from the %s queue failed: %s", lane.name, exc)
                    self._stop.wait(0.5)
                continue
            self._release(lane, free - len(messages))
            for message in messages:
                assert lane.pool is not None
                lane.pool.submit(self._deliver, lane, message)

    def _acquire_slots(self, lane: Lane) -> int:
        """Wait for one free worker, then take every free one: never receive more than can run now."""
        if not lane.slots.acquire(timeout=0.2):
            return 0
        taken = 1
        while taken < min(lane.workers, 10) and lane.slots.acquire(blocking=False):
            taken += 1
        return taken

    def _release(self, lane: Lane, n: int) -> None:
        for _ in range(n):
            lane.slots.release()

    def _receive(self, lane: Lane, most: int) -> list[dict[str, Any]]:
        with _polling_as(lane):
            return self._receive_now(lane, most)

    def _receive_now(self, lane: Lane, most: int) -> list[dict[str, Any]]:
        resp = self._sqs.receive_message(
            QueueUrl=lane.queue_url,
            MaxNumberOfMessages=most,
            WaitTimeSeconds=self.poll_wait,
            VisibilityTimeout=self.visibility_timeout,
            AttributeNames=["ApproximateReceiveCount"],
        )
        return list(resp.get("Messages", []))

    def _extend_loop(self) -> None:
        """Keep the messages of long invocations invisible (as Lambda does not re-invoke a running event)."""
        while not self._stop.wait(max(0.2, self.visibility_timeout / 3)):
            self.in_flight.extend_due()

    def _deliver(self, lane: Lane, message: dict[str, Any]) -> None:
        attempt = self.in_flight.begin(lane, message)
        try:
            self._deliver_running(lane, message, attempt)
        finally:
            self.in_flight.done(message)

    def _deliver_running(self, lane: Lane, message: dict[str, Any], attempt: int) -> None:
        received = int(message.get("Attributes", {}).get("ApproximateReceiveCount", "1"))
        plan = DELIVER_ONCE
        try:
            event = json.loads(message["Body"])
            if self.faults is not None and lane.faulty:
                plan = self.faults.delivery(event, received)
            if plan.hold > 0:
                self.in_flight.requeue(lane, message, plan.hold)  # late: later events overtake it
                return
            began = time.time()
            try:
                invoke(lane, event, plan.copies)
            finally:
                if self.spans is not None:
                    self.spans.append((lane.function, _object_key(event), began, time.time()))
        except Exception as exc:
            self.in_flight.done(message)
            self.stats.add("failed", f"{lane.name}: {type(exc).__name__}: {exc}")
            if attempt < self.max_attempts:
                # Left on the queue: delivered again after the visibility timeout, as Lambda retries.
                log.exception("%s failed (attempt %d of %d); the event will be delivered again",
                              lane.name, attempt, self.max_attempts)
            else:
                # Lambda gives up on an async event after its retries (to a dead-letter queue, if any).
                log.exception("%s failed %d times; the event is dropped: %s", lane.name, attempt,
                              message["Body"][:500])
                self.stats.add("dropped")
                self.in_flight.delete(lane, message)
        else:
            if plan.again_after > 0:
                # delivered again later: an at-least-once duplicate
                self.in_flight.requeue(lane, message, plan.again_after)
            else:
                self.in_flight.delete(lane, message)
            self.stats.add("delivered")
            self.stats.delivered_kind(lane.name, _object_key(event))
            if lane.name == JOIN_LANE:
                self.stats.add("joins_delivered")
        finally:
            lane.slots.release()

    # --- ticks -------------------------------------------------------------------------------------------

    def _tick_loop(self) -> None:
        rule = tick_rule_name(self.resources.run_id)
        schedule = Schedule(rule, boto3.client("events", endpoint_url=self.resources.endpoint,
                                               region_name=self.resources.region))
        next_at = time.monotonic()
        while not self._stop.is_set():
            try:
                with self._tick_lock:
                    self._scheduled_tick(schedule, rule)
            except Exception as exc:
                self.stats.add("tick_failures", f"tick: {type(exc).__name__}: {exc}")
                log.exception("scheduled tick failed; the next one will try again")
            next_at = max(next_at + self.tick_interval, time.monotonic())
            self._stop.wait(max(0.0, next_at - time.monotonic()))

    def _scheduled_tick(self, schedule: Schedule, rule: str) -> None:
        assert self._tick is not None
        if schedule.enabled() is False:  # switched off by the run (finished, or paused): like EventBridge
            self.stats.add("ticks_skipped")
            return
        began = time.time()
        with acting_as(FUNCTION_TICK):
            self._tick(scheduled_event(self.resources.region, rule), LocalContext(function_name="fed-local-tick"))
        if self.spans is not None:
            self.spans.append(("fed-local-tick", "", began, time.time()))
        self.stats.add("ticks")
