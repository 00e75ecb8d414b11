"""What the participant shows: log lines always, rich progress bars when stderr is a terminal.

A transfer (a model file going to or from the bucket) shows on a terminal as a bar with its MB, MB/s and time
left; elsewhere (a log file, a service's journal) as a log line every LOG_EVERY seconds while it runs, with the MB
done of the total and the MB/s so far.
"""

from __future__ import annotations

import logging
import math
import sys
import threading
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
    ProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

LOG_FORMAT = "%(asctime)s %(levelname)-7s %(name)s[%(participant)s] %(message)s"
LOG_EVERY = 5.0  # seconds between the progress lines of a transfer when there are no bars
MB = 1_000_000

log = logging.getLogger("participant")


class _ParticipantFilter(logging.Filter):
    def __init__(self, pid: str) -> None:
        super().__init__()
        self.pid = pid

    def filter(self, record: logging.LogRecord) -> bool:
        record.participant = self.pid
        return True


class TransferLog:
    """`update(done, total)` of a transfer as log lines, at most one every `every` seconds (none for a transfer
    shorter than that); safe to call from the transfer's worker threads."""

    def __init__(self, description: str, every: float = LOG_EVERY, clock: Callable[[], float] = time.monotonic) -> None:
        self.description, self.every, self.clock = description, every, clock
        self.started = self.last = clock()
        self._lock = threading.Lock()

    def __call__(self, done: int, total: int) -> None:
        now = self.clock()
        with self._lock:
            if now - self.last < self.every:
                return
            self.last = now
        rate = done / MB / max(now - self.started, 1e-9)
        if total > 0:
            left = (total - done) / MB / rate if rate > 0 else math.inf
            log.info("%s: %.1f of %.1f MB (%d%%), %.1f MB/s, %s left", self.description, done / MB, total / MB,
                     100 * done // total, rate, f"{left:.0f}s" if math.isfinite(left) else "?")
        else:
            log.info("%s: %.1f MB, %.1f MB/s", self.description, done / MB, rate)


class Reporter:
    """Progress of downloads, training and uploads: bars on a terminal; otherwise, for transfers, a log line every
    few seconds (the daemon logs one line per finished step either way)."""

    def __init__(self, bars: bool, console: Console | None = None, log_every: float = LOG_EVERY) -> None:
        self.bars = bars
        self.console = console or Console(stderr=True)
        self.log_every = log_every

    @contextmanager
    def track(self, description: str, total: int, kind: str = "steps") -> Iterator[Callable[[int, int], None]]:
        """Yield `update(done, total)`; draws a transient bar while the block runs (`kind` "bytes": a transfer,
        with MB, MB/s and time left; logged every few seconds instead when there are no bars)."""
        if not self.bars:
            yield TransferLog(description, self.log_every) if kind == "bytes" else (lambda done, total: None)
            return
        columns: tuple[ProgressColumn, ...]
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
