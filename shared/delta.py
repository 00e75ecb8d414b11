"""Compressed downloads: each round's global model offered as a compressed delta from the previous one.

With `download_encoding` bf16 or int8 the global model of round r + 1 is *defined* as

    G[r+1] = G[r] + decode(delta)      (float32 per float element, stored in the model's dtype)

where delta is what the round's aggregate (after any server optimizer) changes, G[r+1]' - G[r], encoded like
an update (`shared.compress`: bfloat16, or int8 codes with one float32 scale per block of `quant_block`
elements). So a participant holding G[r] rebuilds G[r+1] byte for byte from the delta, and anyone
recomputing the round (`fed verify`) gets the same bytes: the delta is exact by construction, not an
approximation of the stored model. What the encoding loses each round (the difference between the strategy's
aggregate and G[r+1]) is not carried over; the next round trains from G[r+1] as it is.

The delta is cut like the global model: one *delta piece* file per piece of G[r+1] (`shared.plan`), so each
shard worker writes the delta pieces of the pieces it computes. A delta piece is a canonical safetensors file:

    head    U8   the bytes of G[r+1]'s header inside the piece (piece 0, usually)
    others  U8   the piece's bytes of tensors that are not float (integer buffers), verbatim
    codes   BF16 or I8, one per float element of the piece (data order)
    scales  F32  int8 only: one per block of `quant_block` float elements, blocks counted from the piece's start

and the *delta index* (canonical JSON, at `keys.delta_key(run, r + 1, digest of G[r+1])`) lists, for every
piece, SHA-256 of G[r+1]'s piece and the digest of its delta piece file. The index authenticates itself:
combining its piece hashes must give G[r+1]'s digest, which the run state records; each rebuilt piece is
checked against its hash before the next is fetched.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from shared.compress import Encoding, dequantize, quantize
from shared.digest import combine
from shared.keys import DIGEST_PATTERN
from shared.plan import PieceLayout
from shared.wire import Manifest, WireError, bfloat16, decode, encode, header_length, parse_header_prefix

INDEX_SCHEMA = 1
MAX_INDEX_BYTES = 16 * 1024 * 1024  # ~120,000 pieces: a 1 TB model


class DeltaError(ValueError):
    """A delta index or piece that does not rebuild the model it names (the message says why)."""


def codes_of(step: np.ndarray, encoding: Encoding) -> tuple[np.ndarray, np.ndarray]:
    """`step` (float32, one per float element of a piece) encoded: codes and (int8) scales."""
    if encoding.kind == "bf16":
        return step.astype(bfloat16()), np.zeros(0, np.float32)
    if encoding.kind == "int8":
        return quantize(step, encoding.block)
    raise DeltaError(f"{encoding.kind} is not a delta encoding")


def applied(base: np.ndarray, codes: np.ndarray, scales: np.ndarray, encoding: Encoding) -> np.ndarray:
    """The next global's float elements: `base` (float32) plus the decoded codes, in float32. The one
    definition, used by the coordinator writing the model and the participant rebuilding it."""
    step = codes.astype(np.float32) if encoding.kind == "bf16" else dequantize(codes, scales, encoding.block)
    return np.asarray(np.add(base, step, dtype=np.float32))


def encode_delta_piece(layout: PieceLayout, encoding: Encoding, head: bytes, others: bytes, codes: np.ndarray,
                 scales: np.ndarray) -> bytes:
    tensors = {"head": np.frombuffer(head, np.uint8), "others": np.frombuffer(others, np.uint8), "codes": codes}
    if encoding.kind == "int8":
        tensors["scales"] = scales
    return encode(tensors, {"fed.kind": "global-delta", "fed.piece": str(layout.index)} | encoding.metadata())


@dataclass(frozen=True)
class DeltaPiece:
    head: np.ndarray
    others: np.ndarray
    codes: np.ndarray
    scales: np.ndarray


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
    if Encoding.of_metadata(meta) != encoding:
        raise DeltaError(f"delta piece {index} is in {Encoding.of_metadata(meta)}, the index says {encoding}")
    code_dtype = bfloat16() if encoding.kind == "bf16" else np.dtype(np.int8)
    wanted = {"head": np.dtype(np.uint8), "others": np.dtype(np.uint8), "codes": code_dtype}
    if encoding.kind == "int8":
        wanted["scales"] = np.dtype(np.float32)
    if set(arrays) != set(wanted) or any(arrays[k].dtype != t or arrays[k].ndim != 1 for k, t in wanted.items()):
        raise DeltaError(f"delta piece {index} does not hold {sorted(wanted)} as flat tensors of the right dtypes")
    return DeltaPiece(arrays["head"], arrays["others"], arrays["codes"], arrays.get("scales", np.zeros(0, np.float32)))


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
    if len(piece.codes) != layout.count or (encoding.kind == "int8"
                                           and len(piece.scales) != -(-layout.count // encoding.block)):
        raise DeltaError(f"delta piece {layout.index} holds {len(piece.codes)} codes and {len(piece.scales)} "
                         f"scales for {layout.count} float elements")
    out[: layout.in_header] = piece.head.tobytes()
    data = memoryview(out)[layout.in_header :]
    if data_bytes:
        base.readinto(layout.data_begin, data)
        with np.errstate(over="ignore"):
            values = applied(layout.gather_floats(data), piece.codes, piece.scales, encoding)
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
