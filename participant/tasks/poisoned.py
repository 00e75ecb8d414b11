"""Testing aid: the digits task with a poisoned update (`--task participant.tasks.poisoned:task`).

It trains honestly, then uploads `global - 5 * (trained - global)`: a scaled, sign-flipped delta. The
file has the right tensor names, shapes and dtypes and only finite values, so the coordinator's
structural checks accept it; only the witnesses, who evaluate what it does to the model, can refuse
to attest it. Never use it outside tests and demonstrations.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from participant.task import Progress
from participant.tasks.digits import Digits
from shared.config import RunConfig

SCALE = 5.0


class Poisoned(Digits):
    """Digits, but the trained update points the other way, five times as far."""

    def __init__(self, scale: float = SCALE) -> None:
        super().__init__()
        self.scale = scale

    def train(
        self,
        model: nn.Module,
        indices: Sequence[int],
        config: RunConfig,
        device: torch.device,
        progress: Progress | None = None,
        seed: int = 0,
    ) -> dict[str, float]:
        start = {name: t.detach().clone() for name, t in model.state_dict().items()}
        metrics = super().train(model, indices, config, device, progress, seed)
        with torch.no_grad():
            for name, tensor in model.state_dict().items():
                if tensor.is_floating_point():
                    tensor.copy_(start[name] - self.scale * (tensor - start[name]))
        return metrics  # the honest training loss: nothing in the metadata gives it away


task = Poisoned()
