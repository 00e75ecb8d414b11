"""A `Deps` on the in-memory fakes: the service layer without AWS (and without moto)."""

from __future__ import annotations

from coordinator.deps import Deps
from shared.config import RunConfig
from tests.fakes.bucket import FakeBucket
from tests.fakes.store import FakeStateStore


def fake_deps(config: RunConfig, now: float | None = None) -> Deps:
    """The run's `Deps` on a new `FakeBucket` (its uploads stamped at `now`; None: the wall clock) and a
    `FakeStateStore` of their own; no schedule, no topic, aggregation shards in threads of this process."""
    bucket = FakeBucket(now=now)
    return Deps(config, FakeStateStore(config.run_id, bucket), bucket)
