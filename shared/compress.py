"""Compressed updates: what a participant sends instead of its trained weights, and how it is read back.

An update is sent in one of three encodings (`RunConfig.update_encoding`):

    weights  the trained weights, in the model's own dtypes (the default; nothing to decode)
    bf16     the delta from the round's global model (trained - global, computed in float32), as bfloat16
    int8     that delta quantized per block of `quant_block` consecutive elements of each tensor: for tensor
             `name`, an I8 tensor `name` of the same shape, q = rint(delta / scale), and an F32 tensor
             `name + SCALE_SUFFIX` holding one scale per block, scale = max|delta in the block| / 127

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
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from shared.wire import FLOAT_TAGS, ITEMSIZE, Manifest, TensorSpec, bfloat16, is_float, tensor_view

SCALE_SUFFIX = ".__scale__"
ENCODINGS = ("weights", "bf16", "int8")
DEFAULT_BLOCK = 256
INT8_MAX = 127.0
COALESCE_GAP = 64 * 1024  # encoded byte spans closer than this are read in one request


class CompressError(ValueError):
    """An encoding that cannot be used (the message says why)."""


@dataclass(frozen=True)
class Encoding:
    kind: str = "weights"
    block: int = DEFAULT_BLOCK  # int8 only

    def __post_init__(self) -> None:
        if self.kind not in ENCODINGS:
            raise CompressError(f"unknown update encoding {self.kind!r}: one of {', '.join(ENCODINGS)}")
        if self.kind != "int8":  # (the block means nothing else: encodings that differ only by it are equal)
            object.__setattr__(self, "block", DEFAULT_BLOCK)
        elif not 1 <= self.block <= 1 << 20:
            raise CompressError(f"quantization block must be 1 to {1 << 20} elements, got {self.block}")

    @property
    def is_delta(self) -> bool:
        return self.kind != "weights"

    def metadata(self) -> dict[str, str]:
        """What an encoded file says about itself (nothing for plain weights)."""
        if not self.is_delta:
            return {}
        return {"fed.encoding": self.kind} | ({"fed.block": str(self.block)} if self.kind == "int8" else {})

    @classmethod
    def of_metadata(cls, metadata: dict[str, str]) -> Encoding:
        kind = metadata.get("fed.encoding", "weights")
        try:
            block = int(metadata.get("fed.block", DEFAULT_BLOCK))
        except ValueError:
            raise CompressError(f"malformed metadata: fed.block must be an integer, got {metadata['fed.block']!r}") \
                from None
        return cls(kind, block)

    def __str__(self) -> str:
        return f"int8/{self.block}" if self.kind == "int8" else self.kind

    @classmethod
    def parse(cls, text: str) -> Encoding:
        """The inverse of str(): "weights", "bf16", "int8/256" ("" is "weights")."""
        kind, _, block = (text or "weights").partition("/")
        return cls(kind, int(block) if block else DEFAULT_BLOCK)


def blocks(numel: int, block: int) -> int:
    return -(-numel // block)


def encoded_manifest(manifest: Manifest, encoding: Encoding) -> Manifest:
    """What a file in `encoding` holds for a model of `manifest`."""
    if not encoding.is_delta:
        return manifest
    if clash := sorted(n for n in manifest.tensors if n.endswith(SCALE_SUFFIX)):
        raise CompressError(f"tensor name {clash[0]!r} ends in {SCALE_SUFFIX!r}, reserved for int8 scales")
    tensors: dict[str, TensorSpec] = {}
    for name, spec in manifest.tensors.items():
        if spec.dtype not in FLOAT_TAGS:
            tensors[name] = spec
        elif encoding.kind == "bf16":
            tensors[name] = TensorSpec("BF16", spec.shape)
        else:
            tensors[name] = TensorSpec("I8", spec.shape)
            tensors[name + SCALE_SUFFIX] = TensorSpec("F32", (blocks(spec.numel, encoding.block),))
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
        else:
            codes, scales = quantize(delta, encoding.block)
            out[name], out[name + SCALE_SUFFIX] = codes, scales
            lost[name] = delta - dequantize(codes.reshape(-1), scales, encoding.block).reshape(delta.shape)
    return out, lost


def decode_arrays(
    encoded: dict[str, np.ndarray], base: dict[str, np.ndarray], encoding: Encoding
) -> dict[str, np.ndarray]:
    """The trained weights an encoded update stands for (whole tensors in memory: tests and small models)."""
    if not encoding.is_delta:
        return dict(encoded)
    out: dict[str, np.ndarray] = {}
    for name, ref in base.items():
        value = encoded[name]
        if not is_float(ref.dtype):
            out[name] = value
            continue
        if encoding.kind == "bf16":
            delta = value.astype(np.float32)
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

    def __init__(self, manifest: Manifest, encoding: Encoding, base: _Ranged, encoded: _Ranged) -> None:
        self.manifest, self.encoding, self.base, self.encoded = manifest, encoding, base, encoded
        self.layout = manifest.layout()
        self.encoded_layout = encoded_manifest(manifest, encoding).layout()
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
            if b <= lo:
                continue
            spec = self.manifest.tensors[name]
            size = ITEMSIZE[spec.dtype]
            first, last = (max(a, lo) - a) // size, (min(b, hi) - a) // size
            at = self.encoded_layout[name][0]
            scales_at = self.encoded_layout.get(name + SCALE_SUFFIX, (0, 0))[0]
            yield _Part(name, spec, a + first * size, first, last,
                        _encoded_spans(spec, at, scales_at, first, last, self.encoding))


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


def _encoded_spans(spec: TensorSpec, at: int, scales_at: int, first: int, last: int,
                   encoding: Encoding) -> tuple[tuple[int, int], ...]:
    if spec.dtype not in FLOAT_TAGS:
        size = ITEMSIZE[spec.dtype]
        return ((at + first * size, at + last * size),)
    if encoding.kind == "bf16":
        return ((at + 2 * first, at + 2 * last),)
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

