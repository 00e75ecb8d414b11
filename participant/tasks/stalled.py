"""Testing aid: a participant that stops working mid-epoch (`--task participant.tasks.stalled:task`).

The digits task, except that only the first round it is selected for trains; from the second on,
`train()` blocks until the daemon is asked to stop (it returns through the progress callback, which
raises when the daemon stops). The heartbeat thread keeps running, so the coordinator's liveness
check never drops it: it is the health path (witnesses see no update, a member reports it, the
coordinator confirms from its witness records) that must. Never use it outside tests.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch
from torch import nn

from participant.task import Progress
from participant.tasks.digits import Digits
from shared.config import RunConfig

TRAINED_ROUNDS = 1  # rounds trained normally before it stalls


class Stalled(Digits):
    def __init__(self, trained_rounds: int = TRAINED_ROUNDS) -> None:
        super().__init__()
        self.trained_rounds = trained_rounds
        self.calls = 0
        self._never = threading.Event()

    def train(
        self,
        model: nn.Module,
        indices: Sequence[int],
        config: RunConfig,
        device: torch.device,
        progress: Progress | None = None,
        seed: int = 0,
    ) -> dict[str, float]:
        self.calls += 1
        if self.calls <= self.trained_rounds:
            return super().train(model, indices, config, device, progress, seed)
        while True:  # stuck: only the daemon stopping (progress raises) gets it out
            if progress is not None:
                progress(0, 1)
            self._never.wait(0.2)


task = Stalled()
