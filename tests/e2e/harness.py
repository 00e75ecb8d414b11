"""End-to-end helpers: the local stack in this process, and real `fed-participant start` processes."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from fed.demo import Participants, await_joins, check_processes
from fed.localrun import store_for, wait_until
from local.stack import LocalStack
from participant.tasks import digits_meta
from shared import keys
from shared.config import RunConfig
from shared.state import RunState
from store.blobs import Bucket, s3_client
from store.table import StateStore


def e2e_config(**overrides: Any) -> RunConfig:
    """Small and quick: a few short rounds of the digits task."""
    values: dict[str, Any] = dict(
        run_id="e2e", min_clients=3, min_per_round=3, min_updates=2, total_rounds=3, warmup_time=5,
        max_round_train_time=20, cooldown_time=0, liveness_timeout=6, task=digits_meta.TASK,
        dataset_size=digits_meta.TRAIN_SIZE, local_epochs=1, learning_rate=0.05,
    )
    values.update(overrides)
    # offers of any other model are refused: no participant can make round 0's global one the task cannot load
    values.setdefault("initial_model_schema", digits_meta.MODEL_SCHEMA if values["task"] == digits_meta.TASK else "")
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
        c = stack.connection
        self.bucket = Bucket(c.bucket, s3_client(c.endpoint, c.region))

    @property
    def config(self) -> RunConfig:
        return self.stack.config

    def state(self) -> RunState:
        return self.store.read_state()

    def start_participants(self, names: list[str], tasks: dict[str, str] | None = None,
                           extra: dict[str, list[str]] | None = None) -> None:
        """Spawn them (some with another --task, or other `extra` arguments); deliver events once all have asked to
        join, so the first epoch admits them all."""
        args = {n: ["--task", t] for n, t in (tasks or {}).items()}
        for n, more in (extra or {}).items():
            args[n] = [*args.get(n, []), *more]
        self.procs.spawn(names, args)
        await_joins(self.stack, names, self.procs, timeout=90)
        self.stack.release_events()

    def spawn(self, name: str) -> None:
        """Start one more participant process now (events are already flowing: a late joiner)."""
        self.procs.spawn([name])

    def wait_for(self, predicate: Callable[[], bool], timeout: float, what: str) -> None:
        """Poll `predicate` (failing at once if a participant process dies) until it holds or `timeout` passes."""

        def check() -> bool:
            check_processes(self.procs)
            return predicate()

        # (not much more often: the stack's server and dispatcher share this process, and its interpreter lock)
        if not wait_until(check, timeout, interval=0.25):
            state = self.store.read_state()
            logs = "\n".join(f"--- {n}\n{self.procs.tail(n)}" for n in self.procs.procs)
            pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}; phase {state.phase}, round "
                        f"{state.round}, aggregated {state.aggregated}\n{logs}")

    def fed(self, *args: str) -> tuple[int, str]:
        """Run a `fed` command (in this process) against the run: exit status and output."""
        from fed.cli import app

        result = CliRunner().invoke(app, [*args, "--connection", str(self.connection_file)])
        crash = f"\n{type(result.exception).__name__}: {result.exception}" if result.exit_code == 1 and \
            result.exception is not None and not isinstance(result.exception, SystemExit) else ""
        return result.exit_code, result.output + crash

    def accuracy(self, round_no: int, model_digest: str) -> float:
        """Test accuracy of round `round_no`'s global model, evaluated with the digits task in this process."""
        import torch

        from participant.tasks.digits import task
        from participant.tensors import load_into

        data = self.bucket.get(keys.global_key(self.config.run_id, round_no, model_digest)).data
        model = load_into(task.build_model(0), data)
        return float(task.evaluate(model, torch.device("cpu"))["test_accuracy"])
