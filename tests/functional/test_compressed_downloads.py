"""Compressed downloads through the handlers (`download_encoding`): a 64 MB model aggregated in shards writes,
beside its global model, a delta whose pieces the shard workers wrote; the global rebuilt from the previous one
and the delta is the stored global byte for byte, whatever the shard count; `fed verify` recomputes it; and a
delta that does not rebuild the model (or is missing) leaves the participant downloading it whole."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from coordinator.aggregation import write_aggregate
from coordinator.verify import verify_run
from participant.delta_fetch import rebuild_from_delta
from shared import keys
from shared.delta import DeltaIndex
from shared.digest import PIECE_BYTES
from shared.state import Aggregate, AggregateInput
from store.blobs import Bucket
from tests.functional.conftest import Harness
from tests.functional.test_large_models import PIDS, run_one_round

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


def test_one_shard_and_three_write_the_same_global_and_delta(big: Harness) -> None:
    run_one_round(big, np.dtype(np.float32))
    deps = big.deps
    records = {u.pid: u for u in deps.store.all_updates() if u.round == 0}
    effect = Aggregate(0, tuple(AggregateInput(p, records[p].samples, records[p].digest, records[p].version_id,
                                               records[p].norm) for p in PIDS), big.global_digest(0))
    made = {}
    for shard_bytes in (PIECE_BYTES * 100, PIECE_BYTES):
        config = deps.config.model_copy(update={"shard_bytes": shard_bytes})
        model, _ = write_aggregate(dataclasses.replace(deps, config=config), effect)
        made[shard_bytes] = (model, get(big, keys.delta_key(big.config.run_id, 1, model)))
    assert len(set(made.values())) == 1
    assert made[PIECE_BYTES][0] == big.global_digest(1)


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
