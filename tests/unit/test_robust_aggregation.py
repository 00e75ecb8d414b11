"""One attacker among five moves FedAvg far, but not the robust strategies."""

from __future__ import annotations

import numpy as np
import pytest

from shared.aggregate import ArraySource, WeightedInput, aggregate_file
from shared.config import RunConfig, Strategy
from shared.wire import Manifest, decode, encode, parse_header

RNG = np.random.default_rng(0)
GLOBAL = {"w": RNG.normal(size=(20, 10)).astype(np.float32), "b": np.zeros(10, np.float32)}
MANIFEST = Manifest.of(parse_header(encode(GLOBAL)))


def honest(i: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(100 + i)
    return {k: (v + 0.01 * rng.normal(size=v.shape) + 0.05).astype(np.float32) for k, v in GLOBAL.items()}


def attack(kind: str) -> tuple[dict[str, np.ndarray], int]:
    if kind == "inflated samples":  # a plausible-looking update claiming a huge weight
        return {k: (v - 3.0).astype(np.float32) for k, v in GLOBAL.items()}, 100_000
    # a scaled, sign-flipped delta
    return {k: (v - 50.0 * (honest(0)[k] - v)).astype(np.float32) for k, v in GLOBAL.items()}, 20


def item(pid: str, samples: int, arrays: dict[str, np.ndarray]) -> WeightedInput:
    return WeightedInput(pid, samples, "", ArraySource(MANIFEST, arrays), distance(arrays, GLOBAL))


def combine(config: RunConfig, items: list[WeightedInput]) -> dict[str, np.ndarray]:
    """The strategy's global model, through the same piece-wise path the coordinator runs."""
    data = aggregate_file(config, MANIFEST, 1, items, ArraySource(MANIFEST, GLOBAL))
    return {k: np.array(v) for k, v in decode(data)[0].items()}


def inputs(kind: str) -> list[WeightedInput]:
    items = [item(f"h{i}", 20, honest(i)) for i in range(4)]
    bad, samples = attack(kind)
    return items + [item("mallory", samples, bad)]


def distance(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    return float(np.sqrt(sum(((a[k].astype(np.float64) - b[k]) ** 2).sum() for k in a)))


@pytest.mark.parametrize("kind", ["inflated samples", "scaled sign-flipped delta"])
def test_fedavg_moves_far_but_robust_strategies_do_not(kind: str) -> None:
    clean = combine(RunConfig(run_id="r1x"), inputs(kind)[:4])
    scale = distance(clean, GLOBAL)  # how far an honest round moves the model
    moved = {}
    for strategy in Strategy:
        config = RunConfig(run_id="r1x", strategy=strategy, trim_fraction=0.2)
        moved[strategy] = distance(combine(config, inputs(kind)), clean)
    assert moved[Strategy.FEDAVG] > 10 * scale, moved
    for strategy in (Strategy.MEDIAN, Strategy.TRIMMED_MEAN, Strategy.CLIPPED_FEDAVG):
        assert moved[strategy] < 0.5 * scale, (strategy, moved)


def test_robust_strategies_agree_with_the_mean_on_identical_updates() -> None:
    same = [item(f"p{i}", 10, GLOBAL) for i in range(3)]
    for strategy in Strategy:
        out = combine(RunConfig(run_id="r1x", strategy=strategy), same)
        np.testing.assert_allclose(out["w"], GLOBAL["w"], rtol=1e-6)
        assert out["w"].dtype == np.float32


def test_the_mean_around_the_median_keeps_the_majority_nearest_the_median() -> None:
    from shared.strategies.meamed import kept, mean_around_median

    assert [kept(n) for n in (1, 2, 3, 4, 5, 6, 7)] == [1, 2, 2, 3, 3, 4, 4]
    # two of five sent far one way: the three honest values are averaged, whatever their weight or distance
    rows = np.array([[-50.0, 1.0], [-40.0, 1.0], [1.0, 1.0], [2.0, 2.0], [3.0, 4.0]])
    np.testing.assert_allclose(mean_around_median(rows), [2.0, 1.0])
    assert RunConfig(run_id="defaults").strategy == "meamed"
