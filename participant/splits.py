"""Splitting one labelled data set among participants, to simulate each one's private data.

A split spec names how the data set is divided and which part this participant holds:

- `iid:I/N` — part I (0-based) of N equal parts of a seeded shuffle;
- `dirichlet:ALPHA:I/N` — label skew: for every class, its samples are shared among the N parts in
  proportions drawn from Dirichlet(ALPHA, ..., ALPHA) (Hsu et al., 2019); a small ALPHA (0.1) gives each part
  a few classes, a large one (100) is close to IID.

Every participant computes the same partition from the labels and the seed, so the parts are disjoint and
together hold every sample exactly once.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

SPEC = re.compile(r"(?P<kind>iid|dirichlet:(?P<alpha>[0-9]+(?:\.[0-9]+)?))(?::(?P<part>[0-9]+)/(?P<parts>[0-9]+))?")
MIN_PART = 10  # the fewest samples a Dirichlet draw may give a part before it is drawn again
DRAWS = 100  # draws at most, before a part of fewer than MIN_PART samples is accepted


@dataclass(frozen=True)
class Split:
    alpha: float | None  # None: IID
    part: int
    parts: int

    @property
    def kind(self) -> str:
        return "iid" if self.alpha is None else f"dirichlet:{self.alpha:g}"


def parse_split(spec: str, part: int | None = None, parts: int | None = None) -> Split:
    """`iid:I/N` or `dirichlet:ALPHA:I/N`; `part`/`parts` fill in a spec given without `:I/N`."""
    match = SPEC.fullmatch(spec.strip())
    if not match:
        raise ValueError(f"split {spec!r}: expected iid:I/N or dirichlet:ALPHA:I/N, e.g. dirichlet:0.5:3/8")
    alpha = float(match["alpha"]) if match["alpha"] else None
    if match["part"] is not None:
        part, parts = int(match["part"]), int(match["parts"])
    if part is None or parts is None:
        raise ValueError(f"split {spec!r}: say which part this participant holds, e.g. {match['kind']}:0/4")
    if parts < 1 or not 0 <= part < parts:
        raise ValueError(f"split {spec!r}: part {part} of {parts} does not exist (parts are 0 to {parts - 1})")
    if alpha is not None and alpha <= 0:
        raise ValueError(f"split {spec!r}: the Dirichlet concentration must be positive")
    return Split(alpha, part, parts)


def partition(labels: np.ndarray, parts: int, alpha: float | None, seed: int = 0) -> list[np.ndarray]:
    """Indices of `labels` for each of `parts` parts: disjoint, covering every index, each sorted."""
    rng = np.random.default_rng(seed)
    n = len(labels)
    if parts > n:
        raise ValueError(f"cannot split {n} samples into {parts} parts")
    if alpha is None:
        return [np.sort(chunk) for chunk in np.array_split(rng.permutation(n), parts)]
    classes = np.unique(labels)
    for _ in range(DRAWS):
        buckets: list[list[np.ndarray]] = [[] for _ in range(parts)]
        for label in classes:
            members = rng.permutation(np.flatnonzero(labels == label))
            shares = rng.dirichlet(np.full(parts, alpha))
            cuts = (np.cumsum(shares)[:-1] * len(members)).astype(np.int64)
            for bucket, chunk in zip(buckets, np.split(members, cuts), strict=True):
                bucket.append(chunk)
        result = [np.sort(np.concatenate(b)) for b in buckets]
        if min(len(r) for r in result) >= min(MIN_PART, n // parts):
            break
    return result


def label_counts(labels: np.ndarray, indices: np.ndarray, classes: int) -> np.ndarray:
    """How many of `indices` carry each label 0..classes-1 (to show how skewed a part is)."""
    return np.bincount(labels[indices], minlength=classes)
