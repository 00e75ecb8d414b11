"""`fed-participant`: the command a GPU host runs to take part in a run."""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import threading
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, NoReturn
from urllib.parse import urlparse

import typer

from shared.keys import KeyError_, validate_participant_id
from store.connection import DEFAULT_LOCAL_FILE, Connection, ConnectionError_
from store.trace import install_from_env

if TYPE_CHECKING:
    from participant.credentials import CredentialServer
    from participant.daemon import Options
    from participant.ui import Reporter

log = logging.getLogger("participant")

app = typer.Typer(
    name="fed-participant",
    help=(
        "Take part in a federated training run coordinated through S3 and DynamoDB.\n\n"
        "A participant is a long-running daemon: it joins the run, polls the coordinator's state, downloads "
        "the global model, trains the samples assigned to it each round, uploads its update, and repeats "
        "until the run is finished. It survives its own restarts and transient network or AWS faults.\n\n"
        "Run `fed-participant start --help` for every option."
    ),
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode="rich",
    context_settings={"help_option_names": ["-h", "--help"]},
)

EXAMPLES = """
[bold]Examples[/bold]

  [dim]# against the local stack of `fed local` (another terminal; reads .fed/local.json)[/dim]
  fed-participant start --id alice

  [dim]# a second participant on the same machine needs its own id[/dim]
  fed-participant start --id bob --device cpu --threads 1

  [dim]# a host anywhere, with the line `fed hosts invite gpu-host-7` printed (no AWS account needed)[/dim]
  fed-participant start --invite fed-invite-v1.eyJlbmRwb2ludCI6...

  [dim]# on AWS: read bucket, table and run id from the deployed stack's outputs[/dim]
  fed-participant start --stack FedRun-digits --run digits --id gpu-host-7 --device cuda

  [dim]# a node of 8 GPUs as one participant (one update a round), or the same under torchrun[/dim]
  fed-participant start --stack FedRun-llm --id node-1 --gpus 8
  torchrun --nproc-per-node 8 --max-restarts 3 --no-python fed-participant start --stack FedRun-llm --id node-1

  [dim]# your own training code (build_model, train, evaluate, train_size)[/dim]
  fed-participant start --id alice --task mypkg.tasks:resnet_cifar

"""
EXAMPLES += (
    "[bold]Exit status[/bold]: 0 when the run finished (the final model's test accuracy is printed on stdout), "
    "when --max-rounds was reached, or after SIGTERM; 1 on an error it cannot work around (wrong task or run, "
    "bad credentials); 2 on bad usage; 130 after Ctrl-C.\n\n"
    "[bold]Restarts[/bold]: progress is kept in --state-dir, so starting it again with the same --id resumes "
    "where it stopped: an uploaded round is never redone, a round interrupted mid-training is retrained "
    "identically."
)


LOCAL_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})


def use_local_credentials(endpoint: str | None, pid: str = "") -> bool:
    """Against a loopback endpoint (moto, `fed local`) use throwaway credentials: moto accepts any, and
    real keys from the environment or a profile are never sent to it. Their key id names the participant
    (participant-<id>), as the session tag does on AWS: the local stack judges its requests as the participant
    role's (`local.access`). Returns whether it did."""
    if not endpoint or urlparse(endpoint).hostname not in LOCAL_HOSTS:
        return False
    key = f"participant-{pid}" if pid else "local"
    os.environ.update(AWS_ACCESS_KEY_ID=key, AWS_SECRET_ACCESS_KEY="local", AWS_EC2_METADATA_DISABLED="true")
    for name in ("AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_PROFILE"):
        os.environ.pop(name, None)
    return True


def default_participant_id() -> str:
    """This host's name, reduced to the characters a participant id allows."""
    host = socket.gethostname().split(".")[0]
    pid = re.sub(r"[^A-Za-z0-9_-]+", "-", host).strip("-_")[:63]
    try:
        return validate_participant_id(pid)
    except KeyError_:
        return "participant"


@app.callback()
def main() -> None:
    """Take part in a federated training run coordinated through S3 and DynamoDB."""


START_HELP = (
    "Join a run and train until it is finished.\n\n"
    "Joins (offering the task's initial model if the run has none yet) and heartbeats so the coordinator "
    "knows it is alive. In each round it is selected for, it downloads the global model (cached by digest), "
    "trains exactly the samples the round assigns it, and uploads its update with the sample count and metrics "
    "(loss, test accuracy). When elected a round's witness it checks the round's updates on the task's held-out "
    "data and uploads a proof of those it attests; after a witnessed round it reports members the witnesses did "
    "not attest. Late joiners and dropped participants wait and are admitted at the next epoch. "
    "When the run is finished it prints the final model's test accuracy and exits."
)


@app.command(help=START_HELP, epilog=EXAMPLES, short_help="Join a run and train until it is finished.")
def start(
    participant_id: str = typer.Option(
        None, "--id", metavar="PID", show_default="this host's name",
        help="Participant id: 1-63 letters, digits, '_' or '-', unique within the run. It names your keys in "
             "the bucket and your state directory; reuse it after a restart to resume.",
    ),
    connection: Path = typer.Option(
        DEFAULT_LOCAL_FILE, "--connection", metavar="FILE",
        help="Connection file naming the run's bucket, table and endpoint. `fed local` writes .fed/local.json. "
             "Ignored with --stack.",
    ),
    stack: str = typer.Option(
        None, "--stack", metavar="NAME",
        help="A deployed run stack on AWS: its CloudFormation outputs name the bucket, table and run id. "
             "Credentials come from the standard AWS chain (environment, profile, instance role).",
    ),
    region: str = typer.Option(
        None, "--region", metavar="REGION", help="AWS region of --stack (default: your AWS configuration).",
    ),
    invite: str = typer.Option(
        None, "--invite", metavar="LINE|@FILE",
        help="The invite line an operator made with `fed hosts invite` (or @FILE holding it): all a host needs. "
             "The host redeems it once with a key it makes (kept in --state-dir, or ~/.fed/hosts/), then renews its "
             "credentials by itself; no AWS account, profile or environment variable. Names the participant id.",
    ),
    run: str = typer.Option(
        None, "--run", metavar="RUN",
        help="Run id you expect to join; the participant refuses to start if the connection is for another run.",
    ),
    task: str = typer.Option(
        None, "--task", metavar="MODULE:OBJECT", show_default="the run config's task",
        help="Python object providing model, data, training and evaluation (see participant.task.Task), e.g. "
             "participant.tasks.digits:task. Every participant of a run must use the same model and data.",
    ),
    data: str = typer.Option(
        None, "--data", metavar="SPEC",
        help="Runs in local data mode (data_mode = local) only: this participant's own data, passed to the task's "
             "local_data (a path, or a spec the task defines). Its sample count is registered when joining; an "
             "update may not claim more. Built-in digits: iid:I/N or dirichlet:ALPHA:I/N (part I of N, label "
             "skew Dirichlet(ALPHA)), e.g. dirichlet:0.5:3/8.",
    ),
    state_dir: Path = typer.Option(
        None, "--state-dir", metavar="DIR", show_default="~/.fed/<run>/<id>",
        help="Where progress (rounds uploaded, the round in training) and the global-model cache are kept.",
    ),
    device: str = typer.Option(
        "auto", "--device", metavar="auto|cpu|cuda[:N]", help="Training device; auto picks CUDA when available.",
    ),
    threads: int = typer.Option(
        0, "--threads", min=0, metavar="N", show_default="torch's default",
        help="CPU threads torch may use. With several participants on one machine, 1 each avoids contention.",
    ),
    gpus: int = typer.Option(1, "--gpus", min=1, metavar="N", help="Train as a node of N ranks, one per device "
                             "(cuda:0..N-1; on a CPU, N processes over gloo), one update a round. A rank that dies "
                             "stops the participant (exit 1): start it again to resume. Under torchrun (`torchrun "
                             "--nproc-per-node N --no-python fed-participant start ...`), torchrun's ranks."),
    parallel: str = typer.Option("auto", "--parallel", metavar="auto|ddp|fsdp", help="How a node spreads the model: "
                                 "ddp, a whole copy on each device; fsdp, weights, gradients and optimizer state "
                                 "sharded across them (a model whose training does not fit one device); auto, fsdp "
                                 "where training would crowd a device (participant/node.py)."),
    max_rounds: int = typer.Option(
        0, "--max-rounds", min=0, metavar="N", rich_help_panel="Testing",
        help="Leave after uploading N updates (0: stay until the run is finished). The coordinator drops the "
             "participant once it goes silent, as if the host had died.",
    ),
    poll_max: float = typer.Option(
        2.0, "--poll-max", min=0.05, metavar="SECONDS", rich_help_panel="Testing",
        help="Longest pause between two reads of the run state while waiting (polls start at 0.2s and back off).",
    ),
    push: bool = typer.Option(
        True, "--push/--poll", rich_help_panel="Testing",
        help="Learn of new rounds from a queue of this participant's own subscribed to the run's state topic "
             "(long polling: one request per 20 s while nothing happens, woken at once when something does), or "
             "by polling the run state (--poll). Without a topic, or where the queue cannot be created, it polls.",
    ),
    throttle: float = typer.Option(
        1.0, "--throttle", min=0.01, max=1.0, metavar="F", rich_help_panel="Testing",
        help="Testing aid: train at F of this host's speed (after each batch, wait (1/F - 1) times as long as it "
             "took), to try throughput sizing with mixed speeds on one machine: --throttle 0.25 is a host four "
             "times slower.",
    ),
    log_level: str = typer.Option(
        "INFO", "--log-level", metavar="LEVEL", help="DEBUG, INFO, WARNING or ERROR.", case_sensitive=False,
    ),
) -> None:
    """Join a run and train until it is finished (see START_HELP)."""
    gpus = _node_size(gpus, parallel)
    pid, reporter, conn, credentials = _join(invite, participant_id, state_dir, log_level, connection, stack, region,
                                             run)
    from participant.daemon import Options, default_state_dir  # loaded only to run: --help stays quick
    options = Options(pid=pid, state_dir=state_dir or default_state_dir(conn.run_id, pid), task=task, device=device,
                      threads=threads, max_rounds=max_rounds, poll_max=poll_max, data=data, throttle=throttle,
                      push=push, gpus=gpus, parallel=parallel,
                      signing_key=credentials.session.upload_key_path if credentials is not None else None)
    try:
        raise typer.Exit(_run(conn, options, reporter, credentials))
    finally:
        if credentials is not None:
            credentials.stop()


CHECK_HELP = (
    "Check, before starting, that this host can take part: one line per item, ✓ or ✗, each ✗ with what to do.\n\n"
    "Credentials (from --invite, which it redeems if it was not yet, or the host's usual ones), the run's config and "
    "a missing key of its own as AWS answers them, its push queue, its clock against S3's, free disk against the "
    "model's size, CUDA and bf16, and the upload and download rates to the bucket with the time one round's "
    "transfers take at the current model size. Nothing is written that the coordinator would see. Exit status 0 when "
    "every item is ✓, 1 otherwise."
)


@app.command(help=CHECK_HELP, short_help="Check that this host can take part (before starting).")
def check(
    participant_id: str = typer.Option(None, "--id", metavar="PID", show_default="this host's name",
                                       help="Participant id (the invite's, with --invite)."),
    invite: str = typer.Option(None, "--invite", metavar="LINE|@FILE", help="An invite line, as for `start`."),
    connection: Path = typer.Option(DEFAULT_LOCAL_FILE, "--connection", metavar="FILE",
                                    help="Connection file (`fed local` writes .fed/local.json). Ignored with --stack."),
    stack: str = typer.Option(None, "--stack", metavar="NAME", help="A deployed run stack on AWS."),
    region: str = typer.Option(None, "--region", metavar="REGION", help="AWS region of --stack."),
    run: str = typer.Option(None, "--run", metavar="RUN", help="Run id you expect."),
    state_dir: Path = typer.Option(None, "--state-dir", metavar="DIR", show_default="~/.fed/<run>/<id>",
                                   help="Where the participant will keep its state (its disk is measured)."),
    device: str = typer.Option("auto", "--device", metavar="auto|cpu|cuda[:N]", help="The device you will train on."),
) -> None:
    credentials: CredentialServer | None = None
    if invite:
        participant_id, credentials = _redeem(invite, participant_id, state_dir)
    pid, _ = _setup(participant_id, "WARNING")
    try:
        if credentials is not None:
            conn = credentials.session.connection()
            install_from_env()
        else:
            conn = _connect(connection, stack, region, run, pid)
        from participant.daemon import default_state_dir
        from participant.preflight import Preflight

        items = Preflight(conn, pid, state_dir or default_state_dir(conn.run_id, pid), device).run()
    finally:
        if credentials is not None:
            credentials.stop()
    for item in items:
        typer.echo(item.line())
    raise typer.Exit(0 if all(item.ok for item in items) else 1)


def _join(invite: str | None, participant_id: str | None, state_dir: Path | None, log_level: str, connection: Path,
          stack: str | None, region: str | None, run: str | None) -> tuple[str, Reporter, Connection,
                                                                           CredentialServer | None]:
    """The participant id, its reporter, the run's connection and, with --invite, the host's credential server."""
    credentials: CredentialServer | None
    participant_id, credentials = _redeem(invite, participant_id, state_dir) if invite else (participant_id, None)
    pid, reporter = _setup(participant_id, log_level)
    if credentials is None:
        return pid, reporter, _connect(connection, stack, region, run, pid), None
    conn = credentials.session.connection()
    if run and run != conn.run_id:
        _fail(f"--run {run}: the invite is for run {conn.run_id!r}")
    install_from_env()
    return pid, reporter, conn, credentials


def _node_size(gpus: int, parallel: str) -> int:
    """The node's size: --gpus, or under torchrun its ranks. A rank > 0 that torchrun started follows rank 0 here and
    exits: it never redeems an invite or speaks to the coordinator (`participant.node`)."""
    from participant.node import PARALLEL, follow_launched, launched
    from participant.protocol import ParticipantError

    if parallel not in PARALLEL:
        raise typer.BadParameter(f"{parallel!r}: use auto, ddp or fsdp", param_hint="--parallel")
    try:
        launch = launched()
    except ParticipantError as exc:
        _fail(str(exc))
    if launch is None:
        return gpus
    if gpus not in (1, launch.size):
        raise typer.BadParameter(f"{gpus}, but torchrun started {launch.size} ranks: leave it out", param_hint="--gpus")
    if launch.rank > 0:
        raise typer.Exit(follow_launched(launch))
    return launch.size


def _redeem(line: str, participant_id: str | None, state_dir: Path | None) -> tuple[str, CredentialServer]:
    """The invite's host id and its session, served to this process's AWS clients (`participant.credentials`)."""
    from participant.credentials import CredentialServer, HostRefused, HostSession, default_host_dir
    from shared.hosts import InviteError, parse_invite

    if line.startswith("@"):
        try:
            line = Path(line[1:]).read_text()
        except OSError as exc:
            raise typer.BadParameter(f"cannot read {line[1:]}: {exc.strerror}", param_hint="--invite") from None
    try:
        parsed = parse_invite(line)
    except InviteError as exc:
        raise typer.BadParameter(str(exc), param_hint="--invite") from None
    if participant_id and participant_id != parsed.host:
        raise typer.BadParameter(f"{participant_id!r}: the invite is for host {parsed.host!r}", param_hint="--id")
    session = HostSession(parsed, state_dir / "host" if state_dir else default_host_dir(parsed))
    try:
        session.wait_for_first(threading.Event())
    except HostRefused as exc:
        _fail(str(exc))
    return parsed.host, CredentialServer(session).start()


def _setup(participant_id: str | None, log_level: str) -> tuple[str, Reporter]:
    """Check --log-level and --id (this host's name by default) and set up logging: the participant id, and the
    reporter that shows the training's progress."""
    from participant.ui import setup_logging

    if log_level.upper() not in {"DEBUG", "INFO", "WARNING", "ERROR"}:
        raise typer.BadParameter(f"{log_level!r}: use DEBUG, INFO, WARNING or ERROR", param_hint="--log-level")
    pid = participant_id or default_participant_id()
    try:
        validate_participant_id(pid)
    except KeyError_ as exc:
        raise typer.BadParameter(str(exc), param_hint="--id") from None
    return pid, setup_logging(log_level, pid)


def _connect(connection: Path, stack: str | None, region: str | None, run: str | None, pid: str) -> Connection:
    """The run's connection: read from --stack's outputs or the --connection file, and for the run --run names.
    Against a local endpoint, with throwaway credentials (`use_local_credentials`) and its requests traced where
    the local stack asks for it."""
    try:
        conn = Connection.from_stack(stack, region) if stack else Connection.load(connection)
    except ConnectionError_ as exc:
        _fail(str(exc))
    except Exception as exc:  # botocore: no credentials, no such stack, ...
        _fail(f"cannot read stack {stack}: {exc}")
    if run and run != conn.run_id:
        _fail(f"--run {run}: the connection ({stack or connection}) is for run {conn.run_id!r}")
    if use_local_credentials(conn.endpoint, pid):
        install_from_env()  # the local stack's access check: the code path of each request
    return conn


def _stop_on_signals() -> tuple[threading.Event, list[int]]:
    """An event SIGTERM and Ctrl-C set, asking the daemon to stop after its current step (a second Ctrl-C stops it
    at once), and the list of the signals received (the exit status tells Ctrl-C)."""
    stop = threading.Event()
    received: list[int] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        if stop.is_set() and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now
        received.append(signum)
        log.info("%s received: stopping after the current step", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    return stop, received


def _run(conn: Connection, options: Options, reporter: Reporter, credentials: CredentialServer | None = None) -> int:
    """Run the daemon until the run is finished, --max-rounds is reached, a signal stops it or the credential
    endpoint refuses this host, and print the outcome; the exit status (an error it cannot work around exits 1
    here)."""
    from participant.daemon import Daemon
    from participant.protocol import ParticipantError
    from participant.remote import FatalRemoteError

    stop, received = _stop_on_signals()
    if credentials is not None:
        credentials.on_refused = lambda reason: stop.set()
    endpoint = conn.endpoint or f"AWS {conn.region}"
    log.info("participant %s, run %s (bucket %s, table %s, %s); state in %s", options.pid, conn.run_id, conn.bucket,
             conn.table, endpoint, options.state_dir)
    try:
        outcome = Daemon(conn, options, stop, reporter).run()
    except (ParticipantError, FatalRemoteError) as exc:
        if credentials is not None and isinstance(exc, FatalRemoteError) and (refused := credentials.session.refusal()):
            _fail(f"stopped: {refused} ({exc})")  # (a revoked host's session is cut first: the endpoint says why)
        _fail(str(exc))
    if credentials is not None and credentials.session.refused:
        _fail(f"stopped: {credentials.session.refused}")
    if outcome.finished:
        if outcome.final:
            metrics = ", ".join(f"{k} {v:.4f}" for k, v in sorted(outcome.final.items()))
            acc = outcome.final.get("test_accuracy")
            headline = f"final test accuracy: {acc:.4f}" if acc is not None else "final model evaluated"
            typer.echo(f"{headline} ({metrics}; run {conn.run_id}, participant {options.pid}, "
                       f"{outcome.rounds} round(s) trained by this process)")
        else:
            typer.echo(f"run {conn.run_id} finished: {outcome.reason}")
        return 0
    if received and received[-1] == signal.SIGINT:
        return 130
    return 0


def _fail(message: str) -> NoReturn:
    log.error(message)
    typer.echo(f"fed-participant: error: {message}", err=True)
    raise typer.Exit(1)
