"""`fed`: run the coordinator on this machine (`local`, `demo`), look at any run (`status`, `dashboard`, `verify`),
operate it (`run pause|resume|restore`) and check a deployed stack's wiring (`check`)."""

from __future__ import annotations

import functools
import os
import time
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import ParamSpec, TypeVar

import typer
from rich.console import Console

from shared.config import ConfigError, RunConfig, load_config
from store.connection import DEFAULT_LOCAL_FILE, Connection, ConnectionError_
from store.trace import OPERATOR, acting_as

app = typer.Typer(
    name="fed",
    help=(
        "A serverless, event-driven federated-training coordinator on S3 + DynamoDB.\n\n"
        "`fed local` and `fed demo` run the whole system on this machine, with moto's server standing in for "
        "AWS; `fed status` shows a run, local or deployed, and `fed dashboard` serves a live page of it; `fed verify` "
        "recomputes its global models from the "
        "bucket; `fed run pause|resume|restore` operate it; `fed check` shows that a deployed stack's wiring works."
    ),
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode="markdown",
)
console = Console()
err = Console(stderr=True)

run_app = typer.Typer(
    name="run",
    help=(
        "Operate on a run, local or deployed: pause it, resume it, or restore it from its latest checkpoint.\n\n"
        "Each command writes the run's state with the same conditional write a tick uses, then ticks, so the "
        "change shows at once in `fed status`. The run is named by `--connection FILE` (a local run; default "
        f"{DEFAULT_LOCAL_FILE}) or `--stack NAME` (a deployed run; AWS credentials from the standard chain)."
    ),
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode="markdown",
)
app.add_typer(run_app, name="run")

hosts_app = typer.Typer(
    name="hosts",
    help=(
        "Hosts that join with an invite line alone: no AWS account, profile or key on the host.\n\n"
        "`fed hosts invite ID` prints one line to hand to the host, which runs `fed-participant start --invite "
        "LINE`. It redeems the line once, with a key it makes, and then renews its 15-60 minute credentials by "
        "itself. `fed hosts list` shows every host; `fed hosts revoke ID` refuses it at once, for good: "
        "`fed hosts reinstate ID` brings the id back as a new generation. The run is named by "
        f"`--connection FILE` (a local run; default {DEFAULT_LOCAL_FILE}) or `--stack NAME` (a deployed run)."
    ),
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode="markdown",
)
app.add_typer(hosts_app, name="hosts")

CONNECTION_HELP = f"A local run's connection file (default {DEFAULT_LOCAL_FILE}, written by `fed local`)."
STACK_HELP = "A deployed run's CloudFormation stack; AWS through the standard credential chain."
REGION_HELP = "AWS region of --stack (default: from your AWS config)."
RUN_ARG_HELP = "The run id you mean; refused if the connection is for another run (optional)."
RESTORE_ATTEMPTS = 6


P = ParamSpec("P")
T = TypeVar("T")


def as_operator(command: Callable[P, T]) -> Callable[P, T]:
    """Run a command as the run's operator: the local stack judges its requests against the operator policy
    (`local.access`), as IAM judges the operator's own credentials on AWS."""

    @functools.wraps(command)
    def run(*args: P.args, **kwargs: P.kwargs) -> T:
        with acting_as(OPERATOR):
            return command(*args, **kwargs)

    return run


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

    Every AWS call is judged as IAM would judge it on AWS, against the roles `cdk deploy` creates (the function's,
    the participant's, the operator's), and refused with the service's AccessDenied when IAM would refuse it: set
    FED_ACCESS_CHECK=record to only record what would be refused, or off (off where Node or the CDK library is
    missing; `npm ci` installs the evaluator).

    Writes the connection file (default `.fed/local.json`); start participants in other terminals with
    `fed-participant start --connection .fed/local.json --id NAME` and watch with `fed status --watch`.
    State lives in memory: stopping the stack ends the run.
    """
    from fed.localrun import default_local_config, run_local

    cfg = _load(config) or default_local_config()
    raise typer.Exit(run_local(cfg, port, tick_interval, connection_file, log_file, log_level.upper(), console))


# `fed demo`'s longer option texts, kept out of its signature so that the options read as a list
DEMO_TASK_HELP = (
    "The built-in task to train, with settings that finish in minutes on a 2-core CPU: `digits` (the "
    "default; an MLP on scikit-learn's 8x8 digits, 20 rounds, each round's test accuracy), `lm` (a "
    "~1M-parameter byte-level transformer on Python's help text, 4 rounds, each round's held-out loss and "
    "perplexity), `hf` (a Hugging Face causal LM, by default a tiny Llama built offline, fine-tuned on Python's "
    "help text, 6 rounds, each round's held-out loss and perplexity; see --model and --adapter) or `flower` (the "
    "Flower anchor's digits work: participant i trains its own shard i, 15 rounds; `make bench-rounds`). With "
    "--config, the file's task runs (an lm or hf task is reported by its held-out loss)."
)
DEMO_SPLIT_HELP = (
    "Train on private data (data_mode = local): the training set is split among the participants, "
    "IID or with a Dirichlet(ALPHA) label skew (0.1: a few digits each; 100: close to IID), and each trains "
    "only on its own part. Default: every round assigns each participant a slice of the shared set."
)
DEMO_UPDATES_HELP = (
    "What participants upload (update_encoding): their trained weights (the default), or the delta from "
    "the round's global as bfloat16 (half the bytes), int8 per block of 256 with a scale each (about a "
    "quarter) or topk (the largest 2 % of each chunk of 4096 at 2 bits: about 1/87), what is not sent "
    "carried into their next round."
)
DEMO_DOWNLOADS_HELP = (
    "What participants download each round (download_encoding): the global model (the default), or the "
    "round's change from the previous global as bfloat16 or int8 (about a quarter of the bytes), which each "
    "participant applies to the model it holds; the global is then defined as previous + decoded change."
)
DEMO_MIXED_SPEEDS_HELP = (
    "A fleet of mixed speeds: the last participant trains at a quarter of this host's speed (`fed-participant "
    "start --throttle 0.25`). The report shows each participant's share and training seconds per round: equal "
    "in the first round, sized by the measured throughput after it."
)


@app.command()
def demo(
    participants: int = typer.Option(4, "--participants", "-n", min=1, help="Participant processes to start."),
    task: str | None = typer.Option(None, "--task", "-t", help=DEMO_TASK_HELP),
    rounds: int | None = typer.Option(
        None, "--rounds", "-r", min=1,
        help="Rounds to aggregate. Default: 20 (digits), 4 (lm), 6 (hf), 15 (flower), or the --config file's "
        "total_rounds.",
    ),
    report: Path | None = typer.Option(
        None, "--report", help="Write the report JSON here: config, per-round rows, final accuracy (lm: also the "
        "held-out loss and perplexity), wall time."
    ),
    plot: Path | None = typer.Option(
        None, "--plot", dir_okay=False,
        help="Also write a PNG of loss, test accuracy (lm: held-out loss) and seconds per round here.",
    ),
    config: Path | None = typer.Option(
        None, "--config", "-c", exists=True, dir_okay=False,
        help="Run configuration (TOML) instead of the demo's own settings (quick rounds of the --task).",
    ),
    kill_one: bool = typer.Option(
        False, "--kill-one",
        help="SIGKILL one participant in the middle of a round: the coordinator drops it and the run goes on "
        "(the demo's default config then needs only N-1 members).",
    ),
    split: str | None = typer.Option(None, "--split", metavar="iid|dirichlet:ALPHA", help=DEMO_SPLIT_HELP),
    updates: str | None = typer.Option(None, "--updates", metavar="weights|bf16|int8", help=DEMO_UPDATES_HELP),
    downloads: str | None = typer.Option(None, "--downloads", metavar="full|bf16|int8", help=DEMO_DOWNLOADS_HELP),
    mixed_speeds: bool = typer.Option(False, "--mixed-speeds", help=DEMO_MIXED_SPEEDS_HELP),
    invites: bool = typer.Option(
        False, "--invites", help="Each participant joins with an invite line alone (`fed hosts invite`), redeemed "
        "at the local credential endpoint, as a host outside AWS would: no credential in its environment.",
    ),
    model: str | None = typer.Option(
        None, "--model", metavar="DIR", help="--task hf: a Hugging Face causal LM directory (config, tokenizer, "
        "safetensors weights) to fine-tune. Default: a tiny Llama (2 layers, width 64) built here once, offline.",
    ),
    adapter: str | None = typer.Option(
        None, "--adapter", metavar="none|lora", help="--task hf: lora trains low-rank adapters on q_proj and v_proj "
        "of the frozen model (PEFT), so that each update is the adapters alone; none (the default) the whole model.",
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
    accuracy of the round's new global model, or with `--task lm` its held-out loss and perplexity, seconds) and
    writes the report JSON. Exits non-zero with the reason if a participant process fails or the run does not
    finish within --timeout. Ctrl-C stops everything.
    """
    from fed.demo import DEMO_TASKS, DemoFailed, DemoOptions, run_demo

    if task is not None and task not in DEMO_TASKS:
        err.print(f"[red]unknown --task {task!r}[/]: choose one of {', '.join(DEMO_TASKS)}")
        raise typer.Exit(2)
    options = DemoOptions(participants=participants, rounds=rounds, report=report, plot=plot, config=_load(config),
                          kill_one=kill_one, timeout=timeout, tick_interval=tick_interval, workdir=workdir, task=task,
                          split=split, updates=updates, downloads=downloads, mixed_speeds=mixed_speeds,
                          invites=invites, model=model, adapter=adapter)
    try:
        run_demo(options, console)
    except DemoFailed as exc:
        err.print(f"[red]demo failed:[/] {exc}")
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        err.print("interrupted: participants and the local stack stopped")
        raise typer.Exit(130) from None


@app.command()
@as_operator
def status(
    connection_file: Path | None = typer.Option(None, "--connection", help=CONNECTION_HELP),
    stack: str | None = typer.Option(None, "--stack", help=STACK_HELP),
    region: str | None = typer.Option(None, "--region", help=REGION_HELP),
    watch: bool = typer.Option(False, "--watch", "-w", help="Refresh until Ctrl-C."),
    interval: float = typer.Option(1.0, "--interval", min=0.2, help="Seconds between refreshes with --watch."),
    as_json: bool = typer.Option(False, "--json", help="Print the status as JSON (once) instead of tables."),
    wide: bool = typer.Option(False, "--wide", help="Every column, however narrow the terminal (default: the "
                              "columns that fit: participant, condition, this round, progress, last seen and why "
                              "first)."),
    plot: Path | None = typer.Option(
        None, "--plot", dir_okay=False,
        help="Also write a PNG of every round's training loss, test accuracy and seconds here (again at each "
        "refresh with --watch).",
    ),
) -> None:
    """Show a run: phase, epoch, round and the phase's deadline, and where its latest global model is (round, key,
    digest, metrics, and the `fed export` command that fetches it); one row per participant: its state (pending,
    active, finished with the round it last trained, dropped and why), its condition (ok, slow, stuck, silent,
    finished, dropped), whether it is selected this round
    and has uploaded or been refused, its training progress, its measured samples per second and its share of the
    round (throughput sizing), when it was last seen, its host and device, what it says it is doing, and its drops
    and refusals with their reasons; refused uploads; the last rounds' loss and accuracy; and the run's ETA from
    the measured throughput. The table fits the terminal: on a narrow one the columns that matter most (participant,
    condition, this round, progress, last seen, why) stay and the rest go (`--wide` keeps them); `--json` has every
    field.

    With witnessing on: the current round's witnesses and which proofs are in, the last witnessed round's health
    scores (how many witnesses attested each participant) against its quorum, and who was dropped, when and why."""
    from fed.plot import PlotUnavailable
    from fed.status import Status, collect, render, render_json, write_plot

    conn = _connect(connection_file, stack, region)
    said: set[str] = set()
    named = _named(connection_file, stack)

    def collect_and_plot() -> Status:
        status = collect(conn, named=named)
        if plot is not None:
            try:
                write_plot(conn, plot)
            except PlotUnavailable as exc:
                if str(exc) not in said:  # once, not at every refresh
                    said.add(str(exc))
                    err.print(f"[yellow]no plot:[/] {exc}")
        return status

    try:
        if as_json:
            console.print_json(render_json(collect_and_plot()))
            return
        if not watch:
            console.print(render(collect_and_plot(), console.width, wide))
            return
        if not console.is_terminal:  # piped or logged: one full status per refresh
            while True:
                console.rule(time.strftime("%H:%M:%S"))
                console.print(render(collect_and_plot(), console.width, wide))
                time.sleep(interval)
        from rich.live import Live

        with Live(render(collect_and_plot(), console.width, wide), console=console, refresh_per_second=4,
                  screen=False) as live:
            while True:
                time.sleep(interval)
                live.update(render(collect_and_plot(), console.width, wide))
    except KeyboardInterrupt:
        pass
    except Exception as exc:  # an endpoint that is gone, a table that does not exist
        err.print(f"[red]cannot read the run: {type(exc).__name__}: {exc}[/]")
        if conn.endpoint:
            err.print(f"is `fed local` still running on {conn.endpoint}?")
        raise typer.Exit(1) from None


@app.command()
@as_operator
def dashboard(
    connection_file: Path | None = typer.Option(None, "--connection", help=CONNECTION_HELP),
    stack: str | None = typer.Option(None, "--stack", help=STACK_HELP),
    region: str | None = typer.Option(None, "--region", help=REGION_HELP),
    port: int = typer.Option(8765, "--port", min=0, max=65535, help="Port on 127.0.0.1 (0: any free port)."),
    interval: float = typer.Option(2.0, "--interval", min=0.2, help="Seconds between the page's refreshes."),
) -> None:
    """Serve a live page of the run on 127.0.0.1: the fleet (one row per participant: state, condition, progress,
    samples/s, share, last seen, host and device, activity, drops and refusals), the run's phase and ETA, and the
    loss, accuracy and seconds curves, refreshing by itself. Local (`--connection`) or deployed (`--stack`).
    Ctrl-C stops it."""
    from fed.dashboard import Dashboard, status_source

    conn = _connect(connection_file, stack, region)
    try:
        board = Dashboard(status_source(conn, _named(connection_file, stack)), port=port, interval=interval,
                          title=f"fed: run {conn.run_id}")
    except OSError as exc:
        err.print(f"[red]cannot serve on 127.0.0.1:{port}:[/] {exc}")
        raise typer.Exit(1) from None
    console.print(f"fed dashboard for run {conn.run_id}: {board.url}  (Ctrl-C to stop)")
    try:
        board.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        board.server.server_close()


def _connect(connection_file: Path | None, stack: str | None, region: str | None, run: str | None = None
             ) -> Connection:
    """The run's connection from --connection or --stack (exit 1 with the reason if it cannot be had); for a
    local endpoint, throwaway credentials in the environment and a quick check that it answers."""
    if connection_file is not None and stack is not None:
        err.print("[red]give either --connection or --stack, not both[/]")
        raise typer.Exit(2)
    try:
        conn = (Connection.from_stack(stack, region) if stack else
                Connection.load(connection_file or DEFAULT_LOCAL_FILE))
    except ConnectionError_ as exc:
        err.print(f"[red]{exc}[/]")
        raise typer.Exit(1) from None
    except Exception as exc:  # botocore: no credentials, no such stack
        err.print(f"[red]cannot read stack {stack}: {exc}[/]")
        raise typer.Exit(1) from None
    if run is not None and run != conn.run_id:
        err.print(f"[red]run {run!r}: the connection ({stack or connection_file or DEFAULT_LOCAL_FILE}) is for run "
                  f"{conn.run_id!r}[/]")
        raise typer.Exit(2)
    if conn.endpoint:
        from local.stack import client_environment
        from store.trace import install_from_env

        os.environ.update(client_environment(conn.region))
        install_from_env()  # (the commands run `as_operator`: the local stack judges them as the operator policy)
        if not _reachable(conn.endpoint):
            err.print(f"[red]nothing answers at {conn.endpoint}[/]: is `fed local` (or `fed demo`) still running?")
            raise typer.Exit(1)
    return conn


def _named(connection_file: Path | None, stack: str | None) -> str:
    """How the commands a view shows (`fed export ...`) name the run, as this one was named."""
    return f"--stack {stack}" if stack else f"--connection {connection_file}" if connection_file else ""


def _deps(conn: Connection):  # type: ignore[no-untyped-def]
    from fed.operate import OperateError, deps_for

    try:
        return deps_for(conn)
    except OperateError as exc:
        err.print(f"[red]{exc}[/]")
        raise typer.Exit(1) from None
    except Exception as exc:  # an endpoint that is gone, a bucket that does not exist
        err.print(f"[red]cannot read run {conn.run_id}: {type(exc).__name__}: {exc}[/]")
        raise typer.Exit(1) from None


@as_operator
def _set_paused(run: str | None, connection_file: Path | None, stack: str | None, region: str | None,
                paused: bool) -> None:
    from coordinator.operations import OperationError, request_pause
    from fed.operate import OperateError, tick_now

    conn = _connect(connection_file, stack, region, run)
    deps = _deps(conn)
    try:
        request_pause(deps, paused)
        ticked = tick_now(conn, deps)
    except (OperationError, OperateError) as exc:
        err.print(f"[red]cannot {'pause' if paused else 'resume'} run {conn.run_id}: {exc}[/]")
        raise typer.Exit(1) from None
    except Exception as exc:  # an endpoint that is gone, a table that does not exist
        err.print(f"[red]cannot {'pause' if paused else 'resume'} run {conn.run_id}: {type(exc).__name__}: {exc}[/]")
        raise typer.Exit(1) from None
    if ticked is None:
        console.print(f"run {conn.run_id}: {'pause' if paused else 'resume'} requested; the next scheduled tick "
                      "carries it out (the stack names no tick function to invoke now).")
        return
    s = deps.store.read_state()
    if paused:
        console.print(f"run {conn.run_id} paused: phase {s.phase}, epoch {s.epoch}, round {s.round}, "
                      f"{s.aggregated} round(s) aggregated. Participants keep polling; `fed run resume` goes on.")
    else:
        console.print(f"run {conn.run_id} resumed: phase {s.phase}, epoch {s.epoch}, round {s.round}. A new epoch "
                      f"starts as soon as {deps.config.min_clients} participants are live (up to start_grace, "
                      f"{deps.config.start_grace:g} s, later while one that just joined has not been heard from).")


@run_app.command("init")
def run_init(
    source: str | None = typer.Option(None, "--from", metavar="DIR", help="A Hugging Face causal LM: a directory "
                                      "(config.json, tokenizer, safetensors weights) or a hub id in this machine's "
                                      "cache."),
    task: str | None = typer.Option(None, "--task", metavar="NAME", help="Instead of --from: a built-in task "
                                    "(digits, lm, flower) or a module:object of your own."),
    seed: int = typer.Option(0, "--seed", min=0, help="With --task: the run's seed, which builds the initial model."),
    run_id: str = typer.Option("my-run", "--run-id", help="The new run's id (3-40 characters of a-z, 0-9, '-')."),
    adapter: str = typer.Option("none", "--adapter", metavar="none|lora", help="lora: train low-rank adapters "
                                "on the frozen model (the base is then recorded by digest too)."),
    out: Path | None = typer.Option(None, "--out", "-o", dir_okay=False, help="Write the run file here "
                                    "(refused if it exists). Default: print it."),
) -> None:
    """Start a run from a Hugging Face model: print a run file naming it, with its config's, tokenizer's (and with
    --adapter lora its weights') digests, its training set size and initial model schema, read from the model
    itself. Run it with `fed local --config FILE` or deploy it; every participant checks it holds the same model.
    Either way (--from, or --task), the run file pins the initial model by its digest: ingest refuses any other
    offer, and a participant refuses to train on any other round 0."""
    from fed.demo.errors import DemoFailed
    from fed.demo.hf import described_settings, run_toml
    from shared.config import Adapter, ConfigError, HfOptions, parse_config

    if (source is None) == (task is None):
        err.print("[red]give --from DIR (a Hugging Face model) or --task NAME[/]")
        raise typer.Exit(2)
    if adapter not in {a.value for a in Adapter}:
        err.print(f"[red]--adapter {adapter!r}: none or lora[/]")
        raise typer.Exit(2)
    if out is not None and out.exists():
        err.print(f"[red]{out} exists: choose a new file[/]")
        raise typer.Exit(2)
    try:
        if task is not None:
            from fed.demo.pin import task_run_toml, task_spec

            text = task_run_toml(run_id, task_spec(task), seed)
        else:
            assert source is not None
            text = run_toml(run_id, described_settings(source, HfOptions(adapter=Adapter(adapter))))
        parse_config(tomllib.loads(text), "the run file")  # (a run id the config refuses says so here)
    except (DemoFailed, ConfigError) as exc:
        err.print(f"[red]cannot start a run from {source or task}: {exc}[/]")
        raise typer.Exit(1) from None
    if out is None:
        print(text, end="")
    else:
        out.write_text(text)
        console.print(f"run file written to {out}: `fed local --config {out}`")


@run_app.command("pause")
def run_pause(
    run: str | None = typer.Argument(None, metavar="[RUN]", help=RUN_ARG_HELP),
    connection_file: Path | None = typer.Option(None, "--connection", help=CONNECTION_HELP),
    stack: str | None = typer.Option(None, "--stack", help=STACK_HELP),
    region: str | None = typer.Option(None, "--region", help=REGION_HELP),
) -> None:
    """Pause the run. The next tick closes an open round without aggregating it (its updates are not counted)
    and enters Paused; uploads are refused meanwhile. Participants stay up and wait. Undo with `fed run resume`.
    Exits 1 if the run has no state yet or is finished."""
    _set_paused(run, connection_file, stack, region, True)


@run_app.command("resume")
def run_resume(
    run: str | None = typer.Argument(None, metavar="[RUN]", help=RUN_ARG_HELP),
    connection_file: Path | None = typer.Option(None, "--connection", help=CONNECTION_HELP),
    stack: str | None = typer.Option(None, "--stack", help=STACK_HELP),
    region: str | None = typer.Option(None, "--region", help=REGION_HELP),
) -> None:
    """Resume a paused run. It goes back to WaitingForMembers and starts a new epoch, at the next round number,
    with every live participant, as soon as `min_clients` are there (up to `start_grace` seconds later while a
    participant that just joined has not been heard from yet)."""
    _set_paused(run, connection_file, stack, region, False)


@run_app.command("restore")
@as_operator
def run_restore(
    run: str | None = typer.Argument(None, metavar="[RUN]", help=RUN_ARG_HELP),
    connection_file: Path | None = typer.Option(None, "--connection", help=CONNECTION_HELP),
    stack: str | None = typer.Option(None, "--stack", help=STACK_HELP),
    region: str | None = typer.Option(None, "--region", help=REGION_HELP),
    force: bool = typer.Option(
        False, "--force", help="Replace the run's current state (refused without it, so a live run is not rolled "
        "back by mistake). Needed when the coordinator has ticked since the table was recreated.",
    ),
) -> None:
    """Rebuild the run's state from its latest checkpoint (`checkpoints/latest.json`, written at the end of each
    epoch), after its table's items were lost.

    The run restarts in WaitingForMembers at the checkpoint's round, with the checkpoint's global model copied back
    to that round's key. Participants still polling find their records gone, join again, and the next epoch admits
    them; rounds after the checkpoint are trained again. Exits 1 if there is no checkpoint, if its model does not
    match its digest, or if the run has state and --force was not given."""
    from coordinator.operations import OperationError, restore
    from store.table import Conflict

    conn = _connect(connection_file, stack, region, run)
    deps = _deps(conn)
    for attempt in range(1, RESTORE_ATTEMPTS + 1):
        try:
            restored = restore(deps, force)
            break
        except Conflict:  # with --force, a tick (a participant joining again) committed between read and write
            if attempt == RESTORE_ATTEMPTS:
                err.print(f"[red]cannot restore run {conn.run_id}: its state kept changing; try again[/]")
                raise typer.Exit(1) from None
        except OperationError as exc:
            err.print(f"[red]cannot restore run {conn.run_id}: {exc}[/]")
            raise typer.Exit(1) from None
        except Exception as exc:  # the table missing or not ready, an endpoint that is gone
            err.print(f"[red]cannot restore run {conn.run_id}: {type(exc).__name__}: {exc}[/]")
            raise typer.Exit(1) from None
    console.print(f"run {conn.run_id} restored from the checkpoint of epoch {restored.epoch}: round {restored.round}, "
                  f"{restored.aggregated} round(s) aggregated, global model {restored.global_digest[:16]}. It waits "
                  f"for {deps.config.min_clients} participants to join again.")


@app.command()
@as_operator
def verify(
    run: str | None = typer.Argument(None, metavar="[RUN]", help=RUN_ARG_HELP),
    connection_file: Path | None = typer.Option(None, "--connection", help=CONNECTION_HELP),
    stack: str | None = typer.Option(None, "--stack", help=STACK_HELP),
    region: str | None = typer.Option(None, "--region", help=REGION_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print the checks as JSON (full digests) instead of a table."),
) -> None:
    """Recompute every aggregated round's global model from the bucket and compare digests.

    For each round: the updates its summary counted, read by the object version the coordinator accepted (and
    checked against the recorded digest), combined by the run's strategy with the coordinator's own code; the
    result's SHA-256 is compared with the digest the round recorded and with the object stored at
    `rounds/<round+1>/global`. A round whose objects are gone (round objects expire after `[deploy]
    round_objects_expire_days`, 30 by default) cannot be recomputed: it is shown as expired, and checked against
    its checkpoint where one keeps its global model. Exit status 0 when every round matches or is expired with
    nothing contradicting its record, 1 on any mismatch or unreadable input."""
    import json

    from rich.table import Table

    from coordinator.verify import verify_run
    from fed.operate import VerifyLine

    conn = _connect(connection_file, stack, region, run)
    deps = _deps(conn)
    try:
        lines = [VerifyLine.of(c) for c in verify_run(deps)]
    except Exception as exc:
        err.print(f"[red]cannot verify run {conn.run_id}: {type(exc).__name__}: {exc}[/]")
        raise typer.Exit(1) from None
    bad = [line for line in lines if not line.passes]
    expired = [line for line in lines if line.expired and line.passes]
    if as_json:
        console.print_json(json.dumps({"run_id": conn.run_id, "ok": not bad, "rounds": [v.to_json() for v in lines]}))
    elif not lines:
        console.print(f"run {conn.run_id}: no aggregated round to verify yet")
    else:
        table = Table(title=f"run {conn.run_id}: global models recomputed from the bucket", title_justify="left")
        for col in ("round", "recorded", "recomputed", "stored", "result"):
            table.add_column(col)
        for v in lines:
            result = "[green]ok[/]" if v.ok else "[yellow]expired[/]" if v.passes else "[red]MISMATCH[/]"
            table.add_row(str(v.round), v.recorded[:16] or "-", v.recomputed[:16] or "-", v.stored[:16] or "-", result)
        console.print(table)
        for v in bad:
            console.print(f"[red]round {v.round}: {v.problem}[/]", soft_wrap=True)
        for v in expired:
            console.print(f"[yellow]round {v.round}: {v.problem}[/]", soft_wrap=True)
        summary = f"{len(lines) - len(bad) - len(expired)} of {len(lines)} round(s) match"
        console.print(f"[red]{summary}[/]" if bad else f"[green]{summary}[/]")
    if bad:
        raise typer.Exit(1)


@app.command()
@as_operator
def check(
    connection_file: Path | None = typer.Option(None, "--connection", help=CONNECTION_HELP),
    stack: str | None = typer.Option(None, "--stack", help=STACK_HELP),
    region: str | None = typer.Option(None, "--region", help=REGION_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print the checks as JSON (a list, with each refused call's "
                                 "principal, action, resource and the statement to add) instead of lines."),
) -> None:
    """Show, in seconds and without a run, that a deployed stack's wiring works (`--stack NAME`, after `cdk deploy`,
    with the credentials of an identity holding the stack's OperatorPolicyArn), or a local run's (`--connection`).
    One ✓ or ✗ line per finding, each ✗ with what to do; exit status 1 if any ✗ (a – is not shown yet, not wrong).

    - **stack**: the stack and its outputs exist, and the bucket and the table answer. ✗: deploy this version.

    - **functions**: AWS: each function (tick, ingest, join, shard) is Active and its last update Successful
    (runtime and architecture shown), and the tick accepts a DryRun invoke. Locally: each handler imports and is
    callable. ✗: the reason is shown; fix it and deploy again.

    - **roles**: every call the code makes (a catalog, read off the code paths, on sample keys of the layout) is
    allowed to the role that makes it: each function's role, the participant role with its session tag, and the
    operator policy; judged by IAM's policy simulator on AWS, locally by the access check's evaluator on the model the
    local server holds. ✗: names the principal, action and resource, and the statement to add (and where: infra/).

    - **events**: the bucket tells EventBridge of its objects; the main and join rules are ENABLED with the patterns
    `shared.naming` builds; a sample heartbeat matches the main rule, a join request the join rule, a global model
    neither. ✗: deploy this version (or enable the rule).

    - **schedule**: the tick schedule has a rate and is on while the run needs ticks. ✗: `fed run resume`.

    - **participant**: a participant session (the participant role, assumed with the tag participant=fed-check-xxxxxx,
    x random) reads a missing key of its own as missing (S3 answers 403: the role may not list the bucket, by design)
    and reads the run state and config.json (– until the first tick wrote it). ✗: the participant role lacks the read
    named."""
    import json

    from rich.markup import escape

    from fed.check import MARKS, Status, run_checks

    conn = _connect(connection_file, stack, region)
    report = run_checks(conn, stack)
    if as_json:
        console.print_json(json.dumps(report.to_json()))
    else:
        console.print(f"fed check: run {conn.run_id}, {report.target}", soft_wrap=True)
        colours = {Status.PASS: "green", Status.FAIL: "red", Status.SKIP: "yellow"}
        for line in report.lines:
            colour = colours[line.status]
            console.print(f"[{colour}]{MARKS[line.status]}[/] {escape(line.text)}", soft_wrap=True)
            if line.fix and line.status is not Status.PASS:
                console.print(f"    [{colour}]→[/] {escape(line.fix)}", soft_wrap=True)
        failed = sum(line.status is Status.FAIL for line in report.lines)
        summary = (f"{len(report.lines)} line(s), {failed} ✗, in {report.seconds:.1f} s" if failed else
                   f"all checks pass ({len(report.lines)} line(s)) in {report.seconds:.1f} s")
        console.print(f"[{'red' if failed else 'green'}]{summary}[/]", soft_wrap=True)
    if not report.ok:
        raise typer.Exit(1)


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


HOST_ARG_HELP = "The host's participant id: 1-63 letters, digits, '_' or '-'."
EXPIRES_HELP = "How long the invite may be redeemed: e.g. 30m, 24h, 7d (at most 30d)."


@hosts_app.command("invite")
@as_operator
def hosts_invite(
    host: str = typer.Argument(..., metavar="ID", help=HOST_ARG_HELP),
    expires: str = typer.Option("24h", "--expires", metavar="DURATION", help=EXPIRES_HELP),
    connection_file: Path | None = typer.Option(None, "--connection", help=CONNECTION_HELP),
    stack: str | None = typer.Option(None, "--stack", help=STACK_HELP),
    region: str | None = typer.Option(None, "--region", help=REGION_HELP),
) -> None:
    """Print an invite line for host ID (stdout: the line alone). Only its secret's hash is stored; the line is
    redeemed once, by `fed-participant start --invite LINE` on the host. Inviting an id again replaces an invite
    not yet redeemed; an active host must be revoked first, and a revoked one is brought back by `fed hosts
    reinstate`."""
    from fed.hosts import HostsError, duration_seconds, invite
    from shared.keys import KeyError_

    conn = _connect(connection_file, stack, region)
    try:
        line = invite(conn, host, duration_seconds(expires))
    except (HostsError, KeyError_) as exc:
        err.print(f"[red]cannot invite {host!r}: {exc}[/]")
        raise typer.Exit(1) from None
    typer.echo(line)
    err.print(f"hand this line to host {host}, who runs: fed-participant start --invite <line>  "
              f"(redeemable once, for {expires})")


@hosts_app.command("list")
@as_operator
def hosts_list(
    as_json: bool = typer.Option(False, "--json", help="Print the hosts as JSON (times in epoch seconds)."),
    connection_file: Path | None = typer.Option(None, "--connection", help=CONNECTION_HELP),
    stack: str | None = typer.Option(None, "--stack", help=STACK_HELP),
    region: str | None = typer.Option(None, "--region", help=REGION_HELP),
) -> None:
    """Every host: its generation (`fed hosts reinstate` starts the next), invited, active, expired or revoked; when
    it last received credentials and was last seen (its last accepted upload); the endpoint's refusals of it. A last
    row, host "?", counts the refused requests that named no invited host."""
    from rich.table import Table

    from fed.hosts import as_json as hosts_json
    from fed.hosts import listing

    lines = listing(_connect(connection_file, stack, region))
    if as_json:
        typer.echo(hosts_json(lines))
        return
    table = Table("host", "generation", "status", "credentials", "last seen", "refusals", "why", box=None)
    for h in lines:
        why = h.revoke_reason if h.status == "revoked" else h.last_refusal
        table.add_row(h.host, str(h.generation or "-"), h.status, _ago(h.last_credentials_at), _ago(h.last_seen),
                      str(h.refusals), why)
    console.print(table if lines else "no hosts: `fed hosts invite ID` makes the first")


def _ago(at: float) -> str:
    return f"{max(0.0, time.time() - at):.0f} s ago" if at else "-"


@hosts_app.command("revoke")
@as_operator
def hosts_revoke(
    host: str = typer.Argument(..., metavar="ID", help=HOST_ARG_HELP),
    reason: str = typer.Option("revoked by the operator", "--reason", help="Recorded, and shown to the host."),
    connection_file: Path | None = typer.Option(None, "--connection", help=CONNECTION_HELP),
    stack: str | None = typer.Option(None, "--stack", help=STACK_HELP),
    region: str | None = typer.Option(None, "--region", help=REGION_HELP),
) -> None:
    """Revoke host ID at once: its renewals are refused, ingest refuses its uploads with the reason, and its sessions
    already issued are denied. The run goes on without it; the id stays revoked (`fed hosts reinstate` brings it
    back as a new generation)."""
    from fed.hosts import HostsError, revoke

    conn = _connect(connection_file, stack, region)
    try:
        for line in revoke(conn, host, reason):
            console.print(line)
    except HostsError as exc:
        err.print(f"[red]cannot revoke {host!r}: {exc}[/]")
        raise typer.Exit(1) from None


@hosts_app.command("reinstate")
@as_operator
def hosts_reinstate(
    host: str = typer.Argument(..., metavar="ID", help=HOST_ARG_HELP),
    expires: str = typer.Option("24h", "--expires", metavar="DURATION", help=EXPIRES_HELP),
    connection_file: Path | None = typer.Option(None, "--connection", help=CONNECTION_HELP),
    stack: str | None = typer.Option(None, "--stack", help=STACK_HELP),
    region: str | None = typer.Option(None, "--region", help=REGION_HELP),
) -> None:
    """Bring revoked host ID back as its next generation: print a new invite line (stdout: the line alone), under
    which the host makes new keys. The revoked generation's sessions, keys and uploads stay refused."""
    from fed.hosts import HostsError, duration_seconds, reinstate
    from shared.keys import KeyError_

    conn = _connect(connection_file, stack, region)
    try:
        line = reinstate(conn, host, duration_seconds(expires))
    except (HostsError, KeyError_) as exc:
        err.print(f"[red]cannot reinstate {host!r}: {exc}[/]")
        raise typer.Exit(1) from None
    typer.echo(line)
    err.print(f"host {host} reinstated as a new generation: hand it this line (fed-participant start --invite <line>, "
              f"redeemable once, for {expires})")


@app.command("export")
@as_operator
def export(
    out: Path = typer.Argument(..., metavar="PATH", help="Where to write the model: a safetensors file, or with "
                               "--format hf a new directory."),
    round_no: str = typer.Option("latest", "--round", metavar="R|latest",
                                 help="The round whose global model to export (latest: the run's newest)."),
    fmt: str = typer.Option("safetensors", "--format", metavar="safetensors|hf", help="safetensors: the file the "
                            "coordinator wrote. hf (a run of participant.tasks.hf): a Hugging Face model directory "
                            "(config, tokenizer, sharded safetensors) that from_pretrained loads; a LoRA run's "
                            "adapters merged into the base, or with --adapter-only the adapters for PEFT."),
    adapter_only: bool = typer.Option(False, "--adapter-only", help="--format hf of a LoRA run: write the adapters "
                                      "(adapter_config.json, adapter_model.safetensors) and the tokenizer, not the "
                                      "merged model."),
    model: str | None = typer.Option(None, "--model", metavar="DIR", help="--format hf: this machine's copy of "
                                     "the run's model, where [run.hf] model names another path (checked by digest)."),
    connection_file: Path | None = typer.Option(None, "--connection", help=CONNECTION_HELP),
    stack: str | None = typer.Option(None, "--stack", help=STACK_HELP),
    region: str | None = typer.Option(None, "--region", help=REGION_HELP),
) -> None:
    """Write a run's global model to PATH: the safetensors file the coordinator wrote (tensors and their metadata),
    checked against its digest before it is written, or with `--format hf` a Hugging Face model directory. `fed
    status` shows the latest's round and digest."""
    from fed.export import ExportError, export_global, export_hf_dir

    if round_no != "latest" and not round_no.isdigit():
        err.print(f"[red]--round {round_no!r}: a round number, or latest[/]")
        raise typer.Exit(2)
    if fmt not in {"safetensors", "hf"}:
        err.print(f"[red]--format {fmt!r}: safetensors or hf[/]")
        raise typer.Exit(2)
    conn = _connect(connection_file, stack, region)
    wanted = None if round_no == "latest" else int(round_no)
    try:
        if fmt == "hf":
            done, files = export_hf_dir(conn, wanted, out, merged=not adapter_only, model=model)
        else:
            done, files = export_global(conn, wanted, out), []
    except ExportError as exc:
        err.print(f"[red]cannot export: {exc}[/]")
        raise typer.Exit(1) from None
    written = f"{out} ({', '.join(files)})" if files else str(done.path)
    console.print(f"round {done.round}'s global model of run {conn.run_id}: {done.size:,} bytes, sha256 "
                  f"{done.digest}, written to {written}")


from fed.plan import plan as _plan  # noqa: E402  (its own module: the cost model is imported only when it runs)

app.command("plan")(_plan)
