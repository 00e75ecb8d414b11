"""The training plug-in: what `--task module:object` must provide, and how it is loaded.

A task owns the model, the data and the training loop; the daemon owns everything else (the run's
protocol, downloads, uploads, restarts). Training is deterministic given the seed the daemon passes
for each round, so a participant that dies mid-round retrains the same update after a restart.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from shared.config import RunConfig

# progress(done, total): called by `train` as it goes (e.g. once per batch); cheap, may raise to abort.
Progress = Callable[[int, int], None]


class TaskError(RuntimeError):
    """A task that cannot be loaded or does not fit the run."""


@runtime_checkable
class Task(Protocol):
    """Model, data and training of one federated workload.

    - `train_size`: number of samples in the shared training set; the coordinator's data assignment
      hands out indices in `range(train_size)`.
    - `build_model(seed)`: a freshly initialised model; the same seed gives the same weights on every
      host (every participant offers the same initial model).
    - `train(model, indices, config, device, progress, seed)`: train `model` in place on exactly the
      samples `indices`, for `config.local_epochs` passes (or `config.local_steps` steps: `local_batches`
      gives the batches either way) with `config.batch_size` and
      `config.learning_rate`; return metrics, at least `loss` (mean training loss). Draw every random
      choice (shuffling, dropout) from `seed` — e.g. a `torch.Generator().manual_seed(seed)` — so a
      round retrained after a restart gives the same update. (The daemon also seeds torch's global RNG
      with it, which is enough in a process that trains one model at a time.)
    - `evaluate(model, device)`: `{"test_accuracy": ..., "test_loss": ...}` on the task's held-out set.
    - optional, for runs in local data mode: `local_data(spec)`: load this participant's own data (`spec` is
      what `fed-participant start --data` was given: a path, or a spec the task defines) and return the
      indices `train` is called with each round; their number is the sample count registered at join.
    - optional: `for_run(config)`: the task as the run configures it (e.g. `participant.tasks.hf` reads `[run.hf]`);
      `load_task` calls it with the run's config. It may raise TaskError, e.g. for a model that is not the run's.
    - optional: `identity`: names to digests of what the model is built from (a Hugging Face run: config,
      tokenizer, base); every update names them, and ingest refuses one that differs from the run's record.
    - optional: `train` may take a keyword `round_no` (the round being trained), for schedules that span rounds.
    - optional: `torch_optimizers = False`: `train` does not step with `torch.optim` (whose first use imports
      `torch._dynamo`, ~1.3 s of CPU), so start-up's warm-up does not import it either (`participant.sgd`).
    """

    train_size: int

    def build_model(self, seed: int) -> nn.Module: ...

    def train(
        self,
        model: nn.Module,
        indices: Sequence[int],
        config: RunConfig,
        device: torch.device,
        progress: Progress | None = None,
        seed: int = 0,
    ) -> dict[str, float]: ...

    def evaluate(self, model: nn.Module, device: torch.device) -> dict[str, float]: ...


REQUIRED = ("train_size", "build_model", "train", "evaluate")


def local_batches(count: int, config: RunConfig, generator: torch.Generator) -> tuple[int, Iterator[torch.Tensor]]:
    """A round's mini-batches as positions in `range(count)`: `config.local_steps` batches if it is set (DiLoCo's
    H inner steps; the data is gone through again, in a new order each pass, as often as needed), else
    `config.local_epochs` passes; every order drawn from `generator`. Returns (number of batches, batches)."""
    if count <= 0:
        raise ValueError("no samples to train on")
    per_pass = math.ceil(count / config.batch_size)
    total = config.local_steps or per_pass * config.local_epochs

    def batches() -> Iterator[torch.Tensor]:
        done = 0
        while done < total:
            order = torch.randperm(count, generator=generator)
            for start in range(0, count, config.batch_size):
                if done == total:
                    return
                yield this_rank(order[start : start + config.batch_size])
                done += 1

    return total, batches()


@contextmanager
def mixed_precision(device: torch.device) -> Iterator[None]:
    """Training's forward passes in bfloat16 on CUDA (`torch.autocast`), the weights staying float32 (the optimizer
    steps them in float32, and updates are float32 files); nothing changes on a CPU. The participant trains every
    task under it, on each rank of a node alike."""
    with torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext():
        yield


@contextmanager
def gradient_sync(model: nn.Module, sync: bool) -> Iterator[None]:
    """A micro-batch's forward and backward pass under gradient accumulation: on a node of DDP ranks, the gradients
    are averaged across the ranks only in the pass that ends an optimizer step (`no_sync` in the others), which moves
    1/accumulation of the bytes and takes the same step. FSDP (which keeps its gradients sharded) and a model alone
    are unchanged."""
    no_sync = getattr(model, "no_sync", None)
    with no_sync() if callable(no_sync) and not sync else nullcontext():
        yield


def this_rank(batch: torch.Tensor) -> torch.Tensor:
    """On a node of N ranks (`participant.node`), rank r's slice `batch[r::N]` of a batch: the ranks' gradients,
    averaged by DDP, are then the whole batch's. A batch of fewer than N samples gives the ranks past its end its
    last sample again. Elsewhere, the whole batch."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return batch
    rank, size = dist.get_rank(), dist.get_world_size()
    return batch[rank::size] if rank < len(batch) else batch[-1:]


def load_task(spec: str, config: RunConfig | None = None) -> Task:
    """Import `module:object` (object may be dotted, e.g. `pkg.mod:Factory.task`) and check its shape.

    A class or a zero-argument factory function is called to obtain the task; with a run `config`, a task that has
    `for_run` is configured by it.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise TaskError(f"task {spec!r}: expected 'module:object', e.g. 'participant.tasks.digits:task'")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise TaskError(f"task {spec!r}: cannot import module {module_name!r} ({exc})") from None
    except Exception as exc:  # a task module that fails at import: show why
        raise TaskError(f"task {spec!r}: importing {module_name!r} failed: {type(exc).__name__}: {exc}") from exc
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise TaskError(f"task {spec!r}: module {module_name!r} has no attribute {attr!r}") from None
    if isinstance(obj, type) or (callable(obj) and not all(hasattr(obj, name) for name in REQUIRED)):
        try:
            obj = obj()
        except Exception as exc:
            raise TaskError(f"task {spec!r}: calling {attr} failed: {type(exc).__name__}: {exc}") from exc
    if config is not None and callable(getattr(obj, "for_run", None)):
        obj = obj.for_run(config)
    missing = [name for name in REQUIRED if not hasattr(obj, name)]
    if missing:
        raise TaskError(f"task {spec!r}: {type(obj).__name__} lacks {', '.join(missing)} (see participant.task.Task)")
    try:
        size = int(obj.train_size)
    except Exception as exc:
        raise TaskError(f"task {spec!r}: train_size is not an integer ({exc})") from None
    if size <= 0:
        raise TaskError(f"task {spec!r}: train_size must be positive, got {size}")
    return obj  # type: ignore[no-any-return]
