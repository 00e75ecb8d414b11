"""Splitting a labelled data set among participants (participant.splits): every sample in exactly one part."""

from __future__ import annotations

import numpy as np
import pytest

from participant.splits import parse_split, partition

LABELS = np.random.default_rng(1).integers(0, 10, 1437)


@pytest.mark.parametrize("alpha", [None, 0.1, 0.5, 100.0])
def test_parts_are_disjoint_cover_every_sample_and_are_the_same_on_every_host(alpha: float | None) -> None:
    parts = partition(LABELS, 8, alpha, seed=3)
    joined = np.concatenate(parts)
    assert len(joined) == len(LABELS) and len(np.unique(joined)) == len(LABELS)
    assert all(len(p) >= 10 for p in parts)
    again = partition(LABELS, 8, alpha, seed=3)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))


def test_iid_parts_are_equal_in_size() -> None:
    sizes = [len(p) for p in partition(LABELS, 8, None)]
    assert max(sizes) - min(sizes) <= 1


def skew(parts: list[np.ndarray]) -> float:
    """Mean share of a part's samples held by its most frequent label (0.1 when balanced over 10 labels)."""
    return float(np.mean([np.bincount(LABELS[p], minlength=10).max() / len(p) for p in parts]))


def test_a_smaller_dirichlet_concentration_skews_labels_more() -> None:
    assert skew(partition(LABELS, 8, 0.1)) > skew(partition(LABELS, 8, 0.5)) > skew(partition(LABELS, 8, 100.0))
    assert skew(partition(LABELS, 8, 100.0)) < 0.2


@pytest.mark.parametrize(("spec", "expected"), [
    ("iid:3/8", (None, 3, 8)), ("dirichlet:0.5:0/4", (0.5, 0, 4)), ("dirichlet:2:1/2", (2.0, 1, 2)),
])
def test_specs_parse(spec: str, expected: tuple[float | None, int, int]) -> None:
    split = parse_split(spec)
    assert (split.alpha, split.part, split.parts) == expected


@pytest.mark.parametrize(("spec", "words"), [
    ("iid", "say which part"), ("iid:8/8", "does not exist"), ("dirichlet:0:1/4", "positive"),
    ("dirichlet:-1:1/4", "expected"), ("zipf:1/4", "expected"), ("iid:1/4 trailing", "expected"),
])
def test_bad_specs_are_refused_with_the_reason(spec: str, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        parse_split(spec)
