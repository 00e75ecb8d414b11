"""The whole local stack in one object: moto's server, the run's resources, and the dispatcher.

What `cdk deploy` stands up on AWS, stood up in this process: the same bucket, table, rules and handler
functions, with moto's server in place of the services and the dispatcher in place of Lambda's
triggers. `fed local`, `fed demo` and the end-to-end tests all start it through this class.
"""

from __future__ import annotations

import logging
import os
import threading
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from local import access
from local.credentials import LocalCredentialEndpoint
from local.dispatcher import Dispatcher, FaultPlan
from local.moto.pin import check_moto
from local.resources import LocalResources, create_resources
from local.server import LocalServer, ServerProcess
from shared.config import RunConfig
from shared.naming import (
    ENV_BUCKET,
    ENV_CONFIG,
    ENV_CREDENTIAL_SECONDS,
    ENV_ENDPOINT,
    ENV_PARTICIPANT_ROLE,
    ENV_RUN_ID,
    ENV_SHARD_RUNNER,
    ENV_SHARD_WAIT,
    ENV_STATE_TOPIC,
    ENV_TABLE,
)
from store.connection import Connection
from store.trace import ENV_TRACE
from store.trace import install as install_trace

log = logging.getLogger("fed.local")

LOCAL_REGION = "us-east-1"

# moto accepts any credentials; these keep boto3 from ever sending a real key to the local endpoint.
LOCAL_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "local", "AWS_SECRET_ACCESS_KEY": "local"}
_CLEARED = ("AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_PROFILE", ENV_SHARD_RUNNER, ENV_SHARD_WAIT)


def client_environment(region: str = LOCAL_REGION) -> dict[str, str]:
    """Environment for any process talking to the local endpoint (participants, `fed status`)."""
    return {**LOCAL_CREDENTIALS, "AWS_DEFAULT_REGION": region, "AWS_REGION": region,
            "AWS_EC2_METADATA_DISABLED": "true"}


def local_participant_role(run_id: str) -> str:
    """The participant role the local credential endpoint names (moto's STS issues sessions of any role)."""
    return f"arn:aws:iam::123456789012:role/fed-{run_id}-participant"


LOCAL_SHARD_WAIT = 300  # seconds a tick waits for its shards' outcomes (a lost one fails the tick, which is retried)


def function_environment(resources: LocalResources, config: RunConfig, log_level: str,
                         shard_queue: bool = True) -> dict[str, str]:
    """What the Lambda functions find in their environment on AWS, pointing at the local endpoint; with
    `shard_queue`, the ticks send their aggregation shards to the shard queue, as deployed."""
    assert resources.endpoint is not None
    shards = {ENV_SHARD_RUNNER: f"queue:{resources.shard_queue_url}", ENV_SHARD_WAIT: str(LOCAL_SHARD_WAIT)}
    return {
        **(shards if shard_queue and resources.shard_queue_url else {}),
        **client_environment(resources.region),
        ENV_RUN_ID: config.run_id,
        ENV_BUCKET: resources.bucket,
        ENV_TABLE: resources.table,
        ENV_CONFIG: config.model_dump_json(),
        ENV_ENDPOINT: resources.endpoint,
        ENV_STATE_TOPIC: resources.state_topic,
        "POWERTOOLS_TRACE_DISABLED": "true",
        "POWERTOOLS_METRICS_DISABLED": "true",
        "POWERTOOLS_SERVICE_NAME": "fed-coordinator",
        "POWERTOOLS_LOG_LEVEL": log_level,
    }


def route_function_logs(level: str | int, stream: IO[str] | None) -> tuple[int, IO[str] | None]:
    """Send the functions' JSON logs to `stream` (a log file; None: leave it) at `level`; return the level and
    stream they had, to put back. The functions' module is imported here, so its powertools Logger exists."""
    from functions.observability import logger

    # Metrics are disabled locally; powertools still warns, once per process, that none were published.
    warnings.filterwarnings("ignore", message="No application metrics to publish")
    previous_level = logger.log_level
    logger.setLevel(level.upper() if isinstance(level, str) else level)
    handler = logger.registered_handler
    previous_stream = handler.stream if isinstance(handler, logging.StreamHandler) else None
    if stream is not None and isinstance(handler, logging.StreamHandler):
        if getattr(handler.stream, "closed", False):  # e.g. an earlier test runner's captured output: no flush
            handler.stream = stream
        else:
            handler.setStream(stream)
    return previous_level, previous_stream


@dataclass
class LocalStack:
    """Start with `start()` (or `with`), stop with `stop()`; `connection` is what participants need."""

    config: RunConfig
    port: int = 0
    tick_interval: float = 1.0
    workers: int = 3  # the main lane's (heartbeats, updates, offers, proofs, reports)
    join_workers: int = 1  # the join lane's: a burst of joins waits in its own queue
    log_level: str = "INFO"
    log_file: Path | None = None  # the functions' logs; None: this process's stdout
    region: str = LOCAL_REGION
    hold_events: bool = False  # True: tick, but deliver no S3 event until `release_events()`
    credential_seconds: int = 900  # the lifetime of the sessions the credential endpoint issues to invited hosts
    shard_workers: int | None = None  # the shard-worker function's processes (None: one a core; 0: none, and the
    # ticks aggregate on their own threads)
    dispatch: bool = True  # False: no dispatcher in this process (another process delivers events and ticks)
    faults: FaultPlan | None = None  # the dispatcher's fault plan (chaos tests); None: deliver faithfully
    count_requests: bool = False  # True: the server counts requests by service (`server.requests`) and keeps each
    # request (`server.requests.events()`), the dispatcher each invocation (`dispatcher.spans`): the demo's report
    # carries both for `make bench-rounds`
    server_process: bool = False  # True: the server runs in a process of its own (`local.server.ServerProcess`)
    server: LocalServer | ServerProcess | None = field(default=None, init=False)
    resources: LocalResources | None = field(default=None, init=False)
    access: access.CheckState | None = field(default=None, init=False)  # how the access check runs
    dispatcher: Dispatcher | None = field(default=None, init=False)
    credentials: LocalCredentialEndpoint | None = field(default=None, init=False)  # served with the dispatcher
    _saved_env: dict[str, str | None] = field(default_factory=dict, init=False, repr=False)
    _log_stream: IO[str] | None = field(default=None, init=False, repr=False)
    _previous_logs: tuple[int, IO[str] | None] | None = field(default=None, init=False, repr=False)

    @property
    def endpoint(self) -> str:
        if self.server is None:
            raise RuntimeError("the local stack is not running")
        return self.server.endpoint

    @property
    def connection(self) -> Connection:
        if self.resources is None:
            raise RuntimeError("the local stack is not running")
        r = self.resources
        return Connection(run_id=r.run_id, bucket=r.bucket, table=r.table, endpoint=r.endpoint, region=r.region,
                          state_topic=r.state_topic, participant_role=local_participant_role(r.run_id),
                          credential_endpoint=self.credentials.url if self.credentials is not None else "")

    def start(self) -> LocalStack:
        check_moto()  # before anything starts (a server process would only fail to come up)
        try:
            self._set_env({**client_environment(self.region), **{name: None for name in _CLEARED}})
            kind = ServerProcess if self.server_process else LocalServer
            self.server = kind(self.port, count_requests=self.count_requests, keep_events=self.count_requests).start()
            _reset_moto(self.server.endpoint)  # a fresh run, even if this process ran one before
            self.resources = create_resources(self.config.run_id, self.server.endpoint, self.region)
            self.access = access.enable_on(self.server, self.config, self.region, self.server.endpoint)
            log.info("%s", self.access)
            if self.access.on:
                self._set_env({ENV_TRACE: "1"})  # this process's functions and the participants it starts
                install_trace()
            self._set_env(function_environment(self.resources, self.config, self.log_level, self.shard_workers != 0))
            self._set_env({ENV_PARTICIPANT_ROLE: local_participant_role(self.config.run_id),
                           ENV_CREDENTIAL_SECONDS: str(self.credential_seconds)})
            if self.log_file is not None:
                self.log_file.parent.mkdir(parents=True, exist_ok=True)
                self._log_stream = self.log_file.open("a", buffering=1)
            self._previous_logs = route_function_logs(self.log_level, self._log_stream)
            if self.dispatch:
                self.dispatcher = Dispatcher(self.resources, self.tick_interval, self.workers, faults=self.faults,
                                             join_workers=self.join_workers, shard_workers=self.shard_workers,
                                             record_spans=self.count_requests)
                self.dispatcher.start(deliver=not self.hold_events)
                self.credentials = LocalCredentialEndpoint().start()
        except BaseException:
            self.stop()
            raise
        return self

    def release_events(self) -> None:
        """Deliver the S3 events held back since `start()` (with `hold_events`), and every one after them."""
        if self.dispatcher is None:
            raise RuntimeError("the local stack is not running")
        self.dispatcher.release()

    def stop(self) -> None:
        """Stop delivering, stop the server, give the environment back. Safe to call twice."""
        # The credential endpoint's and the dispatcher's stops each wait out a poll (0.5 s, and a 1 s long poll of
        # the queues): together, not one after the other
        closing = threading.Thread(target=self.credentials.stop, name="credentials-stop") if self.credentials else None
        if closing is not None:
            closing.start()
        if self.dispatcher is not None:
            self.dispatcher.stop()
            self.dispatcher = None
        if closing is not None:
            closing.join()
            self.credentials = None
        if self.server is not None:
            self.server.stop()
            self.server = None
        if self._previous_logs is not None:
            route_function_logs(*self._previous_logs)
            self._previous_logs = None
        if self._log_stream is not None:
            self._log_stream.close()
            self._log_stream = None
        for name, value in self._saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        self._saved_env = {}

    def __enter__(self) -> LocalStack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _set_env(self, values: Mapping[str, str | None]) -> None:
        for name, value in values.items():
            self._saved_env.setdefault(name, os.environ.get(name))
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _reset_moto(endpoint: str) -> None:
    """moto's backends live in the process, not in the server object: clear what an earlier run left."""
    import urllib.request

    request = urllib.request.Request(f"{endpoint}/moto-api/reset", method="POST", data=b"")
    with urllib.request.urlopen(request, timeout=10) as resp:  # noqa: S310 - loopback, our own server
        resp.read()

