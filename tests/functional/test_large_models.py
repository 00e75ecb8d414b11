"""Models of real size through ingest and aggregation: streamed, in parameter shards, in bf16 and fp16.

A 64 MB model is 8 digest pieces; with `shard_bytes` of 3 pieces the aggregation runs as 3 shards (3, 3 and
2 pieces), each writing its own parts of one multipart upload. Whatever the shard count, the global model
is the same bytes, and `fed verify` recomputes it.
"""

from __future__ import annotations

import dataclasses
import json

import ml_dtypes
import numpy as np
import pytest

from coordinator.aggregation import write_aggregate
from coordinator.verify import verify_run
from shared import keys, wire
from shared.config import ServerOptimizer, Strategy
from shared.digest import PIECE_BYTES
from shared.state import Aggregate, AggregateInput
from tests.functional.conftest import Harness, assert_round_left_to_lease_holder

MB = 1024 * 1024
PIDS = ["alice", "bob", "carol"]


def big_model(seed: int, dtype: np.dtype, megabytes: int = 64) -> dict[str, np.ndarray]:
    """Four tensors of `dtype` (the first an odd length, so tensors do not fall on piece boundaries) plus an
    integer step counter, about `megabytes` in all."""
    rng = np.random.default_rng(seed)
    per = megabytes * MB // np.dtype(dtype).itemsize // 4
    shapes = {"embed.weight": (per - 7,), "block0.weight": (per // 1024, 1024), "block1.weight": (per,),
              "head.bias": (per + 5,)}
    arrays = {name: rng.standard_normal(shape, np.float32).astype(dtype) for name, shape in shapes.items()}
    return {**arrays, "step": np.array([seed], np.int64)}


def run_one_round(h: Harness, dtype: np.dtype) -> tuple[dict[str, dict[str, np.ndarray]], dict[str, int]]:
    h.scheduled_tick()
    for pid in PIDS:
        h.join_alive(pid)
    h.offer(PIDS[0], big_model(0, dtype))
    assert h.state().round == 0 and h.state().selected == tuple(sorted(PIDS)), h.state()
    sent, samples = {}, {}
    for i, pid in enumerate(PIDS):
        sent[pid] = big_model(i + 1, dtype)
        samples[pid] = 10 + 5 * i  # (each was assigned 20 of the 60 samples)
        outcome = h.upload(pid, sent[pid], samples=samples[pid])
        assert outcome["accepted"], outcome
    assert h.state().aggregated == 1, h.state()
    return sent, samples


@pytest.fixture
def big(harness_factory):  # type: ignore[no-untyped-def]
    return harness_factory(min_clients=3, min_per_round=3, min_updates=3, total_rounds=2, dataset_size=60,
                           max_update_bytes=256 * MB, shard_bytes=3 * PIECE_BYTES)


@pytest.mark.parametrize("dtype", [np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16)],
                         ids=["fp32", "bf16", "fp16"])
def test_a_64_mb_model_aggregates_in_three_shards_to_the_independent_mean(big: Harness, dtype: np.dtype) -> None:
    sent, samples = run_one_round(big, dtype)
    out = big.global_model(1)
    total = sum(samples.values())
    for name in sent[PIDS[0]]:
        if name == "step":  # not averaged: taken from the first input by participant order
            assert out[name].tolist() == sent["alice"][name].tolist()
            continue
        want = sum(sent[p][name].astype(np.float64) * samples[p] for p in PIDS) / total
        assert out[name].dtype == dtype
        tolerance = {np.dtype(np.float32): 1e-5}.get(dtype, 1e-2)  # bf16 keeps 8 bits of mantissa, fp16 11
        np.testing.assert_allclose(out[name].astype(np.float64), want, rtol=tolerance, atol=tolerance)
    checks = verify_run(big.deps)
    assert [(c.round, c.ok) for c in checks] == [(0, True)], checks


@pytest.mark.parametrize("strategy, optimizer", [(s, ServerOptimizer.NONE) for s in Strategy]
                         + [(Strategy.FEDAVG, ServerOptimizer.FEDADAM), (Strategy.MEDIAN, ServerOptimizer.DILOCO)])
def test_one_shard_and_three_give_byte_identical_globals(big: Harness, strategy: Strategy,
                                                         optimizer: ServerOptimizer) -> None:
    run_one_round(big, np.dtype(np.float32))
    deps = big.deps
    records = {u.pid: u for u in deps.store.all_updates() if u.round == 0}
    base = big.global_digest(0)
    effect = Aggregate(0, tuple(AggregateInput(p, records[p].samples, records[p].digest, records[p].version_id,
                                               records[p].norm) for p in PIDS), base)
    digests = {}
    for shard_bytes in (PIECE_BYTES * 100, PIECE_BYTES * 3, PIECE_BYTES):
        config = deps.config.model_copy(update={"strategy": strategy, "shard_bytes": shard_bytes,
                                                "server_optimizer": optimizer})
        digests[shard_bytes // PIECE_BYTES] = write_aggregate(dataclasses.replace(deps, config=config), effect)
    assert len(set(digests.values())) == 1, digests  # the global model and the optimizer state
    model, state = digests[1]
    stored = big.s3.get_object(Bucket=big.res.bucket, Key=keys.global_key(big.config.run_id, 1, model))
    assert wire.digest(stored["Body"].read()) == model
    assert bool(state) == (optimizer is not ServerOptimizer.NONE)
    if state:  # the index names the state, and lists one state file per piece of the global model
        index = big.s3.get_object(Bucket=big.res.bucket, Key=keys.optimizer_key(big.config.run_id, 1, state))
        assert len(json.loads(index["Body"].read())["pieces"]) == -(-int(stored["ContentLength"]) // PIECE_BYTES)


def test_a_round_another_invocation_is_aggregating_is_left_to_it(big: Harness) -> None:
    big.scheduled_tick()
    for pid in PIDS:
        big.join_alive(pid)
    big.offer(PIDS[0], big_model(0, np.dtype(np.float32), megabytes=24))

    def close_round() -> None:
        for i, pid in enumerate(PIDS):
            assert big.upload(pid, big_model(i + 1, np.dtype(np.float32), megabytes=24), samples=10)["accepted"]

    # Given another invocation holding the round's lease (computing the shards): when the last update closes the
    # round, the round waits for the holder's commit, and is aggregated once the lease is given back
    assert_round_left_to_lease_holder(big, close_round)
