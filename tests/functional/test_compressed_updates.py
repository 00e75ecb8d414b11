"""Compressed updates through the handlers (`update_encoding`): ingest checks what they stand for, every
strategy aggregates them as the weights they decode to, `fed verify` recomputes the same globals, and a
malformed one is refused with its reason."""

from __future__ import annotations

import numpy as np
import pytest

from coordinator.verify import verify_run
from shared import keys, wire
from shared.compress import INDEX_SUFFIX, SCALE_SUFFIX, Encoding, decode_arrays, encode_delta
from shared.config import Strategy
from tests.functional.conftest import Harness

PIDS = ("alice", "bob", "carol")


def _send(h: Harness, pid: str, encoded: dict[str, np.ndarray], encoding: Encoding, samples: int = 10) -> dict:
    s = h.state()
    meta = wire.UpdateMeta(h.config.run_id, s.round, pid, samples, {"loss": 1.0}).to_metadata()
    return h.send(keys.update_key(h.config.run_id, s.round, pid), wire.encode(encoded, meta | encoding.metadata()))


@pytest.mark.parametrize("kind", ["bf16", "int8", "topk"])
@pytest.mark.parametrize("strategy", [Strategy.FEDAVG, Strategy.MEDIAN, Strategy.CLIPPED_FEDAVG])
def test_compressed_updates_aggregate_as_the_weights_they_stand_for(harness_factory, kind: str,  # type: ignore[no-untyped-def]
                                                                   strategy: Strategy) -> None:
    h: Harness = harness_factory(update_encoding=kind, quant_block=5, topk_chunk=5, topk_percent=40,
                                 strategy=strategy, min_clients=3, min_per_round=3, total_rounds=2,
                                 norm_outlier_factor=0)
    enc = h.config.encoding
    h.start(list(PIDS))
    rng = np.random.default_rng(0)
    for round_no in range(2):
        base = h.global_model(round_no)
        for pid in PIDS:
            trained = {k: (v + rng.normal(0, 0.1, v.shape)).astype(np.float32) for k, v in base.items()}
            encoded, _ = encode_delta(trained, base, enc)
            reply = _send(h, pid, encoded, enc)
            assert reply["accepted"], reply
        # (the record's distance is the decoded weights' distance from the global)
        if round_no == 0 and strategy is Strategy.FEDAVG:
            decoded = decode_arrays(encoded, base, enc)
            norm = np.sqrt(sum(float(((decoded[k] - base[k]) ** 2).sum()) for k in base))
            record = h.deps.store.update_record(0, PIDS[-1])
            assert record is not None and record.norm == pytest.approx(norm, rel=1e-5)
    assert h.state().aggregated == 2
    checks = verify_run(h.deps)
    assert [(c.round, c.ok) for c in checks] == [(0, True), (1, True)], checks


def test_fedavg_of_int8_updates_is_the_mean_of_their_decoded_weights(harness_factory) -> None:  # type: ignore[no-untyped-def]
    h: Harness = harness_factory(update_encoding="int8", quant_block=4, min_clients=2, min_per_round=2,
                                 min_updates=2)
    enc = h.config.encoding
    h.start(["alice", "bob"])
    base = h.global_model(0)
    decoded = []
    for pid, shift in (("alice", 0.3), ("bob", -0.1)):
        trained = {k: v + shift * np.arange(v.size, dtype=np.float32).reshape(v.shape) / v.size
                   for k, v in base.items()}
        encoded, _ = encode_delta(trained, base, enc)
        assert encoded["dense.weight"].dtype == np.int8 and encoded["dense.weight" + SCALE_SUFFIX].shape == (3,)
        assert _send(h, pid, encoded, enc)["accepted"]
        decoded.append(decode_arrays(encoded, base, enc))
    got = h.global_model(1)
    for name in base:
        np.testing.assert_allclose(got[name], (decoded[0][name] + decoded[1][name]) / 2, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(("case", "reason"), [
    ("plain weights", "update encoded as weights; this run's updates are int8/4"),
    ("another block", "update encoded as int8/8; this run's updates are int8/4"),
    ("a NaN scale", "non-finite values"),
    ("an overflowing scale", "non-finite values (NaN or Inf) in dense"),
    ("a scale tensor missing", "missing tensors: dense.bias.__scale__"),
])
def test_a_malformed_compressed_update_is_refused_with_its_reason(harness_factory, case: str, reason: str) -> None:  # type: ignore[no-untyped-def]
    h: Harness = harness_factory(update_encoding="int8", quant_block=4)
    enc = h.config.encoding
    h.start(["alice", "bob"])
    base = h.global_model(0)
    encoded, _ = encode_delta({k: v + 0.1 for k, v in base.items()}, base, enc)
    sent_as = enc
    if case == "plain weights":
        encoded, sent_as = {k: v + 0.1 for k, v in base.items()}, Encoding()
    elif case == "another block":
        encoded, _ = encode_delta({k: v + 0.1 for k, v in base.items()}, base, Encoding("int8", 8))
        sent_as = Encoding("int8", 8)
    elif case == "a NaN scale":
        encoded["dense.weight" + SCALE_SUFFIX] = np.full_like(encoded["dense.weight" + SCALE_SUFFIX], np.nan)
    elif case == "an overflowing scale":
        encoded["dense.weight" + SCALE_SUFFIX] = np.full_like(encoded["dense.weight" + SCALE_SUFFIX], 3e38)
    else:
        del encoded["dense.bias" + SCALE_SUFFIX]
    reply = _send(h, "alice", encoded, sent_as)
    assert not reply["accepted"] and reason in reply["reason"], reply
    # and the run goes on: a good update from alice's peer is accepted
    good, _ = encode_delta({k: v + 0.2 for k, v in base.items()}, base, enc)
    assert _send(h, "bob", good, enc)["accepted"]


@pytest.mark.parametrize(("case", "reason"), [
    ("another keep", "update encoded as topk/2/4/2; this run's updates are topk/2/4/1"),
    ("4 bits", "update encoded as topk/4/4/1; this run's updates are topk/2/4/1"),
    ("an extra position", "wrong shape for dense.weight.__index__"),
    ("a position past its chunk", "topk positions of chunks 0-2 are outside their chunk or not ascending"),
    ("a negative step", "a topk step (scale) is negative or not finite"),
    ("an infinite step", "non-finite values (NaN or Inf) in dense.weight.__scale__"),
])
def test_a_topk_update_that_lies_is_refused_with_its_reason(harness_factory, case: str, reason: str) -> None:  # type: ignore[no-untyped-def]
    h: Harness = harness_factory(update_encoding="topk", topk_chunk=4, topk_percent=25)
    enc = h.config.encoding
    h.start(["alice", "bob"])
    base = h.global_model(0)
    trained = {k: v + np.linspace(0.1, 0.5, v.size, dtype=np.float32).reshape(v.shape) for k, v in base.items()}
    encoded, _ = encode_delta(trained, base, enc)
    sent_as = enc
    if case in ("another keep", "4 bits"):
        sent_as = Encoding("topk", bits=4 if case == "4 bits" else 2, chunk=4, keep=1 if case == "4 bits" else 2)
        encoded, _ = encode_delta(trained, base, sent_as)
    elif case == "an extra position":
        encoded["dense.weight" + INDEX_SUFFIX] = np.append(encoded["dense.weight" + INDEX_SUFFIX], np.int16(0))
    elif case == "a position past its chunk":
        encoded["dense.weight" + INDEX_SUFFIX] = np.full_like(encoded["dense.weight" + INDEX_SUFFIX], 4)
    else:
        steps = encoded["dense.weight" + SCALE_SUFFIX]
        encoded["dense.weight" + SCALE_SUFFIX] = np.full_like(steps, -1.0 if case == "a negative step" else np.inf)
    reply = _send(h, "alice", encoded, sent_as)
    assert not reply["accepted"] and reason in reply["reason"], reply
    # and the run goes on: a good update from alice's peer is accepted
    good, _ = encode_delta({k: v + 0.2 for k, v in base.items()}, base, enc)
    assert _send(h, "bob", good, enc)["accepted"]


def test_shard_workers_sum_sparse_updates_to_the_dense_reference(harness_factory) -> None:  # type: ignore[no-untyped-def]
    """A 64 MB model, three topk updates, three shards: the global the shard workers write is the FedAvg of the
    weights the updates stand for, computed densely in memory here."""
    from shared.digest import PIECE_BYTES
    from tests.functional.test_large_models import PIDS as BIG_PIDS
    from tests.functional.test_large_models import big_model

    h: Harness = harness_factory(update_encoding="topk", min_clients=3, min_per_round=3, min_updates=3,
                                 total_rounds=2, dataset_size=60, max_update_bytes=256 << 20,
                                 shard_bytes=3 * PIECE_BYTES)
    enc = h.config.encoding
    h.scheduled_tick()
    for pid in BIG_PIDS:
        h.join_alive(pid)
    h.offer(BIG_PIDS[0], big_model(0, np.dtype(np.float32)))
    base = h.global_model(0)
    decoded, samples = {}, {}
    for i, pid in enumerate(BIG_PIDS):
        trained = {k: v + (big_model(i + 1, v.dtype)[k] - v) * np.float32(0.01) if v.dtype == np.float32 else v
                   for k, v in base.items()}
        encoded, _ = encode_delta(trained, base, enc)
        samples[pid] = 10 + 5 * i
        reply = _send(h, pid, encoded, enc, samples=samples[pid])
        assert reply["accepted"], reply
        decoded[pid] = decode_arrays(encoded, base, enc)
        assert sum(a.nbytes for a in encoded.values()) < sum(a.nbytes for a in base.values()) / 50
    assert h.state().aggregated == 1, h.state()
    out = h.global_model(1)
    total = sum(samples.values())
    for name, value in base.items():
        if value.dtype != np.float32:
            continue
        want = sum(decoded[p][name].astype(np.float64) * samples[p] for p in BIG_PIDS) / total
        np.testing.assert_allclose(out[name].astype(np.float64), want, rtol=1e-6, atol=1e-6)
    checks = verify_run(h.deps)
    assert [(c.round, c.ok) for c in checks] == [(0, True)], checks
