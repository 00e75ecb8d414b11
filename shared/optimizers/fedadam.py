"""FedAdam (Reddi et al. 2021, "Adaptive Federated Optimization"): adaptive moments over the pseudo-gradient.

    m = b1 m + (1 - b1) g      v = b2 v + (1 - b2) g^2      x' = x - lr m / (sqrt(v) + tau)
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from shared.optimizers.base import Hyperparameters, ServerOptimizerRule, pseudo_gradient

f32 = np.float32


def first_moment(m: np.ndarray, g: np.ndarray, beta1: float) -> None:
    """m = beta1 m + (1 - beta1) g, in place."""
    m *= f32(beta1)
    m += f32(1 - beta1) * g


def adam_second_moment(v: np.ndarray, g2: np.ndarray, beta2: float) -> None:
    """v = beta2 v + (1 - beta2) g^2, in place."""
    v *= f32(beta2)
    v += f32(1 - beta2) * g2


def adaptive_step(x: np.ndarray, m: np.ndarray, v: np.ndarray, lr: float, tau: float) -> np.ndarray:
    return np.asarray(x - f32(lr) * m / (np.sqrt(v) + f32(tau)), np.float32)


class FedAdam(ServerOptimizerRule):
    name = "fedadam"
    slots = ("m", "v")
    default_lr = 0.1

    @staticmethod
    def second_moment(v: np.ndarray, g2: np.ndarray, beta2: float) -> None:
        adam_second_moment(v, g2, beta2)

    @classmethod
    def update(cls, x: np.ndarray, aggregate: np.ndarray, state: Mapping[str, np.ndarray],
               hp: Hyperparameters) -> np.ndarray:
        g = pseudo_gradient(x, aggregate)
        m, v = state["m"], state["v"]
        first_moment(m, g, hp.momentum)
        cls.second_moment(v, g * g, hp.beta2)
        return adaptive_step(x, m, v, hp.lr, hp.tau)
