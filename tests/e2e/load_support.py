"""Lightweight simulated participants for the load test: the daemon's protocol without torch.

Each `SimParticipant` runs in a thread of the test process and follows the real participant's protocol
step by step: the same decisions (`participant.decide.decide`), the same reads before each decision
(run state; its own record until its join is recorded, and during warmup; its update record while its
upload is pending), the same writes (signed join, heartbeat, initial-model offer, ready report, update),
and the same polling backoff. Only the training is a numpy stand-in on a tiny model. Every request the
participants send is counted by service and operation with botocore event hooks.
"""

from __future__ import annotations

import hashlib
import json
import random
import select
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import boto3
import numpy as np
from botocore.config import Config

from infra.local.resources import LocalResources
from participant.decide import (
    JOIN_RETRY_SECONDS,
    READY_RETRY_SECONDS,
    Fetch,
    Finish,
    Join,
    Local,
    OfferModel,
    ReportReady,
    Train,
    Wait,
    decide,
    is_resend,
)
from shared import keys, wire
from shared.config import RunConfig
from shared.connection import Connection
from shared.records import STATE_SK, participant_sk, run_pk, state_from_body, update_sk
from shared.selection import assigned_count
from shared.signing import Signer
from shared.state import Phase, RunState
from tests.e2e.chaos_support import child_process

POLL_FIRST, POLL_GROWTH = 0.2, 1.6  # as the daemon polls


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
                                     self.resources.endpoint, self.resources.region)

    def requests(self) -> Counter[tuple[str, str]]:
        """Every request the server has served so far, by (service, operation)."""
        with urllib.request.urlopen(f"{self.endpoint}/_fed/requests", timeout=30) as resp:  # noqa: S310 - loopback
            return Counter({(svc, op): n for svc, op, n in json.loads(resp.read())})

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

    def attach(self, client: Any) -> Any:
        client.meta.events.register("before-send", self._count)
        return client

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


class Clients:
    """One S3 and one DynamoDB client shared by all simulated participants (botocore clients are
    thread-safe; the requests are the same as with a client each)."""

    def __init__(self, conn: Connection, counter: RequestCounter, pool: int = 256) -> None:
        config = Config(retries={"max_attempts": 8, "mode": "standard"}, max_pool_connections=pool,
                        s3={"addressing_style": "path"})
        self.s3 = counter.attach(boto3.client("s3", endpoint_url=conn.endpoint, region_name=conn.region,
                                              config=config))
        self.ddb = counter.attach(boto3.client("dynamodb", endpoint_url=conn.endpoint, region_name=conn.region,
                                               config=config))


class SimParticipant:
    """One simulated `fed-participant start`. `join_retry` and `ready_retry` are how long it waits before
    re-sending an unrecorded join request or ready report (the daemon: JOIN_RETRY_SECONDS and
    READY_RETRY_SECONDS of participant.decide); `poll_max` is its --poll-max."""

    def __init__(self, pid: str, conn: Connection, clients: Clients, counter: RequestCounter, dataset_size: int,
                 poll_max: float = 2.0, timeout: float = 600.0, join_retry: float = JOIN_RETRY_SECONDS,
                 ready_retry: float = READY_RETRY_SECONDS) -> None:
        self.pid, self.conn, self.run_id = pid, conn, conn.run_id
        self.dataset_size = dataset_size
        # decide() compares ages with the daemon's constants: scale the ages so they trip at our retry times
        self.join_scale, self.ready_scale = JOIN_RETRY_SECONDS / join_retry, READY_RETRY_SECONDS / ready_retry
        self.s3, self.ddb = clients.s3, clients.ddb
        self.counter = counter
        self.poll_max, self.timeout = poll_max, timeout
        self.signer = Signer.generate()
        self.rng = random.Random(pid)
        self.joined = False
        self.offered = False
        self.held, self.held_bytes = "", b""
        self.reported_ready, self.ready_sent, self.join_sent = 0, 0.0, 0.0
        self.join_sends, self.ready_sends = 0, 0
        self.uploaded: dict[int, str] = {}  # round -> digest
        self.outcomes: dict[int, str] = {}
        self.sent: dict[int, bytes] = {}
        self.error: BaseException | None = None
        self.finished_digest = ""
        self.actions: Counter[str] = Counter()  # what it sent, by kind (joins and ready reports are re-sent)

    # --- requests ------------------------------------------------------------------------------------

    def _put(self, key: str, body: bytes) -> None:
        self.s3.put_object(Bucket=self.conn.bucket, Key=key, Body=body, Metadata=self.signer.metadata(key, body))

    def _get(self, key: str) -> bytes | None:
        try:
            return bytes(self.s3.get_object(Bucket=self.conn.bucket, Key=key)["Body"].read())
        except self.s3.exceptions.NoSuchKey:
            return None

    def _item(self, sk: str) -> dict[str, Any] | None:
        resp = self.ddb.get_item(TableName=self.conn.table, Key={"pk": {"S": run_pk(self.run_id)}, "sk": {"S": sk}},
                                 ConsistentRead=True)
        return resp.get("Item")

    def read_state(self) -> RunState:
        item = self._item(STATE_SK)
        if item is None:
            return RunState(self.run_id)
        return state_from_body(json.loads(item["body"]["S"]), int(item["version"]["N"]))

    # --- the protocol --------------------------------------------------------------------------------

    def run(self, start_after: float = 0.0) -> None:
        """The daemon's life, started `start_after` seconds from now (hosts do not start in the same instant)."""
        try:
            time.sleep(start_after)
            self._run()
        except BaseException as exc:  # reported by the test
            self.error = exc

    def _run(self) -> None:
        self.counter.phase.name = "setup"
        self._join()
        delay = POLL_FIRST
        while self._get(keys.config_key(self.run_id)) is None:  # published by the coordinator's first tick
            time.sleep(delay * self.rng.uniform(0.75, 1.25))
            delay = min(delay * POLL_GROWTH, self.poll_max)
        self._beat(0)  # the daemon's heartbeat thread beats once at start (then every liveness_timeout / 4)
        deadline = time.monotonic() + self.timeout
        delay, last_wait = POLL_FIRST, None
        while time.monotonic() < deadline:
            state = self.read_state()
            if state.phase in (Phase.TRAIN, Phase.WITNESS, Phase.FINISHED) or state.aggregated:
                self.counter.phase.name = "round"
            self._check_outcome(state)
            local = self._local(state)
            action = decide(state, local)
            if isinstance(action, Wait):
                marker = (state.version, action.reason)
                if marker != last_wait:
                    delay, last_wait = POLL_FIRST, marker
                time.sleep(delay * self.rng.uniform(0.75, 1.25))
                delay = min(delay * POLL_GROWTH, self.poll_max)
                continue
            resend = is_resend(action, local)
            if not resend:  # as the daemon: a re-send is no progress, polling keeps its slower pace
                delay, last_wait = POLL_FIRST, None
            if isinstance(action, Finish):
                self.finished_digest = action.digest
                return
            if isinstance(action, Join):
                self._join()
            elif isinstance(action, OfferModel):
                self._put(keys.init_key(self.run_id, self.pid), wire.encode(tiny_model()))
                self.offered = True
                self.actions["initial-model offer"] += 1
            elif isinstance(action, Fetch):
                self._fetch(action)
            elif isinstance(action, ReportReady):
                self.ready_sends = self.ready_sends + 1 if resend else 1
                self._beat(action.epoch)
                self.reported_ready, self.ready_sent = action.epoch, time.monotonic()
            elif isinstance(action, Train):
                self._train(action)
        raise TimeoutError(f"{self.pid}: the run did not finish within {self.timeout:.0f}s")

    def _join(self) -> None:
        self.actions["join"] += 1
        body = {"run_id": self.run_id, "participant": self.pid, "public_key": self.signer.public_key,
                "info": {"host": "load-test"}}
        self._put(keys.join_key(self.run_id, self.pid), json.dumps(body, sort_keys=True).encode())
        self.join_sent, self.join_sends = time.monotonic(), self.join_sends + 1

    def _beat(self, ready_epoch: int) -> None:
        self.actions["ready report" if ready_epoch else "heartbeat"] += 1
        body = {"participant": self.pid, "ready_epoch": ready_epoch, "info": {"activity": "simulated"}}
        self._put(keys.heartbeat_key(self.run_id, self.pid), json.dumps(body, sort_keys=True).encode())

    def _local(self, state: RunState) -> Local:
        ready_recorded = self.reported_ready
        if not self.joined:
            self.joined = self._item(participant_sk(self.pid)) is not None
        elif state.phase is Phase.WARMUP and self.reported_ready >= state.epoch and self.pid in state.members:
            record = self._item(participant_sk(self.pid))
            ready_recorded = int(record.get("ready_epoch", {}).get("N", 0)) if record else 0
        recorded = False
        if state.phase is Phase.TRAIN and self.pid in state.selected and state.round not in self.uploaded:
            recorded = self._item(update_sk(state.round, self.pid)) is not None
            if not recorded:
                key = keys.update_key(self.run_id, state.round, self.pid)
                try:
                    self.s3.head_object(Bucket=self.conn.bucket, Key=key)
                    recorded = True
                except self.s3.exceptions.ClientError:
                    recorded = False
        now = time.monotonic()
        return Local(pid=self.pid, joined=self.joined, join_age=(now - self.join_sent) * self.join_scale,
                     join_sends=self.join_sends, offered=self.offered, held=self.held,
                     reported_ready=self.reported_ready, ready_age=(now - self.ready_sent) * self.ready_scale,
                     ready_sends=self.ready_sends,
                     ready_recorded=ready_recorded, uploaded=frozenset(self.uploaded), recorded=recorded)

    def _check_outcome(self, state: RunState) -> None:
        pending = [r for r in self.uploaded if r not in self.outcomes]
        if not pending:
            return
        r = max(pending)
        rec = self._item(update_sk(r, self.pid))
        if rec is None:
            if state.round > r:
                self.outcomes[r] = "no record"
            return
        self.outcomes[r] = "accepted" if rec["accepted"]["BOOL"] else rec.get("reason", {}).get("S", "refused")

    def _fetch(self, action: Fetch) -> None:
        data = self._get(keys.global_key(self.run_id, action.round, action.digest))
        if data is None or wire.digest(data) != action.digest:
            time.sleep(1.0)  # not there yet (or not yet the committed one): the daemon waits and asks again
            return
        self.held, self.held_bytes = action.digest, data

    def _train(self, a: Train) -> None:
        arrays, _ = wire.decode(self.held_bytes)
        noise = np.random.default_rng(int(hashlib.sha256(f"{a.seed}:{self.pid}".encode()).hexdigest()[:8], 16))
        trained = {k: (v + noise.normal(0, 0.01, v.shape)).astype(v.dtype) for k, v in arrays.items()}
        samples = assigned_count(self.dataset_size, a.selected, self.pid)
        meta = wire.UpdateMeta(self.run_id, a.round, self.pid, samples, {"loss": float(noise.uniform(0.5, 1.0))})
        data = wire.encode(trained, meta.to_metadata())
        now = self.read_state()  # as the daemon does: is the round still open for us?
        if now.round != a.round or now.phase is not Phase.TRAIN or self.pid not in now.selected:
            self.uploaded[a.round] = ""
            return
        self._put(keys.update_key(self.run_id, a.round, self.pid), data)
        self.actions["update"] += 1
        self.uploaded[a.round] = wire.digest(data)
        self.sent[a.round] = data
