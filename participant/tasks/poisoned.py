"""Testing aid: the digits task with a poisoned update (`--task participant.tasks.poisoned:task`).

It trains honestly, then uploads `global - 5 * (trained - global)`: a scaled, sign-flipped delta. The
file has the right tensor names, shapes and dtypes and only finite values, so the coordinator's
structural checks accept it; only the witnesses, who evaluate what it does to the model, can refuse
to attest it. Never use it outside tests and demonstrations.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from participant.task import Progress
from participant.tasks.digits import Digits

SCALE = 5.0


class Poisoned(Digits):
    """Digits, but the trained update points the other way, five times as far."""

    def __init__(self, scale: float = SCALE) -> None:
        super().__init__()
        self.scale = scale

    @contextmanager
    def around_train(self, model: nn.Module, progress: Progress | None) -> Iterator[None]:
        start = {name: t.detach().clone() for name, t in model.state_dict().items()}
        yield  # honest training: its loss, in the metrics, gives nothing away
        with torch.no_grad():
            for name, tensor in model.state_dict().items():
                if tensor.is_floating_point():
                    tensor.copy_(start[name] - self.scale * (tensor - start[name]))


task = Poisoned()
