"""SGD with momentum, as `torch.optim.SGD(params, lr, momentum)` steps on the CPU, without `torch.optim`.

Constructing any `torch.optim` optimizer imports `torch._dynamo`, torch's compiler stack: about 1.3 s of CPU here,
more than importing torch itself. The digits tasks step with this instead, so a participant that trains them (and
the demo's zygote that forks such participants, `fed.zygote`) never imports it. The update is torch's own
(its single-tensor path, dampening 0, no Nesterov, no weight decay): the first step's momentum buffer is the
gradient, each later one `buf = momentum * buf + grad`, then `param -= lr * buf`. tests/unit/test_sgd.py checks it
against `torch.optim.SGD`, bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


class MomentumSGD:
    def __init__(self, params: Iterable[torch.nn.Parameter], lr: float, momentum: float = 0.0) -> None:
        if lr < 0 or momentum < 0:
            raise ValueError(f"lr and momentum must not be negative: {lr}, {momentum}")
        self.params = [p for p in params if p.requires_grad]
        self.lr, self.momentum = lr, momentum
        self.buffers: list[torch.Tensor | None] = [None] * len(self.params)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.detach_().zero_()

    @torch.no_grad()
    def step(self) -> None:
        for i, p in enumerate(self.params):
            grad: Any = p.grad
            if grad is None:
                continue
            if self.momentum:
                buf = self.buffers[i]
                if buf is None:
                    buf = self.buffers[i] = torch.clone(grad).detach()
                else:
                    buf.mul_(self.momentum).add_(grad)
                grad = buf
            p.add_(grad, alpha=-self.lr)
