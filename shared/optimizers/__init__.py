"""The server optimizers, by the name a run file gives (`server_optimizer = "..."`): the one place that lists them.

Each is one module of this package: a class declaring its persisted state (`slots`) and its default server
learning rate, its update rule a pure function (`shared.optimizers.base`). Adding one is its module and a line
below (`shared.config.ServerOptimizer` is made from these names); `shared.server_opt` lays out and names its
state whatever its slots.
"""

from __future__ import annotations

from shared.optimizers.base import Hyperparameters, ServerOptimizerRule, pseudo_gradient
from shared.optimizers.diloco import DiLoCo
from shared.optimizers.fedadam import FedAdam
from shared.optimizers.fedavgm import FedAvgM
from shared.optimizers.fedyogi import FedYogi
from shared.optimizers.none import NoServerOptimizer

OPTIMIZERS: dict[str, type[ServerOptimizerRule]] = {optimizer.name: optimizer for optimizer in (
    NoServerOptimizer,
    FedAvgM,
    FedAdam,
    FedYogi,
    DiLoCo,
)}

__all__ = ["OPTIMIZERS", "Hyperparameters", "ServerOptimizerRule", "pseudo_gradient"]
