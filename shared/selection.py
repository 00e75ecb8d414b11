"""Deterministic randomness of a round: its seed, who trains, and which data each trains.

Every process (coordinator, each participant, a verifier) computes the same answers from the same
inputs, with nothing but hashing and integer arithmetic, so no library version can make them differ.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import numpy as np

from shared.sizing import Share, WorkPlan, bounds

_MASK = np.uint64(0xFFFFFFFFFFFFFFFF)


def round_seed(run_seed: int, epoch: int, round_no: int) -> str:
    """The round's random seed as hex: fixes selection, witnesses and data assignment."""
    return hashlib.sha256(f"fed-round:{run_seed}:{epoch}:{round_no}".encode()).hexdigest()


def _hash_rank(seed_hex: str, item: str) -> str:
    return hashlib.sha256(f"{seed_hex}:{item}".encode()).hexdigest()


def shuffled(seed_hex: str, items: Sequence[str]) -> list[str]:
    """A deterministic shuffle: items ordered by SHA-256 of (seed, item)."""
    return sorted(items, key=lambda item: (_hash_rank(seed_hex, item), item))


def selection_size(members: int, fraction: float, minimum: int) -> int:
    """XAIN's rule: a fraction of the members, at least a minimum, never more than there are."""
    if members <= 0:
        return 0
    return min(members, max(minimum, math.ceil(members * fraction - 1e-9)))


def select(seed_hex: str, members: Sequence[str], fraction: float, minimum: int) -> tuple[str, ...]:
    """The participants that train this round, in assignment order."""
    order = shuffled(seed_hex, sorted(members))
    return tuple(order[: selection_size(len(order), fraction, minimum)])


def _splitmix64(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        x = (x + np.uint64(0x9E3779B97F4A7C15)) & _MASK
        x = ((x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & _MASK
        x = ((x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & _MASK
        return x ^ (x >> np.uint64(31))


def permutation(seed_hex: str, n: int) -> np.ndarray:
    """A permutation of range(n) fixed by the seed (sort of splitmix64 hashes; ties cannot reorder)."""
    key = np.uint64(int(seed_hex[:16], 16))
    idx = np.arange(n, dtype=np.uint64)
    return np.argsort(_splitmix64(idx ^ key), kind="stable").astype(np.int64)


def shard_bounds(n: int, parts: int, position: int) -> tuple[int, int]:
    """Contiguous, non-overlapping bounds of part `position` when n items are split into `parts`."""
    base, extra = divmod(n, parts)
    start = position * base + min(position, extra)
    return start, start + base + (1 if position < extra else 0)


def as_plan(planned: WorkPlan | Sequence[str]) -> WorkPlan:
    """A round's plan (`shared.sizing`); a bare selection is a plan of equal weights."""
    return tuple(Share(p) if isinstance(p, str) else p for p in planned)


def assigned_count(dataset_size: int, planned: WorkPlan | Sequence[str], participant: str) -> int:
    """How many samples a participant was assigned (the most it may claim to have trained)."""
    start, end = bounds(as_plan(planned), dataset_size, participant)
    return end - start


def assignment(seed_hex: str, dataset_size: int, planned: WorkPlan | Sequence[str], participant: str) -> np.ndarray:
    """The sample indices a planned participant trains this round: a contiguous slice of the round's permutation,
    as long as its weight makes it; disjoint across the round, covering the data set."""
    start, end = bounds(as_plan(planned), dataset_size, participant)
    if end == start:
        return np.empty(0, dtype=np.int64)
    return permutation(seed_hex, dataset_size)[start:end]
