"""What a server optimizer is: the state it keeps (its slots) and its update rule, a pure function in float32.

A round's pseudo-gradient is `g = x - a`: the global model the round trained from minus the strategy's aggregate
of its updates. An optimizer turns it into the next global model element by element, updating its state in place
(`shared.server_opt` lays the state out in the global's pieces and names it by its index). Each slot is one
float32 value per float element of the model, zero before the first round.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import ClassVar, Protocol

import numpy as np


class Hyperparameters(Protocol):
    """The run's server step settings (`shared.server_opt.ServerStep`)."""

    @property
    def lr(self) -> float: ...

    @property
    def momentum(self) -> float: ...  # fedavgm and diloco momentum; fedadam and fedyogi beta1

    @property
    def beta2(self) -> float: ...

    @property
    def tau(self) -> float: ...


def pseudo_gradient(x: np.ndarray, aggregate: np.ndarray) -> np.ndarray:
    """g = x - a in float32."""
    g: np.ndarray = np.subtract(x, aggregate, dtype=np.float32)
    return g


class ServerOptimizerRule(ABC):
    """One server optimizer (`shared.optimizers.OPTIMIZERS` lists them by `name`, the run file's
    `server_optimizer`)."""

    name: ClassVar[str]
    slots: ClassVar[tuple[str, ...]]  # its persisted state
    default_lr: ClassVar[float]  # the server learning rate when `server_lr` is 0
    identity: ClassVar[bool] = False  # no step: the aggregate is the next global model, and no state is kept

    @classmethod
    @abstractmethod
    def update(cls, x: np.ndarray, aggregate: np.ndarray, state: Mapping[str, np.ndarray],
               hp: Hyperparameters) -> np.ndarray:
        """The next global values of elements `x` (float32) whose aggregate is `aggregate`, updating `state`'s
        slots (float32 arrays over the same elements) in place."""
