"""The topk encoding (`shared.compress`): against an independent reading of its definition, error feedback that
conserves every delta, any byte range decoded exactly, its size, and every lie a hostile file can tell refused."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.aggregate import ArraySource
from shared.compress import (
    INDEX_SUFFIX,
    SCALE_SUFFIX,
    CompressError,
    DecodedSource,
    Encoding,
    decode_arrays,
    encode_delta,
    encoded_manifest,
    topk_entries,
    wire_ratio,
)
from shared.wire import Manifest, decode, encode, spec_of
from tests.unit.test_compress import BF16, assert_read_as_decoded, manifest_of, rounds_of_error_feedback, trained_from
from tests.unit.test_compress import model as dense_model


def model(rng: np.random.Generator, dtype: np.dtype = np.dtype(np.float32)) -> dict[str, np.ndarray]:
    """test_compress's model (407 elements in emb.weight: chunks do not divide it) and an empty tensor."""
    return dense_model(rng, dtype) | {"empty": np.zeros((0, 3), dtype)}


def independent_topk(delta: np.ndarray, enc: Encoding) -> np.ndarray:
    """Chunk by chunk, as the encoding is defined: the keep largest |x| of each chunk, each sent as the nearest of
    2^bits levels (q - h) * s, s fitted from max|kept| / h by four rounds of nearest codes then least squares;
    everything else zero."""
    flat = delta.astype(np.float32).reshape(-1)
    out = np.zeros_like(flat)
    h = ((1 << enc.bits) - 1) / 2
    for start in range(0, flat.size, enc.chunk):
        chunk = flat[start : start + enc.chunk]
        k = enc.keep if chunk.size == enc.chunk else min(chunk.size, max(1, -(-chunk.size * enc.keep // enc.chunk)))
        kept = np.argsort(-np.abs(chunk), kind="stable")[:k]
        s = np.float32(np.abs(chunk[kept]).max() / np.float32(h)) if k else np.float32(0)
        for _ in range(4):
            if s > 0:
                c = np.clip(np.rint(chunk[kept] / s + h), 0, 2 * h) - np.float32(h)
                s = np.float32((chunk[kept] * c).sum() / np.square(c).sum())
        q = np.clip(np.rint(chunk[kept] / (s if s > 0 else np.float32(1)) + h), 0, 2 * h)
        out[start + kept] = (q.astype(np.float32) - np.float32(h)) * s
    return out.reshape(delta.shape)


@pytest.mark.parametrize(("bits", "chunk", "keep"), [(2, 64, 3), (4, 100, 7), (2, 4096, 82), (4, 5, 5), (2, 1, 1)])
def test_topk_decodes_as_its_definition_says(bits: int, chunk: int, keep: int) -> None:
    rng = np.random.default_rng(chunk)
    base = model(rng)
    trained = trained_from(base, rng)  # (distinct magnitudes: no ties for the two readings to break differently)
    enc = Encoding("topk", bits=bits, chunk=chunk, keep=keep)
    encoded, _ = encode_delta(trained, base, enc)
    decoded = decode_arrays(encoded, base, enc)
    for name in ("emb.weight", "head.bias", "head.weight"):
        want = base[name] + independent_topk(trained[name] - base[name], enc)
        np.testing.assert_allclose(decoded[name], want, rtol=0, atol=1e-6)
        sent = np.count_nonzero(decoded[name] - base[name])
        assert sent <= -(-base[name].size // chunk) * keep and sent <= base[name].size * keep / chunk + 1
    assert decoded["steps"].tolist() == [8, 10] and decoded["empty"].shape == (0, 3)


@settings(max_examples=60, deadline=None)
@given(bits=st.sampled_from([2, 4]), chunk=st.sampled_from([1, 7, 64, 300, 4096]),
       percent=st.floats(0.1, 100), dtype=st.sampled_from(["float32", "bfloat16"]), seed=st.integers(0, 99))
def test_what_is_sent_plus_what_is_kept_is_the_delta_plus_the_carried_error(bits: int, chunk: int, percent: float,
                                                                           dtype: str, seed: int) -> None:
    rng = np.random.default_rng(seed)
    base = model(rng, BF16 if dtype == "bfloat16" else np.dtype(np.float32))
    trained = trained_from(base, rng)
    carried = {n: rng.normal(0, 0.005, a.shape).astype(np.float32) for n, a in base.items() if a.dtype != np.int64}
    enc = Encoding.topk(percent, bits, chunk)
    encoded, lost = encode_delta(trained, base, enc, carried)
    assert manifest_of(encoded) == encoded_manifest(manifest_of(base), enc)
    for name, spec in carried.items():
        delta = trained[name].astype(np.float32) - base[name].astype(np.float32) + spec
        entries = topk_entries(base[name].size, 0, -(-base[name].size // chunk), encoded[name],
                               encoded[name + INDEX_SUFFIX], encoded[name + SCALE_SUFFIX], enc)
        sent = np.zeros(base[name].size, np.float32)
        sent[entries[0]] = entries[1]
        np.testing.assert_allclose(sent.reshape(delta.shape) + lost[name], delta, rtol=0, atol=1e-6)


def test_error_feedback_over_rounds_loses_nothing_for_good() -> None:
    sent_sum, true_sum, residual = rounds_of_error_feedback(Encoding.topk(2.0, 2, 64), 30, seed=5)
    np.testing.assert_allclose(sent_sum + residual, true_sum, atol=1e-5)
    # and what is sent is most of it: the residual stays bounded while the total grows
    assert np.linalg.norm(residual) < np.linalg.norm(true_sum)


@settings(max_examples=60, deadline=None)
@given(bits=st.sampled_from([2, 4]), chunk=st.sampled_from([1, 3, 64, 300]), keep=st.integers(1, 8),
       dtype=st.sampled_from(["float32", "bfloat16"]), begin=st.integers(0, 10_000), length=st.integers(0, 10_000))
def test_a_decoded_source_reads_any_range_of_topk_as_the_decoded_files_bytes(bits: int, chunk: int, keep: int,
                                                                            dtype: str, begin: int,
                                                                            length: int) -> None:
    rng = np.random.default_rng(chunk + keep)
    base = model(rng, BF16 if dtype == "bfloat16" else np.dtype(np.float32))
    enc = Encoding("topk", bits=bits, chunk=chunk, keep=min(keep, chunk))
    encoded, _ = encode_delta(trained_from(base, rng), base, enc)
    assert_read_as_decoded(base, encoded, enc, begin, length)


def test_topk_sends_over_30_times_fewer_bytes_than_fp32() -> None:
    big = Manifest({"w": spec_of("w", np.zeros((4096, 1024), np.float32))})
    two, four = wire_ratio(big, Encoding.topk(2.0, 2)), wire_ratio(big, Encoding.topk(2.0, 4))
    # per 4096 elements: 82 kept x (2 position bytes + bits / 8) + 4 step bytes
    assert two == pytest.approx((82 * 2 + 21 + 4) / (4096 * 4))
    assert four == pytest.approx((82 * 2 + 41 + 4) / (4096 * 4))
    assert 1 / two > 80 and 1 / four > 75


def test_a_topk_file_says_its_encoding_and_parses_back() -> None:
    rng = np.random.default_rng(3)
    base = model(rng)
    enc = Encoding.topk(3.0, 4, 256)
    assert enc.keep == 8  # 3 % of 256, rounded up
    encoded, _ = encode_delta(trained_from(base, rng), base, enc)
    _, header = decode(encode(encoded, enc.metadata()))
    assert Encoding.of_metadata(header.metadata) == enc
    assert encoded_manifest(manifest_of(base), enc).mismatch(header) is None
    assert Encoding.parse(str(enc)) == enc and str(enc) == "topk/4/256/8"


def test_bad_topk_settings_are_refused_with_the_reason() -> None:
    with pytest.raises(CompressError, match="2 or 4 bits"):
        Encoding("topk", bits=3)
    with pytest.raises(CompressError, match="chunk is 1 to 32768"):
        Encoding("topk", chunk=1 << 16)
    with pytest.raises(CompressError, match="keeps 1 to 64"):
        Encoding("topk", chunk=64, keep=65)
    with pytest.raises(CompressError, match="fed.keep must be an integer"):
        Encoding.of_metadata({"fed.encoding": "topk", "fed.keep": "8.5"})
    with pytest.raises(CompressError, match="malformed encoding"):
        Encoding.parse("topk/2/64")
    clash = Manifest({"w": spec_of("w", np.zeros(3, np.float32)), "w" + INDEX_SUFFIX: spec_of("i", np.zeros(1))})
    with pytest.raises(CompressError, match="reserved"):
        encoded_manifest(clash, Encoding("topk"))


def _lie(what: str) -> tuple[dict[str, np.ndarray], Encoding]:
    rng = np.random.default_rng(11)
    base = {"w": rng.normal(0, 1, (1000,)).astype(np.float32)}
    enc = Encoding("topk", bits=2, chunk=64, keep=6)  # 15 full chunks and one of 40 (keeping 4)
    encoded, _ = encode_delta(trained_from(base, rng), base, enc)
    index, packed, steps = (encoded["w" + INDEX_SUFFIX].copy(), encoded["w"].copy(),
                            encoded["w" + SCALE_SUFFIX].copy())
    if what == "position past its chunk":
        index[6 * 3 + 5] = 64
    elif what == "position past the short last chunk":
        index[-1] = 40
    elif what == "negative position":
        index[0] = -1
    elif what == "a position twice":
        index[7] = index[6]
    elif what == "positions out of order":
        index[[6, 7]] = index[[7, 6]]
    elif what == "negative step":
        steps[2] = -steps[2]
    elif what == "NaN step":
        steps[4] = np.nan
    elif what == "bits past the codes":
        packed[enc.chunk_bytes * 3 + enc.chunk_bytes - 1] |= 0xC0  # a 7th and 8th code where 6 are kept
    return {"w": packed, "w" + INDEX_SUFFIX: index, "w" + SCALE_SUFFIX: steps}, enc


@pytest.mark.parametrize("what", ["position past its chunk", "position past the short last chunk",
                                  "negative position", "a position twice", "positions out of order",
                                  "negative step", "NaN step", "bits past the codes"])
def test_every_lie_a_topk_file_tells_is_refused_by_the_decoder(what: str) -> None:
    encoded, enc = _lie(what)
    base = {"w": np.zeros(1000, np.float32)}
    manifest = manifest_of(base)
    with pytest.raises(CompressError, match="topk"):
        decode_arrays(encoded, base, enc)
    # and by range, as ingest and the shard workers read it: the whole model read in ranges meets the lie
    source = DecodedSource(manifest, enc, ArraySource(manifest, base),
                           ArraySource(encoded_manifest(manifest, enc), encoded))
    with pytest.raises(CompressError, match="topk"):
        for begin in range(0, manifest.nbytes, 512):
            source.readinto(begin, memoryview(bytearray(min(512, manifest.nbytes - begin))))


@pytest.mark.parametrize(("bits", "bound"), [(2, 0.15), (4, 0.06)])
def test_the_fitted_step_sends_the_kept_values_closely(bits: int, bound: float) -> None:
    # (scaled to each chunk's largest value instead, 2 bits were 0.38 off and 4 bits 0.055 on the same deltas)
    rng = np.random.default_rng(7)
    delta = rng.normal(0, 1, (256, 4096)).astype(np.float32)
    enc = Encoding.topk(2.0, bits)
    encoded, _ = encode_delta({"w": delta}, {"w": np.zeros_like(delta)}, enc)
    at, values = topk_entries(delta.size, 0, 256, encoded["w"], encoded["w" + INDEX_SUFFIX],
                              encoded["w" + SCALE_SUFFIX], enc)
    kept = delta.reshape(-1)[at]
    assert np.linalg.norm(values - kept) / np.linalg.norm(kept) < bound


def test_a_run_file_that_cannot_work_with_topk_is_refused_with_the_reason() -> None:
    from shared.config import RunConfig

    with pytest.raises(ValueError, match="topk cannot be witnessed"):
        RunConfig(run_id="topk-run", update_encoding="topk", witness_nodes=2)
    with pytest.raises(ValueError, match="needs error_feedback"):
        RunConfig(run_id="topk-run", update_encoding="topk", error_feedback=False)
    with pytest.raises(ValueError, match="topk_bits must be one of 2, 4"):
        RunConfig(run_id="topk-run", update_encoding="topk", topk_bits=3)
    assert RunConfig(run_id="topk-run", update_encoding="topk", topk_percent=3).encoding == Encoding.topk(3.0)


def test_fed_demo_with_topk_updates_runs_unwitnessed() -> None:
    from fed.demo.tasks import demo_config

    assert demo_config(3).witness_nodes == 2
    config = demo_config(3, update_encoding="topk")
    assert config.witness_nodes == 0 and config.round_witness_time == 0
