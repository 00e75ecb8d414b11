"""Built-in task: a small MLP on scikit-learn's bundled 8x8 digits (no download).

1797 images split once, with a fixed seed, into 1437 training and 360 held-out test samples
(`digits_meta`); pixels are scaled from 0..16 to 0..1. The model is 64 -> 64 -> 10 with ReLU, trained
by SGD with momentum. The data set is small enough to live on the device as two tensors. On CUDA the forward
passes run in bfloat16 (`torch.autocast`) while the weights, and SGD's steps, stay float32.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import cached_property

import numpy as np
import torch
from torch import nn

from participant.sgd import MomentumSGD
from participant.splits import label_counts, parse_split, partition
from participant.task import Progress, local_batches
from participant.tasks import digits_meta
from participant.tasks.digits_data import load_digits_arrays
from shared.config import RunConfig

log = logging.getLogger("participant")


class Digits:
    """The digits task; `task` below is the instance runs name as `participant.tasks.digits:task`."""

    train_size = digits_meta.TRAIN_SIZE
    torch_optimizers = digits_meta.TORCH_OPTIMIZERS  # it steps with participant.sgd

    def __init__(self, hidden: int = 64, momentum: float = 0.9) -> None:
        self.hidden = hidden
        self.momentum = momentum

    @cached_property
    def _data(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        data, target = load_digits_arrays()
        x = torch.from_numpy(np.asarray(data, dtype=np.float32) / 16.0)
        y = torch.from_numpy(np.asarray(target, dtype=np.int64))
        if len(x) != digits_meta.TOTAL_SIZE:
            raise RuntimeError(f"scikit-learn's digits has {len(x)} samples, expected {digits_meta.TOTAL_SIZE}")
        order = torch.from_numpy(np.random.RandomState(digits_meta.SPLIT_SEED).permutation(len(x)))
        test, train = order[: digits_meta.TEST_SIZE], order[digits_meta.TEST_SIZE :]
        return x[train], y[train], x[test], y[test]

    def build_model(self, seed: int) -> nn.Module:
        """PyTorch's default Linear initialisation, drawn from a generator of its own (thread-safe, and
        the same weights for the same seed on every host)."""
        generator = torch.Generator().manual_seed(seed)
        meta = torch.device("meta")  # no storage and no draws from the global RNG until initialised below
        model = nn.Sequential(
            nn.Linear(64, self.hidden, device=meta), nn.ReLU(), nn.Linear(self.hidden, 10, device=meta)
        ).to_empty(device="cpu")
        with torch.no_grad():
            for layer in model:
                if isinstance(layer, nn.Linear):
                    nn.init.kaiming_uniform_(layer.weight, a=math.sqrt(5), generator=generator)
                    bound = 1 / math.sqrt(layer.in_features)
                    nn.init.uniform_(layer.bias, -bound, bound, generator=generator)
        return model

    def train(
        self,
        model: nn.Module,
        indices: Sequence[int],
        config: RunConfig,
        device: torch.device,
        progress: Progress | None = None,
        seed: int = 0,
    ) -> dict[str, float]:
        with self.around_train(model, progress):
            return self._train(model, indices, config, device, progress, seed)

    def local_data(self, spec: str) -> np.ndarray:
        """Local data mode: this participant's own part of the training set, as a split spec names it
        (`iid:I/N` or `dirichlet:ALPHA:I/N`, see participant.splits): indices into the training set."""
        split = parse_split(spec)
        labels = self._data[1].numpy()
        own = partition(labels, split.parts, split.alpha, seed=digits_meta.SPLIT_SEED)[split.part]
        counts = " ".join(f"{d}:{c}" for d, c in enumerate(label_counts(labels, own, 10)))
        log.info("local data %s: %d samples (per digit %s)", spec, len(own), counts)
        return own

    @contextmanager
    def around_train(self, model: nn.Module, progress: Progress | None) -> Iterator[None]:
        """Runs around every `train`: the testing aids change what training does here (participant.tasks.poisoned
        and .stalled); the digits task just trains."""
        yield

    def _train(self, model: nn.Module, indices: Sequence[int], config: RunConfig, device: torch.device,
               progress: Progress | None, seed: int) -> dict[str, float]:
        x_all, y_all, _, _ = self._data
        idx = torch.as_tensor(np.asarray(indices, dtype=np.int64))
        if len(idx) == 0:
            raise ValueError("no samples to train on")
        if int(idx.min()) < 0 or int(idx.max()) >= self.train_size:
            raise ValueError(f"sample indices must lie in [0, {self.train_size})")
        x, y = x_all[idx].to(device), y_all[idx].to(device)
        model.to(device).train()
        opt = MomentumSGD(model.parameters(), lr=config.learning_rate, momentum=self.momentum)
        loss_fn = nn.CrossEntropyLoss()
        total, batches = local_batches(len(idx), config, torch.Generator().manual_seed(seed))
        done, loss_sum, seen = 0, 0.0, 0
        bf16 = device.type == "cuda"
        for batch in batches:
            batch = batch.to(device)
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
                loss = loss_fn(model(x[batch]), y[batch])
            loss.backward()
            opt.step()
            loss_sum += float(loss.detach()) * len(batch)
            seen += len(batch)
            done += 1
            if progress is not None:
                progress(done, total)
        return {"loss": loss_sum / seen}

    @torch.no_grad()
    def evaluate(self, model: nn.Module, device: torch.device) -> dict[str, float]:
        _, _, x, y = self._data
        model.to(device).eval()
        logits = model(x.to(device))
        y = y.to(device)
        return {
            "test_accuracy": float((logits.argmax(1) == y).float().mean()),
            "test_loss": float(nn.functional.cross_entropy(logits, y)),
        }


task = Digits()
