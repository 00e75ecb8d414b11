"""The demo's run, start to end: the local stack and the participants started, the rounds followed as the
coordinator records them (each global model evaluated), a participant killed mid-round if asked, the report
written, and everything stopped. The demo only observes: it never drives the run itself."""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from fed.demo.errors import DemoFailed
from fed.demo.options import DemoOptions, check_members, resolve_config, throttles, with_task_split
from fed.demo.processes import Participants, await_joins, check_processes
from fed.demo.report import (
    HEADER,
    LOSS_HEADER,
    RoundRow,
    demo_report,
    evaluate,
    format_row,
    format_sizing,
    headline,
    plot_rounds,
    print_sizing,
    round_row,
    write_report,
)
from fed.demo.tasks import reports_loss, steps_with_torch_optim
from fed.evaluation import Evaluator
from fed.hosts import invite
from fed.localrun import RoundFollower, store_for
from local.stack import LocalStack
from shared.config import RunConfig
from shared.state import Phase

INVITE_SECONDS = 3600  # how long the demo's invites may be redeemed (--invites)
EXIT_GRACE = 20.0  # after the run finished, how long participants get to notice and exit


def run_demo(opts: DemoOptions, console: Console | None = None) -> dict[str, Any]:
    """Run the demo to the end; return the report (also written to `opts.report`). Raises DemoFailed."""
    console = console or Console()
    opts = with_task_split(opts)
    config = resolve_config(opts)
    check_members(opts, config)
    started = time.monotonic()
    marks = {"run_demo": time.time()}  # start-up's milestones, epoch seconds (the report's "timeline")
    workdir = opts.workdir or Path(tempfile.mkdtemp(prefix="fed-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    # Events are held until every participant has asked to join only where the first epoch could start without
    # some of them (fewer needed than started: --kill-one): it admits only who it has heard from.
    hold = config.min_clients < opts.participants
    stack = LocalStack(config, tick_interval=opts.tick_interval, log_file=workdir / "functions.log",
                       log_level="INFO", hold_events=hold, count_requests=opts.count_requests, server_process=True)
    procs: Participants | None = None
    evaluator: Evaluator | None = None
    ok = False
    try:
        connection_file = workdir / "connection.json"
        procs = Participants(connection_file, workdir, forked=True,  # (the zygote's imports overlap the stack's start)
                             torch_optimizers=steps_with_torch_optim(config.task))
        stack.start()
        marks["stack_started"] = time.time()
        stack.connection.save(connection_file)
        _announce(console, opts, config, stack, workdir, connection_file)
        names = [f"p{i}" for i in range(1, opts.participants + 1)]
        speeds = throttles(names, opts.mixed_speeds)
        invites = {n: invite(stack.connection, n, INVITE_SECONDS) for n in names} if opts.invites else None
        procs.spawn(names, _participant_args(names, speeds, opts.split, console), invites)
        marks["participants_started"] = time.time()  # (forked once the zygote's imports are done)
        evaluator = Evaluator(config, connection_file, workdir / "logs" / "evaluator.log",
                              lambda args, log: procs.start_helper("fed.evaluation", args, log))
        with console.status(f"starting {len(names)} participant processes"):
            await_joins(stack, names, procs)
        marks["joins_seen"] = time.time()
        if hold:
            stack.release_events()  # every participant has asked to join: the first epoch admits them all
        by_loss = reports_loss(config.task)
        rows = _follow(stack, config, opts, procs, evaluator, console, started, by_loss)
        marks["finished_seen"] = time.time()
        final = store_for(stack.connection).read_state()
        final_eval = evaluate(evaluator, final.round, final.global_digest)
        marks["final_evaluated"] = time.time()
        procs.wait_exit(EXIT_GRACE)
        marks["participants_exited"] = time.time()
        wall = time.monotonic() - started
        report = demo_report(config, opts, rows, final, final_eval, wall,
                             [p.name for p in procs.procs.values() if p.killed], speeds,
                             stack.server.requests if stack.server is not None else None,
                             {"marks": marks, "invocations": stack.dispatcher.spans} if stack.dispatcher else None)
        if opts.mixed_speeds:
            print_sizing(console, report["sizing"])
        if opts.report is not None:
            write_report(report, opts.report)
        if opts.plot is not None:
            plot_rounds(rows, opts.plot, f"fed demo: {opts.participants} participants, {config.task}", by_loss,
                        console)
        console.print(f"[green]finished[/]: {final.aggregated} rounds in {wall:.1f}s, {headline(final_eval, by_loss)}"
                      + (f"; report: {opts.report}" if opts.report else "")
                      + (f"; plot: {opts.plot}" if opts.plot else ""))
        ok = True
        return report
    finally:
        if evaluator is not None:
            evaluator.stop()
        if procs is not None:
            procs.stop()
        stack.stop()
        if ok and not opts.keep and opts.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
        elif not ok:
            console.print(f"logs kept in {workdir}")


def _announce(console: Console, opts: DemoOptions, config: RunConfig, stack: LocalStack, workdir: Path,
              connection_file: Path) -> None:
    """The opening lines: what runs where, where the logs are, how to watch, and whether access is checked."""
    console.print(f"[bold]fed demo[/]: {opts.participants} participants, {config.total_rounds} rounds of "
                  f"{config.task} on {stack.endpoint}")
    console.print(f"logs: {workdir / 'logs'}   watch: fed status --connection {connection_file} --watch")
    console.print(str(stack.access))


def _participant_args(names: list[str], speeds: dict[str, float], split: str | None,
                      console: Console) -> dict[str, list[str]]:
    """Each participant's own arguments: its part of the data with --split, its --throttle when slowed (said)."""
    extra = {name: ["--data", f"{split}:{i}/{len(names)}"] if split else [] for i, name in enumerate(names)}
    for name, throttle in speeds.items():
        if throttle < 1:
            extra[name] += ["--throttle", str(throttle)]
            console.print(f"{name} trains at {throttle:g} of this host's speed (--throttle {throttle:g})")
    return extra


def _follow(stack: LocalStack, config: RunConfig, opts: DemoOptions, procs: Participants, evaluator: Evaluator,
            console: Console, started: float, by_loss: bool = False) -> list[RoundRow]:
    """Print a row per recorded round until the run is Finished; kill a participant if asked."""
    store = store_for(stack.connection)
    follower = RoundFollower(store)
    rows: list[RoundRow] = []
    victim = sorted(procs.procs)[-1] if opts.kill_one else None
    console.print(LOSS_HEADER if by_loss else HEADER)
    deadline = started + opts.timeout

    def record_new_rounds() -> None:
        for summary in follower.new():
            row = round_row(summary, evaluator, by_loss, store, config.download.is_delta)
            rows.append(row)
            console.print(format_row(row))
            if opts.mixed_speeds:
                console.print(format_sizing(row))

    while True:
        check_processes(procs)
        state = store.read_state()
        record_new_rounds()
        if victim is not None and not procs.procs[victim].killed:
            _maybe_kill(procs, store, state, victim, len(rows), opts.kill_after_round, console)
        if state.phase is Phase.FINISHED:
            record_new_rounds()  # the closing tick records the last round with the state
            return rows
        if time.monotonic() > deadline:
            raise DemoFailed(
                f"the run did not finish within {opts.timeout:.0f}s: phase {state.phase}, round {state.round}, "
                f"{state.aggregated}/{config.total_rounds} rounds aggregated"
            )
        time.sleep(0.25)


def _maybe_kill(procs: Participants, store: Any, state: Any, victim: str, rounds_seen: int, after: int,
                console: Console) -> None:
    """Kill the victim while it is selected for a round it has not delivered yet: mid-round."""
    if rounds_seen < after or state.phase is not Phase.TRAIN or victim not in state.selected:
        return
    if store.update_record(state.round, victim) is not None:
        return
    procs.kill(victim)
    console.print(f"[yellow]killed participant {victim} (SIGKILL) during round {state.round}[/]")
