"""`fed run init --task NAME`: a run file of a task that pins its initial model by digest.

Every honest participant builds the same initial model from the run's seed (on the CPU, in float32: the same bytes
on every host), so the run file can name those bytes. Ingest then refuses any other offer, whoever sends it first,
and a participant refuses to train on any other round 0 (`participant.training.Training.check_initial_model`).
The model is built here, in this process, exactly as a participant builds the one it offers.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from fed.demo.errors import DemoFailed
from fed.demo.hf import pin_lines
from fed.demo.tasks import DEMO_TASKS
from participant.tasks import hf_meta
from shared import wire
from shared.config import RunConfig
from shared.digest import digest, digest_file


def task_spec(task: str) -> str:
    """The task a name stands for: a built-in one (`digits`, `lm`, `flower`) or a `module:object` of the user's."""
    if task in DEMO_TASKS:
        spec = DEMO_TASKS[task].spec
    elif ":" in task:
        spec = task
    else:
        raise DemoFailed(f"--task {task!r}: give one of {', '.join(n for n in DEMO_TASKS if n != 'hf')} or a "
                         "module:object")
    if hf_meta.is_hf(spec):
        raise DemoFailed("a Hugging Face model's run file starts from its files: `fed run init --from DIR`")
    return spec


def initial_model_pin(run_id: str, spec: str, seed: int) -> dict[str, Any]:
    """The seed, schema and digest of the initial model `spec` builds from `seed`, as a participant offers it."""
    from participant.task import load_task
    from participant.tensors import save_model

    try:
        task = load_task(spec, RunConfig(run_id=run_id, task=spec, seed=seed))
        model = task.build_model(seed)
    except Exception as exc:  # (a user's task may fail in any way: said, not a traceback)
        raise DemoFailed(f"building the initial model of {spec}: {type(exc).__name__}: {exc}") from None
    with tempfile.TemporaryDirectory() as scratch:
        path = save_model(model, Path(scratch) / "init.safetensors")
        with path.open("rb") as f:
            prefix = f.read(8)
            prefix += f.read(wire.header_length(prefix, path.stat().st_size))
        header = wire.parse_header_prefix(prefix, path.stat().st_size)
        return {"seed": seed, "initial_model_schema": digest(wire.encode_header(header.tensors)),
                "initial_model_digest": digest_file(path)}


def task_run_toml(run_id: str, spec: str, seed: int) -> str:
    """A run file of `spec` that pins its initial model; every other key at its default."""
    lines = ["# A run of a task: `fed local --config FILE`, or `cdk deploy -c config=FILE`.",
             "# Every other [run] key keeps its default (shared/config.py: RunConfig).", "", "[run]",
             f"run_id = {json.dumps(run_id)}", f"task = {json.dumps(spec)}",
             *pin_lines(initial_model_pin(run_id, spec, seed))]
    return "\n".join(lines) + "\n"
