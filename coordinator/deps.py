"""What the coordinator service works with: the run's config and its two stores, bound to one endpoint."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cache

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


@dataclass(frozen=True)
class Deps:
    """The run's config and its two stores, bound to one endpoint."""

    config: RunConfig
    store: StateStore
    bucket: Bucket
    shard_runner: ShardRunner | None = None  # None: threads of the calling process
    schedule: Schedule | None = None  # the tick schedule, switched to what each committed state needs; None: none
    topic: StateTopic | None = None  # announces commits that change phase, round, epoch or model; None: nothing
    # What a warm function remembers between invocations lives here, with what it was read from, so that a test sees
    # it and a fresh `Deps` (`build_deps.cache_clear()`: a cold start) forgets it. `dataclasses.replace` passes it on:
    # the `Deps` derived per invocation (`functions.settings`) share their warm function's.
    # (store.pk, pid) -> the participant's record as intake read it (`coordinator.intake.common.registered`)
    registered: dict[tuple[str, str], ParticipantRecord] = field(default_factory=dict, compare=False, repr=False)


@cache
def build_deps(run_id: str, bucket: str, table: str, config_json: str, endpoint: str | None, region: str,
               state_topic: str = "") -> Deps:
    """One `Deps` per distinct set of names (cached: a Lambda's warm invocations share its clients)."""
    config = RunConfig.model_validate_json(config_json)
    if config.run_id != run_id:
        raise SettingsError(f"the configuration is for run {config.run_id!r}, but the run id is {run_id!r}")
    blobs = Bucket(bucket, s3_client(endpoint, region))
    return Deps(config, StateStore(table, run_id, blobs, endpoint, region), blobs,
                schedule=Schedule.connect(tick_rule_name(run_id), endpoint, region),
                topic=StateTopic.connect(state_topic, endpoint, region))
