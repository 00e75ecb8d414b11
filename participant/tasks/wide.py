"""The digits MLP made wide: a model of a chosen size, to carry updates of real size through the whole loop
(`make bench-big`, and anyone sizing a deployment). Training is real (SGD on digits) and cheap per sample;
what grows is the model: 64 -> hidden -> 10, so 75 x hidden + 10 parameters.

    participant.tasks.wide:gb1        ~1.07 GB of float32 (268 M parameters)
    participant.tasks.wide:gb1_bf16   the same parameters in bfloat16 (~0.54 GB): weights kept in bf16,
                                      trained in float32 and rounded back (what a bf16 checkpoint carries)
    participant.tasks.wide:mb64       ~64 MB of float32, for quick runs (mb64_bf16: in bfloat16)
    participant.tasks.wide:mb271      ~271 MB of float32 (68 M parameters; mb271_bf16: in bfloat16)
    wide(megabytes, dtype)            any other size

Its training set is the first 64 digits (run it with `dataset_size = 64`): a round trains a step or two per
participant, and the time goes where the benchmark looks, into moving and aggregating the model.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from participant.task import Progress
from participant.tasks.digits import Digits
from shared.config import RunConfig

EVAL_BATCH = 16


class Wide(Digits):
    train_size = 64  # the first 64 training digits: a round is a step or two, the time goes into the model's bytes

    def __init__(self, hidden: int, dtype: torch.dtype = torch.float32) -> None:
        super().__init__(hidden=hidden)
        self.dtype = dtype

    def build_model(self, seed: int) -> nn.Module:
        return super().build_model(seed).to(self.dtype)

    def train(self, model: nn.Module, indices: Sequence[int], config: RunConfig, device: torch.device,
              progress: Progress | None = None, seed: int = 0) -> dict[str, float]:
        if self.dtype == torch.float32:
            return super().train(model, indices, config, device, progress, seed)
        master = model.float()  # in place: float32 while training, the task's dtype again after
        try:
            return super().train(master, indices, config, device, progress, seed)
        finally:
            model.to(self.dtype)

    @torch.no_grad()
    def evaluate(self, model: nn.Module, device: torch.device) -> dict[str, float]:
        """The held-out digits a few at a time: a wide hidden layer for all 360 at once would take GBs."""
        _, _, x, y = self._data
        if self.dtype != torch.float32:
            model.float()
        try:
            model.to(device).eval()
            logits = torch.cat([model(x[i : i + EVAL_BATCH].to(device)) for i in range(0, len(x), EVAL_BATCH)])
        finally:
            model.to(self.dtype)
        y = y.to(device)
        return {"test_accuracy": float((logits.argmax(1) == y).float().mean()),
                "test_loss": float(nn.functional.cross_entropy(logits, y))}


def wide(megabytes: float, dtype: torch.dtype = torch.float32) -> Wide:
    """A wide digits MLP of about `megabytes` MB of float32 parameters, stored as `dtype`."""
    params = megabytes * 1e6 / 4
    return Wide(hidden=max(1, round((params - 10) / 75)), dtype=dtype)


def gb1() -> Wide:
    return wide(1070)


def gb1_bf16() -> Wide:
    return wide(1070, torch.bfloat16)


def mb64() -> Wide:
    return wide(64)


def mb64_bf16() -> Wide:
    return wide(64, torch.bfloat16)


def mb271() -> Wide:
    return wide(271)


def mb271_bf16() -> Wide:
    return wide(271, torch.bfloat16)
