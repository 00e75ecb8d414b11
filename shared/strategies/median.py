"""Coordinate-wise median (Yin et al. 2018): each element the median of the updates' values of it, unweighted."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from shared.strategies.base import Configured, Counted, RowWise, WholeInputs, everyone


def median(rows: np.ndarray) -> np.ndarray:
    """The coordinate-wise median of `rows` (inputs x elements)."""
    return np.asarray(np.median(rows, axis=0), np.float64)


class Median(RowWise):
    name = "median"

    def configure(self, inputs: Sequence[Counted], whole: WholeInputs | None) -> Configured:
        return Configured(everyone(inputs), (1.0,) * len(inputs))

    def aggregate(self, rows: np.ndarray, base: np.ndarray | None, configured: Configured) -> np.ndarray:
        return median(rows)
