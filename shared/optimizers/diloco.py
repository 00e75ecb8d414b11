"""DiLoCo's outer step (Douillard et al. 2023): Nesterov momentum over the pseudo-gradient.

    m = mu m + g          x' = x - lr (g + mu m)
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from shared.optimizers.base import Hyperparameters, ServerOptimizerRule, pseudo_gradient
from shared.optimizers.fedavgm import heavy_ball


def nesterov(x: np.ndarray, g: np.ndarray, m: np.ndarray, lr: float, momentum: float) -> np.ndarray:
    heavy_ball(m, g, momentum)
    return np.asarray(x - np.float32(lr) * (g + np.float32(momentum) * m), np.float32)


class DiLoCo(ServerOptimizerRule):
    name = "diloco"
    slots = ("m",)
    default_lr = 0.7

    @classmethod
    def update(cls, x: np.ndarray, aggregate: np.ndarray, state: Mapping[str, np.ndarray],
               hp: Hyperparameters) -> np.ndarray:
        return nesterov(x, pseudo_gradient(x, aggregate), state["m"], hp.lr, hp.momentum)
