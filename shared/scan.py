"""Checks of a model file's data section as it streams by (ingest never holds a whole update).

Fed consecutive blocks of the data section (8-aligned, so no element is cut: see `wire.canonical_layout`),
with the same byte range of a reference model when there is one, it finds the first non-finite value and
the L2 distance from the reference over the float tensors.
"""

from __future__ import annotations

import math

import numpy as np

from shared.plan import PiecePlan
from shared.wire import FLOAT_TAGS, Manifest, TensorSpec, tensor_view


class DataScan:
    def __init__(self, manifest: Manifest) -> None:
        self.plan = PiecePlan(manifest, b"")
        self.problem = ""
        self._squares = 0.0

    @property
    def distance(self) -> float:
        return math.sqrt(self._squares)

    def feed(self, begin: int, block: memoryview, reference: memoryview | None = None) -> None:
        """Check data-section bytes [begin, begin + len(block)) (and their distance from `reference`'s)."""
        for seg in self.plan.segments(begin, begin + len(block)):
            if seg.spec.dtype not in FLOAT_TAGS:
                continue
            flat = TensorSpec(seg.spec.dtype, (seg.count,))
            x = _widened(tensor_view(block, seg.begin - begin, flat))
            if not self.problem and not _finite(x):
                self.problem = f"non-finite values (NaN or Inf) in {seg.name}"
            if reference is not None and not self.problem:
                self._squares += _squared_distance(x, _widened(tensor_view(reference, seg.begin - begin, flat)))


def _widened(x: np.ndarray) -> np.ndarray:
    """float32 for the half-precision dtypes (their arithmetic in numpy is slow and lossy), else as is."""
    return x if x.dtype in (np.float32, np.float64) else x.astype(np.float32)


def _squared_distance(x: np.ndarray, r: np.ndarray) -> float:
    """Squared L2 distance, in the block's precision; in float64 when that overflows (values near float32's
    limit). Recorded once per update; clipping reads the record."""
    diff = x - r
    squares = float(np.dot(diff, diff))
    if not math.isfinite(squares):
        wide = x.astype(np.float64) - r
        squares = float(np.dot(wide, wide))
    return squares


def _finite(x: np.ndarray) -> bool:
    """All values finite: a float32 block's sum in float64 cannot overflow (2^128 x its length is far below
    float64's range), so it is finite exactly when every value is — one pass, no boolean temporary."""
    if x.dtype == np.float32:
        return bool(np.isfinite(np.add.reduce(x, dtype=np.float64)))
    return bool(np.isfinite(x).all())
