"""Every registered strategy (`shared.strategies.STRATEGIES`) through each path that computes a round: the whole
round in memory (`aggregate_round`), its digests piece by piece (`aggregate_digest`, what `fed verify` runs) and
its pieces cut into shards, each computed by an aggregator of its own (what the shard workers do) — the same
bytes every way, with and without a server optimizer.

And the digests pinned: FedAvg, median, trimmed mean and clipped FedAvg give the bytes they gave before the
strategies and optimizers were classes (`GOLDEN`, computed then), as does Krum since it was added. A change that
moves any of these bytes moves every recorded run's `fed verify`: it must be deliberate, and these are updated
with it."""

from __future__ import annotations

import hashlib

import ml_dtypes
import numpy as np
import pytest

from shared.aggregate import ArraySource, PieceAggregator, WeightedInput, aggregate_digest, aggregate_round, round_plan
from shared.config import RunConfig, parse_config
from shared.digest import PIECE_BYTES, combine, digest, piece_hash
from shared.server_opt import ServerStep, encode_index
from shared.wire import Manifest, TensorSpec

MANIFEST = Manifest({
    "a.weight": TensorSpec("F32", (PIECE_BYTES // 4 + 1_001,)),  # crosses the boundary of the file's two pieces
    "b.half": TensorSpec("BF16", (3, 1_001)),
    "c.steps": TensorSpec("I64", (2,)),
    "d.f16": TensorSpec("F16", (257,)),
    "e.f64": TensorSpec("F64", (65,)),
})
DTYPES = {"F32": np.float32, "BF16": ml_dtypes.bfloat16, "F16": np.float16, "F64": np.float64}
SAMPLES = [12, 30, 7, 19, 25, 11]


def _model(rng: np.random.Generator, centre: dict[str, np.ndarray] | None, spread: float) -> dict[str, np.ndarray]:
    out = {}
    for name, spec in MANIFEST.tensors.items():
        if spec.dtype == "I64":
            out[name] = rng.integers(0, 1000, spec.shape).astype(np.int64)
        else:
            around = 0.0 if centre is None else centre[name].astype(np.float64)
            out[name] = (around + spread * rng.standard_normal(spec.shape)).astype(DTYPES[spec.dtype])
    return out


def _distance(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    return float(np.sqrt(sum(((a[n].astype(np.float64) - b[n].astype(np.float64)) ** 2).sum()
                             for n, s in MANIFEST.tensors.items() if s.dtype != "I64")))


_rng = np.random.default_rng(2024)
BASE = _model(_rng, None, 1.0)
UPDATES = [_model(_rng, BASE, 0.05 * (k + 1)) for k in range(len(SAMPLES))]  # the last ones farther off


def inputs() -> list[WeightedInput]:
    """Participants not in upload order (the aggregation sorts them), their distances from the global as ingest
    measures them (clipping's scales)."""
    return [WeightedInput(f"p{(5 * k) % len(UPDATES)}", s, "0" * 64, ArraySource(MANIFEST, u), _distance(u, BASE))
            for k, (u, s) in enumerate(zip(UPDATES, SAMPLES, strict=True))]


def config_of(strategy: str, optimizer: str, download: str = "full") -> RunConfig:
    return parse_config({"run_id": "strategies-run", "strategy": strategy, "server_optimizer": optimizer,
                         "download_encoding": download})


def round_digests(config: RunConfig) -> tuple[str, str, str]:
    """The global's digest, the optimizer state's ("" without) and the download deltas' (a hash of their bytes; ""
    without) of one round from the updates above."""
    out = aggregate_round(config, MANIFEST, 1, inputs(), ArraySource(MANIFEST, BASE))
    deltas = hashlib.sha256(b"".join(out.delta_pieces)).hexdigest() if out.delta_pieces else ""
    return out.digest, out.state_digest, deltas


# Computed before the strategies and server optimizers were classes (krum: when it was added).
GOLDEN: dict[tuple[str, str, str], tuple[str, str, str]] = {
    ("fedavg", "none", "full"): (
        "510008d66a3524c8176587c6c56b1f7537e40dac78f3cc8a7fec2a933d932171",
        "",
        "",
    ),
    ("fedavg", "fedadam", "full"): (
        "ee4da44698d2a3649dfc947def06b483447c6e3c75aafebfeb8c451bae623934",
        "17a6e6b8d62d8670465c94cc6d313aad81603ed9eea4bd2dd01da05572492296",
        "",
    ),
    ("median", "none", "full"): (
        "1ecd478aee8dce091dc3c8261aba94889f3a47f19427ede095f1cb3fdce4c51f",
        "",
        "",
    ),
    ("meamed", "none", "full"): (
        "18c57cc9d087d8c2ad3dd8ee9710f1ff851e03ab171d333659dffa8c75a7c084",
        "",
        "",
    ),
    ("median", "fedadam", "full"): (
        "e15443196bddbff6d5dcd50b1d75d534a31c1efe0bd4e7fcef2ca11ef1ef801c",
        "066971d26331d8fff8aafddc69dbd0e8e7fcf14fa7f1f1b54918b1655e16d923",
        "",
    ),
    ("trimmed_mean", "none", "full"): (
        "923cf963a064e038c6557d5e372819e351c012f338276162ea398d85106e769f",
        "",
        "",
    ),
    ("trimmed_mean", "fedadam", "full"): (
        "89167eae9a8a9e853bea40389316283e9509108a91b8f50d2857a622d08f010d",
        "1419040f5df7dfd62e08ce9c7926519d2e0615cd9248235f0987e691eea7431d",
        "",
    ),
    ("clipped_fedavg", "none", "full"): (
        "b9a870ccf855d920f219f99af982a51d40cef455bdb61920153fbb1b0c30e8db",
        "",
        "",
    ),
    ("clipped_fedavg", "fedadam", "full"): (
        "75d8c6c23238937f7d6e61880f2220ad076fbfe8db58aa9c1649097ae1f50513",
        "3b078c142f17d2d321998c2d3a111690050cfdefc86a82d5a7b475a592119755",
        "",
    ),
    ("fedavg", "diloco", "int8"): (
        "932a4dcbc605cdaf09f2796d9a18227669532b6308b4b9c4a0557451b57895ef",
        "99c4eb0f78a69bda8dd9abceb40f31681b6d930446b78e0bcd0e7e07250fec98",
        "1bcec304dca8ba2acc3a0abc88c7f964e52067ba8534f848a0eda33961d78fec",
    ),
    ("median", "fedyogi", "bf16"): (
        "884295a65f03c6799767d394d3ef6598454a7c303d222a390b60c4e972dd8d13",
        "7555d9e9cdf8e4e5d368221a0873fbf6f7ff17b703fe35936cd1800d03bd4737",
        "7f436eb1aa39c24d563e760bf61a998371fea930fad1ad6dd20fcf8ce09f46d5",
    ),
    ("clipped_fedavg", "fedavgm", "full"): (
        "eeee2ebe04343746e91a2f0dc1ddc181c1154e00d7eb922c1284a6d83d035ec6",
        "0dd53da4a1a47862e9388b90beafb98905c0ec724714829e37fa88e64da187eb",
        "",
    ),
    ("trimmed_mean", "none", "int8"): (
        "9d70f8f856cac5fd44e0dd7d24ebd89d1eaabf8b83668927cd5f84b76549adba",
        "",
        "51301391fc374b630e08748da71521459b0633e5b17e8ec16cb04a4ee181afe1",
    ),
    ("krum", "none", "full"): (
        "38063c32fcafa8edfb6cbbf0259795de8eae36cedaa7aeedea9d3c67e0a3a781",
        "",
        "",
    ),
    ("krum", "fedadam", "int8"): (
        "3bf4312fe1f72a970d8157a77e1b75d4ee62f1239be478df2c6cd5ad64ce4e87",
        "19b596dbc38f45a578b686185d7fe73708fb65e6c43cce25cd58ff732dde3d96",
        "b6886293cfbad2dbe314cc9ee6afb059c51085ecfc7054ff2104e931cf62c73d",
    ),
}


@pytest.mark.parametrize("setting", list(GOLDEN), ids="-".join)
def test_a_round_gives_the_bytes_it_always_gave(setting: tuple[str, str, str]) -> None:
    assert round_digests(config_of(*setting)) == GOLDEN[setting]


def sharded_digests(config: RunConfig, pieces_per_shard: int) -> tuple[str, str]:
    """The global's and the state's digests with the round's pieces cut into shards of `pieces_per_shard`, each
    computed by an aggregator of its own (`coordinator.aggregation.run_shard`)."""
    ins = inputs()
    plan = round_plan(config, MANIFEST, 1, ins)
    hashes, states = [], []
    for shard in plan.shards(pieces_per_shard * PIECE_BYTES):
        worker = PieceAggregator(config, plan, ins, ArraySource(MANIFEST, BASE))
        for index in shard:
            made = worker.piece_output(index)
            hashes.append(piece_hash(made.data))
            if made.state is not None:
                states.append(digest(made.state))
    model = combine(hashes)
    step = ServerStep.of(config)
    if step is None:
        return model, ""
    counts = [plan.layout(i).count for i in range(plan.pieces)]
    return model, digest(encode_index(step, 1, model, states, counts))


def registered() -> list[str]:
    from shared.strategies import STRATEGIES

    return list(STRATEGIES)


@pytest.mark.parametrize("optimizer", ["none", "fedadam"])
@pytest.mark.parametrize("strategy", registered())
def test_every_strategy_gives_the_same_bytes_whole_piece_by_piece_and_in_shards(strategy: str, optimizer: str) -> None:
    config = config_of(strategy, optimizer)
    out = aggregate_round(config, MANIFEST, 1, inputs(), ArraySource(MANIFEST, BASE))
    assert round_plan(config, MANIFEST, 1, inputs()).pieces == 2
    assert bool(out.state_digest) == (optimizer != "none")
    assert aggregate_digest(config, MANIFEST, 1, inputs(), ArraySource(MANIFEST, BASE)) == (out.digest,
                                                                                            out.state_digest)
    assert sharded_digests(config, 1) == (out.digest, out.state_digest)


def test_every_strategy_is_pinned() -> None:
    assert {strategy for strategy, _, _ in GOLDEN} == set(registered())
