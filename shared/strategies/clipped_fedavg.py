"""Clipped FedAvg: each update's change from the round's global model scaled down to at most `clip_norm` in L2
(the median of the round's distances when 0), then the changes averaged, unweighted, onto the global.

The distances are the ones ingest measured as each update streamed in (`WeightedInput.norm`), so the configure
half reads nothing: the scales are known before any piece."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from shared.strategies.base import Configured, Counted, RowWise, WholeInputs, everyone


def clip_scales(norms: Sequence[float], bound: float) -> list[float]:
    """Each update's scale: min(1, bound / its distance); `bound` 0: the median distance."""
    bound = bound or float(np.median(norms))
    return [min(1.0, bound / max(n, 1e-12)) for n in norms]


def clipped_mean(rows: np.ndarray, base: np.ndarray, scales: Sequence[float]) -> np.ndarray:
    """base + the mean of the scaled changes (rows - base) (inputs x elements)."""
    return np.asarray(base + ((rows - base) * np.asarray(scales).reshape(-1, 1)).mean(axis=0), np.float64)


class ClippedFedAvgSettings(Protocol):
    @property
    def clip_norm(self) -> float: ...


class ClippedFedAvg(RowWise):
    name = "clipped_fedavg"
    needs_base = True

    def __init__(self, config: ClippedFedAvgSettings) -> None:
        self.bound = config.clip_norm

    def configure(self, inputs: Sequence[Counted], whole: WholeInputs | None) -> Configured:
        norms = [i.norm for i in inputs]
        if any(n < 0 for n in norms):
            raise ValueError("clipped FedAvg needs every update's distance from the global model")
        return Configured(everyone(inputs), tuple(clip_scales(norms, self.bound)))

    def aggregate(self, rows: np.ndarray, base: np.ndarray | None, configured: Configured) -> np.ndarray:
        assert base is not None
        return clipped_mean(rows, base, configured.coefficients)
