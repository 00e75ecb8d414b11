"""The checks ingest makes of an update's data section as it streams (shared/scan.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from shared.aggregate import ArraySource
from shared.scan import DataScan
from shared.wire import Manifest, spec_of


def scan(update: dict[str, np.ndarray], reference: dict[str, np.ndarray] | None = None) -> DataScan:
    """Feed the update's whole data section (and the reference's) in one block."""
    manifest = Manifest({n: spec_of(n, a) for n, a in update.items()})
    result = DataScan(manifest)
    ref = memoryview(ArraySource(manifest, reference).data) if reference is not None else None
    result.feed(0, memoryview(ArraySource(manifest, update).data), ref)
    return result


def distance(update: dict[str, np.ndarray], reference: dict[str, np.ndarray]) -> float:
    return scan(update, reference).distance


def test_distance_is_the_l2_norm_over_float_tensors() -> None:
    reference = {"w": np.zeros((2, 2), np.float32), "b": np.zeros(1, np.float32), "steps": np.zeros(1, np.int64)}
    update = {"w": np.array([[3.0, 0.0], [0.0, 0.0]], np.float32), "b": np.array([4.0], np.float32),
              "steps": np.array([100], np.int64)}  # integer tensors (counters) do not count
    assert distance(update, reference) == pytest.approx(5.0)
    assert distance(reference, reference) == 0.0


def test_distance_does_not_overflow_near_the_float32_limit() -> None:
    big = np.full(4, 3e38, np.float32)  # squares overflow float32
    assert math.isfinite(distance({"w": big}, {"w": np.zeros(4, np.float32)}))
    assert distance({"w": big}, {"w": np.zeros(4, np.float32)}) == pytest.approx(6e38, rel=1e-6)


def test_non_finite_is_found() -> None:
    arrays = {"w": np.zeros((2, 3), np.float32), "b": np.zeros(3, np.float32)}
    bad = dict(arrays, b=np.array([0, np.nan, 0], np.float32))
    assert scan(bad).problem and not scan(arrays).problem
