"""Compressed downloads (`shared.delta`): the global model a round writes is the previous one plus its decoded
delta, byte for byte as a participant rebuilds it from the delta pieces; the step it takes is the strategy's
within the encoding's error, computed independently; and a delta that does not rebuild the model is refused."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from shared.aggregate import ArraySource, WeightedInput, aggregate_round
from shared.compress import Encoding
from shared.config import parse_config
from shared.delta import DeltaError, DeltaIndex, decode_delta_piece, header_of, index_of, rebuild_piece
from shared.digest import PIECE_BYTES, digest, piece_hashes
from shared.plan import PiecePlan
from shared.wire import Manifest, TensorSpec, decode

BIG = PIECE_BYTES // 4 + 300_000  # the model spans two pieces, a float32 tensor crossing the boundary
MANIFEST = Manifest({
    "a.weight": TensorSpec("F32", (BIG,)),
    "b.bias": TensorSpec("F32", (7, 3)),
    "steps": TensorSpec("I64", (2,)),
    "c.half": TensorSpec("BF16", (1000,)),
})


def model(rng: np.random.Generator, steps: tuple[int, int] = (5, 9)) -> dict[str, np.ndarray]:
    return {
        "a.weight": rng.standard_normal(BIG).astype(np.float32),
        "b.bias": rng.standard_normal((7, 3)).astype(np.float32),
        "steps": np.array(steps, np.int64),
        "c.half": rng.standard_normal(1000).astype(ml_dtypes.bfloat16),
    }


class FileSource:
    """A model file read by data-section range, as a participant reads its cached previous global."""

    def __init__(self, data: bytes) -> None:
        self.data, self.offset = data, decode(data)[1].data_offset

    def readinto(self, begin: int, buf: memoryview) -> None:
        got = self.data[self.offset + begin : self.offset + begin + len(buf)]
        assert len(got) == len(buf)
        buf[:] = got


def rebuild(previous: bytes, index: DeltaIndex, pieces: list[bytes]) -> bytes:
    """What a participant does: header from the pieces' heads, then each piece from the previous model."""
    source, heads, out = FileSource(previous), b"", []
    plan: PiecePlan | None = None
    for i, data in enumerate(pieces):
        assert digest(data) == index.pieces[i]
        piece = decode_delta_piece(data, i, index.encoding)
        heads += piece.head.tobytes()
        if plan is None and (found := header_of(heads, index.size)) is not None:
            plan = PiecePlan(found[1], found[0])
        assert plan is not None
        out.append(bytes(rebuild_piece(plan.layout(i), source, piece, index.encoding)))
    return b"".join(out)


def round_with(kind: str, strategy: str = "fedavg", block: int = 64) -> tuple[bytes, dict, list[dict], bytes, list]:
    config = parse_config({"run_id": "delta-run", "download_encoding": kind, "quant_block": block,
                           "strategy": strategy})
    rng = np.random.default_rng(3)
    base = model(rng)
    updates = [{k: (v + (rng.standard_normal(v.shape) * 0.01).astype(v.dtype)) if k != "steps" else v + 1
                for k, v in base.items()} for _ in range(3)]
    inputs = [WeightedInput(f"p{i}", 10 * (i + 1), "0" * 64, ArraySource(MANIFEST, u)) for i, u in enumerate(updates)]
    out = aggregate_round(config, MANIFEST, 1, inputs, ArraySource(MANIFEST, base))
    from shared.wire import encode
    previous = encode(base, {"fed.kind": "global"})
    return out.model, base, updates, previous, list(out.delta_pieces)


@pytest.mark.parametrize("kind", ["int8", "bf16"])
@pytest.mark.parametrize("strategy", ["fedavg", "median"])
def test_a_participant_rebuilds_the_global_byte_for_byte(kind: str, strategy: str) -> None:
    written, base, updates, previous, pieces = round_with(kind, strategy)
    assert len(pieces) == PiecePlan.of(MANIFEST, {}).pieces == 2
    index = index_of(1, digest(written), digest(previous), Encoding(kind, 64), len(written), piece_hashes(written),
                     [digest(p) for p in pieces])
    again = DeltaIndex.decode(index.encode(), digest(written))
    assert rebuild(previous, again, pieces) == written
    ratio = sum(len(p) for p in pieces) / len(written)
    assert ratio < (0.27 if kind == "int8" else 0.51), ratio


def test_the_step_is_the_strategys_within_the_encodings_error() -> None:
    written, base, updates, _, _ = round_with("int8")
    got, _ = decode(written)
    weights = np.array([10, 20, 30]) / 60
    for name in ("a.weight", "b.bias", "c.half"):
        exact = sum(w * u[name].astype(np.float64) for w, u in zip(weights, updates, strict=True))
        step = exact - base[name].astype(np.float64)
        err = got[name].astype(np.float64) - exact
        # int8 per block of 64: at most half a code of the block's largest step (plus bf16 rounding of the sum)
        bound = np.abs(step).max() / 127 * 0.5 + (np.abs(exact).max() * 2.0**-8 if name == "c.half" else 1e-6)
        assert np.abs(err).max() <= bound, name
        assert np.linalg.norm(err) < 0.02 * np.linalg.norm(step) or name == "c.half", name
    assert got["steps"].tolist() == [6, 10]  # integer tensors exact (from the first input, as without a delta)


def test_without_a_delta_encoding_nothing_changes() -> None:
    config = parse_config({"run_id": "delta-run"})
    rng = np.random.default_rng(3)
    base, upd = model(rng), model(rng)
    inputs = [WeightedInput("p0", 10, "0" * 64, ArraySource(MANIFEST, upd))]
    out = aggregate_round(config, MANIFEST, 1, inputs, ArraySource(MANIFEST, base))
    assert out.delta_pieces == () and decode(out.model)[0]["a.weight"].tobytes() == upd["a.weight"].tobytes()


def test_an_index_that_does_not_rebuild_its_model_is_refused() -> None:
    written, _, _, previous, pieces = round_with("int8")
    hashes = piece_hashes(written)
    good = index_of(1, digest(written), digest(previous), Encoding("int8", 64), len(written), hashes,
                    [digest(p) for p in pieces])
    with pytest.raises(DeltaError, match="does not rebuild"):
        DeltaIndex.decode(good.encode(), "f" * 64)
    forged = index_of(1, digest(written), digest(previous), Encoding("int8", 64), len(written),
                      [hashes[1], hashes[0]], [digest(p) for p in pieces])
    with pytest.raises(DeltaError, match="does not rebuild"):
        DeltaIndex.decode(forged.encode(), digest(written))
    with pytest.raises(DeltaError, match="not the JSON"):
        DeltaIndex.decode(b"{", digest(written))
    with pytest.raises(DeltaError, match="piece 1"):
        decode_delta_piece(pieces[0], 1, Encoding("int8", 64))
    with pytest.raises(DeltaError, match="in int8/64"):
        decode_delta_piece(pieces[0], 0, Encoding("int8", 32))
