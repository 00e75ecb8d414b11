"""The test side of running the functions as Lambda runs them (`lambda_sandbox.py` is the sandbox side).

`Sandbox` starts one function's sandbox: a fresh interpreter (`-I -S -B`) in a directory of its own, whose
environment holds PATH, LANG, the function's variables as the synthesized stack sets them (with the local run's
names in place of the stack's references), the local endpoint, powertools' settings as the local stack sets them,
the region and the function's own credentials (`function-<name>`: whom the local access check takes the requests
for). `Participant` uploads what a participant uploads, with its own credentials (`participant-<id>`), and builds
the EventBridge "Object Created" event S3 emits for it.
"""

from __future__ import annotations

import copy
import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import boto3
from botocore.config import Config

from local.resources import LocalResources
from local.stack import function_environment
from shared.config import RunConfig
from shared.naming import ENV_BUCKET, ENV_CONFIG, ENV_ENDPOINT, ENV_RUN_ID, ENV_SHARD_RUNNER, ENV_STATE_TOPIC, ENV_TABLE
from shared.signing import Signer

if TYPE_CHECKING:
    from tests.infrastructure.conftest import Synth

DRIVER = Path(__file__).resolve().with_name("lambda_sandbox.py")
EVENTS = Path(__file__).resolve().parents[1] / "events"
SECRET = "not-a-secret"  # the local server checks no signature; the access key says who is asking
START_TIMEOUT = 120.0  # a cold sandbox imports numpy, pydantic, boto3, powertools: seconds, more on a busy machine


class SandboxDied(RuntimeError):
    pass


def function_name(handler: str) -> str:
    """ "functions.tick.handler" -> "tick" (the name the stack and the access check know the function by)."""
    return handler.split(".")[1]


def function_environments(
    synth: Synth, config: RunConfig, resources: LocalResources, shard_queue_url: str, region: str
) -> dict[str, dict[str, str]]:
    """Each function's environment, by name: the variables the synthesized stack gives it, those that name the
    stack's resources (or the run) replaced by the local run's, plus what pointing at the local endpoint needs."""
    assert resources.endpoint
    local_names = {
        ENV_RUN_ID: config.run_id,
        ENV_BUCKET: resources.bucket,
        ENV_TABLE: resources.table,
        ENV_CONFIG: config.model_dump_json(),
        ENV_STATE_TOPIC: resources.state_topic,
        ENV_SHARD_RUNNER: f"queue:{shard_queue_url}",
    }
    powertools = {
        name: value
        for name, value in function_environment(resources, config, "INFO").items()
        if name.startswith("POWERTOOLS_")
    }
    environments = {}
    for fn in synth.stack.coordinator.functions:
        props = synth.resources[synth.logical_id(fn)]["Properties"]
        name = function_name(props["Handler"])
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "LANG": "C.UTF-8",
            "AWS_REGION": region,
            "AWS_DEFAULT_REGION": region,
            "AWS_ACCESS_KEY_ID": f"function-{name}",
            "AWS_SECRET_ACCESS_KEY": SECRET,
            ENV_ENDPOINT: resources.endpoint,
            **powertools,
        }
        for variable, value in props["Environment"]["Variables"].items():
            if variable in local_names:
                env[variable] = local_names[variable]
            else:  # a literal (FED_SHARD_WAIT, the metrics namespace); a reference without a local name fails here
                assert isinstance(value, str), f"{name}: no local value for {variable} = {value}"
                env.setdefault(variable, value)
        environments[name] = env
    return environments


def function_settings(synth: Synth) -> dict[str, tuple[str, int, int]]:
    """Each function's handler, memory (MB) and timeout (s), by name, as the stack deploys it."""
    settings = {}
    for fn in synth.stack.coordinator.functions:
        props = synth.resources[synth.logical_id(fn)]["Properties"]
        settings[function_name(props["Handler"])] = (props["Handler"], props["MemorySize"], props["Timeout"])
    return settings


class Sandbox:
    """One function's sandbox process, warm: `invoke` one event at a time; `close` ends it."""

    def __init__(
        self,
        name: str,
        asset: Path,
        handler: str,
        env: Mapping[str, str],
        workdir: Path,
        *,
        timeout: int = 900,
        memory: int = 1769,
        queue_url: str = "",
    ) -> None:
        self.name, self.asset = name, asset
        cwd = workdir / name
        cwd.mkdir(parents=True)
        self.log_path = workdir / f"{name}.log"
        self._log: IO[bytes] = self.log_path.open("wb")
        cmd = [sys.executable, "-I", "-S", "-B", str(DRIVER), str(asset), handler, "--name", name,
               "--timeout", str(timeout), "--memory", str(memory)]  # fmt: skip
        if queue_url:
            cmd += ["--queue", queue_url, "--endpoint", env[ENV_ENDPOINT]]
        self.process = subprocess.Popen(
            cmd, cwd=cwd, env=dict(env), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log
        )
        self._answers: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._changed = threading.Condition()
        self.polled: list[dict[str, Any]] = []  # the queue's invocations (with queue_url)
        self.poller_errors: list[dict[str, Any]] = []
        self._reader = threading.Thread(target=self._read, name=f"sandbox-{name}", daemon=True)
        self._reader.start()
        self.ready: dict[str, Any] = {}

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            message = json.loads(line)
            with self._changed:
                if "polled" in message:
                    self.polled.append(message["polled"])
                elif "poller_error" in message:
                    self.poller_errors.append(message["poller_error"])
                else:
                    self._answers.put(message)
                self._changed.notify_all()
        self._answers.put(None)  # the process's stdout closed: it exited
        with self._changed:
            self._changed.notify_all()

    def log_tail(self, chars: int = 4000) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-chars:]

    def _answer(self, deadline: float, abort: Callable[[], str | None] = lambda: None) -> dict[str, Any]:
        while True:
            reason = abort()
            if reason:
                raise AssertionError(f"{reason}\n--- {self.name}'s log:\n{self.log_tail()}")
            try:
                answer = self._answers.get(timeout=min(0.2, max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"{self.name} did not answer in time\n{self.log_tail()}") from None
                continue
            if answer is None:
                raise SandboxDied(f"{self.name}'s sandbox exited ({self.process.wait()})\n{self.log_tail()}")
            return answer

    def wait_ready(self, timeout: float = START_TIMEOUT) -> dict[str, Any]:
        """The sandbox's init: its sys.path, and the error its handler's import raised (None if none)."""
        if not self.ready:
            answer = self._answer(time.monotonic() + timeout)
            assert "ready" in answer, answer
            self.ready = answer["ready"]
        return self.ready

    def _request(self, request: dict[str, Any]) -> None:
        assert self.process.stdin is not None
        try:
            self.process.stdin.write(json.dumps(request).encode() + b"\n")
            self.process.stdin.flush()
        except BrokenPipeError:
            raise SandboxDied(f"{self.name}'s sandbox exited ({self.process.wait()})\n{self.log_tail()}") from None

    def invoke(
        self, event: dict[str, Any], timeout: float = 120.0, abort: Callable[[], str | None] = lambda: None
    ) -> dict[str, Any]:
        """The invocation's answer: {"result": ...} or {"error": {...}}; `abort` (polled while waiting) may name a
        reason to give up at once (another sandbox failed)."""
        self.wait_ready()
        self._request({"event": event})
        return self._answer(time.monotonic() + timeout, abort)

    def call(
        self, event: dict[str, Any], timeout: float = 120.0, abort: Callable[[], str | None] = lambda: None
    ) -> Any:
        """The handler's result; an invocation that failed fails the test with its error and the function's log."""
        answer = self.invoke(event, timeout, abort)
        if "error" in answer:
            error = answer["error"]
            raise AssertionError(
                f"{self.name} failed: {error['errorType']}: {error['errorMessage']}\n"
                + "".join(error.get("stackTrace", []))
                + f"--- {self.name}'s log:\n{self.log_tail()}"
            )
        return answer["result"]

    def modules(self) -> dict[str, str | None]:
        """Every module the sandbox has loaded, and the file each came from."""
        self.wait_ready()
        self._request({"modules": True})
        answer = self._answer(time.monotonic() + 30)
        return dict(answer["modules"])

    def wait_polled(self, count: int, timeout: float = 60.0) -> list[dict[str, Any]]:
        """The first `count` invocations the sandbox's queue poller made (waiting for them up to `timeout`)."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while len(self.polled) < count and self.process.poll() is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._changed.wait(left)
            return list(self.polled)

    def close(self) -> None:
        if self.process.stdin is not None and not self.process.stdin.closed:
            try:
                self.process.stdin.close()  # (the sandbox's signal to exit)
            except BrokenPipeError:
                pass
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._reader.join(timeout=15)
        if self.process.stdout is not None:
            self.process.stdout.close()
        self._log.close()


def sqs_record(message: Mapping[str, Any], queue_arn: str, region: str) -> dict[str, Any]:
    """One record of the SQS event Lambda's event source mapping hands a function."""
    return {
        "messageId": message["MessageId"],
        "receiptHandle": message["ReceiptHandle"],
        "body": message["Body"],
        "attributes": message.get("Attributes", {}),
        "messageAttributes": {},
        "md5OfBody": message.get("MD5OfBody", ""),
        "eventSource": "aws:sqs",
        "eventSourceARN": queue_arn,
        "awsRegion": region,
    }


def object_created_event(bucket: str, key: str, size: int, put: Mapping[str, Any], region: str) -> dict[str, Any]:
    """The EventBridge "Object Created" event S3 emits for an upload (`put`: PutObject's response)."""
    event: dict[str, Any] = copy.deepcopy(json.loads((EVENTS / "s3_object_created.json").read_text()))
    event["time"] = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    event["region"] = region
    event["resources"] = [f"arn:aws:s3:::{bucket}"]
    event["detail"]["bucket"]["name"] = bucket
    event["detail"]["object"].update(
        key=key, size=size, etag=put["ETag"].strip('"'), **{"version-id": put.get("VersionId", "")}
    )
    return event


def scheduled_tick_event() -> dict[str, Any]:
    event: dict[str, Any] = json.loads((EVENTS / "scheduled_tick.json").read_text())
    event["time"] = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return event


class Participant:
    """Uploads as participant `pid` does: signed objects, with its own credentials."""

    def __init__(self, pid: str, resources: LocalResources) -> None:
        self.pid, self.resources = pid, resources
        self.signer = Signer.generate()
        self.s3 = boto3.client(
            "s3",
            endpoint_url=resources.endpoint,
            region_name=resources.region,
            aws_access_key_id=f"participant-{pid}",
            aws_secret_access_key=SECRET,
            # (checksums in headers, as the participant sends them, not aws-chunked bodies)
            config=Config(request_checksum_calculation="when_required", response_checksum_validation="when_required"),
        )

    def put(self, key: str, body: bytes) -> dict[str, Any]:
        """Upload `body` at `key`, signed; the event S3 emits for it."""
        put = self.s3.put_object(
            Bucket=self.resources.bucket, Key=key, Body=body, Metadata=self.signer.metadata(key, body)
        )
        return object_created_event(self.resources.bucket, key, len(body), put, self.resources.region)

    def join_request(self, run_id: str) -> bytes:
        return json.dumps({"run_id": run_id, "participant": self.pid, "info": {"host": "sandbox-test"},
                           "public_key": self.signer.public_key, "sent_at": time.time()}).encode()  # fmt: skip

    def heartbeat(self) -> bytes:
        return json.dumps({"participant": self.pid, "sent_at": time.time()}).encode()
