"""`fed`: run the coordinator on this machine (`local`, `demo`) and look at any run (`status`)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import typer
from rich.console import Console

from shared.config import ConfigError, RunConfig, load_config
from shared.connection import DEFAULT_LOCAL_FILE, Connection, ConnectionError_

app = typer.Typer(
    name="fed",
    help=(
        "A serverless, event-driven federated-training coordinator on S3 + DynamoDB.\n\n"
        "`fed local` and `fed demo` run the whole system on this machine, with moto's server standing in for "
        "AWS; `fed status` shows a run, local or deployed."
    ),
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode="markdown",
)
console = Console()
err = Console(stderr=True)


def _load(config: Path | None) -> RunConfig | None:
    if config is None:
        return None
    try:
        return load_config(config)
    except ConfigError as exc:
        err.print(f"[red]{exc}[/]")
        raise typer.Exit(2) from None


@app.command()
def local(
    config: Path | None = typer.Option(
        None, "--config", "-c", exists=True, dir_okay=False,
        help="Run configuration (TOML; keys under [run] or at the top). Default: run `local`, the built-in "
        "digits task, 2 participants, 20 rounds.",
    ),
    port: int = typer.Option(0, "--port", "-p", min=0, max=65535, help="Port of the local endpoint; 0: a free one."),
    tick_interval: float = typer.Option(
        1.0, "--tick-interval", min=0.05,
        help="Seconds between scheduled ticks (the deadline safety net; 1 min on AWS).",
    ),
    connection_file: Path = typer.Option(
        DEFAULT_LOCAL_FILE, "--connection",
        help="Where to write the connection file participants and `fed status` read.",
    ),
    log_file: Path | None = typer.Option(
        None, "--log-file", help="The coordinator functions' JSON logs. Default: local.log beside the connection file."
    ),
    log_level: str = typer.Option("INFO", "--log-level", help="Level of the functions' logs: DEBUG, INFO, WARNING."),
) -> None:
    """Run the coordinator on this machine until Ctrl-C: moto's server on 127.0.0.1, the run's bucket, table,
    S3 -> EventBridge -> queue wiring, and a dispatcher that delivers S3 events and scheduled ticks to the same
    handler functions the Lambdas run.

    Writes the connection file (default `.fed/local.json`); start participants in other terminals with
    `fed-participant start --connection .fed/local.json --id NAME` and watch with `fed status --watch`.
    State lives in memory: stopping the stack ends the run.
    """
    from fed.localrun import default_local_config, run_local

    cfg = _load(config) or default_local_config()
    raise typer.Exit(run_local(cfg, port, tick_interval, connection_file, log_file, log_level.upper(), console))


@app.command()
def demo(
    participants: int = typer.Option(4, "--participants", "-n", min=1, help="Participant processes to start."),
    rounds: int | None = typer.Option(
        None, "--rounds", "-r", min=1, help="Rounds to aggregate. Default: 20, or the --config file's total_rounds."
    ),
    report: Path | None = typer.Option(
        None, "--report", help="Write the report JSON here: config, per-round rows, final accuracy, wall time."
    ),
    config: Path | None = typer.Option(
        None, "--config", "-c", exists=True, dir_okay=False,
        help="Run configuration (TOML) instead of the demo's: quick rounds of the built-in digits task.",
    ),
    kill_one: bool = typer.Option(
        False, "--kill-one",
        help="SIGKILL one participant in the middle of a round: the coordinator drops it and the run goes on "
        "(the demo's default config then needs only N-1 members).",
    ),
    timeout: float = typer.Option(600.0, "--timeout", min=1, help="Give up (exit 1) if the run has not finished."),
    tick_interval: float = typer.Option(1.0, "--tick-interval", min=0.05, help="Seconds between scheduled ticks."),
    workdir: Path | None = typer.Option(
        None, "--workdir", help="Where participants keep their state and logs. Default: a temporary directory, "
        "removed after a successful run and kept after a failed one.",
    ),
) -> None:
    """Train a real model on this machine: the local stack plus N `fed-participant start` processes.

    Prints a row per round as it finishes (participants, accepted and refused updates, training loss, the test
    accuracy of the round's new global model, seconds) and writes the report JSON. Exits non-zero with the reason
    if a participant process fails or the run does not finish within --timeout. Ctrl-C stops everything.
    """
    from fed.demo import DemoFailed, DemoOptions, run_demo

    options = DemoOptions(participants=participants, rounds=rounds, report=report, config=_load(config),
                          kill_one=kill_one, timeout=timeout, tick_interval=tick_interval, workdir=workdir)
    try:
        run_demo(options, console)
    except DemoFailed as exc:
        err.print(f"[red]demo failed:[/] {exc}")
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        err.print("interrupted: participants and the local stack stopped")
        raise typer.Exit(130) from None


@app.command()
def status(
    connection_file: Path | None = typer.Option(
        None, "--connection",
        help=f"A local run's connection file (default {DEFAULT_LOCAL_FILE}, written by `fed local`).",
    ),
    stack: str | None = typer.Option(
        None, "--stack", help="A deployed run's CloudFormation stack; AWS through the standard credential chain."
    ),
    region: str | None = typer.Option(None, "--region", help="AWS region of --stack (default: from your AWS config)."),
    watch: bool = typer.Option(False, "--watch", "-w", help="Refresh until Ctrl-C."),
    interval: float = typer.Option(1.0, "--interval", min=0.2, help="Seconds between refreshes with --watch."),
    as_json: bool = typer.Option(False, "--json", help="Print the status as JSON (once) instead of tables."),
) -> None:
    """Show a run: phase, epoch, round and the phase's deadline; each participant's state (pending, active,
    dropped and why), whether it is selected this round and has uploaded or been refused, and when it was last
    seen; refused uploads with their reasons; and the last rounds' loss and accuracy."""
    from fed.status import collect, render, render_json

    if connection_file is not None and stack is not None:
        err.print("[red]give either --connection or --stack, not both[/]")
        raise typer.Exit(2)
    try:
        conn = (Connection.from_stack(stack, region) if stack else
                Connection.load(connection_file or DEFAULT_LOCAL_FILE))
    except ConnectionError_ as exc:
        err.print(f"[red]{exc}[/]")
        raise typer.Exit(1) from None
    if conn.endpoint:
        from infra.local.stack import client_environment

        os.environ.update(client_environment(conn.region))
        if not _reachable(conn.endpoint):
            err.print(f"[red]nothing answers at {conn.endpoint}[/]: is `fed local` (or `fed demo`) still running?")
            raise typer.Exit(1)
    try:
        if as_json:
            console.print_json(render_json(collect(conn)))
            return
        if not watch:
            console.print(render(collect(conn)))
            return
        if not console.is_terminal:  # piped or logged: one full status per refresh
            while True:
                console.rule(time.strftime("%H:%M:%S"))
                console.print(render(collect(conn)))
                time.sleep(interval)
        from rich.live import Live

        with Live(render(collect(conn)), console=console, refresh_per_second=4, screen=False) as live:
            while True:
                time.sleep(interval)
                live.update(render(collect(conn)))
    except KeyboardInterrupt:
        pass
    except Exception as exc:  # an endpoint that is gone, a table that does not exist
        err.print(f"[red]cannot read the run: {type(exc).__name__}: {exc}[/]")
        if conn.endpoint:
            err.print(f"is `fed local` still running on {conn.endpoint}?")
        raise typer.Exit(1) from None


def _reachable(endpoint: str, timeout: float = 1.0) -> bool:
    """A TCP connect to a local endpoint: fails fast where the AWS clients would retry for seconds."""
    import socket
    from urllib.parse import urlsplit

    url = urlsplit(endpoint)
    try:
        with socket.create_connection((url.hostname or "127.0.0.1", url.port or 80), timeout=timeout):
            return True
    except OSError:
        return False


if __name__ == "__main__":
    app()
