"""Coordinate-wise trimmed mean (Yin et al. 2018): each element the mean of the updates' values of it once the
`trim_fraction` largest and smallest are dropped (at most all but one or two), unweighted."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from shared.strategies.base import Configured, Counted, RowWise, WholeInputs, everyone


def trimmed(n: int, fraction: float) -> int:
    """How many values of n are dropped at each end: a `fraction` of them, leaving at least one or two."""
    return min(int(fraction * n), (n - 1) // 2)


def trimmed_mean(rows: np.ndarray, fraction: float) -> np.ndarray:
    """The coordinate-wise mean of `rows` (inputs x elements) without the `trimmed` largest and smallest."""
    n = len(rows)
    k = trimmed(n, fraction)
    return np.asarray(np.sort(rows, axis=0)[k : n - k].mean(axis=0), np.float64)


class TrimmedMeanSettings(Protocol):
    @property
    def trim_fraction(self) -> float: ...


class TrimmedMean(RowWise):
    name = "trimmed_mean"

    def __init__(self, config: TrimmedMeanSettings) -> None:
        self.fraction = config.trim_fraction

    def configure(self, inputs: Sequence[Counted], whole: WholeInputs | None) -> Configured:
        return Configured(everyone(inputs), (1.0,) * len(inputs))

    def aggregate(self, rows: np.ndarray, base: np.ndarray | None, configured: Configured) -> np.ndarray:
        return trimmed_mean(rows, self.fraction)
