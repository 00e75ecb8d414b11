"""Compressed updates: what a participant sends instead of its trained weights, and how it is read back.

An update is sent in one of four encodings (`RunConfig.update_encoding`):

    weights  the trained weights, in the model's own dtypes (the default; nothing to decode)
    bf16     the delta from the round's global model (trained - global, computed in float32), as bfloat16
    int8     that delta quantized per block of `quant_block` consecutive elements of each tensor: for tensor
             `name`, an I8 tensor `name` of the same shape, q = rint(delta / scale), and an F32 tensor
             `name + SCALE_SUFFIX` holding one scale per block, scale = max|delta in the block| / 127
    topk     that delta cut into chunks of `chunk` consecutive elements, of which only the `keep` largest in
             magnitude are sent (as in SparseLoCo), each quantized to `bits` (2 or 4) bits. For tensor `name` of
             n elements, C = ceil(n / chunk) chunks, chunk c keeping k_c = keep entries (a shorter last chunk of
             L elements the same share, ceil(L * keep / chunk)):
               `name + INDEX_SUFFIX`  I16, sum of k_c: each chunk's kept positions within the chunk, ascending
               `name`                 U8, C * ceil(keep * bits / 8): each chunk's codes, packed low bits first,
                                      the bits after its k_c codes zero
               `name + SCALE_SUFFIX`  F32, C: each chunk's step s; code q stands for (q - h) * s, h = (2^bits - 1)/2
                                      (the encoder fits s to the chunk's values: `fitted_step`)
             Every chunk's entries sit at a place its number alone gives, so any range of a tensor is decoded
             from its chunks' bytes alone (`DecodedSource`), never the whole tensor. About 0.046 bytes a parameter
             at 2 % and 2 bits (fp32: 4).

Only float tensors are encoded; any other tensor (an integer buffer) is sent as its trained value in its own
dtype. An encoded file is still a canonical safetensors file (`shared.wire`) whose manifest is
`encoded_manifest(model manifest, encoding)`, and names its encoding in its metadata (`fed.encoding`,
`fed.block`). Decoding adds the delta to the global model in float32 and stores the sum in the model's dtype.

`DecodedSource` reads an encoded update as if it were the trained weights, by byte range of the model's data
section (`shared.aggregate.RangeSource`): so every strategy, the shard workers, verification and the witnesses
work on encoded updates unchanged, in the same bounded memory.

Participants keep what quantization lost and add it to the next round's delta (error feedback, as in EF-SGD
and DiLoCo's compressed outer steps): `encode_delta` returns it.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from shared.wire import FLOAT_TAGS, ITEMSIZE, Manifest, TensorSpec, bfloat16, is_float, tensor_view

SCALE_SUFFIX = ".__scale__"
INDEX_SUFFIX = ".__index__"
ENCODINGS = ("weights", "bf16", "int8", "topk")
DEFAULT_BLOCK = 256
INT8_MAX = 127.0
TOPK_BITS = (2, 4)
DEFAULT_CHUNK = 4096
DEFAULT_KEEP = 82  # 2 % of a chunk of 4096
MAX_CHUNK = 1 << 15  # positions within a chunk are I16
LLOYD_ROUNDS = 4  # fitting a topk chunk's step (`fitted_step`)
COALESCE_GAP = 64 * 1024  # encoded byte spans closer than this are read in one request


class CompressError(ValueError):
    """An encoding that cannot be used (the message says why)."""


@dataclass(frozen=True)
class Encoding:
    kind: str = "weights"
    block: int = DEFAULT_BLOCK  # int8 only
    bits: int = 2  # topk only: bits per kept value
    chunk: int = DEFAULT_CHUNK  # topk only: elements per chunk
    keep: int = DEFAULT_KEEP  # topk only: entries kept per chunk

    def __post_init__(self) -> None:
        if self.kind not in ENCODINGS:
            raise CompressError(f"unknown update encoding {self.kind!r}: one of {', '.join(ENCODINGS)}")
        # (parameters mean nothing to other encodings: encodings that differ only by them are equal)
        if self.kind != "int8":
            object.__setattr__(self, "block", DEFAULT_BLOCK)
        elif not 1 <= self.block <= 1 << 20:
            raise CompressError(f"quantization block must be 1 to {1 << 20} elements, got {self.block}")
        if self.kind != "topk":
            object.__setattr__(self, "bits", 2)
            object.__setattr__(self, "chunk", DEFAULT_CHUNK)
            object.__setattr__(self, "keep", DEFAULT_KEEP)
            return
        if self.bits not in TOPK_BITS:
            raise CompressError(f"topk values are 2 or 4 bits, got {self.bits}")
        if not 1 <= self.chunk <= MAX_CHUNK:
            raise CompressError(f"a topk chunk is 1 to {MAX_CHUNK} elements, got {self.chunk}")
        if not 1 <= self.keep <= self.chunk:
            raise CompressError(f"a topk chunk keeps 1 to {self.chunk} entries (its size), got {self.keep}")

    @classmethod
    def topk(cls, percent: float, bits: int = 2, chunk: int = DEFAULT_CHUNK) -> Encoding:
        """Keeping `percent` % of each chunk (rounded up: at least one entry)."""
        return cls("topk", bits=bits, chunk=chunk, keep=max(1, min(chunk, math.ceil(chunk * percent / 100 - 1e-9))))

    @property
    def is_delta(self) -> bool:
        return self.kind != "weights"

    @property
    def levels_half(self) -> float:
        """h: a topk code q stands for (q - h) * step."""
        return ((1 << self.bits) - 1) / 2

    @property
    def chunk_bytes(self) -> int:
        """Packed value bytes per topk chunk."""
        return -(-self.keep * self.bits // 8)

    def metadata(self) -> dict[str, str]:
        """What an encoded file says about itself (nothing for plain weights)."""
        if not self.is_delta:
            return {}
        if self.kind == "topk":
            return {"fed.encoding": "topk", "fed.bits": str(self.bits), "fed.chunk": str(self.chunk),
                    "fed.keep": str(self.keep)}
        return {"fed.encoding": self.kind} | ({"fed.block": str(self.block)} if self.kind == "int8" else {})

    @classmethod
    def of_metadata(cls, metadata: dict[str, str]) -> Encoding:
        kind = metadata.get("fed.encoding", "weights")
        numbers = {"block": DEFAULT_BLOCK, "bits": 2, "chunk": DEFAULT_CHUNK, "keep": DEFAULT_KEEP}
        for name in numbers:
            text = metadata.get(f"fed.{name}")
            if text is None:
                continue
            if not (text.isascii() and text.isdigit() and len(text) <= 9):
                raise CompressError(f"malformed metadata: fed.{name} must be an integer, got {text[:40]!r}")
            numbers[name] = int(text)
        return cls(kind, **numbers)

    def __str__(self) -> str:
        if self.kind == "topk":
            return f"topk/{self.bits}/{self.chunk}/{self.keep}"
        return f"int8/{self.block}" if self.kind == "int8" else self.kind

    @classmethod
    def parse(cls, text: str) -> Encoding:
        """The inverse of str(): "weights", "bf16", "int8/256", "topk/2/4096/82" ("" is "weights")."""
        kind, *numbers = (text or "weights").split("/")
        try:
            values = [int(n) for n in numbers]
        except ValueError:
            raise CompressError(f"malformed encoding {text!r}") from None
        if kind == "topk":
            if len(values) != 3:
                raise CompressError(f"malformed encoding {text!r}: topk/<bits>/<chunk>/<keep>")
            return cls("topk", bits=values[0], chunk=values[1], keep=values[2])
        return cls(kind, values[0] if values else DEFAULT_BLOCK)


def blocks(numel: int, block: int) -> int:
    return -(-numel // block)


def short_keep(length: int, encoding: Encoding) -> int:
    """Entries a tensor's last chunk keeps when it is `length` < chunk elements long: the same share, rounded up."""
    return min(length, max(1, -(-length * encoding.keep // encoding.chunk))) if length else 0


def kept_before(numel: int, chunk: int, encoding: Encoding) -> int:
    """Entries a topk tensor of `numel` elements keeps in its chunks before chunk number `chunk`."""
    whole = min(chunk, numel // encoding.chunk)  # chunks of full length among them
    rest = short_keep(numel - whole * encoding.chunk, encoding) if chunk > whole else 0
    return whole * encoding.keep + rest


def encoded_manifest(manifest: Manifest, encoding: Encoding, only: frozenset[str] | None = None) -> Manifest:
    """What a file in `encoding` holds for a model of `manifest` — of its tensors `only` (a Streaming DiLoCo
    fragment, `shared.fragments`: the others' deltas are zero and not sent), or of all of them (None)."""
    if only is not None:
        if not encoding.is_delta:
            raise CompressError("a fragment is sent as its delta: weights cannot leave tensors out")
        manifest = Manifest({n: s for n, s in manifest.tensors.items() if n in only})
    if not encoding.is_delta:
        return manifest
    for suffix in (SCALE_SUFFIX, INDEX_SUFFIX):
        if clash := sorted(n for n in manifest.tensors if n.endswith(suffix)):
            raise CompressError(f"tensor name {clash[0]!r} ends in {suffix!r}, reserved for compressed updates")
    tensors: dict[str, TensorSpec] = {}
    for name, spec in manifest.tensors.items():
        if spec.dtype not in FLOAT_TAGS:
            tensors[name] = spec
        elif encoding.kind == "bf16":
            tensors[name] = TensorSpec("BF16", spec.shape)
        elif encoding.kind == "int8":
            tensors[name] = TensorSpec("I8", spec.shape)
            tensors[name + SCALE_SUFFIX] = TensorSpec("F32", (blocks(spec.numel, encoding.block),))
        else:
            count = blocks(spec.numel, encoding.chunk)
            tensors[name] = TensorSpec("U8", (count * encoding.chunk_bytes,))
            tensors[name + INDEX_SUFFIX] = TensorSpec("I16", (kept_before(spec.numel, count, encoding),))
            tensors[name + SCALE_SUFFIX] = TensorSpec("F32", (count,))
    return Manifest(tensors)


# --- encoding (participants) ------------------------------------------------------------------------


def quantize(delta: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """int8 codes (the shape of `delta`) and one float32 scale per block of the flattened tensor."""
    flat = np.ascontiguousarray(delta, np.float32).reshape(-1)
    n = flat.size
    padded = np.zeros(blocks(n, block) * block, np.float32)
    padded[:n] = flat
    rows = padded.reshape(-1, block)
    scales = (np.abs(rows).max(axis=1) / INT8_MAX).astype(np.float32)
    safe = np.where(scales > 0, scales, 1.0).astype(np.float32)
    codes = np.rint(rows / safe[:, None]).clip(-INT8_MAX, INT8_MAX).astype(np.int8)
    return codes.reshape(-1)[:n].reshape(delta.shape), scales


def dequantize(codes: np.ndarray, scales: np.ndarray, block: int, first: int = 0) -> np.ndarray:
    """float32 values of flat `codes` holding elements [first, first + len) of a tensor, whose blocks from
    `first // block` on have `scales`."""
    out = codes.astype(np.float32)
    n = out.size
    head = min(n, -first % block)  # elements before the first block boundary: the end of a block cut by `first`
    with np.errstate(over="ignore"):  # (an overflow is caught as a non-finite value at ingest)
        if head:
            out[:head] *= scales[0]
        full = (n - head) // block
        if full:
            at = 1 if head else 0
            out[head : head + full * block].reshape(full, block)[:] *= scales[at : at + full, None]
        if head + full * block < n:
            out[head + full * block :] *= scales[(1 if head else 0) + full]
    return out


def encode_delta(trained: dict[str, np.ndarray], base: dict[str, np.ndarray], encoding: Encoding,
                 residual: dict[str, np.ndarray] | None = None) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The tensors of an update in `encoding`, and what the encoding lost (float32, per float tensor) — to be
    added to the next round's delta (`residual`, this round's carry-over, is added to this one's)."""
    if not encoding.is_delta:
        return dict(trained), {}
    out: dict[str, np.ndarray] = {}
    lost: dict[str, np.ndarray] = {}
    for name, value in trained.items():
        if not is_float(value.dtype):
            out[name] = value
            continue
        delta = value.astype(np.float32) - base[name].astype(np.float32)
        if residual is not None and name in residual:
            delta += residual[name]
        if encoding.kind == "bf16":
            sent = delta.astype(bfloat16())
            out[name], lost[name] = sent, delta - sent.astype(np.float32)
        elif encoding.kind == "topk":
            packed, index, steps, decoded = topk_encode(delta.reshape(-1), encoding)
            out[name], out[name + INDEX_SUFFIX], out[name + SCALE_SUFFIX] = packed, index, steps
            lost[name] = delta - decoded.reshape(delta.shape)
        else:
            codes, scales = quantize(delta, encoding.block)
            out[name], out[name + SCALE_SUFFIX] = codes, scales
            lost[name] = delta - dequantize(codes.reshape(-1), scales, encoding.block).reshape(delta.shape)
    return out, lost

def _top_rows(rows: np.ndarray, k: int) -> np.ndarray:
    """The positions of each row's `k` entries largest in magnitude, ascending."""
    width = rows.shape[1]
    if k >= width:
        return np.broadcast_to(np.arange(width), rows.shape).copy()
    at = np.argpartition(np.abs(rows), width - k, axis=1)[:, width - k :]
    at.sort(axis=1)
    return at


def _pack(codes: np.ndarray, encoding: Encoding) -> np.ndarray:
    """Rows of codes (< 2^bits) packed into `chunk_bytes` bytes each, low bits first, the rest zero."""
    per = 8 // encoding.bits
    padded = np.zeros((codes.shape[0], encoding.chunk_bytes * per), np.uint8)
    padded[:, : codes.shape[1]] = codes
    grouped = padded.reshape(codes.shape[0], encoding.chunk_bytes, per)
    packed = np.zeros((codes.shape[0], encoding.chunk_bytes), np.uint8)
    for j in range(per):
        packed |= grouped[:, :, j] << np.uint8(encoding.bits * j)
    return packed


def _unpack(packed: np.ndarray, encoding: Encoding) -> np.ndarray:
    """The inverse of `_pack`: rows of chunk_bytes * (8 / bits) codes."""
    per, mask = 8 // encoding.bits, np.uint8((1 << encoding.bits) - 1)
    out = np.empty((packed.shape[0], packed.shape[1], per), np.uint8)
    for j in range(per):
        out[:, :, j] = (packed >> np.uint8(encoding.bits * j)) & mask
    return out.reshape(packed.shape[0], packed.shape[1] * per)


def fitted_step(values: np.ndarray, h: float) -> np.ndarray:
    """Each row's step s for codes (q - h) * s: from max|v| / h (nothing clipped), LLOYD_ROUNDS rounds of taking
    each value's nearest code, then the least-squares step for those codes, s = sum(v c) / sum(c^2). A chunk's
    kept values are heavy-tailed: scaled to the largest, most land on the smallest code, far from their value
    (relative error 0.38 on Gaussian deltas at 2 bits, 0.81 on Student-t(3)); fitted, 0.12 and 0.35. What a clipped
    value loses goes to error feedback like the rest."""
    step: np.ndarray = (np.abs(values).max(axis=1, initial=0.0) / h).astype(np.float32)
    for _ in range(LLOYD_ROUNDS):
        safe = np.where(step > 0, step, np.float32(1.0))
        codes = np.clip(np.rint(values / safe[:, None] + h), 0, 2 * h) - np.float32(h)
        energy = np.square(codes).sum(axis=1)
        fitted = np.divide((values * codes).sum(axis=1), energy, out=np.zeros_like(step), where=energy > 0)
        step = np.where(step > 0, fitted, step).astype(np.float32)
    return step


def topk_encode(flat: np.ndarray, encoding: Encoding) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """One tensor's delta (float32, flat) in topk: its packed codes, positions and steps (`encoded_manifest`'s
    three tensors), and the delta they decode to (what was sent; the rest is the encoding's loss)."""
    n, chunk, keep, h = flat.size, encoding.chunk, encoding.keep, encoding.levels_half
    whole = n // chunk
    parts = [(flat[: whole * chunk].reshape(whole, chunk), keep)]
    if n > whole * chunk:
        parts.append((flat[whole * chunk :].reshape(1, -1), short_keep(n - whole * chunk, encoding)))
    packed, index, steps = [], [], []
    decoded = np.zeros(n, np.float32)
    first = 0  # the first chunk of the part
    for rows, k in parts:
        at = _top_rows(rows, k)
        values = np.take_along_axis(rows, at, axis=1)
        step = fitted_step(values, h)
        safe = np.where(step > 0, step, np.float32(1.0))
        codes = np.clip(np.rint(values / safe[:, None] + h), 0, 2 * h).astype(np.uint8)
        packed.append(_pack(codes, encoding).reshape(-1))
        index.append(at.astype(np.int16).reshape(-1))
        steps.append(step)
        positions = (np.arange(first, first + rows.shape[0]) * chunk)[:, None] + at
        decoded[positions.reshape(-1)] = ((codes.astype(np.float32) - np.float32(h)) * step[:, None]).reshape(-1)
        first += rows.shape[0]
    return np.concatenate(packed), np.concatenate(index), np.concatenate(steps), decoded


def topk_entries(numel: int, c0: int, c1: int, packed: np.ndarray, index: np.ndarray, steps: np.ndarray,
                 encoding: Encoding) -> tuple[np.ndarray, np.ndarray]:
    """The entries chunks [c0, c1) of a topk tensor of `numel` elements send — their positions in the tensor and
    float32 values — from those chunks' packed codes, positions and steps. Raises CompressError for a chunk that
    is not what `topk_encode` writes: a position outside its chunk or not ascending (so none twice), a step
    that is negative or not finite, or bits set past its codes."""
    chunk, keep, h = encoding.chunk, encoding.keep, encoding.levels_half
    steps = np.asarray(steps, np.float32)
    if not (np.isfinite(steps).all() and (steps >= 0).all()):
        raise CompressError("a topk step (scale) is negative or not finite")
    codes = _unpack(np.asarray(packed, np.uint8).reshape(c1 - c0, encoding.chunk_bytes), encoding)
    whole = numel // chunk
    full = min(c1, whole) - c0  # chunks of full length
    parts = [(0, full, keep, chunk)] if full > 0 else []
    if c1 > whole:  # the tensor's last, shorter chunk
        parts.append((max(full, 0), max(full, 0) + 1, short_keep(numel - whole * chunk, encoding),
                      numel - whole * chunk))
    positions, values = [], []
    taken = 0
    for a, b, k, width in parts:
        at = np.asarray(index[taken : taken + (b - a) * k], np.int64).reshape(b - a, k)
        taken += (b - a) * k
        if at.size and (at.min() < 0 or at.max() >= width or (k > 1 and (np.diff(at, axis=1) <= 0).any())):
            raise CompressError(f"topk positions of chunks {c0 + a}-{c0 + b - 1} are outside their chunk or not "
                                "ascending")
        if codes[a:b, k:].any():
            raise CompressError(f"topk codes of chunks {c0 + a}-{c0 + b - 1} set bits past their {k} entries")
        positions.append((((c0 + np.arange(a, b)) * chunk)[:, None] + at).reshape(-1))
        with np.errstate(over="ignore"):
            values.append(((codes[a:b, :k].astype(np.float32) - np.float32(h)) * steps[a:b, None]).reshape(-1))
    if not positions:
        return np.zeros(0, np.int64), np.zeros(0, np.float32)
    return np.concatenate(positions), np.concatenate(values)


def topk_dense(numel: int, packed: np.ndarray, index: np.ndarray, steps: np.ndarray,
               encoding: Encoding) -> np.ndarray:
    """A whole topk tensor of `numel` elements as the float32 delta it sends (zero where it sends nothing);
    CompressError as `topk_entries`."""
    at, values = topk_entries(numel, 0, blocks(numel, encoding.chunk), packed, index, steps, encoding)
    dense = np.zeros(numel, np.float32)
    dense[at] = values
    return dense


def decode_arrays(
    encoded: dict[str, np.ndarray], base: dict[str, np.ndarray], encoding: Encoding,
    only: frozenset[str] | None = None,
) -> dict[str, np.ndarray]:
    """The trained weights an encoded update stands for (whole tensors in memory: tests and small models); with
    `only`, an update of those tensors alone (the others are the base's)."""
    if not encoding.is_delta:
        return dict(encoded)
    out: dict[str, np.ndarray] = {}
    for name, ref in base.items():
        if only is not None and name not in only:
            out[name] = ref
            continue
        value = encoded[name]
        if not is_float(ref.dtype):
            out[name] = value
            continue
        if encoding.kind == "bf16":
            delta = value.astype(np.float32)
        elif encoding.kind == "topk":
            delta = topk_dense(ref.size, value, encoded[name + INDEX_SUFFIX], encoded[name + SCALE_SUFFIX],
                               encoding).reshape(ref.shape)
        else:
            delta = dequantize(value.reshape(-1), encoded[name + SCALE_SUFFIX], encoding.block).reshape(ref.shape)
        out[name] = _add(ref, delta)
    return out


def _add(base: np.ndarray, delta: np.ndarray) -> np.ndarray:
    """base + delta in float32 (float64 for a float64 base), stored in the base's dtype."""
    wide = np.float64 if base.dtype == np.float64 else np.float32
    with np.errstate(over="ignore", invalid="ignore"):  # (an overflow is caught as a non-finite value at ingest)
        total: np.ndarray = (base.astype(wide) + delta).astype(base.dtype)
    return total


def _add_in_place(view: np.ndarray, delta: np.ndarray) -> None:
    """view += delta, computed in float32 (float64 for a float64 view), stored in the view's dtype."""
    with np.errstate(over="ignore", invalid="ignore"):
        if view.dtype in (np.float32, np.float64):
            view += delta
        else:
            view[:] = (view.astype(np.float32) + delta).astype(view.dtype)


# --- decoding by byte range (the coordinator) ---------------------------------------------------------


class _Ranged(Protocol):
    def readinto(self, begin: int, buf: memoryview) -> None: ...


class DecodedSource:
    """An encoded update read as the trained weights, by byte range of the model's data section.

    Each read takes the same range of the base model (the round's global) and the encoded bytes of the
    elements in it: the codes and scales lie elsewhere in the encoded file but in the same order, so they are
    read in a few coalesced requests. Memory: the range, its encoded bytes, and float32 scratch per tensor part."""

    def __init__(self, manifest: Manifest, encoding: Encoding, base: _Ranged, encoded: _Ranged,
                 only: frozenset[str] | None = None) -> None:
        self.manifest, self.encoding, self.base, self.encoded = manifest, encoding, base, encoded
        self.layout = manifest.layout()
        self.encoded_layout = encoded_manifest(manifest, encoding, only).layout()
        self.only = only  # a fragment's tensors: the others read as the base (their delta is zero)
        self._order = sorted(self.layout, key=lambda n: self.layout[n][0])
        self._starts = [self.layout[n][0] for n in self._order]

    def readinto(self, begin: int, buf: memoryview) -> None:
        end = begin + len(buf)
        if not len(buf):
            return
        lo, hi = begin - begin % 8, min(-(-end // 8) * 8, self.manifest.nbytes)  # whole elements (8-aligned)
        out = bytearray(hi - lo)
        self.base.readinto(lo, memoryview(out))
        parts = list(self._parts(lo, hi))
        spans = [span for part in parts for span in part.spans]
        fetched = _Fetched(self.encoded, spans)
        for part in parts:
            _decode_into(part, out, lo, fetched, self.encoding)
        buf[:] = memoryview(out)[begin - lo : end - lo]

    def _parts(self, lo: int, hi: int) -> Iterable[_Part]:
        i = max(0, bisect.bisect_right(self._starts, lo) - 1)
        for name in self._order[i:]:
            a, b = self.layout[name]
            if a >= hi:
                break
            if b <= lo or (self.only is not None and name not in self.only):
                continue
            spec = self.manifest.tensors[name]
            size = ITEMSIZE[spec.dtype]
            first, last = (max(a, lo) - a) // size, (min(b, hi) - a) // size
            yield _Part(name, spec, a + first * size, first, last,
                        _encoded_spans(name, spec, self.encoded_layout, first, last, self.encoding))


@dataclass(frozen=True)
class _Part:
    """Elements [first, last) of one tensor: where they are in the model (`offset`, of element `first`) and
    which byte spans of the encoded file hold them (its codes or values, then an int8 part's scales)."""

    name: str
    spec: TensorSpec
    offset: int
    first: int
    last: int
    spans: tuple[tuple[int, int], ...]


def _encoded_spans(name: str, spec: TensorSpec, layout: dict[str, tuple[int, int]], first: int, last: int,
                   encoding: Encoding) -> tuple[tuple[int, int], ...]:
    """The byte spans of the encoded file that hold elements [first, last) of tensor `name` (last > first):
    its codes or values, then an int8 part's scales, or a topk part's positions and steps (of whole chunks)."""
    at = layout[name][0]
    if spec.dtype not in FLOAT_TAGS:
        size = ITEMSIZE[spec.dtype]
        return ((at + first * size, at + last * size),)
    if encoding.kind == "bf16":
        return ((at + 2 * first, at + 2 * last),)
    scales_at = layout[name + SCALE_SUFFIX][0]
    if encoding.kind == "topk":
        c0, c1 = first // encoding.chunk, (last - 1) // encoding.chunk + 1
        index_at = layout[name + INDEX_SUFFIX][0]
        return ((at + c0 * encoding.chunk_bytes, at + c1 * encoding.chunk_bytes),
                (index_at + 2 * kept_before(spec.numel, c0, encoding), index_at + 2 * kept_before(spec.numel, c1,
                                                                                                  encoding)),
                (scales_at + 4 * c0, scales_at + 4 * c1))
    b = encoding.block
    return ((at + first, at + last), (scales_at + 4 * (first // b), scales_at + 4 * ((last - 1) // b + 1)))


def _decode_into(part: _Part, out: bytearray, lo: int, fetched: _Fetched, encoding: Encoding) -> None:
    """Replace the base model's bytes of `part` in `out` (which starts at data-section offset `lo`) with the
    trained weights."""
    n = part.last - part.first
    if n <= 0:
        return
    flat = TensorSpec(part.spec.dtype, (n,))
    begin = part.offset - lo
    if part.spec.dtype not in FLOAT_TAGS:  # sent as its value
        out[begin : begin + flat.nbytes] = fetched.get(part.spans[0])
        return
    if encoding.kind == "bf16":
        delta = np.frombuffer(fetched.get(part.spans[0]), bfloat16()).astype(np.float32)
    elif encoding.kind == "topk":
        c0 = part.first // encoding.chunk
        c1 = (part.last - 1) // encoding.chunk + 1
        at, values = topk_entries(part.spec.numel, c0, c1, np.frombuffer(fetched.get(part.spans[0]), np.uint8),
                                  np.frombuffer(fetched.get(part.spans[1]), "<i2"),
                                  np.frombuffer(fetched.get(part.spans[2]), "<f4"), encoding)
        at -= part.first
        inside = (at >= 0) & (at < n)
        delta = np.zeros(n, np.float32)
        delta[at[inside]] = values[inside]
    else:
        codes = np.frombuffer(fetched.get(part.spans[0]), np.int8)
        scales = np.frombuffer(fetched.get(part.spans[1]), "<f4")
        delta = dequantize(codes, scales, encoding.block, part.first)
    _add_in_place(tensor_view(out, begin, flat), delta)


class _Fetched:
    """The encoded byte spans one read needs, fetched in as few ranged requests as their gaps allow."""

    def __init__(self, source: _Ranged, spans: list[tuple[int, int]]) -> None:
        self.runs: list[tuple[int, bytearray]] = []
        for a, b in _merged(spans):
            data = bytearray(b - a)
            source.readinto(a, memoryview(data))
            self.runs.append((a, data))

    def get(self, span: tuple[int, int]) -> memoryview:
        a, b = span
        for start, data in self.runs:
            if start <= a and b <= start + len(data):
                return memoryview(data)[a - start : b - start]
        raise KeyError(span)  # (cannot happen: every span was fetched)


class CachedRange:
    """A range source that keeps its last read: the inputs of a round decode against the same base model, and
    an aggregation reads the same range of every input in turn, so the base is read once per range, not once
    per input. Memory: one range."""

    def __init__(self, source: _Ranged) -> None:
        self.source = source
        self._lock = threading.Lock()
        self._begin, self._data = -1, bytearray()

    def readinto(self, begin: int, buf: memoryview) -> None:
        with self._lock:
            if begin != self._begin or len(buf) != len(self._data):
                data = bytearray(len(buf))
                self.source.readinto(begin, memoryview(data))
                self._begin, self._data = begin, data
            buf[:] = self._data


def _merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for a, b in sorted(s for s in spans if s[1] > s[0]):
        if out and a - out[-1][1] <= COALESCE_GAP:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def wire_ratio(manifest: Manifest, encoding: Encoding) -> float:
    """Bytes sent in `encoding` over bytes of plain weights (headers aside)."""
    return encoded_manifest(manifest, encoding).nbytes / max(1, manifest.nbytes)

