"""Testing aid: a participant that stops working mid-epoch (`--task participant.tasks.stalled:task`).

The digits task, except that only the first round it is selected for trains; from the second on,
`train()` blocks until the daemon is asked to stop (it returns through the progress callback, which
raises when the daemon stops; that the round closed, which the callback also raises, it ignores). Its progress
stays at 0: the coordinator sees it stuck after `stuck_timeout`. The heartbeat thread keeps running, so the
coordinator's liveness check never drops it: it is the health path (witnesses see no update, a member reports it, the
coordinator confirms from its witness records) that must. Never use it outside tests.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn

from participant.task import Progress
from participant.tasks.digits import Digits
from participant.training import RoundClosed

TRAINED_ROUNDS = 1  # rounds trained normally before it stalls


class Stalled(Digits):
    def __init__(self, trained_rounds: int = TRAINED_ROUNDS) -> None:
        super().__init__()
        self.trained_rounds = trained_rounds
        self.calls = 0
        self._never = threading.Event()

    @contextmanager
    def around_train(self, model: nn.Module, progress: Progress | None) -> Iterator[None]:
        self.calls += 1
        while self.calls > self.trained_rounds:  # stuck: only the daemon stopping (progress raises) gets it out
            if progress is not None:
                try:
                    progress(0, 1)
                except RoundClosed:  # frozen: it does not notice its round closing either
                    pass
            self._never.wait(0.2)
        yield


task = Stalled()
