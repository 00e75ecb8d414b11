"""A run on in-process moto, driven through the real handlers with recorded EventBridge event JSON."""

from __future__ import annotations

import contextlib
import copy
import json
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import boto3
import numpy as np
import pytest
from botocore.config import Config
from moto import mock_aws
from moto.dynamodb.models import DynamoDBBackend

from coordinator.deps import Deps
from coordinator.service import run_tick
from functions import ingest, tick
from functions.settings import deps_from_env, forget_warm_state
from local import access
from local.access.control import install_in_process
from local.context import LocalContext
from local.moto import apply_all
from local.resources import create_resources
from shared import keys, wire
from shared.config import RunConfig
from shared.naming import ENV_BUCKET, ENV_CONFIG, ENV_RUN_ID, ENV_STATE_TOPIC, ENV_TABLE
from shared.selection import assigned_count
from shared.signing import Signer
from shared.state import RunState
from store.trace import acting_as, function, participant

EVENTS = Path(__file__).resolve().parents[1] / "events"
RUN = "func-run"
MODEL = {"dense.weight": np.full((4, 3), 0.5, np.float32), "dense.bias": np.zeros(4, np.float32)}


def writer_of(key: str) -> contextlib.AbstractContextManager[None]:
    """Who writes `key` on AWS: the participant its key names, else the coordinator (the tick's role); a key
    outside the layout, none of the system's principals (an object someone with rights over the bucket left)."""
    try:
        owner = keys.parse_key(key).participant
    except keys.KeyError_:
        return contextlib.nullcontext()
    return acting_as(participant(owner) if owner else function("tick"))


def recorded_event(name: str) -> dict[str, Any]:
    return json.loads((EVENTS / name).read_text())


@pytest.fixture
def aws(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "POWERTOOLS_TRACE_DISABLED": "true",
        "POWERTOOLS_METRICS_DISABLED": "true",
        "POWERTOOLS_LOG_LEVEL": "WARNING",
    }.items():
        monkeypatch.setenv(name, value)
    apply_all()  # moto as the local stack runs it (local/moto/: each patch, its kind and why)
    forget_warm_state()  # a new AWS: every function starts cold, holding no participant's record or model from another
    with mock_aws():
        yield


@pytest.fixture
def atomic_dynamodb(monkeypatch: pytest.MonkeyPatch) -> None:
    """In-process moto checks a condition and writes in two steps; hold one lock around each write (FACTS.md)."""
    lock = threading.RLock()
    for name in ("put_item", "update_item", "delete_item", "transact_write_items", "get_item", "query"):
        original = getattr(DynamoDBBackend, name)

        def locked(self: Any, *args: Any, __original: Any = original, **kwargs: Any) -> Any:
            with lock:
                return __original(self, *args, **kwargs)

        monkeypatch.setattr(DynamoDBBackend, name, locked)


class Harness:
    """One run: put objects as participants would, deliver their events to the handlers, tick."""

    def __init__(self, config: RunConfig) -> None:
        self.config = config
        self.res = create_resources(config.run_id)
        # (checksums in headers, as the coordinator sends them: botocore's default streams large bodies through
        # aws-chunked encoding, which in-process moto decodes slowly)
        self.s3 = boto3.client("s3", region_name="us-east-1",
                               config=Config(request_checksum_calculation="when_required",
                                             response_checksum_validation="when_required"))
        self.signers: dict[str, Signer] = {}

    @property
    def deps(self) -> Deps:
        return deps_from_env()

    def state(self) -> RunState:
        return self.deps.store.read_state()

    # --- objects and their events -----------------------------------------------------------------

    def signer(self, pid: str) -> Signer:
        if pid not in self.signers:
            self.signers[pid] = Signer.generate()
        return self.signers[pid]

    def put(self, key: str, body: bytes, signed_by: str | None = "owner") -> dict[str, Any]:
        """Upload an object (signed by its key's participant, by `signed_by`, or unsigned with None) and
        return the EventBridge event S3 would emit for it. The upload is made by whoever may write the key on AWS
        (`writer_of`); `signed_by` tests the second layer, the signature ingest checks."""
        owner = key.rstrip("/").rsplit("/", 1)[-1]
        signer = None if signed_by is None else self.signer(owner if signed_by == "owner" else signed_by)
        metadata = signer.metadata(key, body) if signer else {}
        with writer_of(key):
            resp = self.s3.put_object(Bucket=self.res.bucket, Key=key, Body=body, Metadata=metadata)
        event = copy.deepcopy(recorded_event("s3_object_created.json"))
        event["time"] = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        event["detail"]["bucket"]["name"] = self.res.bucket
        event["detail"]["object"].update(
            key=key, size=len(body), etag=resp["ETag"].strip('"'), **{"version-id": resp.get("VersionId", "")}
        )
        return event

    def deliver(self, event: dict[str, Any]) -> dict[str, Any]:
        with acting_as(function("ingest")):
            return ingest.handler(event, LocalContext())

    def send(self, key: str, body: bytes, signed_by: str | None = "owner") -> dict[str, Any]:
        return self.deliver(self.put(key, body, signed_by))

    def scheduled_tick(self) -> dict[str, Any]:
        with acting_as(function("tick")):
            return tick.handler(recorded_event("scheduled_tick.json"), LocalContext())

    # --- participant actions ----------------------------------------------------------------------

    def join_bytes(self, pid: str, run_id: str | None = None, sent_at: float | None = None) -> bytes:
        body = {"run_id": run_id or self.config.run_id, "participant": pid, "info": {"host": "test"},
                "public_key": self.signer(pid).public_key, "sent_at": time.time() if sent_at is None else sent_at}
        return json.dumps(body).encode()

    def heartbeat_bytes(self, pid: str, sent_at: float | None = None, **fields: Any) -> bytes:
        """A heartbeat as the daemon sends it (sent now unless `sent_at` says when), with `fields` added."""
        return json.dumps({"participant": pid, "sent_at": time.time() if sent_at is None else sent_at,
                           **fields}).encode()

    def join(self, pid: str, run_id: str | None = None) -> dict[str, Any]:
        return self.send(keys.join_key(self.config.run_id, pid), self.join_bytes(pid, run_id))

    def heartbeat(self, pid: str, **fields: Any) -> dict[str, Any]:
        return self.send(keys.heartbeat_key(self.config.run_id, pid), self.heartbeat_bytes(pid, **fields))

    def join_alive(self, pid: str) -> dict[str, Any]:
        """Join, then heartbeat as the daemon does: an epoch admits only participants heard from after joining."""
        joined = self.join(pid)
        self.heartbeat(pid)
        return joined

    def offer(self, pid: str, model: dict[str, np.ndarray] = MODEL) -> dict[str, Any]:
        return self.send(keys.init_key(self.config.run_id, pid), wire.encode(model))

    def update_bytes(
        self, pid: str, arrays: dict[str, np.ndarray], round_no: int | None = None, samples: int | None = None,
        metrics: dict[str, float] | None = None,
    ) -> bytes:
        s = self.state()
        rnd = s.round if round_no is None else round_no
        if samples is None:
            samples = assigned_count(self.config.dataset_size, s.plan or s.selected, pid) if s.selected else 1
        meta = wire.UpdateMeta(self.config.run_id, rnd, pid, samples, metrics or {"loss": 1.0})
        return wire.encode(arrays, meta.to_metadata())

    def upload(self, pid: str, arrays: dict[str, np.ndarray], round_no: int | None = None, **kw: Any) -> dict[str, Any]:
        rnd = self.state().round if round_no is None else round_no
        return self.send(keys.update_key(self.config.run_id, rnd, pid), self.update_bytes(pid, arrays, rnd, **kw))

    def start(self, pids: list[str]) -> RunState:
        """Join everyone (each heartbeats once registered), offer the initial model: the run is then training
        round 0."""
        self.scheduled_tick()
        for pid in pids:
            self.join_alive(pid)
        self.offer(pids[0])
        return self.state()

    def global_digest(self, round_no: int) -> str:
        """The digest of the global model round `round_no` trained (or trains) from, as the run recorded it."""
        s = self.state()
        if s.round == round_no:
            return s.global_digest
        for summary in self.deps.store.rounds():
            if summary.round == round_no - 1:
                return summary.global_digest
        if round_no == 0:
            return self.deps.store.participants()[s.model_source].init_digest
        raise LookupError(f"no record of round {round_no}'s global model")

    def global_key(self, round_no: int) -> str:
        return keys.global_key(self.config.run_id, round_no, self.global_digest(round_no))

    def global_model(self, round_no: int) -> dict[str, np.ndarray]:
        body = self.s3.get_object(Bucket=self.res.bucket, Key=self.global_key(round_no))
        return wire.decode(body["Body"].read())[0]


def assert_round_left_to_lease_holder(h: Harness, close_round: Callable[[], None]) -> None:
    """Given another invocation holding round 0's aggregation lease, when `close_round` uploads the round's last
    updates, then the tick does not aggregate it again (the round waits for the holder's commit), and once the lease
    is given back (or expires) a tick aggregates it."""
    deps = h.deps
    assert deps.store.claim("aggregate#0", "another invocation", time.time() + 600, time.time())
    close_round()
    result = run_tick(deps)
    assert not result.committed and any("being aggregated" in n for n in result.notes), result
    assert h.state().aggregated == 0
    deps.store.release("aggregate#0", "another invocation")
    h.scheduled_tick()
    assert h.state().aggregated == 1


def make_config(**overrides: Any) -> RunConfig:
    base: dict[str, Any] = dict(
        run_id=RUN, min_clients=2, min_per_round=2, min_updates=1, total_rounds=3, warmup_time=0,
        max_round_train_time=60, round_witness_time=0, cooldown_time=0, liveness_timeout=600, dataset_size=100,
        max_update_bytes=4096,
        # no built-in task's (whose initial model's schema the config would take, `shared.initial_models`): the
        # harness offers and trains MODEL and models of its tests' own
        task="tests.functional.conftest:MODEL",
        # the harness's tests check FedAvg's arithmetic by sample count; the default's robustness is
        # test_default_robustness.py's, its arithmetic tests/unit/test_robust_aggregation.py's
        strategy="fedavg",
    )
    base.update(overrides)
    return RunConfig(**base)


def judge_in_process(config: RunConfig) -> None:
    """Judge every call to in-process moto as IAM would, with the roles of the template synthesized for `config`
    (`local.access`), as the local server does."""
    if access.mode() == access.OFF:
        return
    install_in_process(access.control_for(access.model_for(config), enforce=access.mode() == access.ENFORCE))


@pytest.fixture
def harness_factory(aws: None, atomic_dynamodb: None, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    def build(**overrides: Any) -> Harness:
        config = make_config(**overrides)
        res_bucket = f"fed-{config.run_id}"
        monkeypatch.setenv(ENV_RUN_ID, config.run_id)
        monkeypatch.setenv(ENV_BUCKET, res_bucket)
        monkeypatch.setenv(ENV_TABLE, f"fed-{config.run_id}-state")
        monkeypatch.setenv(ENV_CONFIG, config.model_dump_json())
        harness = Harness(config)
        monkeypatch.setenv(ENV_STATE_TOPIC, harness.res.state_topic)  # commits that change phase or round publish
        judge_in_process(config)
        return harness

    yield build
    install_in_process(None)


@pytest.fixture
def harness(harness_factory):  # type: ignore[no-untyped-def]
    return harness_factory()


@pytest.fixture(scope="session")
def hf_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Hugging Face model (`participant.tasks.hf_tiny`, not pretrained), built once a session."""
    from participant.tasks import hf_tiny

    return hf_tiny.build(tmp_path_factory.mktemp("models") / "tiny", pretrain_steps=0)


def hf_local_task(model: Path, **hf: Any) -> Any:
    """The Hugging Face task of a local data mode run on `model`, sequences of 32 tokens, `hf` its other options."""
    from participant.task import load_task
    from shared.config import DataMode, HfOptions

    config = RunConfig(run_id="local-hf", task="participant.tasks.hf:task", data_mode=DataMode.LOCAL,
                       hf=HfOptions(model=str(model), sequence_length=32, **hf))
    return load_task(config.task, config)
