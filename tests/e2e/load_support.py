"""Lightweight simulated participants for the load test: the daemon's protocol without torch.

Each `SimParticipant` runs in a thread of the test process and runs the participant's own protocol loop
(`participant.protocol.Participant`, the daemon's base class): the same decisions (`participant.decide.decide`),
the same reads before each decision (run state; its own record until its join is recorded, while it is not a
member, and during warmup; its update record while its upload is pending), the same re-sends and the same
polling backoff. Its own are the writes (signed join, heartbeat, initial-model offer, ready report, update) and
the training, a numpy stand-in on a tiny model; it does no witness duty (the load test's run elects no
witnesses). Every request the participants send is counted by service and operation with botocore event hooks.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import select
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import boto3
import numpy as np
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from local.resources import LocalResources
from local.server import RemoteCounter
from local.stack import client_environment, function_environment
from participant.decide import (
    JOIN_RETRY_SECONDS,
    READY_RETRY_SECONDS,
    Fetch,
    Finish,
    Local,
    Train,
    Wait,
    heartbeat_due,
    next_heartbeat,
)
from participant.journal import Journal, JournalKeeper
from participant.protocol import Participant, ParticipantExit, closed_while_training
from participant.remote import Retrier, Stopped
from shared import keys, wire
from shared.config import RunConfig
from shared.messages import Heartbeat, JoinRequest
from shared.selection import assigned_count
from shared.signing import Signer
from shared.state import Phase, RunState
from shared.table_keys import STATE_SK, participant_sk, run_pk, update_sk
from store.blobs import Bucket
from store.connection import Connection
from store.push import LONG_POLL_SECONDS, Pushed, StateQueue
from store.rosters import Rosters, state_of_item
from store.views import ParticipantRecord, UpdateRecord
from tests.e2e.chaos_support import DispatcherPlan, DispatcherProcess, child_process


@contextmanager
def stack_process(config: RunConfig, log: Path, monkeypatch: Any) -> Iterator[StackProcess]:
    """The server in its own process; this process (and a dispatcher it starts) get the functions'
    environment, with the functions logging at WARNING."""
    server = StackProcess(config, log)
    try:
        for name, value in {**client_environment(), **function_environment(server.resources, config,
                                                                              "WARNING")}.items():
            monkeypatch.setenv(name, value)
        yield server
    finally:
        server.stop()


class StackProcess:
    """The local stack's server in a process of its own (tests/e2e/stack_process.py), counting requests."""

    def __init__(self, config: RunConfig, log: Path, timeout: float = 60.0) -> None:
        cmd = [sys.executable, "-m", "tests.e2e.stack_process", "--config", config.model_dump_json()]
        self.process = child_process(cmd, log)
        assert self.process.stdout is not None
        ready, _, _ = select.select([self.process.stdout], [], [], timeout)
        line = self.process.stdout.readline() if ready else b""
        if not line:
            self.stop()
            raise RuntimeError(f"the stack process did not start; see {log}")
        self.resources = LocalResources(**json.loads(line)["resources"])
        assert self.resources.endpoint is not None
        self.endpoint: str = self.resources.endpoint
        self.connection = Connection(self.resources.run_id, self.resources.bucket, self.resources.table,
                                     self.resources.endpoint, self.resources.region,
                                     state_topic=self.resources.state_topic)

    def requests(self) -> Counter[tuple[str, str]]:
        """Every request the server has served so far, by (service, operation)."""
        return RemoteCounter(self.endpoint).snapshot()

    def objects(self) -> Counter[tuple[str, str]]:
        """Every S3 object request the server has served so far, by (operation, the object's kind)."""
        return RemoteCounter(self.endpoint).objects()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def tiny_model(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"dense.weight": rng.normal(0, 0.1, (16, 8)).astype(np.float32), "dense.bias": np.zeros(8, np.float32)}


class RequestCounter:
    """Counts the HTTP requests sent through the clients it is attached to, by (service, operation) and by
    the phase the sending participant believed the run was in."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts: Counter[tuple[str, str]] = Counter()
        self.by_phase: Counter[str] = Counter()
        self.by_phase_service: Counter[tuple[str, str]] = Counter()
        self.phase = threading.local()
        # Long polls that ended with nothing delivered: the requests that grow with the time a participant waits
        # (a round's length), where every other request is one per thing done
        self.empty_receives = 0

    def attach(self, client: Any) -> Any:
        client.meta.events.register("before-send", self._count)
        client.meta.events.register("after-call.sqs.ReceiveMessage", self._received)
        return client

    def _received(self, parsed: dict[str, Any], **_: Any) -> None:
        if not parsed.get("Messages"):
            with self._lock:
                self.empty_receives += 1

    def _count(self, event_name: str, **_: Any) -> None:
        _, service, operation = event_name.split(".", 2)  # before-send.<service>.<Operation>
        phase = getattr(self.phase, "name", "setup")
        service = service.lower().replace("-", "")
        with self._lock:
            self.counts[(service, operation)] += 1
            self.by_phase[phase] += 1
            self.by_phase_service[(phase, service)] += 1

    def snapshot(self) -> Counter[tuple[str, str]]:
        with self._lock:
            return Counter(self.counts)


class _Gated:
    """A botocore HTTP session that sends at most as many requests at once as its semaphore allows."""

    def __init__(self, session: Any, gate: threading.Semaphore) -> None:
        self.session, self.gate = session, gate

    def send(self, request: Any) -> Any:
        with self.gate:
            return self.session.send(request)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.session, name)


class Clients:
    """One S3, DynamoDB, SNS and SQS client shared by all simulated participants (botocore clients are
    thread-safe; the requests are the same as with a client each).

    Their S3, DynamoDB and SNS requests are sent at most `in_flight` at a time, the rest waiting in this process:
    a thousand participants on a thousand hosts do not share a server, but here they share one Python process
    serving one request at a time under its interpreter lock. Left unbounded, a burst (a thousand fetches of the
    global at an epoch's start) put ~800 requests in the server at once, each a thread contending for that lock:
    the server slowed until requests timed out, were sent again and added to the pile (load average 140-450,
    admission taking 800 s instead of 320, heartbeats not arriving in time, a member dropped as silent). Waiting
    here costs no timeout; the server serves as fast as it can either way. The long polls (SQS) are not bounded:
    each waits, holding a connection, for a push (the local server lets them sleep until one comes:
    local/moto/sqs.py)."""

    def __init__(self, conn: Connection, counter: RequestCounter, pool: int = 256, in_flight: int = 64) -> None:
        config = Config(retries={"max_attempts": 8, "mode": "standard"}, max_pool_connections=max(pool, in_flight),
                        s3={"addressing_style": "path"})
        gate = threading.BoundedSemaphore(in_flight)
        self.s3 = self._gated(counter.attach(boto3.client("s3", endpoint_url=conn.endpoint,
                                                          region_name=conn.region, config=config)), gate)
        self.ddb = self._gated(counter.attach(boto3.client("dynamodb", endpoint_url=conn.endpoint,
                                                           region_name=conn.region, config=config)), gate)
        # (every participant holds a 20 s long poll open at once: a connection each)
        listen = Config(retries={"max_attempts": 8, "mode": "standard"}, max_pool_connections=max(pool, 1100),
                        read_timeout=LONG_POLL_SECONDS + 10)
        self.sqs = counter.attach(boto3.client("sqs", endpoint_url=conn.endpoint, region_name=conn.region,
                                               config=listen))
        self.sns = self._gated(counter.attach(boto3.client("sns", endpoint_url=conn.endpoint,
                                                           region_name=conn.region, config=config)), gate)

    @staticmethod
    def _gated(client: Any, gate: threading.Semaphore) -> Any:
        endpoint = client._endpoint  # noqa: SLF001 - the one place botocore sends a request from
        endpoint.http_session = _Gated(endpoint.http_session, gate)
        return client


class SimRemote:
    """A simulated participant's requests, through the shared clients: the reads `participant.protocol` needs
    (what `participant.remote.Remote` does for the daemon) and its uploads, each retried as the daemon retries
    (`participant.remote.Retrier`: a request the overloaded local server did not answer in time is sent again)."""

    def __init__(self, pid: str, conn: Connection, clients: Clients, signer: Signer, stop: threading.Event) -> None:
        """`stop`: set, every request still being retried gives up (raises `participant.remote.Stopped`)."""
        self.pid, self.conn, self.run_id = pid, conn, conn.run_id
        self.s3, self.ddb = clients.s3, clients.ddb
        self.signer = signer
        self.rosters = Rosters(Bucket(conn.bucket, clients.s3), conn.run_id)  # its own: each host reads its own
        self.retry = Retrier(stop)

    def put(self, key: str, body: bytes) -> None:
        self.retry.call(f"uploading {key}", self._put_once, key, body)

    def put_fresh(self, key: str, body: Callable[[], dict[str, Any]]) -> None:
        """A message that says when it was sent, built anew for each attempt (`Remote.put_fresh_json`)."""
        self.retry.call(f"uploading {key}", lambda: self._put_once(key, json.dumps(body(), sort_keys=True).encode()))

    def _put_once(self, key: str, body: bytes) -> None:
        self.s3.put_object(Bucket=self.conn.bucket, Key=key, Body=body, Metadata=self.signer.metadata(key, body))

    def get(self, key: str) -> bytes | None:
        def read() -> bytes | None:
            try:
                return bytes(self.s3.get_object(Bucket=self.conn.bucket, Key=key)["Body"].read())
            except self.s3.exceptions.NoSuchKey:
                return None

        return self.retry.call(f"reading {key}", read)

    def _item(self, sk: str) -> dict[str, Any] | None:
        resp = self.retry.call(f"reading {sk}", self.ddb.get_item, TableName=self.conn.table,
                               Key={"pk": {"S": run_pk(self.run_id)}, "sk": {"S": sk}}, ConsistentRead=True)
        return resp.get("Item")

    def read_state(self) -> RunState:
        item = self._item(STATE_SK)
        if item is None:
            return RunState(self.run_id)
        return state_of_item(json.loads(item["body"]["S"]), int(item["version"]["N"]), self.rosters)

    def pushed_state(self, pushed: Pushed) -> RunState:
        return self.retry.call("reading the roster", state_of_item, pushed.body, pushed.version, self.rosters,
                               pushed.roster)

    def read_config(self) -> RunConfig | None:
        data = self.get(keys.config_key(self.run_id))  # published by the coordinator's first tick
        return RunConfig.model_validate_json(data) if data is not None else None

    def participant_record(self) -> ParticipantRecord | None:
        item = self._item(participant_sk(self.pid))
        if item is None:
            return None
        return ParticipantRecord(self.pid, joined_at=float(item["joined_at"]["N"]),
                                 last_seen=float(item.get("last_seen", {}).get("N", 0)),
                                 ready_epoch=int(item.get("ready_epoch", {}).get("N", 0)),
                                 last_sent=float(item.get("last_sent", {}).get("N", 0)))

    def update_record(self, round_no: int) -> UpdateRecord | None:
        item = self._item(update_sk(round_no, self.pid))
        if item is None:
            return None
        return UpdateRecord(round_no, self.pid, key=item.get("key", {}).get("S", ""),
                            accepted=bool(item["accepted"]["BOOL"]), reason=item.get("reason", {}).get("S", ""))

    def update_stored(self, round_no: int, since: float | None = None) -> bool:
        key = keys.update_key(self.run_id, round_no, self.pid)
        try:
            head = self.s3.head_object(Bucket=self.conn.bucket, Key=key)
        except self.s3.exceptions.ClientError:
            return False
        modified = head.get("LastModified")
        return since is None or modified is None or modified.timestamp() >= math.floor(since)


class SimParticipant(Participant):
    """One simulated `fed-participant start`: the daemon's protocol loop (`participant.protocol.Participant`)
    with a numpy stand-in for training and no witness duty. `join_retry` and `ready_retry` are how long it
    waits before re-sending an unrecorded join request or ready report (the daemon: JOIN_RETRY_SECONDS and
    READY_RETRY_SECONDS of participant.decide); `poll_max` is its --poll-max."""

    def __init__(self, pid: str, conn: Connection, clients: Clients, counter: RequestCounter, dataset_size: int,
                 poll_max: float = 2.0, timeout: float = 600.0, join_retry: float = JOIN_RETRY_SECONDS,
                 ready_retry: float = READY_RETRY_SECONDS, heartbeat_every: float = 0.0,
                 heartbeat_after_update: float = 0.0, train_seconds: float = 0.0, push: bool = True) -> None:
        """`heartbeat_every` > 0: heartbeat on a thread of its own every that many seconds and not within
        `heartbeat_after_update` of an update upload, as the daemon does (its run config's figures; 0: once at
        start only, which a run with a long liveness timeout needs); `train_seconds`: how long a
        round's training takes (the numpy stand-in itself is instant); `push`: listen on a push queue of its own
        (as the daemon does where the run has a state topic), else poll the state."""
        self.signer = Signer.generate()
        self.stopped = threading.Event()  # `stop()`: the test is over, whatever state the run is in
        self.remote = SimRemote(pid, conn, clients, self.signer, self.stopped)
        super().__init__(pid, conn.run_id, self.remote, JournalKeeper(Journal(conn.run_id, pid)), poll_max,
                         rng=random.Random(pid))
        self.conn = conn
        self.dataset_size = dataset_size
        self.held_data = b""  # the global model held, as bytes (the simulation keeps no files)
        # decide() compares ages with the daemon's constants: scale the ages so they trip at our retry times
        self.join_scale, self.ready_scale = JOIN_RETRY_SECONDS / join_retry, READY_RETRY_SECONDS / ready_retry
        self.counter = counter
        self.timeout, self.deadline = timeout, math.inf
        self.sent: dict[int, bytes] = {}
        self.error: BaseException | None = None
        self.finished_digest = ""
        self.actions: Counter[str] = Counter()  # what it sent, by kind (joins and ready reports are re-sent)
        self.heartbeat_every, self.train_seconds = heartbeat_every, train_seconds
        self.heartbeat_after_update = heartbeat_after_update
        self.ready_epoch = 0  # what its heartbeats say (the last epoch it reported ready for)
        self._beats_stop = threading.Event()
        self.clients, self.push = clients, push
        self.update_sent_at = -math.inf  # as the daemon's: no heartbeat within an interval of an update upload
        self.doing = "starting"  # what it is doing or waiting for (a stalled run's report names it)

    @property
    def uploaded(self) -> dict[int, str]:
        """round -> the digest of our update."""
        return {r: str(entry["digest"]) for r, entry in self.journal.uploaded.items()}

    @property
    def outcomes(self) -> dict[int, str]:
        return self.journal.outcomes

    def read_state(self) -> RunState:
        return self.remote.read_state()

    def run(self, start_after: float = 0.0) -> None:
        """The daemon's life, started `start_after` seconds from now (hosts do not start in the same instant)."""
        try:
            if self.stopped.wait(start_after):
                return
            self.counter.phase.name = "setup"
            self._join()
            self._wait_for_config()
            if self.push:
                self.feed = self.remote.retry.call("opening the push queue", StateQueue.open, self.run_id, self.pid,
                                                   self.conn.state_topic, self.clients.sqs, self.clients.sns)
            self._beat(0)  # the daemon's heartbeat thread beats once at start (then every heartbeat_every)
            if self.heartbeat_every > 0:
                threading.Thread(target=self._heartbeats, name=f"{self.pid}-heartbeat", daemon=True).start()
            self.deadline = time.monotonic() + self.timeout
            self._loop()
        except Stopped:  # the test ended it
            pass
        except BaseException as exc:  # reported by the test (and at once: a long run shows its first failure early)
            self.error = exc
            print(f"  {self.pid} failed: {type(exc).__name__}: {exc}", flush=True)
        finally:
            self._beats_stop.set()

    def stop(self) -> None:
        """End this participant's thread soon, wherever it is (a request being retried, a pause, a long poll's end)."""
        self.stopped.set()
        self._beats_stop.set()

    def _heartbeats(self) -> None:
        """The daemon's heartbeat thread: every `heartbeat_every` seconds (jittered as the daemon's), until done."""
        last = time.monotonic()  # (run() beat once at start)
        while True:
            jitter = random.uniform(0.9, 1.0)
            due = next_heartbeat(last, self.update_sent_at, self.heartbeat_every * jitter,
                                 self.heartbeat_after_update * jitter)
            if self._beats_stop.wait(max(0.0, due - time.monotonic())):
                return
            try:
                if heartbeat_due(time.monotonic(), self.update_sent_at, self.heartbeat_after_update * 0.9):
                    self._beat(self.ready_epoch)
                    last = time.monotonic()
            except Exception:  # as the daemon's: a failed heartbeat never ends the thread
                last = time.monotonic()

    # --- the protocol loop's hooks ------------------------------------------------------------------

    def _listen(self, seconds: float) -> Pushed | None:
        """As the daemon's: a long poll that fails (the server too busy to answer within the read timeout) costs a
        read of the state item, not the participant."""
        try:
            return super()._listen(seconds)
        except (ClientError, BotoCoreError):
            self.view.stale()  # read the state item next
            self._pause(1.0)
            return None

    def _check_stop(self) -> None:
        if self.stopped.is_set():
            raise Stopped()
        if time.monotonic() >= self.deadline:
            raise TimeoutError(f"{self.pid}: the run did not finish within {self.timeout:.0f}s")

    def _pause(self, seconds: float) -> None:
        if self.stopped.wait(seconds):
            raise Stopped()

    def _waiting(self, action: Wait, new_reason: bool) -> None:
        self.doing = f"waiting: {action.reason}"

    def _observe(self, state: RunState) -> None:
        if state.phase in (Phase.TRAIN, Phase.WITNESS, Phase.FINISHED) or state.aggregated:
            self.counter.phase.name = "round"

    def _local(self, state: RunState) -> Local:
        local = super()._local(state)
        return replace(local, join_age=local.join_age * self.join_scale, ready_age=local.ready_age * self.ready_scale)

    def _send_join(self) -> None:
        self.actions["join"] += 1
        self.remote.put_fresh(keys.join_key(self.run_id, self.pid), lambda: JoinRequest(
            run_id=self.run_id, participant=self.pid, public_key=self.signer.public_key, sent_at=self.sent_at(),
            info={"host": "load-test"}).model_dump(mode="json"))

    def _send_ready(self, epoch: int) -> None:
        self.ready_epoch = epoch
        self._beat(epoch)

    def _beat(self, ready_epoch: int) -> None:
        self.actions["ready report" if ready_epoch else "heartbeat"] += 1
        self.remote.put_fresh(keys.heartbeat_key(self.run_id, self.pid), lambda: Heartbeat(
            participant=self.pid, sent_at=self.sent_at(), ready_epoch=ready_epoch,
            info={"activity": "simulated"}).model_dump(mode="json"))

    def _offer_model(self) -> None:
        self.remote.put(keys.init_key(self.run_id, self.pid), wire.encode(tiny_model()))
        self.actions["initial-model offer"] += 1

    def _fetch(self, action: Fetch) -> None:
        self.doing = f"fetching the global of round {action.round}"
        data = self.remote.get(keys.global_key(self.run_id, action.round, action.digest))
        if data is None or wire.digest(data) != action.digest:
            self._pause(1.0)  # not there yet (or not yet the committed one): the daemon waits and asks again
            return
        self.me.held, self.me.held_model, self.held_data = action.digest, data, data

    def _train(self, a: Train) -> bool:
        self.doing = f"training round {a.round}"
        if self.train_seconds > 0:
            self._pause(self.train_seconds)
        arrays, _ = wire.decode(self.held_data)
        noise = np.random.default_rng(int(hashlib.sha256(f"{a.seed}:{self.pid}".encode()).hexdigest()[:8], 16))
        trained = {k: (v + noise.normal(0, 0.01, v.shape)).astype(v.dtype) for k, v in arrays.items()}
        samples = assigned_count(self.dataset_size, a.planned, self.pid)
        meta = wire.UpdateMeta(self.run_id, a.round, self.pid, samples, {"loss": float(noise.uniform(0.5, 1.0))})
        data = wire.encode(trained, meta.to_metadata())
        if closed_while_training(self.remote, a, self.pid):  # as the daemon does: is the round still open for us?
            return False
        self.remote.put(keys.update_key(self.run_id, a.round, self.pid), data)
        self.update_sent_at = time.monotonic()
        self.actions["update"] += 1
        self.kept.uploaded(a.round, {"digest": wire.digest(data), "samples": samples})
        self.sent[a.round] = data
        return True

    def _finish(self, action: Finish) -> ParticipantExit:
        if self.feed is not None:
            self.feed.close()
        self.finished_digest = action.digest
        return ParticipantExit(True, self.me.rounds_uploaded)


def honest_fleet(stack: StackProcess, config: RunConfig, pids: list[str], train_seconds: float, timeout: float,
                 log: Path) -> tuple[RequestCounter, list[SimParticipant], DispatcherProcess]:
    """The flood tests' honest side: simulated participants heartbeating and training as `config` says, their
    requests counted, and a dispatcher process (not started) delivering the run's events."""
    conn, counter = stack.connection, RequestCounter()
    clients = Clients(conn, counter, pool=32)
    honest = [SimParticipant(pid, conn, clients, counter, config.dataset_size, poll_max=0.5, timeout=timeout,
                             heartbeat_every=config.heartbeat_every,
                             heartbeat_after_update=config.heartbeat_after_update, train_seconds=train_seconds)
              for pid in pids]
    plan = DispatcherPlan(tick_interval=1.0, visibility_timeout=60)
    return counter, honest, DispatcherProcess(stack.resources, plan, log)
