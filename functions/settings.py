"""What a function needs to know, parsed from its environment on first use (never at import time), and what a warm
function keeps between invocations: one `Deps` per environment, with its clients and its warm caches.

The coordinator is imported on first use too: the credential endpoint's function needs none of the run's
configuration, aggregation or numpy, and its cold start (what a stranger's request can cost) does not pay for them.
"""

from __future__ import annotations

import dataclasses
import os
from functools import cache
from typing import TYPE_CHECKING

from shared.hosts import HostLimits
from shared.naming import (
    ENV_ALL_HOSTS_RATE,
    ENV_BUCKET,
    ENV_CONFIG,
    ENV_CREDENTIAL_SECONDS,
    ENV_ENDPOINT,
    ENV_HOST_RATE,
    ENV_PARTICIPANT_ROLE,
    ENV_RUN_ID,
    ENV_SHARD_RUNNER,
    ENV_SHARD_WAIT,
    ENV_STATE_TOPIC,
    ENV_TABLE,
)

if TYPE_CHECKING:
    from coordinator.credentials import CredentialDeps
    from coordinator.deps import Deps

__all__ = ["credential_deps_from_env", "deps_from_env", "forget_warm_state"]

def _settings_error(message: str) -> Exception:
    """coordinator.deps.SettingsError (imported only when there is one to raise)."""
    from coordinator.deps import SettingsError

    return SettingsError(message)


DEFAULT_SHARD_WAIT = 900.0  # seconds a tick waits for its shards' outcomes when FED_SHARD_WAIT is not set


def _need(name: str) -> str:
    value = os.environ.get(name)
    if not value:
        raise _settings_error(f"environment variable {name} is not set")
    return value


def deps_from_env() -> Deps:
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
    return _warm(_need(ENV_RUN_ID), _need(ENV_BUCKET), _need(ENV_TABLE), _need(ENV_CONFIG),
                 os.environ.get(ENV_ENDPOINT) or None, region, os.environ.get(ENV_STATE_TOPIC, ""),
                 os.environ.get(ENV_SHARD_RUNNER, ""), os.environ.get(ENV_SHARD_WAIT, ""))


def forget_warm_state() -> None:
    """Every function starts cold (tests that start a new AWS, where the same names may hold other things)."""
    _warm.cache_clear()
    _warm_credentials.cache_clear()


@cache
def _warm(run_id: str, bucket: str, table: str, config_json: str, endpoint: str | None, region: str,
          state_topic: str, shard_runner: str, shard_wait: str) -> Deps:
    """One `Deps` per distinct environment: a Lambda's warm invocations share its clients and what it remembers.
    FED_SHARD_RUNNER is "queue:<url>" (the shard queue, as deployed) or unset (the tick's own threads)."""
    from coordinator.deps import build_deps
    from coordinator.shard_queue import queue_runner

    deps = build_deps(run_id, bucket, table, config_json, endpoint, region, state_topic)
    kind, _, url = shard_runner.partition(":")
    if not kind:
        return deps
    if kind != "queue" or not url:
        raise _settings_error(f"{ENV_SHARD_RUNNER} is {shard_runner!r}: expected queue:<url>, or unset")
    wait = float(shard_wait or DEFAULT_SHARD_WAIT)
    runner = queue_runner(url, deps.bucket, run_id, wait, endpoint, region)
    return dataclasses.replace(deps, shard_runner=runner)


def credential_deps_from_env() -> CredentialDeps:
    """The credential endpoint's `CredentialDeps` (it needs no run configuration: only where the run lives, the
    participant role it issues sessions of and its limits)."""
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
    return _warm_credentials(_need(ENV_RUN_ID), _need(ENV_BUCKET), _need(ENV_TABLE),
                             os.environ.get(ENV_ENDPOINT) or None, region, os.environ.get(ENV_STATE_TOPIC, ""),
                             _need(ENV_PARTICIPANT_ROLE), os.environ.get(ENV_CREDENTIAL_SECONDS, ""),
                             os.environ.get(ENV_HOST_RATE, ""), os.environ.get(ENV_ALL_HOSTS_RATE, ""))


def _positive(name: str, text: str, default: int) -> int:
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise _settings_error(f"environment variable {name} is {text!r}: expected a positive whole number")
    return value


@cache
def _warm_credentials(run_id: str, bucket: str, table: str, endpoint: str | None, region: str, state_topic: str,
                      role: str, seconds: str, host_rate: str, all_rate: str) -> CredentialDeps:
    """One `CredentialDeps` per distinct environment, as `_warm` keeps one `Deps`."""
    from coordinator.credentials import build_credential_deps

    default = HostLimits()
    limits = HostLimits(
        credential_seconds=_positive(ENV_CREDENTIAL_SECONDS, seconds, default.credential_seconds),
        per_host_per_minute=_positive(ENV_HOST_RATE, host_rate, default.per_host_per_minute),
        all_hosts_per_minute=_positive(ENV_ALL_HOSTS_RATE, all_rate, default.all_hosts_per_minute),
    )
    return build_credential_deps(run_id, bucket, table, endpoint, region, state_topic, role, limits)
