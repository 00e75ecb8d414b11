"""What a function needs to know, parsed once from its environment (never at import time)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cache

from shared.blobs import Bucket, s3_client
from shared.config import RunConfig
from shared.naming import ENV_BUCKET, ENV_CONFIG, ENV_ENDPOINT, ENV_RUN_ID, ENV_TABLE
from shared.store import StateStore


class SettingsError(RuntimeError):
    pass


@dataclass(frozen=True)
class Deps:
    """The run's config and its two stores, bound to one endpoint."""

    config: RunConfig
    store: StateStore
    bucket: Bucket


def _need(name: str) -> str:
    value = os.environ.get(name)
    if not value:
        raise SettingsError(f"environment variable {name} is not set")
    return value


@cache
def _deps(run_id: str, bucket: str, table: str, config_json: str, endpoint: str | None, region: str) -> Deps:
    config = RunConfig.model_validate_json(config_json)
    if config.run_id != run_id:
        raise SettingsError(f"{ENV_CONFIG} is for run {config.run_id!r}, but {ENV_RUN_ID} is {run_id!r}")
    return Deps(config, StateStore(table, run_id, endpoint, region), Bucket(bucket, s3_client(endpoint, region)))


def deps_from_env() -> Deps:
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
    return _deps(
        _need(ENV_RUN_ID), _need(ENV_BUCKET), _need(ENV_TABLE), _need(ENV_CONFIG), os.environ.get(ENV_ENDPOINT), region
    )
