"""FedAvgM (Hsu et al. 2019): server momentum over the pseudo-gradient.

    m = beta m + g        x' = x - lr m
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from shared.optimizers.base import Hyperparameters, ServerOptimizerRule, pseudo_gradient


def heavy_ball(m: np.ndarray, g: np.ndarray, momentum: float) -> None:
    """m = momentum m + g, in place."""
    m *= np.float32(momentum)
    m += g


def fedavgm(x: np.ndarray, g: np.ndarray, m: np.ndarray, lr: float, momentum: float) -> np.ndarray:
    heavy_ball(m, g, momentum)
    return np.asarray(x - np.float32(lr) * m, np.float32)


class FedAvgM(ServerOptimizerRule):
    name = "fedavgm"
    slots = ("m",)
    default_lr = 1.0

    @classmethod
    def update(cls, x: np.ndarray, aggregate: np.ndarray, state: Mapping[str, np.ndarray],
               hp: Hyperparameters) -> np.ndarray:
        return fedavgm(x, pseudo_gradient(x, aggregate), state["m"], hp.lr, hp.momentum)
