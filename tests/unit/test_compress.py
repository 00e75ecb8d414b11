"""Compressed updates (`shared.compress`): the encodings against an independent reading of their definition,
error feedback, and `DecodedSource` reading any byte range exactly as the decoded weights' bytes."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.aggregate import ArraySource
from shared.compress import (
    SCALE_SUFFIX,
    CompressError,
    DecodedSource,
    Encoding,
    decode_arrays,
    encode_delta,
    encoded_manifest,
    wire_ratio,
)
from shared.wire import Manifest, decode, encode, spec_of

BF16 = np.dtype(ml_dtypes.bfloat16)


def model(rng: np.random.Generator, dtype: np.dtype = np.dtype(np.float32)) -> dict[str, np.ndarray]:
    return {
        "emb.weight": rng.normal(0, 1, (37, 11)).astype(dtype),
        "head.bias": rng.normal(0, 1, (5,)).astype(dtype),
        "head.weight": rng.normal(0, 1, (5, 300)).astype(dtype),
        "steps": np.array([7, 9], np.int64),
    }


def manifest_of(arrays: dict[str, np.ndarray]) -> Manifest:
    return Manifest({n: spec_of(n, a) for n, a in arrays.items()})


def trained_from(base: dict[str, np.ndarray], rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {n: (a + rng.normal(0, 0.01, a.shape)).astype(a.dtype) if a.dtype.kind == "f" or a.dtype == BF16
            else a + 1 for n, a in base.items()}


def independent_int8(delta: np.ndarray, block: int) -> np.ndarray:
    """Block by block, as the encoding is defined: scale = max|x| / 127, q = rint(x / scale)."""
    flat = delta.astype(np.float32).reshape(-1)
    out = np.empty_like(flat)
    for start in range(0, flat.size, block):
        chunk = flat[start : start + block]
        scale = np.float32(np.abs(chunk).max() / np.float32(127))
        out[start : start + block] = 0 if scale == 0 else np.rint(chunk / scale).astype(np.int8) * scale
    return out.reshape(delta.shape)


@pytest.mark.parametrize("block", [1, 16, 256, 4096])
def test_int8_decodes_as_its_definition_says(block: int) -> None:
    rng = np.random.default_rng(block)
    base = model(rng)
    trained = trained_from(base, rng)
    encoded, _ = encode_delta(trained, base, Encoding("int8", block))
    assert encoded["head.weight"].dtype == np.int8
    assert encoded["head.weight" + SCALE_SUFFIX].shape == (-(-1500 // block),)
    decoded = decode_arrays(encoded, base, Encoding("int8", block))
    for name, ref in base.items():
        if ref.dtype.kind != "f":
            np.testing.assert_array_equal(decoded[name], trained[name])  # sent as its value
            continue
        want = ref + independent_int8(trained[name] - ref, block)
        np.testing.assert_allclose(decoded[name], want, rtol=0, atol=1e-6)
        # and the error is at most half a quantization step of each block
        step = np.abs(trained[name] - ref).max() / 127
        assert np.abs(decoded[name] - trained[name]).max() <= step / 2 + 1e-6


def test_bf16_delta_decodes_to_the_rounded_delta() -> None:
    rng = np.random.default_rng(1)
    base = model(rng)
    trained = trained_from(base, rng)
    encoded, lost = encode_delta(trained, base, Encoding("bf16"))
    decoded = decode_arrays(encoded, base, Encoding("bf16"))
    for name in ("emb.weight", "head.weight"):
        delta = trained[name] - base[name]
        np.testing.assert_array_equal(decoded[name], base[name] + delta.astype(BF16).astype(np.float32))
        np.testing.assert_allclose(lost[name], delta - delta.astype(BF16).astype(np.float32))


def test_error_feedback_carries_what_quantization_lost() -> None:
    """Summed over rounds, the decoded deltas track the true deltas to within one round's error."""
    sent_sum, true_sum, residual = rounds_of_error_feedback(Encoding("int8", 64), 20, seed=2)
    # what was sent plus what is still held back is exactly what was trained: nothing is lost for good
    np.testing.assert_allclose(sent_sum + residual, true_sum, atol=1e-5)
    assert np.abs(residual).max() <= np.abs(true_sum).max() / 100


def rounds_of_error_feedback(enc: Encoding, rounds: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`rounds` updates in `enc` from one global, each carrying the last one's residual: the decoded deltas of
    head.weight summed, the true deltas summed, and the residual left."""
    rng = np.random.default_rng(seed)
    base = model(rng)
    residual: dict[str, np.ndarray] | None = None
    true_sum = np.zeros_like(base["head.weight"])
    sent_sum = np.zeros_like(base["head.weight"])
    for _ in range(rounds):
        trained = trained_from(base, rng)
        encoded, residual = encode_delta(trained, base, enc, residual)
        sent_sum += decode_arrays(encoded, base, enc)["head.weight"] - base["head.weight"]
        true_sum += trained["head.weight"] - base["head.weight"]
    assert residual is not None
    return sent_sum, true_sum, residual["head.weight"]


@settings(max_examples=60, deadline=None)
@given(kind=st.sampled_from(["bf16", "int8"]), block=st.sampled_from([1, 3, 64, 256]),
       dtype=st.sampled_from(["float32", "bfloat16"]), begin=st.integers(0, 10_000), length=st.integers(0, 10_000))
def test_a_decoded_source_reads_any_range_as_the_decoded_files_bytes(kind: str, block: int, dtype: str,
                                                                    begin: int, length: int) -> None:
    rng = np.random.default_rng(block)
    base = model(rng, np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(np.float32))
    trained = trained_from(base, rng)
    enc = Encoding(kind, block)
    encoded, _ = encode_delta(trained, base, enc)
    manifest = manifest_of(base)
    assert manifest_of(encoded) == encoded_manifest(manifest, enc)
    assert_read_as_decoded(base, encoded, enc, begin, length)


def assert_read_as_decoded(base: dict[str, np.ndarray], encoded: dict[str, np.ndarray], enc: Encoding, begin: int,
                           length: int) -> None:
    """`DecodedSource` reads bytes [begin, begin + length) (clipped to the model) as the decoded weights' bytes."""
    manifest = manifest_of(base)
    decoded_bytes = ArraySource(manifest, decode_arrays(encoded, base, enc)).data
    source = DecodedSource(manifest, enc, ArraySource(manifest, base),
                           ArraySource(encoded_manifest(manifest, enc), encoded))
    begin = min(begin, manifest.nbytes)
    length = min(length, manifest.nbytes - begin)
    buf = bytearray(length)
    source.readinto(begin, memoryview(buf))
    assert bytes(buf) == bytes(decoded_bytes[begin : begin + length])


def test_an_encoded_file_is_a_canonical_safetensors_file_that_says_its_encoding() -> None:
    rng = np.random.default_rng(3)
    base = model(rng)
    enc = Encoding("int8", 128)
    encoded, _ = encode_delta(trained_from(base, rng), base, enc)
    arrays, header = decode(encode(encoded, enc.metadata()))
    assert Encoding.of_metadata(header.metadata) == enc
    assert encoded_manifest(manifest_of(base), enc).mismatch(header) is None
    assert Encoding.parse(str(enc)) == enc and Encoding.parse("") == Encoding()


def test_the_wire_ratio_is_what_the_encodings_promise() -> None:
    big = Manifest({"w": spec_of("w", np.zeros((4096, 1024), np.float32))})
    assert wire_ratio(big, Encoding("bf16")) == 0.5
    assert wire_ratio(big, Encoding("int8", 256)) == pytest.approx(0.25 + 1 / 256)
    assert wire_ratio(big, Encoding()) == 1.0


def test_bad_encodings_are_refused_with_the_reason() -> None:
    with pytest.raises(CompressError, match="unknown update encoding"):
        Encoding("int4")
    with pytest.raises(CompressError, match="quantization block"):
        Encoding("int8", 0)
    with pytest.raises(CompressError, match="fed.block"):
        Encoding.of_metadata({"fed.encoding": "int8", "fed.block": "x"})
    clash = Manifest({"w": spec_of("w", np.zeros(3, np.float32)), "w" + SCALE_SUFFIX: spec_of("s", np.zeros(1))})
    with pytest.raises(CompressError, match="reserved"):
        encoded_manifest(clash, Encoding("int8"))
