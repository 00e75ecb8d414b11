"""Krum (`shared.strategies.krum`): its selection against a direct numpy reference over the whole flattened model,
its global model the weighted mean of the selected updates, however the pieces are cut into shards; an attacker
far from the honest updates never selected; too few updates combined by FedAvg, and said so."""

from __future__ import annotations

import json
import re

import ml_dtypes
import numpy as np
import pytest

from shared.aggregate import ArraySource, PieceAggregator, WeightedInput, WholeRows, aggregate_digest, aggregate_round
from shared.aggregate import round_plan as plan_of
from shared.config import ConfigError, RunConfig, parse_config
from shared.digest import PIECE_BYTES, combine, piece_hash
from shared.strategies.krum import Krum, krum_plan, krum_scores, krum_select, pairwise_squared_distances
from shared.wire import Manifest, TensorSpec, decode

DTYPES = {"F32": np.float32, "BF16": ml_dtypes.bfloat16, "F16": np.float16, "F64": np.float64}
# float32 elements crossing the first piece boundary, then each float dtype, an integer tensor between them
MANIFEST = Manifest({
    "a.weight": TensorSpec("F32", (PIECE_BYTES // 4 + 3_001,)),
    "b.half": TensorSpec("BF16", (5, 701)),
    "c.steps": TensorSpec("I64", (3,)),
    "d.f16": TensorSpec("F16", (257,)),
    "e.f64": TensorSpec("F64", (33, 3)),
})
FLOATS = [n for n, s in MANIFEST.tensors.items() if s.dtype != "I64"]


def model(rng: np.random.Generator, centre: dict[str, np.ndarray] | None = None, spread: float = 1.0,
          shift: float = 0.0) -> dict[str, np.ndarray]:
    out = {}
    for name, spec in MANIFEST.tensors.items():
        if spec.dtype == "I64":
            out[name] = rng.integers(0, 1000, spec.shape).astype(np.int64)
            continue
        around = 0.0 if centre is None else centre[name].astype(np.float64)
        out[name] = (around + shift + spread * rng.standard_normal(spec.shape)).astype(DTYPES[spec.dtype])
    return out


def inputs_of(updates: list[dict[str, np.ndarray]], samples: list[int]) -> list[WeightedInput]:
    return [WeightedInput(f"p{k:02d}", s, "0" * 64, ArraySource(MANIFEST, u))
            for k, (u, s) in enumerate(zip(updates, samples, strict=True))]


def reference_selection(updates: list[dict[str, np.ndarray]], f: int, m: int) -> list[int]:
    """Blanchard et al.'s multi-Krum written out directly over each update's flattened float tensors."""
    flat = [np.concatenate([u[n].astype(np.float64).ravel() for n in FLOATS]) for u in updates]
    n = len(flat)
    d = np.array([[float(np.sum((a - b) ** 2)) for b in flat] for a in flat])
    scores = [sorted(d[i, j] for j in range(n) if j != i)[: n - f - 2] for i in range(n)]
    order = sorted(range(n), key=lambda i: (sum(scores[i]), i))
    return sorted(order[: (m or n - f)])


def config_of(**settings: object) -> RunConfig:
    return parse_config({"run_id": "krum-run", "strategy": "krum", **settings})


def shards_digest(config: RunConfig, inputs: list[WeightedInput], pieces_per_shard: int) -> str:
    """The global's digest with its pieces computed by one aggregator per shard, as the shard workers do (each runs
    the configure half, Krum's pre-pass, itself)."""
    plan = plan_of(config, MANIFEST, 1, inputs)
    hashes = []
    for shard in plan.shards(pieces_per_shard * PIECE_BYTES):
        worker = PieceAggregator(config, plan, inputs, None)
        hashes += [piece_hash(worker.piece_output(i).data) for i in shard]
    return combine(hashes)


@pytest.mark.parametrize("n, f, m", [(7, 2, 0), (7, 2, 1), (8, 1, 3), (5, 0, 2), (9, 3, 0)])
def test_selection_and_global_match_a_direct_reference(n: int, f: int, m: int) -> None:
    # Given n random updates around a global model, with sample counts of their own
    rng = np.random.default_rng(100 * n + 10 * f + m)
    centre = model(rng)
    updates = [model(rng, centre, spread=0.1 + 0.05 * k) for k in range(n)]
    samples = [int(s) for s in rng.integers(1, 50, n)]
    inputs = inputs_of(updates, samples)
    config = config_of(krum_byzantine=f, krum_selected=m)
    plan = plan_of(config, MANIFEST, 1, inputs)
    assert plan.pieces == 2
    # When Krum's configure half reads every update whole (block by block)
    configured = Krum(config).configure(inputs, WholeRows(plan, [i.source for i in inputs]))
    # Then it selects what the reference selects, weighted by their share of the selected samples
    want = reference_selection(updates, f, m)
    assert list(configured.selected) == want
    total = sum(samples[k] for k in want)
    assert configured.coefficients == tuple(samples[k] / total for k in want)
    # And the global is their weighted mean, its integer tensors the first selected update's
    out = aggregate_round(config, MANIFEST, 1, inputs, None)
    got, header = decode(out.model)
    for name in FLOATS:
        mean = sum(samples[k] / total * updates[k][name].astype(np.float64) for k in want)
        tolerance = 1e-5 if name in ("a.weight", "e.f64") else 1e-2
        np.testing.assert_allclose(got[name].astype(np.float64), mean, rtol=tolerance, atol=tolerance)
    assert got["c.steps"].tolist() == updates[want[0]]["c.steps"].tolist()
    assert header.metadata["fed.krum"] == f"f={f} m={len(want)} of n={n}"
    # And the same bytes come out piece by piece for `fed verify`, and from shards of one piece
    assert aggregate_digest(config, MANIFEST, 1, inputs, None) == (out.digest, "")
    assert shards_digest(config, inputs, 1) == out.digest


def test_the_pure_functions_on_a_small_case() -> None:
    rows = np.array([[0.0, 0.0], [1.0, 0.0], [0.0, 2.0], [10.0, 10.0]])
    d = pairwise_squared_distances(rows)
    assert d.tolist() == [[0, 1, 4, 200], [1, 0, 5, 181], [4, 5, 0, 164], [200, 181, 164, 0]]
    scores = krum_scores(d, 2)
    assert scores.tolist() == [5, 6, 9, 345]
    assert krum_select(scores, 2) == (0, 1)
    assert krum_select(np.array([3.0, 1.0, 1.0, 1.0]), 2) == (1, 2)  # a tie goes to the earlier input
    assert krum_plan(7, 2, 0) == (3, 5, "f=2 m=5 of n=7")
    assert krum_plan(7, 2, 9)[1:] == (5, "f=2 m=5 (9 asked, at most n-f) of n=7")
    assert krum_plan(6, 2, 0)[:2] == (0, 6)


@pytest.mark.parametrize("attack", ["shifted", "sign-flipped and scaled", "colluding pair"])
@pytest.mark.parametrize("m", [0, 1, 4])
def test_a_far_off_attacker_is_never_selected_and_honest_ones_are(attack: str, m: int) -> None:
    # Given six honest updates near the global and two attackers, one claiming many samples
    rng = np.random.default_rng(7)
    centre = model(rng)
    honest = [model(rng, centre, spread=0.01) for _ in range(6)]
    if attack == "shifted":
        bad = [model(rng, centre, spread=0.01, shift=5.0) for _ in range(2)]
    elif attack == "sign-flipped and scaled":
        bad = [{n: (v if n == "c.steps" else (v.astype(np.float64) - 20 * (h[n].astype(np.float64) - v)).astype(
            v.dtype)) for n, v in centre.items()} for h in honest[:2]]
    else:  # two attackers agreeing with each other, far from the rest
        far = model(rng, centre, spread=0.01, shift=-3.0)
        bad = [far, {n: v.copy() for n, v in far.items()}]
    updates = [honest[0], bad[0], *honest[1:4], bad[1], *honest[4:]]  # attackers at p01 and p05
    samples = [10, 10_000, 10, 10, 10, 10_000, 10, 10]
    inputs = inputs_of(updates, samples)
    config = config_of(krum_byzantine=2, krum_selected=m)
    # When Krum selects
    worker = PieceAggregator(config, plan_of(config, MANIFEST, 1, inputs), inputs, None)
    # Then neither attacker is among the selected, and as many honest updates as asked are
    selected = [inputs[k].participant for k in worker.configured.selected]
    assert "p01" not in selected and "p05" not in selected
    assert len(selected) == (m or 8 - 2)
    # And when every honest update is selected, the global is FedAvg over the honest ones alone, to the byte
    if m == 0:
        out = aggregate_round(config, MANIFEST, 1, inputs, None)
        plain = aggregate_round(parse_config({"run_id": "krum-run", "strategy": "fedavg"}), MANIFEST, 1,
                                [i for i in inputs if i.participant not in ("p01", "p05")], None)
        got, want = decode(out.model)[0], decode(plain.model)[0]
        assert all(got[n].tobytes() == want[n].tobytes() for n in MANIFEST.tensors)


def test_too_few_updates_are_combined_by_fedavg_and_the_header_says_so() -> None:
    rng = np.random.default_rng(3)
    centre = model(rng)
    updates = [model(rng, centre, spread=0.1) for _ in range(4)]
    inputs = inputs_of(updates, [5, 6, 7, 8])
    out = aggregate_round(config_of(krum_byzantine=1), MANIFEST, 1, inputs, None)  # 4 < 2f + 3 = 5
    plain = aggregate_round(parse_config({"run_id": "krum-run", "strategy": "fedavg"}), MANIFEST, 1, inputs, None)
    (got, header), (want, _) = decode(out.model), decode(plain.model)
    assert all(got[n].tobytes() == want[n].tobytes() for n in MANIFEST.tensors)
    assert header.metadata["fed.krum"].startswith("fallback: 4 update(s) are too few for f=1 (Krum needs 2f+3 = 5)")
    assert json.loads(header.metadata["fed.inputs"])[0][0] == "p00"


def test_the_header_of_any_other_strategy_is_unchanged() -> None:
    inputs = inputs_of([model(np.random.default_rng(1))], [1])
    for name in ("fedavg", "median"):
        header = plan_of(parse_config({"run_id": "krum-run", "strategy": name}), MANIFEST, 1, inputs).header
        assert set(json.loads(header[8:])["__metadata__"]) == {"fed.schema", "fed.run", "fed.round", "fed.kind",
                                                               "fed.strategy", "fed.inputs"}


@pytest.mark.parametrize("settings, words", [
    ({"krum_byzantine": 4, "max_participants": 10}, "needs rounds of at least 2f+3 = 11 updates, more than "
                                                    "max_participants (10) allows"),
    ({"krum_byzantine": 2, "krum_selected": 9, "max_participants": 10}, "krum_selected (9) cannot exceed "
                                                                        "max_participants - krum_byzantine (8)"),
    ({"krum_byzantine": -1}, "krum_byzantine: Input should be greater than or equal to 0"),
    ({"krum_selected": -2}, "krum_selected: Input should be greater than or equal to 0"),
])
def test_impossible_krum_settings_are_refused_by_name(settings: dict[str, int], words: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(words)):
        config_of(**settings)
    # (the same numbers under another strategy are not its concern)
    if all(v >= 0 for v in settings.values()):
        parse_config({"run_id": "krum-run", **settings})
