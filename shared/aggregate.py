"""Aggregation strategies, computed piece by piece of the output file: pure numpy, bounded memory.

The global model is a canonical safetensors file (`shared.wire`): a header, then every tensor's bytes in a
fixed layout that every accepted update shares. So byte range [a, b) of the global's data section is made
from byte range [a, b) of each update's data section alone — every strategy here is coordinate-wise once
the per-update quantities that span the model (weights, clipping factors) are known up front. The output
file is cut into the digest's pieces (`shared.digest.PIECE_BYTES`, 8 MiB); each piece is computed from
ranged reads of the inputs into reused buffers, hashed, and handed on (written as one part of a multipart
upload). Any subset of the pieces can be computed anywhere (`Plan.shards`): the same piece is the same
bytes whichever worker computes it, so K shards and one give byte-identical globals.

Memory: FedAvg holds one read buffer and float32 scratch the size of a piece; the robust strategies read
each input's slice of a piece in sub-ranges so that all N slices together stay about one piece in size.
Inputs are taken in a fixed order (sorted by participant) so anyone recomputing a round gets the same bytes.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from shared.config import RunConfig, Strategy
from shared.digest import PIECE_BYTES, combine, digest, piece_hash
from shared.server_opt import ServerStep, decode_piece, encode_index, encode_piece, new_state
from shared.wire import DTYPES, FLOAT_TAGS, SCHEMA_VERSION, Manifest, TensorSpec, encode_header, tensor_view

ROBUST_ROW_BYTES = 64 * 1024  # the least a robust strategy reads of one input at a time
FEDAVG_GROUP_BYTES = 64 * 1024 * 1024  # FedAvg reads up to this much of a piece's inputs before summing them
BLOCK_BYTES = 256 * 1024  # the output block summed over a group of inputs while it stays in the CPU cache


class RangeSource(Protocol):
    """One input file's data section, read by byte range (offsets relative to the data section)."""

    def readinto(self, begin: int, buf: memoryview) -> None: ...


class StateSource(Protocol):
    """The server optimizer's state before the round, piece by piece (`shared.server_opt`)."""

    def load(self, index: int, count: int) -> dict[str, np.ndarray]: ...


class NoState:
    """The state before the first round: zeros."""

    def __init__(self, slots: tuple[str, ...]) -> None:
        self.slots = slots

    def load(self, index: int, count: int) -> dict[str, np.ndarray]:
        return new_state(self.slots, count)


class ArraySource:
    """A RangeSource over tensors in memory (tests, and the witnesses' small models)."""

    def __init__(self, manifest: Manifest, arrays: dict[str, np.ndarray]) -> None:
        layout = manifest.layout()
        self.data = bytearray(manifest.nbytes)
        for name, (begin, end) in layout.items():
            raw = np.ascontiguousarray(arrays[name], DTYPES[manifest.tensors[name].dtype][0]).tobytes()
            self.data[begin:end] = raw

    def readinto(self, begin: int, buf: memoryview) -> None:
        buf[:] = self.data[begin : begin + len(buf)]


@dataclass(frozen=True)
class WeightedInput:
    participant: str
    samples: int
    digest: str
    source: RangeSource
    norm: float = -1.0  # L2 distance from the round's global model, as measured at ingest (clipping needs it)


@dataclass(frozen=True)
class Segment:
    """The part of one tensor inside a byte range of the data section."""

    name: str
    spec: TensorSpec
    begin: int  # data-section offsets
    end: int

    @property
    def count(self) -> int:
        return (self.end - self.begin) // DTYPES[self.spec.dtype][1]


@dataclass(frozen=True)
class Plan:
    """The layout of one output file: its header bytes, then its data section, cut into pieces."""

    manifest: Manifest
    header: bytes

    @classmethod
    def of(cls, manifest: Manifest, metadata: dict[str, str]) -> Plan:
        return cls(manifest, encode_header(manifest.tensors, metadata))

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
        """The pieces cut into contiguous shards of about `shard_bytes` (at least one piece each)."""
        per = max(1, shard_bytes // PIECE_BYTES)
        return [range(i, min(i + per, self.pieces)) for i in range(0, self.pieces, per)]

    def segments(self, begin: int, end: int) -> Iterator[Segment]:
        """The tensors' parts in data-section range [begin, end) (8-aligned ends cut no element)."""
        for name, (a, b) in self.manifest.layout().items():
            lo, hi = max(a, begin), min(b, end)
            if lo < hi:
                yield Segment(name, self.manifest.tensors[name], lo, hi)


class PieceAggregator:
    """Computes pieces of a round's global model from ranged reads of its inputs."""

    def __init__(self, config: RunConfig, plan: Plan, inputs: list[WeightedInput], base: RangeSource | None,
                 state: StateSource | None = None) -> None:
        if not inputs:
            raise ValueError("nothing to aggregate")
        if any(i.samples <= 0 for i in inputs):
            raise ValueError("an update's sample count must be positive")
        self.config, self.plan, self.base = config, plan, base
        self.inputs = sorted(inputs, key=lambda i: i.participant)
        self.strategy = config.strategy
        total = sum(i.samples for i in self.inputs)
        self.weights = [i.samples / total for i in self.inputs]
        self.scales = self._clip_scales() if self.strategy is Strategy.CLIPPED_FEDAVG else []
        if self.strategy is Strategy.CLIPPED_FEDAVG and base is None:
            raise ValueError("clipped FedAvg needs the round's global model")
        self.step = ServerStep.of(config)
        if self.step is not None and base is None:
            raise ValueError("a server optimizer needs the round's global model")
        self.state = state or NoState(self.step.slots if self.step else ())
        self._opt: _PieceState | None = None  # the piece being computed's base values and optimizer state
        self._buffers: list[bytearray] = []  # one piece-sized read buffer per input of a group, reused
        # accumulators for one piece, indexed by byte offset / 2 (float32: a bf16/f16 element is 2 bytes) or / 8
        self._acc32 = np.empty(PIECE_BYTES // 2, np.float32)
        self._acc64 = np.empty(PIECE_BYTES // 8, np.float64)
        self._tmp32 = np.empty(BLOCK_BYTES // 2, np.float32)  # one block's temporary
        self._tmp64 = np.empty(BLOCK_BYTES // 8, np.float64)

    def _clip_scales(self) -> list[float]:
        norms = [i.norm for i in self.inputs]
        if any(n < 0 for n in norms):
            raise ValueError("clipped FedAvg needs every update's distance from the global model")
        bound = self.config.clip_norm or float(np.median(norms))
        return [min(1.0, bound / max(n, 1e-12)) for n in norms]

    def piece(self, index: int) -> bytearray:
        """The bytes of piece `index` of the output file (a new buffer: it may be uploaded while the next piece
        is computed)."""
        return self.piece_with_state(index)[0]

    def piece_with_state(self, index: int) -> tuple[bytearray, bytes | None]:
        """Piece `index` of the output file and, with a server optimizer, the state file of that piece after
        the round's step (None without one)."""
        start, stop = self.plan.piece_span(index)
        header = self.plan.header
        out = bytearray(stop - start)
        in_header = max(0, min(stop, len(header)) - start)
        out[:in_header] = header[start : start + in_header]
        data_begin, data_end = max(start, len(header)) - len(header), stop - len(header)
        data_end = max(data_begin, data_end)
        if self.step is not None:
            assert self.base is not None
            self._opt = _PieceState(self.plan, data_begin, data_end, self.base)
            self._opt.values = self.state.load(index, self._opt.count)
        if data_end > data_begin:
            self._data(data_begin, data_end, memoryview(out)[in_header:])
        if self._opt is None:
            return out, None
        assert self.step is not None
        state, self._opt = encode_piece(self.step, index, self._opt.values), None
        return out, state

    def _emit(self, out: memoryview, offset: int, spec: TensorSpec, values: np.ndarray) -> None:
        """Store the strategy's aggregate of elements at byte `offset` of the piece's data — or, with a server
        optimizer, the next global values its step makes from them."""
        if self._opt is not None and self.step is not None:
            x, state = self._opt.at(offset, spec)
            values = self.step.apply(x, values, state)
        _store(out, offset, spec, values)

    def _data(self, begin: int, end: int, out: memoryview) -> None:
        if self.strategy is Strategy.FEDAVG:
            self._fedavg(begin, end, out)
            return
        step = max(ROBUST_ROW_BYTES, (PIECE_BYTES // len(self.inputs)) // 8 * 8)
        for lo in range(begin, end, step):
            self._robust(lo, min(lo + step, end), out, begin)

    def _fedavg(self, begin: int, end: int, out: memoryview) -> None:
        """Blocked accumulation: a group of inputs' slices of the piece is read into reused buffers, then each
        small block of the output is summed over the whole group while it sits in the CPU cache, and written
        once. Memory traffic is the reads of the inputs and one write of the output."""
        size = end - begin
        floats = [seg for seg in self.plan.segments(begin, end) if seg.spec.dtype in FLOAT_TAGS]
        group = max(1, min(len(self.inputs), FEDAVG_GROUP_BYTES // PIECE_BYTES))
        while len(self._buffers) < group:
            self._buffers.append(bytearray(PIECE_BYTES))
        for first in range(0, len(self.inputs), group):
            members = range(first, min(first + group, len(self.inputs)))
            views = [memoryview(self._buffers[k - first])[:size] for k in members]
            for k, view in zip(members, views, strict=True):
                self.inputs[k].source.readinto(begin, view)
            if first == 0:  # tensors that are not averaged (integer counters, flags) come from the first input
                out[:] = views[0]
            last = members.stop == len(self.inputs)
            for seg in floats:
                item = DTYPES[seg.spec.dtype][1]
                for lo in range(seg.begin, seg.end, BLOCK_BYTES):
                    hi = min(lo + BLOCK_BYTES, seg.end)
                    self._block(seg.spec.dtype, lo - begin, (hi - lo) // item, views, members, last, out)

    def _block(self, dtype: str, offset: int, count: int, views: list[memoryview], members: range, last: bool,
               out: memoryview) -> None:
        """Sum one block (`count` elements at byte `offset` of the piece) over a group of inputs."""
        wide = dtype == "F64"
        acc = (self._acc64 if wide else self._acc32)[offset // (8 if wide else 2) :][:count]
        tmp = (self._tmp64 if wide else self._tmp32)[:count]
        flat = TensorSpec(dtype, (count,))
        for view, k in zip(views, members, strict=True):
            x = tensor_view(view, offset, flat)
            if x.dtype != acc.dtype:  # bf16 / f16: widened to float32 first
                np.copyto(tmp, x, casting="unsafe")
                x = tmp
            weight = acc.dtype.type(self.weights[k])
            if k == 0:
                np.multiply(x, weight, out=acc)
            else:
                np.multiply(x, weight, out=tmp)
                np.add(acc, tmp, out=acc)
        if last:
            self._emit(out, offset, flat, acc)

    def _robust(self, begin: int, end: int, out: memoryview, out_begin: int) -> None:
        rows = []
        for item in self.inputs:
            buf = bytearray(end - begin)
            item.source.readinto(begin, memoryview(buf))
            rows.append(buf)
        base = bytearray(end - begin)
        if self.base is not None:
            self.base.readinto(begin, memoryview(base))
        out[begin - out_begin : end - out_begin] = rows[0]
        for seg in self.plan.segments(begin, end):
            if seg.spec.dtype not in FLOAT_TAGS:
                continue
            flat = TensorSpec(seg.spec.dtype, (seg.count,))
            stack = np.stack([tensor_view(r, seg.begin - begin, flat).astype(np.float64) for r in rows])
            if self.strategy is Strategy.MEDIAN:
                value = np.median(stack, axis=0)
            elif self.strategy is Strategy.TRIMMED_MEAN:
                n = len(rows)
                k = min(int(self.config.trim_fraction * n), (n - 1) // 2)
                value = np.sort(stack, axis=0)[k : n - k].mean(axis=0)
            else:
                ref = tensor_view(base, seg.begin - begin, flat).astype(np.float64)
                scales = np.asarray(self.scales).reshape(-1, 1)
                value = ref + ((stack - ref) * scales).mean(axis=0)
            self._emit(out, seg.begin - out_begin, flat, value)


class _PieceState:
    """One piece's base values and optimizer state, addressed by byte offset in the piece's data: the state
    holds the piece's float elements in data order (`shared.server_opt`)."""

    def __init__(self, plan: Plan, begin: int, end: int, base: RangeSource) -> None:
        self.base = bytearray(end - begin)
        if end > begin:
            base.readinto(begin, memoryview(self.base))
        self.starts: list[int] = []  # float segments: byte offset in the piece, element size, state index
        self.items: list[int] = []
        self.firsts: list[int] = []
        count = 0
        for seg in plan.segments(begin, end):
            if seg.spec.dtype in FLOAT_TAGS:
                self.starts.append(seg.begin - begin)
                self.items.append(DTYPES[seg.spec.dtype][1])
                self.firsts.append(count)
                count += seg.count
        self.count = count
        self.values: dict[str, np.ndarray] = {}

    def at(self, offset: int, spec: TensorSpec) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """The base values (float32) and state slices of `spec.numel` elements at byte `offset`."""
        k = bisect.bisect_right(self.starts, offset) - 1
        first = self.firsts[k] + (offset - self.starts[k]) // self.items[k]
        x = tensor_view(self.base, offset, spec).astype(np.float32)
        return x, {slot: v[first : first + spec.numel] for slot, v in self.values.items()}


def _store(out: memoryview, offset: int, spec: TensorSpec, values: np.ndarray) -> None:
    """Write `values` into `out` at `offset` in the dtype of `spec` (little-endian)."""
    dtype = DTYPES[spec.dtype][0].newbyteorder("<")
    target = np.frombuffer(out, dtype=dtype, count=spec.numel, offset=offset)
    np.copyto(target, values, casting="unsafe")


def global_metadata(run_id: str, round_no: int, inputs: Iterable[WeightedInput], strategy: str) -> dict[str, str]:
    """Provenance in the global file's header: which updates, with what weights, made it."""
    listed = [[i.participant, i.samples, i.digest] for i in sorted(inputs, key=lambda i: i.participant)]
    return {
        "fed.schema": SCHEMA_VERSION,
        "fed.run": run_id,
        "fed.round": str(round_no),
        "fed.kind": "global",
        "fed.strategy": strategy,
        "fed.inputs": json.dumps(listed),
    }


def round_plan(config: RunConfig, manifest: Manifest, out_round: int, inputs: Iterable[WeightedInput]) -> Plan:
    return Plan.of(manifest, global_metadata(config.run_id, out_round, inputs, config.strategy.value))


@dataclass(frozen=True)
class RoundOutput:
    """A round's global model file and, with a server optimizer, its state: piece files and index."""

    model: bytes
    state_pieces: tuple[bytes, ...] = ()
    state_index: bytes = b""

    @property
    def digest(self) -> str:
        return digest(self.model)

    @property
    def state_digest(self) -> str:
        return digest(self.state_index) if self.state_index else ""


class MemoryState:
    """A StateSource over a round's state piece files in memory (tests and small models)."""

    def __init__(self, step: ServerStep, pieces: tuple[bytes, ...]) -> None:
        self.step, self.pieces = step, pieces

    def load(self, index: int, count: int) -> dict[str, np.ndarray]:
        return decode_piece(self.step, index, self.pieces[index], count)


def aggregate_round(config: RunConfig, manifest: Manifest, out_round: int, inputs: list[WeightedInput],
                    base: RangeSource | None, state: StateSource | None = None) -> RoundOutput:
    """The whole output of a round in memory (small models and tests)."""
    plan = round_plan(config, manifest, out_round, inputs)
    worker = PieceAggregator(config, plan, inputs, base, state)
    made = [worker.piece_with_state(i) for i in range(plan.pieces)]
    model = b"".join(data for data, _ in made)
    if worker.step is None:
        return RoundOutput(model)
    pieces = tuple(st for _, st in made if st is not None)
    index = encode_index(worker.step, out_round, digest(model), [digest(p) for p in pieces])
    return RoundOutput(model, pieces, index)


def aggregate_file(
    config: RunConfig, manifest: Manifest, out_round: int, inputs: list[WeightedInput], base: RangeSource | None
) -> bytes:
    """The whole global model of `out_round` made from `inputs`, in memory (small models and tests)."""
    return aggregate_round(config, manifest, out_round, inputs, base).model


def aggregate_digest(config: RunConfig, manifest: Manifest, out_round: int, inputs: list[WeightedInput],
                     base: RangeSource | None, state: StateSource | None = None) -> tuple[str, str]:
    """The digests of that global model and of the optimizer state after the round ("" without one), computed
    piece by piece without holding either (`fed verify`)."""
    plan = round_plan(config, manifest, out_round, inputs)
    worker = PieceAggregator(config, plan, inputs, base, state)
    hashes, states = [], []
    for i in range(plan.pieces):
        data, st = worker.piece_with_state(i)
        hashes.append(piece_hash(data))
        if st is not None:
            states.append(digest(st))
    model = combine(hashes)
    if worker.step is None:
        return model, ""
    return model, digest(encode_index(worker.step, out_round, model, states))
