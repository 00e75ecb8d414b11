"""No server optimizer: the strategy's aggregate is the next global model (FedAvg and the robust strategies as
such)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from shared.optimizers.base import Hyperparameters, ServerOptimizerRule


class NoServerOptimizer(ServerOptimizerRule):
    name = "none"
    slots = ()
    default_lr = 1.0
    identity = True

    @classmethod
    def update(cls, x: np.ndarray, aggregate: np.ndarray, state: Mapping[str, np.ndarray],
               hp: Hyperparameters) -> np.ndarray:
        return aggregate
