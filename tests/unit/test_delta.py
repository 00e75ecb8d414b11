"""Compressed downloads (`shared.delta`): the global model a round writes is the previous one plus its decoded
delta, byte for byte as a participant rebuilds it from the delta pieces; the step it takes is the strategy's
within the encoding's error, computed independently; with topk what the delta does not send is carried by the
coordinator's error feedback, so over rounds the steps taken plus the feedback left are the steps asked for; and
a delta that does not rebuild the model is refused."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from shared.aggregate import ArraySource, MemoryState, WeightedInput, aggregate_round
from shared.compress import Encoding
from shared.config import parse_config
from shared.delta import DeltaError, DeltaIndex, decode_delta_piece, header_of, index_of, rebuild_piece
from shared.digest import PIECE_BYTES, digest, piece_hashes
from shared.plan import PiecePlan
from shared.server_opt import FEEDBACK, ServerStep
from shared.wire import Manifest, TensorSpec, decode, encode

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


def encoding_of(kind: str, block: int = 64) -> Encoding:
    return parse_config({"run_id": "delta-run", "download_encoding": kind, "quant_block": block}).download


def round_with(kind: str, strategy: str = "fedavg", block: int = 64) -> tuple[bytes, dict, list[dict], bytes, list]:
    config = parse_config({"run_id": "delta-run", "download_encoding": kind, "quant_block": block,
                           "strategy": strategy})
    rng = np.random.default_rng(3)
    base = model(rng)
    updates = [{k: (v + (rng.standard_normal(v.shape) * 0.01).astype(v.dtype)) if k != "steps" else v + 1
                for k, v in base.items()} for _ in range(3)]
    inputs = [WeightedInput(f"p{i}", 10 * (i + 1), "0" * 64, ArraySource(MANIFEST, u)) for i, u in enumerate(updates)]
    out = aggregate_round(config, MANIFEST, 1, inputs, ArraySource(MANIFEST, base))
    previous = encode(base, {"fed.kind": "global"})
    return out.model, base, updates, previous, list(out.delta_pieces)


@pytest.mark.parametrize("kind", ["int8", "bf16", "topk"])
@pytest.mark.parametrize("strategy", ["fedavg", "median"])
def test_a_participant_rebuilds_the_global_byte_for_byte(kind: str, strategy: str) -> None:
    written, base, updates, previous, pieces = round_with(kind, strategy)
    assert len(pieces) == PiecePlan.of(MANIFEST, {}).pieces == 2
    index = index_of(1, digest(written), digest(previous), encoding_of(kind), len(written), piece_hashes(written),
                     [digest(p) for p in pieces])
    again = DeltaIndex.decode(index.encode(), digest(written))
    assert rebuild(previous, again, pieces) == written
    ratio = sum(len(p) for p in pieces) / len(written)
    assert ratio < {"int8": 0.27, "bf16": 0.51, "topk": 0.013}[kind], ratio


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


def forged(piece: bytes, **changes: np.ndarray) -> bytes:
    """A delta piece file with some of its tensors replaced (its metadata kept)."""
    arrays, header = decode(piece)
    return encode({**arrays, **changes}, header.metadata)


def test_a_topk_piece_that_lies_is_refused() -> None:
    written, _, _, previous, pieces = round_with("topk")
    topk = encoding_of("topk")
    plan = PiecePlan.of(MANIFEST, decode(written)[1].metadata)
    layout = plan.layout(1)
    good = decode_delta_piece(pieces[1], 1, topk)
    assert rebuild_piece(layout, FileSource(previous), good, topk) == written[PIECE_BYTES:]
    arrays = decode(pieces[1])[0]
    positions, scales, codes = arrays["positions"], arrays["scales"], arrays["codes"]
    past = positions.copy()
    past[0] = topk.chunk  # outside its chunk
    backwards = positions.copy()
    backwards[[0, 1]] = backwards[[1, 0]]  # not ascending
    negative = scales.copy()
    negative[3] = -1.0
    stray = codes.copy()
    stray[topk.chunk_bytes - 1] |= 0xC0  # bits past the chunk's 82 two-bit codes (82 * 2 = 164 of 168 bits)
    lies = {"outside their chunk or not ascending": forged(pieces[1], positions=past),
            "not ascending": forged(pieces[1], positions=backwards),
            "negative or not finite": forged(pieces[1], scales=negative),
            "bits past": forged(pieces[1], codes=stray),
            f"{len(positions) - 1} positions; .* need": forged(pieces[1], positions=positions[:-1]),
            f"{len(scales) + 1} scales .* need": forged(pieces[1], scales=np.append(scales, np.float32(1)))}
    for reason, data in lies.items():
        with pytest.raises(DeltaError, match=reason):
            rebuild_piece(layout, FileSource(previous), decode_delta_piece(data, 1, topk), topk)
    with pytest.raises(DeltaError, match="right dtypes"):
        decode_delta_piece(forged(pieces[1], positions=positions.astype(np.int32)), 1, topk)
    with pytest.raises(DeltaError, match="right dtypes"):
        decode_delta_piece(encode({k: v for k, v in arrays.items() if k != "positions"},
                                  decode(pieces[1])[1].metadata), 1, topk)
    with pytest.raises(DeltaError, match="the index says"):  # another k
        decode_delta_piece(pieces[1], 1, Encoding("topk", bits=topk.bits, chunk=topk.chunk, keep=topk.keep + 1))


def feedback_of(config_step: ServerStep, state: MemoryState) -> dict[str, np.ndarray]:
    """The feedback slot, per float tensor (the state holds the model's float elements in data order)."""
    plan = PiecePlan.of(MANIFEST, {})
    flat = state.load(0, plan.float_count)[FEEDBACK]
    return {name: flat[plan.floats_before(a) : plan.floats_before(a) + MANIFEST.tensors[name].numel]
            for name, (a, _) in MANIFEST.layout().items() if name != "steps"}


def test_the_coordinators_feedback_carries_what_topk_does_not_send() -> None:
    # Given a run with topk downloads and no server optimizer: the state is the feedback alone
    config = parse_config({"run_id": "delta-run", "download_encoding": "topk", "strategy": "fedavg"})
    step = ServerStep.of(config)
    assert step is not None and step.slots == (FEEDBACK,) and step.rule.identity
    rng = np.random.default_rng(5)
    g = model(rng)
    first = {k: v.astype(np.float64) for k, v in g.items()}
    asked = {name: np.zeros(v.size) for name, v in g.items() if name != "steps"}
    state: MemoryState | None = None
    weights = np.array([10, 20, 30]) / 60
    for r in range(4):
        # When each round's updates ask for a change (the last asks for none at all)
        scale = 0.0 if r == 3 else 0.01
        updates = [{k: (v + (rng.standard_normal(v.shape) * scale).astype(v.dtype)) if k != "steps" else v
                    for k, v in g.items()} for _ in range(3)]
        inputs = [WeightedInput(f"p{i}", 10 * (i + 1), "0" * 64, ArraySource(MANIFEST, u))
                  for i, u in enumerate(updates)]
        out = aggregate_round(config, MANIFEST, r + 1, inputs, ArraySource(MANIFEST, g), state)
        assert sum(len(p) for p in out.delta_pieces) < 0.013 * len(out.model)
        for name in asked:
            target = sum(w * u[name].astype(np.float64) for w, u in zip(weights, updates, strict=True))
            asked[name] += (target - g[name].astype(np.float64)).reshape(-1)
        new = decode(out.model)[0]
        moved = np.count_nonzero(new["a.weight"] != g["a.weight"]) / BIG
        # Then each round moves about topk_percent of the elements, the round asking for nothing too (it sends
        # the feedback carried from earlier rounds)
        assert 0.015 < moved < 0.025, (r, moved)
        state, g = MemoryState.of(step, out), new
    assert state is not None
    # And the steps taken plus the feedback left add up to the steps asked for (in the model's dtype, bf16 too)
    left = feedback_of(step, state)
    for name, want in asked.items():
        taken = (g[name].astype(np.float64) - first[name]).reshape(-1)
        np.testing.assert_allclose(taken + left[name], want, atol=2e-6, err_msg=name)
        assert np.abs(left[name]).max() > 0.01  # most of the change is still to be sent


def test_topk_downloads_keep_a_server_optimizers_state_beside_the_feedback() -> None:
    config = parse_config({"run_id": "delta-run", "download_encoding": "topk", "server_optimizer": "diloco"})
    step = ServerStep.of(config)
    assert step is not None and step.slots == ("m", FEEDBACK)
    assert ServerStep.of(parse_config({"run_id": "delta-run", "download_encoding": "int8"})) is None
    rng = np.random.default_rng(8)
    base = model(rng)
    upd = {k: (v + (rng.standard_normal(v.shape) * 0.01).astype(v.dtype)) if k != "steps" else v
           for k, v in base.items()}
    out = aggregate_round(config, MANIFEST, 1, [WeightedInput("p0", 10, "0" * 64, ArraySource(MANIFEST, upd))],
                          ArraySource(MANIFEST, base))
    previous = encode(base, {"fed.kind": "global"})
    index = index_of(1, digest(out.model), digest(previous), config.download, len(out.model),
                     piece_hashes(out.model), [digest(p) for p in out.delta_pieces])
    assert rebuild(previous, index, list(out.delta_pieces)) == out.model
    plan = PiecePlan.of(MANIFEST, {})
    held = MemoryState.of(step, out).load(0, plan.float_count)
    # diloco's first step is x - lr (1 + mu) g; the feedback is that step less what the download sent
    g = (base["a.weight"] - upd["a.weight"]).astype(np.float32)
    np.testing.assert_allclose(held["m"][:BIG], g, rtol=1e-6)
    sent = decode(out.model)[0]["a.weight"] - base["a.weight"]
    np.testing.assert_allclose(held[FEEDBACK][:BIG] + sent, -0.7 * 1.9 * g, rtol=1e-4, atol=1e-6)


def test_topk_downloads_with_fragments_are_refused_with_the_reason() -> None:
    with pytest.raises(ValueError, match="feedback would go on changing"):
        parse_config({"run_id": "delta-run", "download_encoding": "topk", "fragments": 2, "update_encoding": "int8"})
    parse_config({"run_id": "delta-run", "download_encoding": "int8", "fragments": 2, "update_encoding": "int8"})
