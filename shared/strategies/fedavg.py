"""FedAvg (McMahan et al. 2017): every update weighted by its share of the round's sample counts.

The aggregator streams the weighted sum itself (`shared.aggregate.PieceAggregator._fedavg`: several inputs read
at once, a slice at a time, summed in float32 — float64 for F64 tensors — in input order): the common case,
kept as fast as the reads allow."""

from __future__ import annotations

from collections.abc import Sequence

from shared.strategies.base import Configured, Counted, WeightedSum, WholeInputs, by_samples, everyone


class FedAvg(WeightedSum):
    name = "fedavg"

    def configure(self, inputs: Sequence[Counted], whole: WholeInputs | None) -> Configured:
        return by_samples(inputs, everyone(inputs))
