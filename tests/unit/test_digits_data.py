"""scikit-learn's digits and its stratified split without importing scikit-learn (participant.tasks.digits_data):
the same arrays and the same split, index for index, as scikit-learn gives (these tests import it to compare)."""

from __future__ import annotations

import gzip
import importlib.util
import subprocess
import sys
from importlib.machinery import ModuleSpec
from pathlib import Path

import numpy as np
import pytest
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

from participant.tasks import digits_data, flower_digits_meta
from participant.tasks.digits_data import load_digits_arrays, stratified_split

ROOT = Path(__file__).resolve().parents[2]
DIGITS = load_digits()
# 22 samples in 5 classes: class shares with equal remainders, so the random tie-break decides some counts
IMBALANCED = np.array([3] * 7 + [0] * 5 + [4] * 5 + [1] * 3 + [2] * 2)
np.random.default_rng(5).shuffle(IMBALANCED)


def sklearn_split(y: np.ndarray, test_size: float | int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    train, test = train_test_split(np.arange(len(y)), test_size=test_size, random_state=seed, stratify=y)
    return train, test


def test_the_arrays_are_load_digits_exactly() -> None:
    data, target = load_digits_arrays()
    assert data.dtype == DIGITS.data.dtype and data.shape == (1797, 64)
    assert np.array_equal(data, DIGITS.data)
    assert target.dtype == DIGITS.target.dtype and np.array_equal(target, DIGITS.target)


def test_the_anchor_split_is_train_test_splits() -> None:
    train, test = stratified_split(DIGITS.target, 0.25, flower_digits_meta.SPLIT_STATE)
    expected_train, expected_test = sklearn_split(DIGITS.target, 0.25, flower_digits_meta.SPLIT_STATE)
    assert (len(train), len(test)) == (flower_digits_meta.TRAIN_SIZE, flower_digits_meta.TEST_SIZE)
    assert np.array_equal(train, expected_train) and np.array_equal(test, expected_test)


@pytest.mark.parametrize("seed", [0, 1, 42])
@pytest.mark.parametrize("test_size", [0.1, 0.25, 0.33, 100])
def test_other_seeds_and_sizes_split_the_digits_as_scikit_learn(seed: int, test_size: float | int) -> None:
    train, test = stratified_split(DIGITS.target, test_size, seed)
    expected_train, expected_test = sklearn_split(DIGITS.target, test_size, seed)
    assert np.array_equal(train, expected_train) and np.array_equal(test, expected_test)


@pytest.mark.parametrize("test_size", [0.3, 0.5, 7])
def test_tied_class_shares_are_broken_as_scikit_learn_breaks_them(test_size: float | int) -> None:
    test_counts = set()
    for seed in range(20):
        train, test = stratified_split(IMBALANCED, test_size, seed)
        expected_train, expected_test = sklearn_split(IMBALANCED, test_size, seed)
        assert np.array_equal(train, expected_train) and np.array_equal(test, expected_test), seed
        test_counts.add(tuple(np.bincount(IMBALANCED[test], minlength=5)))
    assert len(test_counts) > 1  # the tie-break did pick different classes for different seeds


@pytest.mark.parametrize(("y", "test_size", "match"), [
    (IMBALANCED, 0, "at least one sample per class"),
    (IMBALANCED, 1.0, "a fraction must lie in"),
    (IMBALANCED, 3, "at least one sample per class"),  # 3 test samples for 5 classes
    (np.array([0, 0, 0, 1, 1, 1, 2]), 3, "a single sample cannot be split: \\[2\\]"),
])
def test_splits_that_cannot_be_made_are_refused(y: np.ndarray, test_size: float | int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        stratified_split(y, test_size, 0)


def fake_sklearn(monkeypatch: pytest.MonkeyPatch, root: Path | None) -> None:
    """find_spec("sklearn") answers a package at `root` (None: not installed)."""
    spec = None
    if root is not None:
        spec = ModuleSpec("sklearn", None, is_package=True)
        spec.submodule_search_locations = [str(root)]
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: spec if name == "sklearn" else real(name, *a))


def test_without_scikit_learn_the_error_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_sklearn(monkeypatch, None)
    with pytest.raises(RuntimeError, match="scikit-learn is not installed"):
        load_digits_arrays()


def test_a_package_without_the_csv_is_named(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fake_sklearn(monkeypatch, tmp_path)
    with pytest.raises(RuntimeError, match="has no datasets/data/digits.csv.gz"):
        load_digits_arrays()


@pytest.mark.parametrize(("content", "match"), [
    (gzip.compress(b"1,2,3\n4,5,6\n"), r"shape \(2, 3\), expected \(1797, 65\)"),
    (gzip.compress(b"1,2,x\n"), "not a readable digits CSV"),
    (b"not gzip", "not a readable digits CSV"),
    (gzip.compress(b"1,2,3\n")[:-9], "not a readable digits CSV"),  # cut short
])
def test_a_malformed_csv_is_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, content: bytes,
                                    match: str) -> None:
    path = tmp_path.joinpath(*digits_data.CSV)
    path.parent.mkdir(parents=True)
    path.write_bytes(content)
    fake_sklearn(monkeypatch, tmp_path)
    with pytest.raises(RuntimeError, match=match):
        load_digits_arrays()


def test_loading_the_flower_split_does_not_import_scikit_learn() -> None:
    code = ("import sys, participant.tasks.flower_digits as f; f.load_split(); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'sklearn'))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
