"""End-to-end fixtures: the local stack in this process, and real `fed-participant start` processes."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from local.stack import LocalStack
from shared.config import RunConfig
from tests.e2e.harness import Run


@pytest.fixture()
def local_run(tmp_path: Path) -> Iterator[Callable[[RunConfig], Run]]:
    """Start the local stack for a config (S3 events held until participants joined); stop it all after."""
    runs: list[Run] = []

    def start(config: RunConfig) -> Run:
        stack = LocalStack(config, tick_interval=0.5, log_file=tmp_path / "functions.log", log_level="INFO",
                           hold_events=True)
        stack.start()
        run = Run(stack, tmp_path)
        runs.append(run)
        return run

    yield start
    for run in runs:
        run.procs.stop()
        run.stack.stop()
