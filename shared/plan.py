"""The layout of a model file as the aggregation writes it: a canonical header, then the data section, cut
into the content digest's pieces (`shared.digest.PIECE_BYTES`), and where each tensor's elements fall in a
piece. Pure: no I/O.

Piece `i` is bytes [i * PIECE_BYTES, (i + 1) * PIECE_BYTES) of the file; it may hold part of the header and
a range of the data section. Within that range, the elements of float tensors, taken in data order, are the
piece's *float elements*: the download delta (`shared.delta`) is a flat array over them, so any piece can be
computed, stored and rebuilt on its own. The optimizer state (`shared.server_opt`) is addressed by the index of
a float element among the whole model's (`PiecePlan.floats_before`), which the header's length never moves.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from shared.digest import PIECE_BYTES
from shared.wire import FLOAT_TAGS, ITEMSIZE, Manifest, TensorSpec, encode_header, numpy_dtype, tensor_view


@dataclass(frozen=True)
class Segment:
    """The part of one tensor inside a byte range of the data section."""

    name: str
    spec: TensorSpec
    begin: int  # data-section offsets
    end: int

    @property
    def count(self) -> int:
        return (self.end - self.begin) // ITEMSIZE[self.spec.dtype]


@dataclass(frozen=True)
class PiecePlan:
    """The layout of one output file: its header bytes, then its data section, cut into pieces."""

    manifest: Manifest
    header: bytes
    synced: frozenset[str] | None = None  # the tensors the round changes (a Streaming DiLoCo fragment); None: all

    @classmethod
    def of(cls, manifest: Manifest, metadata: dict[str, str], synced: frozenset[str] | None = None) -> PiecePlan:
        return cls(manifest, encode_header(manifest.tensors, metadata), synced)

    @property
    def size(self) -> int:
        return len(self.header) + self.manifest.nbytes

    @property
    def pieces(self) -> int:
        return max(1, -(-self.size // PIECE_BYTES))

    def piece_span(self, index: int) -> tuple[int, int]:
        """Piece `index`'s byte range in the file."""
        return index * PIECE_BYTES, min((index + 1) * PIECE_BYTES, self.size)

    def shards(self, shard_bytes: int) -> list[range]:
        """The pieces cut into as few contiguous shards as hold at most `shard_bytes` each (at least one piece),
        as even as whole pieces allow: the aggregation waits for the largest."""
        count = -(-self.pieces // max(1, shard_bytes // PIECE_BYTES))
        return [range(i * self.pieces // count, (i + 1) * self.pieces // count) for i in range(count)]

    def segments(self, begin: int, end: int) -> Iterator[Segment]:
        """The tensors' parts in data-section range [begin, end) (8-aligned ends cut no element)."""
        for name, (a, b) in self.manifest.layout().items():
            lo, hi = max(a, begin), min(b, end)
            if lo < hi:
                yield Segment(name, self.manifest.tensors[name], lo, hi)

    def layout(self, index: int) -> PieceLayout:
        return PieceLayout.of(self, index)

    @property
    def float_count(self) -> int:
        """The model's float elements: what the optimizer state holds one of per slot, whatever the header."""
        return sum(spec.numel for spec in self.manifest.tensors.values() if spec.dtype in FLOAT_TAGS)

    def floats_before(self, data_offset: int) -> int:
        """How many of the model's float elements (in data order) lie before `data_offset` of the data section: the
        index of the first float element of a range starting there. It depends on the tensors alone, never on the
        header, so a state addressed by it survives any change of the header's length."""
        before = 0
        for name, (a, b) in self.manifest.layout().items():
            spec = self.manifest.tensors[name]
            if spec.dtype in FLOAT_TAGS and a < data_offset:
                before += (min(b, data_offset) - a) // ITEMSIZE[spec.dtype]
        return before


@dataclass(frozen=True)
class PieceLayout:
    """Where piece `index`'s bytes come from: `in_header` bytes of the header, then data-section range
    [data_begin, data_end), whose segments are float (`floats`) or not (`others`). Offsets in `floats` and
    `others` are relative to the piece's data (byte 0 = data_begin)."""

    index: int
    in_header: int
    data_begin: int
    data_end: int
    floats: tuple[tuple[int, TensorSpec, int], ...]  # (offset, flat spec, index of its first float element)
    others: tuple[tuple[int, int], ...]  # byte spans of the segments that are not floats
    count: int  # float elements in the piece

    @classmethod
    def of(cls, plan: PiecePlan, index: int) -> PieceLayout:
        start, stop = plan.piece_span(index)
        head = len(plan.header)
        in_header = max(0, min(stop, head) - start)
        begin = max(start, head) - head
        end = max(begin, stop - head)
        floats, others, count = [], [], 0
        for seg in plan.segments(begin, end):
            if seg.spec.dtype in FLOAT_TAGS:
                floats.append((seg.begin - begin, TensorSpec(seg.spec.dtype, (seg.count,)), count))
                count += seg.count
            else:
                others.append((seg.begin - begin, seg.end - begin))
        return cls(index, in_header, begin, end, tuple(floats), tuple(others), count)

    @property
    def data_bytes(self) -> int:
        return self.data_end - self.data_begin

    def gather_floats(self, data: bytes | bytearray | memoryview) -> np.ndarray:
        """The piece's float elements, in data order, as float32 (`data`: the piece's data bytes)."""
        out = np.empty(self.count, np.float32)
        for offset, spec, first in self.floats:
            out[first : first + spec.numel] = tensor_view(data, offset, spec)
        return out

    def scatter_floats(self, data: memoryview, values: np.ndarray) -> None:
        """Store float32 `values` (one per float element) into the piece's data bytes, each in its dtype."""
        for offset, spec, first in self.floats:
            store(data, offset, spec, values[first : first + spec.numel])

    def gather_others(self, data: bytes | bytearray | memoryview) -> bytes:
        return b"".join(bytes(data[a:b]) for a, b in self.others)

    def scatter_others(self, data: memoryview, raw: bytes | memoryview) -> None:
        at = 0
        for a, b in self.others:
            data[a:b] = raw[at : at + b - a]
            at += b - a

    @property
    def others_bytes(self) -> int:
        return sum(b - a for a, b in self.others)


def store(out: memoryview, offset: int, spec: TensorSpec, values: np.ndarray) -> None:
    """Write `values` into `out` at `offset` in the dtype of `spec` (little-endian)."""
    dtype = numpy_dtype(spec.dtype).newbyteorder("<")
    target = np.frombuffer(out, dtype=dtype, count=spec.numel, offset=offset)
    np.copyto(target, values, casting="unsafe")
