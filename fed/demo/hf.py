"""`fed demo --task hf`: the Hugging Face task's run settings, found by asking the model itself.

The model is the user's (`--model DIR`) or the tiny Llama this machine builds once (`participant.tasks.hf_tiny`,
cached under `$FED_CACHE`, default `~/.cache/fed`). Its digests, training set size and initial model schema come
from `python -m participant.tasks.hf describe` in a process of its own, so that the demo's process (the local
stack's functions) never imports torch or transformers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from fed.demo.errors import DemoFailed
from participant.tasks import hf_meta
from shared.config import Adapter, HfOptions

TINY_MODEL = "tiny-llama-v1"  # (a new name when hf_tiny's recipe changes: an old cached build is not reused)
DESCRIBE_TIMEOUT = 600.0


def cache_dir() -> Path:
    return Path(os.environ.get("FED_CACHE") or Path.home() / ".cache" / "fed")


def _run(args: list[str], what: str) -> str:
    done = subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=DESCRIBE_TIMEOUT,
                          check=False)
    if done.returncode != 0:
        raise DemoFailed(f"{what} failed: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else ''}")
    return done.stdout


def hf_settings(model: str | None, adapter: str | None) -> dict[str, Any]:
    """`[run.hf]` (with the model's digests), `dataset_size` and `initial_model_schema` of a demo run."""
    source = model or _run(["participant.tasks.hf_tiny", str(cache_dir() / "models" / TINY_MODEL)],
                           "building the tiny model").strip()
    try:
        options = HfOptions(adapter=Adapter(adapter or Adapter.NONE.value))
    except ValueError:
        raise DemoFailed(f"--adapter {adapter}: give one of {', '.join(a.value for a in Adapter)}") from None
    return described_settings(source, options)


def described_settings(source: str, options: HfOptions) -> dict[str, Any]:
    """A run's settings for the model at `source` under `options`: `hf` (options with the model's digests),
    `dataset_size`, `initial_model_schema` and `initial_model_digest` (the model a participant builds from these
    files and seed 0, which `seed` names), as the model itself gives them; DemoFailed if it cannot be read."""
    described = json.loads(_run(["participant.tasks.hf", "describe", source, "--options",
                                 options.model_dump_json()], f"reading the model {source}"))
    return {"hf": options.model_copy(update=described["hf"]), "dataset_size": described["dataset_size"],
            "initial_model_schema": described["initial_model_schema"],
            "initial_model_digest": described["initial_model_digest"], "seed": 0}


def run_toml(run_id: str, settings: dict[str, Any]) -> str:
    """A run file (`[run]` and `[run.hf]`) starting a run from the described model; every other key at its
    default (shared/config.py: RunConfig)."""
    hf: HfOptions = settings["hf"]
    lines = ["# A run of a Hugging Face model: `fed local --config FILE`, or `cdk deploy -c config=FILE`.",
             "# Every other [run] key keeps its default (shared/config.py: RunConfig); learning_rate and batch_size",
             "# are the first to tune.", "", "[run]", f"run_id = {json.dumps(run_id)}",
             f"task = {json.dumps(hf_meta.TASK)}", f"dataset_size = {settings['dataset_size']}",
             *pin_lines(settings), "", "[run.hf]"]
    for name, value in hf.model_dump(mode="json", exclude_defaults=True).items():
        lines.append(f"{name} = {json.dumps(value)}")
    return "\n".join(lines) + "\n"


def pin_lines(settings: dict[str, Any]) -> list[str]:
    """The run file's lines that pin its initial model: the seed it is built from, its schema and its digest (ingest
    refuses every other offer, and a participant refuses to train on any other round 0)."""
    return ["# The initial model every participant builds from the seed below: ingest refuses any other offer.",
            "# Another seed builds another model: run `fed run init` again for it.",
            f"seed = {settings['seed']}",
            f"initial_model_schema = {json.dumps(settings['initial_model_schema'])}",
            f"initial_model_digest = {json.dumps(settings['initial_model_digest'])}"]
