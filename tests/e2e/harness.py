"""End-to-end helpers: the local stack in this process, and real `fed-participant start` processes."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from fed.demo import Participants, await_joins, check_processes
from fed.localrun import store_for, wait_until
from infra.local.stack import LocalStack
from participant.tasks import digits_meta
from shared.config import RunConfig
from shared.store import StateStore


def e2e_config(**overrides: Any) -> RunConfig:
    """Small and quick: a few short rounds of the digits task."""
    values: dict[str, Any] = dict(
        run_id="e2e", min_clients=3, min_per_round=3, min_updates=2, total_rounds=3, warmup_time=5,
        max_round_train_time=20, cooldown_time=0, liveness_timeout=6, task=digits_meta.TASK,
        dataset_size=digits_meta.TRAIN_SIZE, local_epochs=1, learning_rate=0.05,
    )
    values.update(overrides)
    return RunConfig(**values)


class Run:
    """A started local stack plus participant processes, and ways to wait on what the coordinator records."""

    def __init__(self, stack: LocalStack, workdir: Path) -> None:
        self.stack = stack
        self.workdir = workdir
        self.connection_file = workdir / "connection.json"
        stack.connection.save(self.connection_file)
        self.procs = Participants(self.connection_file, workdir)
        self.store: StateStore = store_for(stack.connection)

    def start_participants(self, names: list[str]) -> None:
        """Spawn them; deliver events once all have asked to join, so the first epoch admits them all."""
        self.procs.spawn(names)
        await_joins(self.stack, names, self.procs, timeout=90)
        self.stack.release_events()

    def wait_for(self, predicate: Callable[[], bool], timeout: float, what: str) -> None:
        """Poll `predicate` (failing at once if a participant process dies) until it holds or `timeout` passes."""

        def check() -> bool:
            check_processes(self.procs)
            return predicate()

        if not wait_until(check, timeout, interval=0.05):
            state = self.store.read_state()
            logs = "\n".join(f"--- {n}\n{self.procs.tail(n)}" for n in self.procs.procs)
            pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}; phase {state.phase}, round "
                        f"{state.round}, aggregated {state.aggregated}\n{logs}")
