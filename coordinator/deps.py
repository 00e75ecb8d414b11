"""What the coordinator service works with: the run's config and its two stores, bound to one endpoint."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from shared.config import RunConfig
from shared.messages import ShardDone, ShardTask
from shared.naming import tick_rule_name
from store.blobs import Bucket, s3_client
from store.push import StateTopic
from store.schedule import Schedule
from store.table import ParticipantRecord, StateStore


class SettingsError(RuntimeError):
    pass


# Runs aggregation shard tasks somewhere (threads of this process, worker processes, a shard-worker Lambda) and
# returns their results in order; raises if a task failed after its retries (`coordinator.aggregation`).
ShardRunner = Callable[[Sequence[ShardTask]], list[ShardDone]]


@dataclass
class WarmModels:
    """Global models a warm function has authenticated (by bucket and key) and, for small ones, holds in memory (by
    key and version): a few at most (`coordinator.model_files`). The lock is taken to fill either, so that
    concurrent invocations in one process (the local stack's functions are threads; a round's updates are ingested
    together) authenticate and read a model once, not once each."""

    verified: dict[tuple[str, str], Any] = field(default_factory=dict)
    held: dict[tuple[str, str], Any] = field(default_factory=dict)
    lock: threading.RLock = field(default_factory=threading.RLock)


@dataclass(frozen=True)
class Deps:
    """The run's config and its two stores, bound to one endpoint."""

    config: RunConfig
    store: StateStore
    bucket: Bucket
    shard_runner: ShardRunner | None = None  # None: threads of the calling process
    schedule: Schedule | None = None  # the tick schedule, switched to what each committed state needs; None: none
    topic: StateTopic | None = None  # announces commits that change phase, round, epoch or model; None: nothing
    # What a warm function remembers between invocations lives here, so that a test sees it and a fresh `Deps` (a
    # cold start) forgets it. `dataclasses.replace` passes it on: the `Deps` derived from a warm function's share it.
    # (store.pk, pid) -> the participant's record as intake read it (`coordinator.intake.common.registered`)
    registered: dict[tuple[str, str], ParticipantRecord] = field(default_factory=dict, compare=False, repr=False)
    models: WarmModels = field(default_factory=WarmModels, compare=False, repr=False)


def build_deps(run_id: str, bucket: str, table: str, config_json: str, endpoint: str | None, region: str,
               state_topic: str = "") -> Deps:
    """The run's `Deps` from the names its functions are given (`functions.settings` keeps one per warm function)."""
    config = RunConfig.model_validate_json(config_json)
    if config.run_id != run_id:
        raise SettingsError(f"the configuration is for run {config.run_id!r}, but the run id is {run_id!r}")
    blobs = Bucket(bucket, s3_client(endpoint, region))
    return Deps(config, StateStore(table, run_id, blobs, endpoint, region), blobs,
                schedule=Schedule.connect(tick_rule_name(run_id), endpoint, region),
                topic=StateTopic.connect(state_topic, endpoint, region))
