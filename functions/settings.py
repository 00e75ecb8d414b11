"""What a function needs to know, parsed once from its environment (never at import time)."""

from __future__ import annotations

import dataclasses
import os

from coordinator.deps import Deps, SettingsError, build_deps
from functions.shard_runners import runner_for
from shared.naming import (
    ENV_BUCKET,
    ENV_CONFIG,
    ENV_ENDPOINT,
    ENV_RUN_ID,
    ENV_SHARD_RUNNER,
    ENV_STATE_TOPIC,
    ENV_TABLE,
)

__all__ = ["Deps", "SettingsError", "deps_from_env"]


def _need(name: str) -> str:
    value = os.environ.get(name)
    if not value:
        raise SettingsError(f"environment variable {name} is not set")
    return value


def deps_from_env() -> Deps:
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
    deps = build_deps(
        _need(ENV_RUN_ID), _need(ENV_BUCKET), _need(ENV_TABLE), _need(ENV_CONFIG), os.environ.get(ENV_ENDPOINT), region,
        os.environ.get(ENV_STATE_TOPIC, ""),
    )
    runner = runner_for(os.environ.get(ENV_SHARD_RUNNER, ""))
    return dataclasses.replace(deps, shard_runner=runner) if runner is not None else deps
