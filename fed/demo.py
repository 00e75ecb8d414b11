"""`fed demo`: the local stack plus N real participant processes training a built-in task to the end.

The demo is an observer: it starts the stack and the participants, then only reads what the coordinator
records (round summaries, the run state) and the global models in the bucket, which it evaluates with
the task on its held-out test set. It never drives the run itself.

Two built-in tasks (`--task`): `digits` (the default: an MLP on scikit-learn's digits; each round's test
accuracy) and `lm` (a ~1M-parameter byte-level transformer on Python's help text, participant.tasks.lm; each
round's held-out loss and perplexity).
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from rich.console import Console

from fed.evaluation import EvaluationFailed, Evaluator
from fed.localrun import RoundFollower, store_for
from fed.plot import PlotUnavailable, RoundPoint, write_png
from fed.zygote import Forked, Zygote, ZygoteError, die_with_parent
from fed.zygote import supported as zygote_supported
from local.stack import LocalStack, client_environment
from participant.splits import parse_split
from participant.tasks import digits_meta, flower_digits_meta, lm_meta
from shared import keys
from shared.config import DataMode, DownloadEncoding, RunConfig, UpdateEncoding
from shared.delta import MAX_INDEX_BYTES, DeltaIndex
from shared.state import Phase, RoundSummary
from store.blobs import Bucket, NotFound, s3_client

DEMO_RUN_ID = "demo"
DEFAULT_ROUNDS = 20
DEFAULT_TIMEOUT = 600.0
JOIN_TIMEOUT = 120.0  # participants import torch first: seconds on a loaded 2-core machine
EXIT_GRACE = 20.0  # after the run finished, how long participants get to notice and exit
POLL_MAX = 0.5  # participants re-read the state at least this often: rounds follow each other quickly
# Witnesses attest an update if the round's aggregate with it is at most this much worse than without it (a task's
# settings may say otherwise: digits, measured, uses 0.2).
WITNESS_TOLERANCE = 0.3


class DemoFailed(RuntimeError):
    """The demo could not finish; the message says why and where the logs are."""


@dataclass(frozen=True)
class DemoTask:
    """A built-in task the demo can run (`--task NAME`): its spec and training set size, and the rounds and
    training settings that finish quickly on a 2-core CPU machine (and the initial model's schema: an offer of any
    other model is refused)."""

    name: str
    spec: str
    train_size: int
    rounds: int
    settings: dict[str, Any]
    split: str | None = None  # a task that trains on local data: the --split its participants' data follows


DEMO_TASKS: dict[str, DemoTask] = {
    "digits": DemoTask(
        "digits", digits_meta.TASK, digits_meta.TRAIN_SIZE, DEFAULT_ROUNDS,
        # measured on 4 participants: >= 0.95 from round 5, about 0.97 after 20. Witness tolerance: leaving an honest
        # update out of 4 moves the aggregate's loss by up to 18% late in a run, a sign-flipped update scaled 5x by
        # 24% at least (benchmarks/witness_errors.py, 30 rounds, IID and Dirichlet 0.5); 0.3 let such updates in
        dict(local_epochs=2, batch_size=32, learning_rate=0.1, witness_tolerance=0.2,
             initial_model_schema=digits_meta.MODEL_SCHEMA),
    ),
    "lm": DemoTask(
        "lm", lm_meta.TASK, lm_meta.TRAIN_SIZE, 4,
        # AdamW, one pass over the corpus a round: a round takes 20-60 s on a 2-core machine (4 participants, one
        # thread each) and the held-out loss falls from 5.55 (untrained) to about 3.0 after round 0, 2.35 after 4
        dict(local_epochs=1, batch_size=16, learning_rate=3e-3, max_round_train_time=300.0, liveness_timeout=30.0,
             initial_model_schema=lm_meta.MODEL_SCHEMA),
    ),
    # the Flower anchor's work (participant.tasks.flower_digits): participant p<i+1> trains the anchor's shard i, all
    # of them every round, plain FedAvg, no witnesses (make bench-rounds)
    "flower": DemoTask(
        "flower", flower_digits_meta.TASK, flower_digits_meta.TRAIN_SIZE, flower_digits_meta.ROUNDS,
        dict(local_epochs=flower_digits_meta.LOCAL_EPOCHS, batch_size=flower_digits_meta.BATCH_SIZE,
             learning_rate=flower_digits_meta.LEARNING_RATE, witness_nodes=0, work_sizing="equal",
             initial_model_schema=flower_digits_meta.MODEL_SCHEMA),
        split="iid",
    ),
}
DEFAULT_TASK = "digits"


def demo_task(name: str) -> DemoTask:
    try:
        return DEMO_TASKS[name]
    except KeyError:
        raise DemoFailed(f"unknown demo task {name!r}: choose one of {', '.join(DEMO_TASKS)}") from None


def reports_loss(task_spec: str) -> bool:
    """Whether the demo reports a run of this task by its held-out loss (the LM task, any size) rather than by
    its test accuracy."""
    return task_spec.partition(":")[0] == lm_meta.TASK.partition(":")[0]


def demo_config(participants: int, rounds: int | None = None, kill_one: bool = False,
                run_id: str = DEMO_RUN_ID, task: str = DEFAULT_TASK, **overrides: Any) -> RunConfig:
    """Settings that finish quickly on a 2-core CPU machine: for digits (default: 20 rounds), >= 0.95 test
    accuracy; for the LM task (`task="lm"`, default 4 rounds), a held-out loss falling every round.

    Every participant trains every round (fraction 1.0) on its 1/N share of the training set. Two of them,
    drawn each round, witness it: each checks every update on its held-out data and the round is aggregated
    from the updates both attested (see participant/witness_eval.py). With `kill_one`, one participant will die
    mid-run, so the run must keep going with N-1 members.
    """
    if participants < 1:
        raise DemoFailed("a demo needs at least one participant")
    chosen = demo_task(task)
    survivors = participants - 1 if kill_one else participants
    if survivors < 1:
        raise DemoFailed("--kill-one needs at least two participants")
    values: dict[str, Any] = dict(
        run_id=run_id,
        min_clients=survivors,
        fraction_per_round=1.0,
        min_per_round=survivors,
        min_updates=max(1, survivors - 1) if survivors > 1 else 1,
        total_rounds=rounds or chosen.rounds,
        rounds_per_epoch=0,
        warmup_time=5.0,
        max_round_train_time=30.0,
        round_witness_time=10.0,  # only when a witness misses the opportunistic close (e.g. --kill-one)
        cooldown_time=0.0,
        liveness_timeout=10.0,
        witness_nodes=2,
        witness_tolerance=WITNESS_TOLERANCE,
        task=chosen.spec,
        dataset_size=chosen.train_size,
    )
    values.update(chosen.settings)
    values.update(overrides)
    if not values["witness_nodes"] and "round_witness_time" not in overrides:
        values["round_witness_time"] = 0.0  # nobody to wait for: a witness phase would only add its full length
    return RunConfig(**values)


# --- evaluation --------------------------------------------------------------------------------------


def download_bytes(bucket: Bucket, run_id: str, round_no: int, model_digest: str) -> int:
    """What a participant holding the previous round's global model downloads to get this one: the delta's index
    and pieces where the round wrote a delta (`download_encoding`), else the whole model."""
    try:
        raw = bucket.get(keys.delta_key(run_id, round_no, model_digest), MAX_INDEX_BYTES).data
    except NotFound:
        head = bucket.head(keys.global_key(run_id, round_no, model_digest))
        return int(head["ContentLength"]) if head else 0
    index = DeltaIndex.decode(raw, model_digest)
    sizes = (bucket.head(keys.delta_key(run_id, round_no, d)) for d in index.pieces)
    return len(raw) + sum(int(h["ContentLength"]) for h in sizes if h)


# --- participant processes ---------------------------------------------------------------------------


def participant_environment() -> dict[str, str]:
    """What a participant process gets: this process's environment, for the local endpoint."""
    return {
        **os.environ,
        **client_environment(),
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",  # N processes share the cores: one thread each trains fastest
        "MKL_NUM_THREADS": "1",
    }


def participant_command() -> list[str]:
    """`fed-participant` from this environment (beside this interpreter), else on PATH."""
    beside = Path(sys.executable).with_name("fed-participant")
    if beside.exists():
        return [str(beside)]
    found = shutil.which("fed-participant")
    if found:
        return [found]
    return [sys.executable, "-c", "from participant.cli import app; app()"]


@dataclass
class ParticipantProcess:
    name: str
    process: subprocess.Popen[bytes] | Forked
    log: Path
    killed: bool = False


@dataclass
class Participants:
    """N `fed-participant start` processes, each with its own state directory and log file; with `forked`, forked
    from a zygote that imported torch and the tasks once (fed/zygote.py: seconds sooner to join on a small machine),
    else each spawned as the command."""

    connection_file: Path
    workdir: Path
    extra_args: list[str] = field(default_factory=list)
    procs: dict[str, ParticipantProcess] = field(default_factory=dict)
    forked: bool = False
    zygote: Zygote | None = None

    def __post_init__(self) -> None:
        if self.forked and zygote_supported():
            self.zygote = Zygote(participant_environment(), self.workdir / "logs" / "zygote.log")
            self.zygote.start()  # (its imports overlap whatever the caller does until the first spawn)

    def spawn(self, names: list[str], extra: dict[str, list[str]] | None = None) -> None:
        """Start a process per name; `extra` adds arguments for some of them (e.g. another --task)."""
        env = participant_environment()
        logs = self.workdir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        for name in names:
            log = logs / f"{name}.log"
            state_dir = self.workdir / "participants" / name
            args = ["start", "--connection", str(self.connection_file), "--id", name, "--state-dir", str(state_dir),
                    "--threads", "1", "--poll-max", str(POLL_MAX), *self.extra_args, *(extra or {}).get(name, [])]
            log.write_bytes(b"")
            self.procs[name] = ParticipantProcess(name, self._start(args, env, log), log)

    def start_helper(self, module: str, args: list[str], log: Path) -> subprocess.Popen[bytes] | Forked:
        """`python -m <module> <args>` (its `main(args)`), forked from the zygote if there is one: a helper of the
        demo's that needs torch, such as the evaluator (fed/evaluation.py)."""
        log.parent.mkdir(parents=True, exist_ok=True)
        return self._start(args, participant_environment(), log, module)

    def _start(self, args: list[str], env: dict[str, str], log: Path,
               helper: str = "") -> subprocess.Popen[bytes] | Forked:
        if self.zygote is not None:
            try:
                return self.zygote.fork(args, env, log, f"{helper}:main" if helper else "")
            except ZygoteError as exc:
                logging.getLogger(__name__).warning("spawning participants instead of forking them: %s", exc)
                self.zygote.stop()
                self.zygote = None
        command = [sys.executable, "-m", helper] if helper else participant_command()
        with log.open("ab") as out:
            return subprocess.Popen(
                [*command, *args], stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=env, start_new_session=True,  # Ctrl-C reaches the demo, which stops them in order
                preexec_fn=die_with_parent if sys.platform.startswith("linux") else None,  # noqa: PLW1509
            )

    def kill(self, name: str) -> None:
        """SIGKILL: no goodbye, no flush; the coordinator must notice on its own."""
        p = self.procs[name]
        p.killed = True
        p.process.send_signal(signal.SIGKILL)
        p.process.wait()

    def failed(self) -> list[ParticipantProcess]:
        """Processes that exited with an error (a killed one does not count)."""
        return [p for p in self.procs.values()
                if not p.killed and p.process.poll() is not None and p.process.returncode != 0]

    def running(self) -> list[ParticipantProcess]:
        return [p for p in self.procs.values() if p.process.poll() is None]

    def wait_exit(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while self.running() and time.monotonic() < deadline:
            time.sleep(0.2)
        return not self.running()

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM every live process, then SIGKILL what is left after `grace` seconds; then the zygote."""
        for p in self.running():
            p.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for p in self.procs.values():
            try:
                p.process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.process.kill()
                p.process.wait()
        if self.zygote is not None:
            self.zygote.stop()

    def tail(self, name: str, lines: int = 15) -> str:
        try:
            text = self.procs[name].log.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


# --- the demo ----------------------------------------------------------------------------------------


@dataclass
class DemoOptions:
    participants: int = 4
    rounds: int | None = None  # None: the config's total_rounds (DEFAULT_ROUNDS without --config)
    report: Path | None = None
    plot: Path | None = None  # a PNG of the per-round curves
    config: RunConfig | None = None
    kill_one: bool = False
    kill_after_round: int = 1  # with kill_one: kill during the first round after this many were recorded
    timeout: float = DEFAULT_TIMEOUT
    tick_interval: float = 1.0
    workdir: Path | None = None
    keep: bool = False
    task: str | None = None  # a DEMO_TASKS name; None: digits, or the --config file's task
    split: str | None = None  # local data mode: iid or dirichlet:ALPHA, part i to participant i; None: assigned
    updates: str | None = None  # update_encoding (weights, bf16, int8); None: the config's (weights by default)
    downloads: str | None = None  # download_encoding (full, bf16, int8); None: the config's (full by default)
    mixed_speeds: bool = False  # the last participant trains at a quarter of the host's speed (--throttle 0.25)
    count_requests: bool = False  # the local server counts requests by service and operation: the report's requests


SLOW_THROTTLE = 0.25  # --mixed-speeds: the last participant is four times slower than the others
# --mixed-speeds on digits: 20 local epochs, so that training takes long enough (~0.15 s) for the throughput
# measurement to mean something, at a learning rate lowered to match. At the demo's 0.1, 20 epochs sometimes spike
# one honest update so far that both witnesses refuse it and it is dropped (seen in CI: leave-one-out loss ratio
# 2.3); simulated, 32 rounds of 4 sized updates: at 0.1 max ratio 1.24 (1 of 128 over the 1.2 tolerance), at 0.03
# max 1.06 (0 of 128), final losses alike (benchmarks/witness_errors.py --local-epochs 20 --learning-rate 0.03).
MIXED_SPEEDS_DIGITS: dict[str, Any] = {"local_epochs": 20, "learning_rate": 0.03}


def throttles(names: list[str], mixed: bool) -> dict[str, float]:
    """Each participant's --throttle: with mixed speeds, the last of two or more trains at SLOW_THROTTLE."""
    return {n: SLOW_THROTTLE if mixed and len(names) > 1 and i == len(names) - 1 else 1.0
            for i, n in enumerate(names)}


@dataclass
class RoundRow:
    round: int
    participants: int
    accepted: int
    refused: int
    loss: float | None
    accuracy: float
    seconds: float
    aggregated: bool
    dropped: dict[str, str]
    witnesses: int = 0  # valid witness proofs received
    elected: int = 0  # witnesses elected
    test_loss: float | None = None  # held-out loss and perplexity: reported for the LM task only
    perplexity: float | None = None
    download_bytes: int = 0  # what a participant holding the previous global downloads for this round's
    # throughput sizing: each participant's share of the round (fraction of the plan's weight), its training seconds
    # (as its update says) and its seconds from the round's start to its upload
    shares: dict[str, float] = field(default_factory=dict)
    train_seconds: dict[str, float] = field(default_factory=dict)
    finished: dict[str, float] = field(default_factory=dict)
    started: float = 0.0  # the round's start and end, epoch seconds, as the coordinator recorded them
    ended: float = 0.0

    def report(self) -> dict[str, Any]:
        row = {"round": self.round, "participants": self.participants, "accepted": self.accepted,
               "refused": self.refused, "loss": self.loss, "accuracy": self.accuracy,
               "seconds": round(self.seconds, 3), "aggregated": self.aggregated, "dropped": self.dropped,
               "witnesses": self.witnesses, "download_bytes": self.download_bytes, "shares": self.shares,
               "train_seconds": self.train_seconds, "participant_seconds": self.finished,
               "started": self.started, "ended": self.ended}
        if self.test_loss is not None:
            row.update(test_loss=self.test_loss, test_perplexity=self.perplexity)
        return row


HEADER = (f"{'round':>5}  {'participants':>12}  {'accepted':>8}  {'refused':>7}  {'proofs':>6}  {'loss':>8}  "
          f"{'test acc':>8}  {'seconds':>7}")
# The LM task: the held-out loss and perplexity of each round's global model where digits shows test accuracy
LOSS_HEADER = (f"{'round':>5}  {'participants':>12}  {'accepted':>8}  {'refused':>7}  {'proofs':>6}  {'loss':>8}  "
               f"{'test loss':>9}  {'perplexity':>10}  {'seconds':>7}")


def format_row(r: RoundRow) -> str:
    loss = f"{r.loss:8.4f}" if r.loss is not None else f"{'-':>8}"
    note = "" if r.aggregated else "  not aggregated"
    if r.dropped:
        note += "  dropped: " + ", ".join(f"{p} ({why})" for p, why in sorted(r.dropped.items()))
    proofs = f"{r.witnesses}/{r.elected}" if r.elected else "-"
    if r.test_loss is not None:
        ppl = f"{r.perplexity:10.3f}" if r.perplexity is not None else f"{'-':>10}"
        held_out = f"{r.test_loss:9.4f}  {ppl}"
    else:
        held_out = f"{r.accuracy:8.4f}"
    return (f"{r.round:>5}  {r.participants:>12}  {r.accepted:>8}  {r.refused:>7}  {proofs:>6}  {loss}  "
            f"{held_out}  {r.seconds:7.2f}{note}")


def format_sizing(r: RoundRow) -> str:
    """One round's sizing: each participant's share and its training seconds."""
    parts = [f"{p} {100 * share:.0f}% {r.train_seconds[p]:.2f}s" if p in r.train_seconds else f"{p} {100 * share:.0f}%"
             for p, share in sorted(r.shares.items())]
    return "       share, training seconds: " + ", ".join(parts)


def sizing_summary(rows: list[RoundRow], speeds: dict[str, float]) -> dict[str, Any]:
    """Per participant: its throttle, and its mean share and training seconds in the first round (equal shares,
    nothing measured yet) and in the rounds after it (sized by the measured throughput)."""

    def mean(values: list[float]) -> float | None:
        return round(sum(values) / len(values), 4) if values else None

    first, later = rows[:1], rows[1:]
    out: dict[str, Any] = {}
    for pid, throttle in sorted(speeds.items()):
        out[pid] = {
            "throttle": throttle,
            "share_first_round": mean([r.shares[pid] for r in first if pid in r.shares]),
            "share_sized_rounds": mean([r.shares[pid] for r in later if pid in r.shares]),
            "train_seconds_first_round": mean([r.train_seconds[pid] for r in first if pid in r.train_seconds]),
            "train_seconds_sized_rounds": mean([r.train_seconds[pid] for r in later if pid in r.train_seconds]),
            "seconds_sized_rounds": mean([r.finished[pid] for r in later if pid in r.finished]),
        }
    return out


def with_task_split(opts: DemoOptions) -> DemoOptions:
    """A built-in task that trains on local data (`DemoTask.split`, e.g. flower) gets its split unless --split or
    --config says otherwise."""
    if opts.split is not None or opts.config is not None:
        return opts
    return replace(opts, split=demo_task(opts.task or DEFAULT_TASK).split)


def resolve_config(opts: DemoOptions) -> RunConfig:
    if opts.split is not None:
        if "/" in opts.split:
            raise DemoFailed(f"--split {opts.split}: give iid or dirichlet:ALPHA; participant i gets part i")
        try:
            parse_split(opts.split, 0, opts.participants)
        except ValueError as exc:
            raise DemoFailed(f"--split: {exc}") from None
    if opts.updates is not None and opts.updates not in [e.value for e in UpdateEncoding]:
        raise DemoFailed(f"--updates {opts.updates}: give one of {', '.join(e.value for e in UpdateEncoding)}")
    if opts.downloads is not None and opts.downloads not in [e.value for e in DownloadEncoding]:
        raise DemoFailed(f"--downloads {opts.downloads}: give one of {', '.join(e.value for e in DownloadEncoding)}")
    encoding: dict[str, Any] = ({"update_encoding": opts.updates} if opts.updates else {}) | (
        {"download_encoding": opts.downloads} if opts.downloads else {})
    if opts.config is None:
        local: dict[str, Any] = {"data_mode": DataMode.LOCAL, "dataset_size": 0} if opts.split else {}
        # mixed speeds on digits: more local epochs, so that training (what the shares divide) is a good part of a
        # round and the sizing shows in its seconds
        heavier = MIXED_SPEEDS_DIGITS if opts.mixed_speeds and (opts.task or DEFAULT_TASK) == "digits" else {}
        return demo_config(opts.participants, opts.rounds, opts.kill_one, task=opts.task or DEFAULT_TASK, **local,
                           **encoding, **heavier)
    if opts.split and opts.config.data_mode is not DataMode.LOCAL:
        raise DemoFailed("--split gives each participant its own data, but the --config file's data_mode is "
                         f"{opts.config.data_mode}: set data_mode = \"local\" there")
    if opts.task is not None and demo_task(opts.task).spec.partition(":")[0] != opts.config.task.partition(":")[0]:
        raise DemoFailed(f"--task {opts.task} and the --config file's task ({opts.config.task}) disagree: "
                         "leave --task out to run the config's task")
    changes = encoding | ({"total_rounds": opts.rounds} if opts.rounds is not None else {})
    return RunConfig(**{**opts.config.model_dump(), **changes}) if changes else opts.config


def run_demo(opts: DemoOptions, console: Console | None = None) -> dict[str, Any]:
    """Run the demo to the end; return the report (also written to `opts.report`). Raises DemoFailed."""
    console = console or Console()
    opts = with_task_split(opts)
    config = resolve_config(opts)
    if config.min_clients > opts.participants:
        raise DemoFailed(f"the config needs {config.min_clients} participants to start (min_clients), but the demo "
                         f"starts {opts.participants}: pass --participants {config.min_clients} or more")
    if opts.kill_one and opts.participants - 1 < config.min_clients:
        raise DemoFailed(
            f"--kill-one with {opts.participants} participants leaves {opts.participants - 1}, fewer than the "
            f"config's min_clients ({config.min_clients}): the run could not go on"
        )
    started = time.monotonic()
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
        procs = Participants(connection_file, workdir, forked=True)  # (the zygote's imports overlap the stack's start)
        stack.start()
        stack.connection.save(connection_file)
        console.print(f"[bold]fed demo[/]: {opts.participants} participants, {config.total_rounds} rounds of "
                      f"{config.task} on {stack.endpoint}")
        console.print(f"logs: {workdir / 'logs'}   watch: fed status --connection {connection_file} --watch")
        console.print(str(stack.access))
        names = [f"p{i}" for i in range(1, opts.participants + 1)]
        speeds = throttles(names, opts.mixed_speeds)
        extra = {name: ["--data", f"{opts.split}:{i}/{len(names)}"] if opts.split else [] for i, name in
                 enumerate(names)}
        for name, throttle in speeds.items():
            if throttle < 1:
                extra[name] += ["--throttle", str(throttle)]
                console.print(f"{name} trains at {throttle:g} of this host's speed (--throttle {throttle:g})")
        procs.spawn(names, extra)
        evaluator = Evaluator(config, connection_file, workdir / "logs" / "evaluator.log",
                              lambda args, log: procs.start_helper("fed.evaluation", args, log))
        with console.status(f"starting {len(names)} participant processes"):
            await_joins(stack, names, procs)
        if hold:
            stack.release_events()  # every participant has asked to join: the first epoch admits them all
        by_loss = reports_loss(config.task)
        rows = _follow(stack, config, opts, procs, evaluator, console, started, by_loss)
        final = store_for(stack.connection).read_state()
        final_eval = evaluate(evaluator, final.round, final.global_digest)
        final_accuracy = final_eval["test_accuracy"]
        procs.wait_exit(EXIT_GRACE)
        wall = time.monotonic() - started
        counted = stack.server.requests if stack.server is not None else None
        report = {
            "config": config.to_json_dict(),
            "rounds": [r.report() for r in rows],
            "final_accuracy": final_accuracy,
            "wall_seconds": round(wall, 2),
            "participants": opts.participants,
            "split": opts.split,
            "killed": [p.name for p in procs.procs.values() if p.killed],
            "aggregated_rounds": final.aggregated,
            "work_sizing": config.work_sizing.value,
            "throttles": speeds,
        }
        if counted is not None:  # every request the local server answered, by service and operation
            report["requests"] = [[svc, op, n] for (svc, op), n in sorted(counted.snapshot().items())]
            # and each request: [epoch seconds, client address, service, operation, S3 PutObject path]
            report["request_events"] = [list(e) for e in counted.events()]
        if opts.mixed_speeds:
            report["sizing"] = summary = sizing_summary(rows, speeds)
            console.print("per participant (first round: equal shares; later rounds: sized by measured throughput):")
            for pid, row in summary.items():
                console.print(f"  {pid}: throttle {row['throttle']:g}, share {_pct(row['share_first_round'])} -> "
                              f"{_pct(row['share_sized_rounds'])}, training {_secs(row['train_seconds_first_round'])}"
                              f" -> {_secs(row['train_seconds_sized_rounds'])} a round")
        if by_loss:
            report.update(final_test_loss=final_eval["test_loss"], final_perplexity=final_eval["test_perplexity"])
        if opts.report is not None:
            opts.report.parent.mkdir(parents=True, exist_ok=True)
            opts.report.write_text(json.dumps(report, indent=1) + "\n")
        if opts.plot is not None:
            points = [RoundPoint(r.round, r.loss, r.accuracy, r.seconds, r.aggregated, r.test_loss) for r in rows]
            try:
                write_png(points, opts.plot, f"fed demo: {opts.participants} participants, {config.task}",
                          metric="test_loss" if by_loss else "accuracy")
            except PlotUnavailable as exc:  # the run itself succeeded: say so, and why there is no plot
                console.print(f"[yellow]no plot:[/] {exc}")
        headline = f"final test accuracy {final_accuracy:.4f}"
        if by_loss:
            headline = (f"final held-out loss {final_eval['test_loss']:.4f} (perplexity "
                        f"{final_eval['test_perplexity']:.2f}, next-byte accuracy {final_accuracy:.4f})")
        console.print(f"[green]finished[/]: {final.aggregated} rounds in {wall:.1f}s, {headline}"
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


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def _secs(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}s"


def await_joins(stack: LocalStack, names: list[str], procs: Participants, timeout: float = JOIN_TIMEOUT,
                heard: bool = True) -> None:
    """Wait until every participant's join request (and, with `heard`, a heartbeat after it) is in the bucket
    (delivery is held back meanwhile, so the first epoch admits them all: an epoch admits only those heard from
    since joining); raise DemoFailed if one dies first or they take longer than `timeout`. `heard=False` where the
    participants cannot heartbeat yet (no tick has published the run's configuration while everything is held)."""
    assert stack.resources is not None
    bucket = Bucket(stack.resources.bucket, s3_client(stack.endpoint, stack.resources.region))
    run_id = stack.config.run_id
    deadline = time.monotonic() + timeout
    while True:
        check_processes(procs)
        joined = {k.rsplit("/", 1)[-1] for k in bucket.keys(keys.join_prefix(run_id))}
        if heard:
            joined &= {k.rsplit("/", 1)[-1] for k in bucket.keys(keys.heartbeat_prefix(run_id))}
        if joined >= set(names):
            return
        if time.monotonic() > deadline:
            missing = ", ".join(sorted(set(names) - joined))
            raise DemoFailed(f"participants {missing} did not ask to join within {timeout:.0f}s")
        time.sleep(0.2)


def check_processes(procs: Participants) -> None:
    failed = procs.failed()
    if failed:
        p = failed[0]
        raise DemoFailed(
            f"participant {p.name} exited with status {p.process.returncode}; the end of {p.log}:\n{procs.tail(p.name)}"
        )


def _follow(stack: LocalStack, config: RunConfig, opts: DemoOptions, procs: Participants, evaluator: Evaluator,
            console: Console, started: float, by_loss: bool = False) -> list[RoundRow]:
    """Print a row per recorded round until the run is Finished; kill a participant if asked."""
    store = store_for(stack.connection)
    follower = RoundFollower(store)
    rows: list[RoundRow] = []
    victim = sorted(procs.procs)[-1] if opts.kill_one else None
    console.print(LOSS_HEADER if by_loss else HEADER)
    deadline = started + opts.timeout
    while True:
        check_processes(procs)
        state = store.read_state()
        for summary in follower.new():
            row = _row(summary, evaluator, by_loss, store)
            rows.append(row)
            console.print(format_row(row))
            if opts.mixed_speeds:
                console.print(format_sizing(row))
        if victim is not None and not procs.procs[victim].killed:
            _maybe_kill(procs, store, state, victim, len(rows), opts.kill_after_round, console)
        if state.phase is Phase.FINISHED:
            for summary in follower.new():  # the closing tick records the last round with the state
                row = _row(summary, evaluator, by_loss, store)
                rows.append(row)
                console.print(format_row(row))
                if opts.mixed_speeds:
                    console.print(format_sizing(row))
            return rows
        if time.monotonic() > deadline:
            raise DemoFailed(
                f"the run did not finish within {opts.timeout:.0f}s: phase {state.phase}, round {state.round}, "
                f"{state.aggregated}/{config.total_rounds} rounds aggregated"
            )
        time.sleep(0.25)


def evaluate(evaluator: Evaluator, round_no: int, model_digest: str) -> dict[str, float]:
    try:
        return evaluator.evaluate(round_no, model_digest)
    except EvaluationFailed as exc:
        raise DemoFailed(str(exc)) from exc


def _row(summary: RoundSummary, evaluator: Evaluator, by_loss: bool = False, store: Any = None) -> RoundRow:
    evaluation = evaluate(evaluator, summary.round + 1, summary.global_digest)
    weight = sum(summary.shares.values())
    row = RoundRow(summary.round, len(summary.selected), len(summary.counted), len(summary.refused), summary.loss,
                   evaluation["test_accuracy"], summary.seconds, summary.aggregated, dict(summary.dropped),
                   summary.proofs, len(summary.witnesses),
                   shares={p: round(w / weight, 4) for p, w in sorted(summary.shares.items())} if weight else {},
                   finished=dict(summary.finished), started=summary.started, ended=summary.ended)
    if summary.global_digest and store is not None:
        row.download_bytes = download_bytes(store.rosters.bucket, store.run_id, summary.round + 1,
                                            summary.global_digest)
    if store is not None:
        for pid in summary.shares:
            rec = store.update_record(summary.round, pid)
            if rec is not None and rec.accepted and "train_seconds" in rec.metrics:
                row.train_seconds[pid] = round(rec.metrics["train_seconds"], 3)
    if by_loss:
        row.test_loss = evaluation[lm_meta.METRIC]
        row.perplexity = evaluation.get("test_perplexity", math.exp(min(row.test_loss, 700.0)))
    return row


def _maybe_kill(procs: Participants, store: Any, state: Any, victim: str, rounds_seen: int, after: int,
                console: Console) -> None:
    """Kill the victim while it is selected for a round it has not delivered yet: mid-round."""
    if rounds_seen < after or state.phase is not Phase.TRAIN or victim not in state.selected:
        return
    if store.update_record(state.round, victim) is not None:
        return
    procs.kill(victim)
    console.print(f"[yellow]killed participant {victim} (SIGKILL) during round {state.round}[/]")

