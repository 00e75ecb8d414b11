"""What the participant shows: log lines always, rich progress bars when stderr is a terminal."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.logging import RichHandler
from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

LOG_FORMAT = "%(asctime)s %(levelname)-7s %(name)s[%(participant)s] %(message)s"


class _ParticipantFilter(logging.Filter):
    def __init__(self, pid: str) -> None:
        super().__init__()
        self.pid = pid

    def filter(self, record: logging.LogRecord) -> bool:
        record.participant = self.pid
        return True


class Reporter:
    """Progress of downloads, training and uploads: bars on a terminal, nothing extra otherwise
    (the daemon logs one line per finished step either way)."""

    def __init__(self, bars: bool, console: Console | None = None) -> None:
        self.bars = bars
        self.console = console or Console(stderr=True)

    @contextmanager
    def track(self, description: str, total: int, kind: str = "steps") -> Iterator[Callable[[int, int], None]]:
        """Yield `update(done, total)`; draws a transient bar while the block runs."""
        if not self.bars:
            yield lambda done, total: None
            return
        if kind == "bytes":
            columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                       TimeRemainingColumn())
        else:
            columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                       TimeRemainingColumn())
        with Progress(*columns, console=self.console, transient=True) as bar:
            task = bar.add_task(description, total=max(total, 1))
            last = [0.0]

            def update(done: int, new_total: int) -> None:
                now = time.monotonic()
                if done >= new_total or now - last[0] > 0.05:  # keep redraws cheap for tiny steps
                    bar.update(task, completed=done, total=max(new_total, 1))
                    last[0] = now

            yield update


def setup_logging(level: str, pid: str, fancy: bool | None = None) -> Reporter:
    """Configure the `participant` logger (only it: the process may host other code); return the reporter
    sharing its console."""
    fancy = sys.stderr.isatty() if fancy is None else fancy
    console = Console(stderr=True)
    handler: logging.Handler
    if fancy:
        handler = RichHandler(console=console, show_path=False, rich_tracebacks=False, markup=False)
        handler.setFormatter(logging.Formatter("%(message)s"))
    else:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
    handler.addFilter(_ParticipantFilter(pid))
    logger = logging.getLogger("participant")
    for previous in list(logger.handlers):
        logger.removeHandler(previous)
    logger.addHandler(handler)
    logger.setLevel(level.upper())
    logger.propagate = False  # library warnings still reach stderr through logging's last-resort handler
    return Reporter(bars=fancy, console=console)
