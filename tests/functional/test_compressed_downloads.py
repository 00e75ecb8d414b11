"""Compressed downloads through the handlers (`download_encoding`): a 64 MB model aggregated in shards writes,
beside its global model, a delta whose pieces the shard workers wrote; the global rebuilt from the previous one
and the delta is the stored global byte for byte, whatever the shard count; `fed verify` recomputes it; and a
delta that does not rebuild the model (or is missing) leaves the participant downloading it whole. With topk the
coordinator's error feedback (a slot of the optimizer state) carries what a round's delta does not send into the
next rounds, recomputed by `fed verify` too."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from coordinator.aggregation import write_aggregate
from coordinator.optimizer_state import StoredState
from coordinator.verify import verify_run
from participant.delta_fetch import rebuild_from_delta
from shared import keys
from shared.delta import DeltaIndex
from shared.digest import PIECE_BYTES
from shared.plan import PiecePlan
from shared.server_opt import FEEDBACK, ServerStep
from shared.state import Aggregate, AggregateInput
from shared.wire import Manifest, decode
from store.blobs import Bucket
from tests.functional.conftest import Harness
from tests.functional.test_large_models import PIDS, big_model, run_one_round

MB = 1024 * 1024


def get(h: Harness, key: str) -> bytes:
    return bytes(h.s3.get_object(Bucket=h.res.bucket, Key=key)["Body"].read())


class Direct:
    """What `rebuild_from_delta` needs of a participant's `Remote`: its bucket, and calls made once."""

    def __init__(self, h: Harness) -> None:
        self.bucket = Bucket(h.res.bucket, h.s3)
        self.retry = self

    def call(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        return fn(*args)


def rebuild(h: Harness, round_no: int, cache: dict[str, Path], out: Path) -> int | None:
    """A participant's rebuild of round `round_no`'s global model from the models in `cache`; bytes fetched."""
    return rebuild_from_delta(Direct(h), h.config.run_id, round_no, h.global_digest(round_no),  # type: ignore[arg-type]
                              h.config.download, cache.get, out)


@pytest.fixture
def big(harness_factory):  # type: ignore[no-untyped-def]
    return harness_factory(min_clients=3, min_per_round=3, min_updates=3, total_rounds=2, dataset_size=60,
                           max_update_bytes=256 * MB, shard_bytes=3 * PIECE_BYTES, download_encoding="int8")


def test_a_sharded_round_writes_a_delta_that_rebuilds_its_global(big: Harness, tmp_path: Path) -> None:
    # Given a 64 MB float32 model aggregated in three shards with int8 downloads
    run_one_round(big, np.dtype(np.float32))
    run_id = big.config.run_id
    previous, out = tmp_path / "g0", tmp_path / "g1"
    previous.write_bytes(get(big, keys.global_key(run_id, 0, big.global_digest(0))))
    stored = get(big, keys.global_key(run_id, 1, big.global_digest(1)))
    # When a participant holding round 0's model rebuilds round 1's from the delta
    fetched = rebuild(big, 1, {big.global_digest(0): previous}, out)
    # Then it has the stored global byte for byte, for about a quarter of its bytes
    assert out.read_bytes() == stored
    assert fetched is not None and fetched < 0.26 * len(stored), fetched
    # And anyone recomputes the round's global model (defined as previous + decoded delta)
    checks = verify_run(big.deps)
    assert [(c.round, c.ok) for c in checks] == [(0, True)], checks


@pytest.fixture
def topk(harness_factory):  # type: ignore[no-untyped-def]
    return harness_factory(min_clients=3, min_per_round=3, min_updates=3, total_rounds=2, dataset_size=60,
                           max_update_bytes=256 * MB, shard_bytes=3 * PIECE_BYTES, download_encoding="topk")


@pytest.mark.parametrize("encoding", ["int8", "topk"])
def test_one_shard_and_three_write_the_same_global_and_delta(harness_factory, encoding: str) -> None:  # type: ignore[no-untyped-def]
    big = harness_factory(min_clients=3, min_per_round=3, min_updates=3, total_rounds=2, dataset_size=60,
                          max_update_bytes=256 * MB, shard_bytes=3 * PIECE_BYTES, download_encoding=encoding)
    run_one_round(big, np.dtype(np.float32))
    deps = big.deps
    records = {u.pid: u for u in deps.store.all_updates() if u.round == 0}
    effect = Aggregate(0, tuple(AggregateInput(p, records[p].samples, records[p].digest, records[p].version_id,
                                               records[p].norm) for p in PIDS), big.global_digest(0))
    made = {}
    for shard_bytes in (PIECE_BYTES * 100, PIECE_BYTES):
        config = deps.config.model_copy(update={"shard_bytes": shard_bytes})
        model, state = write_aggregate(dataclasses.replace(deps, config=config), effect)
        made[shard_bytes] = (model, state, get(big, keys.delta_key(big.config.run_id, 1, model)))
    assert len(set(made.values())) == 1  # the global, its state (topk: the feedback) and its delta's index
    assert made[PIECE_BYTES][:2] == (big.global_digest(1), big.state().optimizer_digest)
    assert bool(made[PIECE_BYTES][1]) == (encoding == "topk")


def test_topk_downloads_rebuild_each_global_and_carry_the_rest_as_feedback(topk: Harness, tmp_path: Path) -> None:
    # Given two rounds of a 64 MB float32 model aggregated in three shards with topk downloads
    sent, samples = run_one_round(topk, np.dtype(np.float32))
    rounds = [sent, {pid: big_model(10 + i, np.dtype(np.float32)) for i, pid in enumerate(PIDS)}]
    for pid in PIDS:
        assert topk.upload(pid, rounds[1][pid], samples=samples[pid])["accepted"]
    assert topk.state().aggregated == 2
    run_id = topk.config.run_id
    files = {r: tmp_path / f"g{r}" for r in range(3)}
    for r in range(3):
        files[r].write_bytes(get(topk, keys.global_key(run_id, r, topk.global_digest(r))))
    # When a participant holding each round's model rebuilds the next from its delta
    for r in (1, 2):
        out = tmp_path / f"rebuilt{r}"
        fetched = rebuild(topk, r, {topk.global_digest(r - 1): files[r - 1]}, out)
        # Then it has the stored global byte for byte, for under 5 % of its bytes
        assert out.read_bytes() == files[r].read_bytes()
        assert fetched is not None and fetched < 0.05 * files[r].stat().st_size, fetched
    # And `fed verify` recomputes both globals and both states (the feedback)
    checks = verify_run(topk.deps)
    assert [(c.round, c.ok) for c in checks] == [(0, True), (1, True)], checks
    assert all(c.optimizer_expected and c.optimizer_recomputed == c.optimizer_expected for c in checks), checks
    # And what the globals moved plus the feedback left is what the rounds' FedAvg asked for
    models = [decode(files[r].read_bytes())[0] for r in range(3)]
    manifest = Manifest.of(decode(files[2].read_bytes())[1])
    plan = PiecePlan.of(manifest, {})
    step = ServerStep.of(topk.config)
    assert step is not None and step.slots == (FEEDBACK,)
    left = StoredState(topk.deps, step, 2, topk.state().optimizer_digest, plan.float_count).load(0, plan.float_count)
    total = sum(samples.values())
    layout = manifest.layout()
    for name in ("embed.weight", "head.bias"):
        asked = np.zeros(models[0][name].size)
        for r in (0, 1):
            for p in PIDS:
                asked += rounds[r][p][name] * (samples[p] / total)
            asked -= models[r][name]
        first = plan.floats_before(layout[name][0])
        feedback = left[FEEDBACK][first : first + asked.size]
        moved = models[2][name].astype(np.float64) - models[0][name]
        np.testing.assert_allclose(moved + feedback, asked, atol=1e-5, err_msg=name)
        assert np.count_nonzero(models[2][name] != models[1][name]) < 0.03 * asked.size  # topk's 2 % a round


def test_a_delta_that_does_not_rebuild_the_model_leaves_the_full_download(big: Harness, tmp_path: Path) -> None:
    run_one_round(big, np.dtype(np.float32))
    run_id, want = big.config.run_id, big.global_digest(1)
    previous, out = tmp_path / "g0", tmp_path / "g1"
    previous.write_bytes(get(big, keys.global_key(run_id, 0, big.global_digest(0))))
    # Without the previous model in the cache: nothing to apply it to
    assert rebuild(big, 1, {}, out) is None
    # A delta piece written over (locally anyone can): refused by its digest, nothing left half-written
    index = DeltaIndex.decode(get(big, keys.delta_key(run_id, 1, want)), want)
    victim = keys.delta_key(run_id, 1, index.pieces[2])
    big.s3.put_object(Bucket=big.res.bucket, Key=victim, Body=get(big, keys.delta_key(run_id, 1, index.pieces[3])))
    assert rebuild(big, 1, {big.global_digest(0): previous}, out) is None and not out.exists()
    # An index written over with one that rebuilds another model: refused before any piece is fetched
    big.s3.put_object(Bucket=big.res.bucket, Key=keys.delta_key(run_id, 1, want), Body=b'{"pieces": []}')
    assert rebuild(big, 1, {big.global_digest(0): previous}, out) is None
    big.s3.delete_object(Bucket=big.res.bucket, Key=keys.delta_key(run_id, 1, want))
    assert rebuild(big, 1, {big.global_digest(0): previous}, out) is None
