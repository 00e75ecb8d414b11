"""Compressed downloads: each round's global model offered as a compressed delta from the previous one.

With `download_encoding` bf16, int8 or topk the global model of round r + 1 is *defined* as

    G[r+1] = G[r] + decode(delta)      (float32 per float element, stored in the model's dtype)

where delta is what the round's aggregate (after any server optimizer) changes, G[r+1]' - G[r], encoded like
an update (`shared.compress`: bfloat16, int8 codes with one float32 scale per block of `quant_block`
elements, or topk's largest entries of each chunk at 2 or 4 bits). So a participant holding G[r] rebuilds
G[r+1] byte for byte from the delta, and anyone recomputing the round (`fed verify`) gets the same bytes: the
delta is exact by construction, not an approximation of the stored model. With bf16 and int8 what the encoding
loses each round (the difference between the strategy's aggregate and G[r+1]) is not carried over; the next
round trains from G[r+1] as it is. topk sends only a few per cent of each change, so the coordinator keeps the
rest as error feedback e, a slot of the server optimizer state (`shared.server_opt.FEEDBACK`): the delta encodes
s = G[r+1]' - G[r] + e, and e becomes s - (G[r+1] - G[r]), what the stored model did not take of it.

The delta is cut like the global model: one *delta piece* file per piece of G[r+1] (`shared.plan`), so each
shard worker writes the delta pieces of the pieces it computes. A delta piece is a canonical safetensors file:

    head       U8   the bytes of G[r+1]'s header inside the piece (piece 0, usually)
    others     U8   the piece's bytes of tensors that are not float (integer buffers), verbatim
    codes      BF16 or I8, one per float element of the piece (data order); topk: U8, each chunk's packed codes
    scales     F32  int8: one per block of `quant_block` float elements; topk: one step per chunk of `topk_chunk`
    positions  I16  topk only: each chunk's kept positions within the chunk, ascending

Blocks and chunks are counted from the piece's start: topk encodes the piece's float elements as one flat
tensor (`shared.compress.topk_encode`) in that order.

and the *delta index* (canonical JSON, at `keys.delta_key(run, r + 1, digest of G[r+1])`) lists, for every
piece, SHA-256 of G[r+1]'s piece and the digest of its delta piece file. The index authenticates itself:
combining its piece hashes must give G[r+1]'s digest, which the run state records; each rebuilt piece is
checked against its hash before the next is fetched.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from shared.compress import (
    CompressError,
    Encoding,
    blocks,
    dequantize,
    kept_before,
    quantize,
    topk_dense,
    topk_encode,
)
from shared.digest import PIECE_BYTES, combine
from shared.keys import DIGEST_PATTERN
from shared.plan import PieceLayout
from shared.wire import (
    FLOAT_TAGS,
    ITEMSIZE,
    Manifest,
    WireError,
    bfloat16,
    decode,
    encode,
    header_length,
    parse_header_prefix,
)

INDEX_SCHEMA = 1
MAX_INDEX_BYTES = 16 * 1024 * 1024  # ~120,000 pieces: a 1 TB model
EMPTY_F32 = np.zeros(0, np.float32)
EMPTY_I16 = np.zeros(0, np.int16)


class DeltaError(ValueError):
    """A delta index or piece that does not rebuild the model it names (the message says why)."""


@dataclass(frozen=True)
class Codes:
    """A piece's step encoded: `codes` (bf16 and int8: one per float element; topk: each chunk's packed codes),
    `scales` (int8: one per block; topk: one step per chunk; bf16: none) and `positions` (topk only)."""

    codes: np.ndarray
    scales: np.ndarray = field(default_factory=lambda: EMPTY_F32)
    positions: np.ndarray = field(default_factory=lambda: EMPTY_I16)


def codes_of(step: np.ndarray, encoding: Encoding) -> Codes:
    """`step` (float32, one per float element of a piece, in data order) encoded."""
    if encoding.kind == "bf16":
        return Codes(step.astype(bfloat16()))
    if encoding.kind == "int8":
        codes, scales = quantize(step, encoding.block)
        return Codes(codes, scales)
    if encoding.kind == "topk":
        packed, positions, steps, _ = topk_encode(np.ascontiguousarray(step, np.float32), encoding)
        return Codes(packed, steps, positions)
    raise DeltaError(f"{encoding.kind} is not a delta encoding")


def step_of(codes: Codes, count: int, encoding: Encoding) -> np.ndarray:
    """The step `codes` stand for: float32, one per of the piece's `count` float elements. Raises DeltaError
    for codes that are not what `codes_of` writes for `count` elements (sizes, and topk's positions, bits and
    steps)."""
    if encoding.kind == "topk":
        chunks = blocks(count, encoding.chunk)
        sizes = (chunks * encoding.chunk_bytes, chunks, kept_before(count, chunks, encoding))
    else:
        sizes = (count, blocks(count, encoding.block) if encoding.kind == "int8" else 0, 0)
    if (len(codes.codes), len(codes.scales), len(codes.positions)) != sizes:
        raise DeltaError(f"the delta holds {len(codes.codes)} codes, {len(codes.scales)} scales and "
                         f"{len(codes.positions)} positions; {count} float elements in {encoding} need "
                         f"{sizes[0]}, {sizes[1]} and {sizes[2]}")
    if encoding.kind == "bf16":
        return codes.codes.astype(np.float32)
    if encoding.kind == "int8":
        return dequantize(codes.codes, codes.scales, encoding.block)
    try:
        return topk_dense(count, codes.codes, codes.positions, codes.scales, encoding)
    except CompressError as exc:
        raise DeltaError(f"the delta's {exc}") from None


def applied(base: np.ndarray, codes: Codes, encoding: Encoding) -> np.ndarray:
    """The next global's float elements: `base` (float32) plus the decoded codes, in float32. The one
    definition, used by the coordinator writing the model and the participant rebuilding it."""
    return np.asarray(np.add(base, step_of(codes, base.size, encoding), dtype=np.float32))


def max_piece_file_bytes(encoding: Encoding) -> int:
    """The largest delta piece file a piece of the model makes in `encoding`: its header and non-float bytes (at
    most the piece), the codes of the most float elements a piece holds (of the narrowest float dtype), and the
    file's own header."""
    floats = PIECE_BYTES // min(ITEMSIZE[t] for t in FLOAT_TAGS)
    if encoding.kind == "topk":
        chunks = blocks(floats, encoding.chunk)
        codes = chunks * (encoding.chunk_bytes + 4) + 2 * kept_before(floats, chunks, encoding)
    elif encoding.kind == "int8":
        codes = floats + 4 * blocks(floats, encoding.block)
    else:
        codes = 2 * floats
    return PIECE_BYTES + codes + 64 * 1024


def encode_delta_piece(layout: PieceLayout, encoding: Encoding, head: bytes, others: bytes, codes: Codes) -> bytes:
    tensors = {"head": np.frombuffer(head, np.uint8), "others": np.frombuffer(others, np.uint8),
               "codes": codes.codes}
    if encoding.kind in ("int8", "topk"):
        tensors["scales"] = codes.scales
    if encoding.kind == "topk":
        tensors["positions"] = codes.positions
    return encode(tensors, {"fed.kind": "global-delta", "fed.piece": str(layout.index)} | encoding.metadata())


@dataclass(frozen=True)
class DeltaPiece:
    head: np.ndarray
    others: np.ndarray
    codes: Codes


def decode_delta_piece(data: bytes, index: int, encoding: Encoding) -> DeltaPiece:
    """A delta piece file's parts, checked for the shape of piece `index` in `encoding` (sizes against the
    piece are checked when it is applied)."""
    try:
        arrays, header = decode(data)
    except WireError as exc:
        raise DeltaError(f"delta piece {index}: {exc}") from None
    meta = header.metadata
    if meta.get("fed.kind") != "global-delta" or meta.get("fed.piece") != str(index):
        raise DeltaError(f"delta piece {index}: the file is {meta.get('fed.kind')!r} piece {meta.get('fed.piece')!r}")
    try:
        said = Encoding.of_metadata(meta)
    except CompressError as exc:
        raise DeltaError(f"delta piece {index}: {exc}") from None
    if said != encoding:
        raise DeltaError(f"delta piece {index} is in {said}, the index says {encoding}")
    code_dtype = {"bf16": bfloat16(), "int8": np.dtype(np.int8), "topk": np.dtype(np.uint8)}[encoding.kind]
    wanted = {"head": np.dtype(np.uint8), "others": np.dtype(np.uint8), "codes": code_dtype}
    if encoding.kind in ("int8", "topk"):
        wanted["scales"] = np.dtype(np.float32)
    if encoding.kind == "topk":
        wanted["positions"] = np.dtype(np.int16)
    if set(arrays) != set(wanted) or any(arrays[k].dtype != t or arrays[k].ndim != 1 for k, t in wanted.items()):
        raise DeltaError(f"delta piece {index} does not hold {sorted(wanted)} as flat tensors of the right dtypes")
    return DeltaPiece(arrays["head"], arrays["others"], Codes(arrays["codes"], arrays.get("scales", EMPTY_F32),
                                                              arrays.get("positions", EMPTY_I16)))


class _Ranged(Protocol):
    def readinto(self, begin: int, buf: memoryview) -> None: ...


def rebuild_piece(layout: PieceLayout, base: _Ranged, piece: DeltaPiece, encoding: Encoding) -> bytearray:
    """Piece `layout.index` of the next global model from the previous one (`base`, read by data-section range)
    and the piece's delta."""
    data_bytes = layout.data_bytes
    out = bytearray(layout.in_header + data_bytes)
    if len(piece.head) != layout.in_header or len(piece.others) != layout.others_bytes:
        raise DeltaError(f"delta piece {layout.index} holds {len(piece.head)} header and {len(piece.others)} other "
                         f"bytes, the piece has {layout.in_header} and {layout.others_bytes}")
    out[: layout.in_header] = piece.head.tobytes()
    data = memoryview(out)[layout.in_header :]
    if data_bytes:
        base.readinto(layout.data_begin, data)
    try:
        with np.errstate(over="ignore"):
            values = applied(layout.gather_floats(data), piece.codes, encoding)
    except DeltaError as exc:
        raise DeltaError(f"delta piece {layout.index}: {exc}") from None
    if data_bytes:
        if not np.isfinite(values).all():
            raise DeltaError(f"delta piece {layout.index} decodes to non-finite values")
        layout.scatter_floats(data, values)
        layout.scatter_others(data, piece.others.tobytes())
    return out


def header_of(prefix: bytes, size: int) -> tuple[bytes, Manifest] | None:
    """The model's header and manifest once `prefix` (its first bytes, from the delta pieces' heads) holds all
    of it; None while it does not."""
    if len(prefix) < 8:
        return None
    try:
        need = 8 + header_length(prefix[:8], size)
        if len(prefix) < need:
            return None
        return prefix[:need], Manifest.of(parse_header_prefix(prefix[:need], size))
    except WireError as exc:
        raise DeltaError(f"the delta's header: {exc}") from None


# --- the index ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class DeltaIndex:
    round: int  # of the model it rebuilds
    model: str  # that model's digest
    base: str  # the digest of the model it applies to (the previous round's global)
    encoding: Encoding
    size: int  # bytes of the model it rebuilds
    hashes: tuple[str, ...]  # SHA-256 of each piece of that model (hex)
    pieces: tuple[str, ...]  # the digest of each delta piece file

    def encode(self) -> bytes:
        body = {"schema": INDEX_SCHEMA, "kind": "global-delta", "round": self.round, "model": self.model,
                "base": self.base, "encoding": str(self.encoding), "size": self.size,
                "pieces": [[h, d] for h, d in zip(self.hashes, self.pieces, strict=True)]}
        return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes, model: str) -> DeltaIndex:
        """The index of a delta that rebuilds the model of digest `model`, checked to be exactly that."""
        try:
            body: dict[str, Any] = json.loads(data)
            pieces = body["pieces"]
            index = cls(int(body["round"]), str(body["model"]), str(body["base"]), Encoding.parse(body["encoding"]),
                        int(body["size"]), tuple(str(h) for h, _ in pieces), tuple(str(d) for _, d in pieces))
        except (ValueError, KeyError, TypeError):
            raise DeltaError("the delta index is not the JSON the coordinator writes") from None
        names = (index.model, index.base, *index.hashes, *index.pieces)
        if not all(DIGEST_PATTERN.fullmatch(d) for d in names) or not index.encoding.is_delta:
            raise DeltaError("the delta index names something other than digests, or no delta encoding")
        if index.model != model or combine(bytes.fromhex(h) for h in index.hashes) != model:
            raise DeltaError(f"the delta index does not rebuild model {model[:12]}")
        return index


def index_of(round_no: int, model: str, base: str, encoding: Encoding, size: int, hashes: Sequence[bytes],
             pieces: Sequence[str]) -> DeltaIndex:
    return DeltaIndex(round_no, model, base, encoding, size, tuple(h.hex() for h in hashes), tuple(pieces))
