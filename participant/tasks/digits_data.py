"""scikit-learn's bundled 8x8 digits, and its stratified train/test split, without importing scikit-learn.

`import sklearn.datasets` costs about 1.5 s of CPU, and a participant's start-up (the zygote's preload, see
fed/zygote.py) is the critical path from `fed demo` to its first round. The data is one gzipped CSV inside
scikit-learn's package (1797 rows: 64 pixel values 0..16, then the label), so it is found with
`importlib.util.find_spec`, which locates the package without running it, and parsed with numpy in milliseconds.
scikit-learn stays a dependency: its package holds the file.

`stratified_split` replays `train_test_split(..., stratify=y, random_state=seed)` draw for draw, because the Flower
anchor's figures (participant.tasks.flower_digits_meta) depend on that split element for element and in order.
"""

from __future__ import annotations

import gzip
import importlib.util
import math
from pathlib import Path

import numpy as np

CSV = ("datasets", "data", "digits.csv.gz")  # inside scikit-learn's package
ROWS, COLUMNS = 1797, 65  # 64 pixels, then the label


def digits_csv() -> Path:
    """The path of scikit-learn's digits CSV; RuntimeError when scikit-learn or the file is missing."""
    spec = importlib.util.find_spec("sklearn")  # a top-level package: found, not imported
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("scikit-learn is not installed: the digits data is the CSV its package ships "
                           f"({'/'.join(CSV)})")
    for root in spec.submodule_search_locations:
        path = Path(root).joinpath(*CSV)
        if path.is_file():
            return path
    raise RuntimeError(f"scikit-learn's package has no {'/'.join(CSV)} (looked in "
                       f"{', '.join(spec.submodule_search_locations)})")


def load_digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """(data, target) as `sklearn.datasets.load_digits()` gives them: 1797 x 64 float64 pixel values 0..16 and the
    1797 int labels, in the file's order."""
    path = digits_csv()
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            table = np.loadtxt(f, delimiter=",", dtype=np.float64, ndmin=2)
    except (OSError, EOFError, ValueError) as exc:
        raise RuntimeError(f"{path}: not a readable digits CSV ({exc})") from exc
    if table.shape != (ROWS, COLUMNS):
        raise RuntimeError(f"{path}: shape {table.shape}, expected {(ROWS, COLUMNS)}")
    return table[:, :-1], table[:, -1].astype(int)


def stratified_split(y: np.ndarray, test_size: int | float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, test) indices into `y`, equal to those `train_test_split(..., test_size=test_size, random_state=seed,
    stratify=y)` uses (scikit-learn 1.x's StratifiedShuffleSplit, one split), in the same order.

    `test_size`: a count of test samples, or a fraction of them (rounded up, as scikit-learn does); the rest train.
    Every random draw below comes from one `RandomState(seed)` in scikit-learn's order, since each draw moves the
    stream that the later ones see."""
    y = np.asarray(y)
    n = len(y)
    if isinstance(test_size, float):
        if not 0 < test_size < 1:
            raise ValueError(f"test_size {test_size}: a fraction must lie in (0, 1)")
        n_test = math.ceil(test_size * n)
    else:
        n_test = int(test_size)
    n_train = n - n_test
    classes, y_class, class_counts = np.unique(y, return_inverse=True, return_counts=True)
    if not 0 < n_test < n or min(n_train, n_test) < len(classes):
        raise ValueError(f"{n_test} test and {n_train} training samples of {n}: each side needs at least one "
                         f"sample per class ({len(classes)} classes)")
    if class_counts.min() < 2:
        raise ValueError(f"classes with a single sample cannot be split: {classes[class_counts < 2].tolist()}")
    # each class's sample indices, ascending (a stable sort by class)
    members = np.split(np.argsort(y_class, kind="stable"), np.cumsum(class_counts)[:-1])
    rng = np.random.RandomState(seed)
    # the training share of each class first, then the test share of what is left
    n_i = _class_shares(class_counts, n_train, rng)
    t_i = _class_shares(class_counts - n_i, n_test, rng)
    train: list[int] = []
    test: list[int] = []
    for k, own in enumerate(members):
        shuffled = own[rng.permutation(len(own))]
        train.extend(shuffled[: n_i[k]])
        test.extend(shuffled[n_i[k] : n_i[k] + t_i[k]])
    # then each side's order is shuffled once more
    return rng.permutation(np.asarray(train, dtype=np.int64)), rng.permutation(np.asarray(test, dtype=np.int64))


def _class_shares(counts: np.ndarray, draws: int, rng: np.random.RandomState) -> np.ndarray:
    """How many of `draws` samples each class gets, in proportion to `counts` (scikit-learn's `_approximate_mode`):
    the floors of the exact shares, then one more each for the classes with the largest remainders. Classes tied on
    a remainder, when not all of them can get one, are picked at random (one `choice` per remainder value, largest
    first, drawn whenever any are still to add: scikit-learn draws even when it takes the whole tie)."""
    exact = counts / counts.sum() * draws  # the same float expression, so the same remainders and ties
    shares = np.floor(exact)
    missing = int(draws - shares.sum())
    if missing > 0:
        remainder = exact - shares
        for value in np.unique(remainder)[::-1]:
            (tied,) = np.where(remainder == value)
            take = min(len(tied), missing)
            shares[rng.choice(tied, size=take, replace=False)] += 1
            missing -= take
            if missing == 0:
                break
    counted: np.ndarray = shares.astype(int)
    return counted
