"""What the operator asked of the demo (`fed demo`'s options) and the run configuration it comes to: the task's
own settings, or a --config file's, with the options' changes checked against them."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from fed.demo.errors import DemoFailed
from fed.demo.tasks import DEFAULT_TASK, demo_config, demo_task
from participant.splits import parse_split
from shared.config import DataMode, DownloadEncoding, RunConfig, UpdateEncoding

DEFAULT_TIMEOUT = 600.0


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
    invites: bool = False  # each participant joins with an invite line alone, as a host outside AWS would
    count_requests: bool = False  # the local server counts requests by service and operation: the report's requests
    model: str | None = None  # --task hf: the Hugging Face model (a directory); None: the tiny Llama built here
    adapter: str | None = None  # --task hf: none (full fine-tuning) or lora; None: none


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


def with_task_split(opts: DemoOptions) -> DemoOptions:
    """A built-in task that trains on local data (`DemoTask.split`, e.g. flower) gets its split unless --split or
    --config says otherwise."""
    if opts.split is not None or opts.config is not None:
        return opts
    return replace(opts, split=demo_task(opts.task or DEFAULT_TASK).split)


def resolve_config(opts: DemoOptions) -> RunConfig:
    """The run's configuration: the task's quick settings, or the --config file's, with --rounds, --updates and
    --downloads applied; DemoFailed where an option is malformed or contradicts the file."""
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
    hf = {name: value for name, value in (("model", opts.model), ("adapter", opts.adapter)) if value is not None}
    if hf and (opts.config is not None or opts.task != "hf"):
        raise DemoFailed(f"--{' and --'.join(hf)} belong to --task hf (a --config file sets [run.hf] itself)")
    if opts.config is None:
        local: dict[str, Any] = {"data_mode": DataMode.LOCAL, "dataset_size": 0} if opts.split else {}
        # mixed speeds on digits: more local epochs, so that training (what the shares divide) is a good part of a
        # round and the sizing shows in its seconds
        heavier = MIXED_SPEEDS_DIGITS if opts.mixed_speeds and (opts.task or DEFAULT_TASK) == "digits" else {}
        return demo_config(opts.participants, opts.rounds, opts.kill_one, task=opts.task or DEFAULT_TASK, **local,
                           **encoding, **heavier, **hf)
    if opts.split and opts.config.data_mode is not DataMode.LOCAL:
        raise DemoFailed("--split gives each participant its own data, but the --config file's data_mode is "
                         f"{opts.config.data_mode}: set data_mode = \"local\" there")
    if opts.task is not None and demo_task(opts.task).spec.partition(":")[0] != opts.config.task.partition(":")[0]:
        raise DemoFailed(f"--task {opts.task} and the --config file's task ({opts.config.task}) disagree: "
                         "leave --task out to run the config's task")
    changes = encoding | ({"total_rounds": opts.rounds} if opts.rounds is not None else {})
    return RunConfig(**{**opts.config.model_dump(), **changes}) if changes else opts.config


def check_members(opts: DemoOptions, config: RunConfig) -> None:
    """DemoFailed unless the participants the demo starts (and, with --kill-one, those left) are enough for the
    config's min_clients."""
    if config.min_clients > opts.participants:
        raise DemoFailed(f"the config needs {config.min_clients} participants to start (min_clients), but the demo "
                         f"starts {opts.participants}: pass --participants {config.min_clients} or more")
    if opts.kill_one and opts.participants - 1 < config.min_clients:
        raise DemoFailed(
            f"--kill-one with {opts.participants} participants leaves {opts.participants - 1}, fewer than the "
            f"config's min_clients ({config.min_clients}): the run could not go on"
        )
