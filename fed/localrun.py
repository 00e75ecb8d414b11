"""`fed local`: the local stack in the foreground, until Ctrl-C, with a line per finished round."""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from rich.console import Console
from rich.markup import escape

from local.moto.pin import MotoVersionMismatch
from local.stack import LocalStack
from participant.tasks import digits_meta
from shared.config import RunConfig
from shared.state import Phase, RoundSummary
from store.blobs import Tampered
from store.connection import DEFAULT_LOCAL_FILE, Connection
from store.table import StateStore

LOCAL_RUN_ID = "local"

log = logging.getLogger("fed.local")
T = TypeVar("T")


def default_local_config(run_id: str = LOCAL_RUN_ID, **overrides: Any) -> RunConfig:
    """A run for trying things by hand: two or more participants on the built-in digits task."""
    values: dict[str, Any] = dict(
        run_id=run_id,
        min_clients=2,
        fraction_per_round=1.0,
        min_per_round=2,
        min_updates=1,
        total_rounds=20,
        rounds_per_epoch=0,
        warmup_time=10.0,
        max_round_train_time=60.0,
        round_witness_time=0.0,
        cooldown_time=0.0,
        liveness_timeout=20.0,
        task=digits_meta.TASK,
        dataset_size=digits_meta.TRAIN_SIZE,
        local_epochs=1,
        batch_size=32,
        learning_rate=0.05,
    )
    values.update(overrides)
    # offers of any other model are refused: no participant can make round 0's global one the task cannot load
    values.setdefault("initial_model_schema", digits_meta.MODEL_SCHEMA if values["task"] == digits_meta.TASK else "")
    return RunConfig(**values)


class RoundFollower:
    """Yield each round summary once, in round order, as the coordinator records them."""

    def __init__(self, store: StateStore) -> None:
        self.store = store
        self.seen: set[int] = set()

    def new(self) -> list[RoundSummary]:
        fresh = [s for s in sorted(self.store.rounds(), key=lambda s: s.round) if s.round not in self.seen]
        self.seen.update(s.round for s in fresh)
        return fresh


class RunFollower:
    """What `fed local` prints while it serves a run: a line per recorded round (`RoundFollower`) and one when the
    run finishes.

    Following only observes: the stack holds the run in memory, and whatever a read meets (the server busy or
    refusing, an object the state names found altered: `Tampered`) must not end the process that holds it. A failed
    read is reported once, with what was being read and the error, then tried again at each poll; its recovery is
    reported too."""

    def __init__(self, store: StateStore) -> None:
        self.store = store
        self.rounds = RoundFollower(store)
        self.finished = False
        self.failing: dict[str, str] = {}  # what -> the error last reported for it (until it reads again)

    def poll(self) -> list[str]:
        """The lines to print now (rich markup); never raises an Exception."""
        lines: list[str] = []
        summaries = self._read("the recorded rounds", self.rounds.new, lines)
        lines += [describe_round(s) for s in summaries or []]
        state = self._read("the run state", self.store.read_state, lines)
        if state is not None and state.phase is Phase.FINISHED and not self.finished:
            self.finished = True
            lines.append(f"[green]run finished[/]: {state.aggregated} rounds aggregated; the stack stays up for "
                         "`fed status` until Ctrl-C")
        return lines

    def _read(self, what: str, read: Callable[[], T], lines: list[str]) -> T | None:
        try:
            value = read()
        except Exception as exc:  # noqa: BLE001 - reported, and tried again at the next poll
            error = f"{type(exc).__name__}: {exc}"
            if self.failing.get(what) != error:
                self.failing[what] = error
                log.warning("reading %s of run %s failed; the stack keeps the run and reads again each poll",
                            what, self.store.run_id, exc_info=exc)
                hint = (" (an object the committed state names no longer holds the bytes its digest names: "
                        "something wrote over it; `fed verify` checks the run)" if isinstance(exc, Tampered) else "")
                lines.append(f"[yellow]reading {what} of run {self.store.run_id!r} failed: {error[:500]}{hint}; the "
                             "stack keeps the run and reads again each second[/]")
            return None
        if self.failing.pop(what, None) is not None:
            lines.append(f"reading {what} works again")
        return value


def store_for(connection: Connection) -> StateStore:
    return StateStore.of(connection)


def describe_round(s: RoundSummary) -> str:
    loss = f"{s.loss:.4f}" if s.loss is not None else "-"
    what = "aggregated" if s.aggregated else "not aggregated (too few updates): model carried over"
    extra = ""
    if s.refused:
        extra += "  refused: " + ", ".join(f"{p} ({r})" for p, r in sorted(s.refused.items()))
    if s.dropped:
        extra += "  dropped: " + ", ".join(f"{p} ({r})" for p, r in sorted(s.dropped.items()))
    return (f"round {s.round} {what}: {len(s.counted)}/{len(s.selected)} updates, loss {loss}, "
            f"{s.seconds:.1f}s{extra}")


def participant_hint(connection_file: Path, names: tuple[str, ...] = ("alice", "bob")) -> list[str]:
    return [f"fed-participant start --connection {connection_file} --id {name}" for name in names]


def run_local(
    config: RunConfig,
    port: int,
    tick_interval: float,
    connection_file: Path = DEFAULT_LOCAL_FILE,
    log_file: Path | None = None,
    log_level: str = "INFO",
    console: Console | None = None,
    stop: threading.Event | None = None,
) -> int:
    """Serve the run until Ctrl-C (or `stop` is set); print a line per round and when the run finishes."""
    console = console or Console()
    stop = stop or threading.Event()
    log_file = log_file or connection_file.parent / "local.log"
    stack = LocalStack(config, port=port, tick_interval=tick_interval, log_file=log_file, log_level=log_level,
                       server_process=True)
    previous = _on_signals(stop)
    try:
        with console.status("starting moto's server and the run's resources"):
            try:
                stack.start()
            except OSError as exc:
                console.print(f"[red]cannot start the local endpoint on 127.0.0.1:{port or 'any port'}: {exc}[/]")
                return 1
            except MotoVersionMismatch as exc:
                console.print(f"[red]{escape(str(exc))}[/]")
                return 1
        stack.connection.save(connection_file)
        console.print(f"[bold]local run {config.run_id!r}[/] on {stack.endpoint} (moto; state is in memory)")
        console.print(f"connection: {connection_file}   function logs: {log_file}")
        console.print(f"{stack.access} (FED_ACCESS_CHECK=enforce|record|off)")
        console.print(f"run: {config.total_rounds} rounds of {config.task}, min_clients {config.min_clients}, "
                      f"round deadline {config.max_round_train_time:g}s, liveness timeout {config.liveness_timeout:g}s")
        console.print(f"waiting for {config.min_clients} participants; in other terminals run:")
        names = tuple(f"p{i}" for i in range(1, config.min_clients + 1))
        for line in participant_hint(connection_file, names):
            console.print(f"  [cyan]{line}[/]")
        console.print(f"and watch it with:\n  [cyan]fed status --connection {connection_file} --watch[/]")
        console.print("Ctrl-C stops the stack.")
        follower = RunFollower(store_for(stack.connection))
        while not stop.wait(1.0):
            for line in follower.poll():
                console.print(line)
    finally:
        _restore_signals(previous)
        dispatcher = stack.dispatcher
        with console.status("stopping"):
            stack.stop()
        if dispatcher is not None:
            stats = dispatcher.stats
            console.print(f"delivered {stats.delivered} events ({stats.joins_delivered} join requests, by their own "
                          f"lane), {stats.ticks} scheduled ticks")
    return 0


def _on_signals(stop: threading.Event) -> dict[int, Any]:
    """Ctrl-C and SIGTERM set `stop` (only possible from the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    previous: dict[int, Any] = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        previous[sig] = signal.signal(sig, lambda *_: stop.set())
    return previous


def _restore_signals(previous: dict[int, Any]) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)


def wait_until(predicate: Callable[[], bool], timeout: float, interval: float = 0.2) -> bool:
    """Poll `predicate` until it holds or `timeout` passes; True if it held."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)
