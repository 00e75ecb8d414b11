"""The aggregation strategies, by the name a run file gives (`strategy = "..."`): the one place that lists them.

Each is one module of this package: a class with a configure half and an aggregate half, its math in pure
functions (`shared.strategies.base`). Adding one is its module, a line below, and any parameters it needs in
`shared.config.RunConfig` (whose `Strategy` is made from these names).
"""

from __future__ import annotations

from typing import Protocol

from shared.strategies.base import AggregationStrategy, Configured, Counted, RowWise, WeightedSum, WholeInputs
from shared.strategies.clipped_fedavg import ClippedFedAvg
from shared.strategies.fedavg import FedAvg
from shared.strategies.krum import Krum
from shared.strategies.meamed import MeanAroundMedian
from shared.strategies.median import Median
from shared.strategies.trimmed_mean import TrimmedMean

STRATEGIES: dict[str, type[AggregationStrategy]] = {strategy.name: strategy for strategy in (
    FedAvg,
    Median,
    MeanAroundMedian,
    TrimmedMean,
    ClippedFedAvg,
    Krum,
)}


class Settings(Protocol):
    @property
    def strategy(self) -> str: ...


def strategy_of(config: Settings) -> AggregationStrategy:
    """The run's strategy (`shared.config.RunConfig`'s), with its parameters."""
    return STRATEGIES[config.strategy](config)


__all__ = ["STRATEGIES", "AggregationStrategy", "Configured", "Counted", "RowWise", "WeightedSum", "WholeInputs",
           "strategy_of"]
