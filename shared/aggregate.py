"""A round's global model computed piece by piece of the output file by the run's strategy: pure numpy, bounded
memory.

The global model is a canonical safetensors file (`shared.wire`): a header, then every tensor's bytes in a
fixed layout that every accepted update shares. So byte range [a, b) of the global's data section is made
from byte range [a, b) of each update's data section alone — every strategy (`shared.strategies`) is
coordinate-wise once the per-update quantities that span the model (which updates, their weights, clipping
factors: the strategy's configure half) are known up front. The output
file is cut into the digest's pieces (`shared.digest.PIECE_BYTES`, 8 MiB); each piece is computed from
ranged reads of the inputs into reused buffers, hashed, and handed on (written as one part of a multipart
upload). Any subset of the pieces can be computed anywhere (`PiecePlan.shards`): the same piece is the same
bytes whichever worker computes it, so K shards and one give byte-identical globals.

Memory: a weighted sum (FedAvg) holds float32 scratch the size of a piece, a slice of input and, for inputs that
do not stream, two piece-sized read buffers (see `PieceAggregator._fedavg`); the row-wise strategies (median,
trimmed mean, clipping), and a configure half that reads the inputs whole (Krum's), read each input's slice of a
piece in sub-ranges so that all N slices together stay about one piece in size.
Inputs are taken in a fixed order (sorted by participant) so anyone recomputing a round gets the same bytes.
"""

from __future__ import annotations

import bisect
import contextlib
import json
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from shared.compress import Encoding
from shared.config import RunConfig
from shared.delta import applied, codes_of, encode_delta_piece
from shared.digest import PIECE_BYTES, combine, digest, piece_hash
from shared.fragments import round_fragment, synced_in
from shared.plan import PieceLayout, PiecePlan, store
from shared.server_opt import FEEDBACK, ServerStep, decode_piece, encode_index, encode_piece, gather, new_state
from shared.strategies import RowWise, WeightedSum, strategy_of
from shared.wire import FLOAT_TAGS, ITEMSIZE, SCHEMA_VERSION, Manifest, TensorSpec, numpy_dtype, tensor_view

ROBUST_ROW_BYTES = 64 * 1024  # the least a row-wise strategy (or a pre-pass) reads of one input at a time
BLOCK_BYTES = 256 * 1024  # the block of an input added into the accumulator at a time (numpy calls stay few)
SLICE_BYTES = 1024 * 1024  # FedAvg sums a piece a slice at a time (a few blocks: a core's own cache holds them)
STREAMS = 8  # inputs whose ranges FedAvg reads at once, each by one streamed request


class RangeSource(Protocol):
    """One input file's data section, read by byte range (offsets relative to the data section). A source may
    also offer `stream(begin, end) -> RangeStream`: the range by one request, read in order a slice at a time
    (FedAvg then reads several inputs' ranges at once, each in slices; see `PieceAggregator._fedavg`)."""

    def readinto(self, begin: int, buf: memoryview) -> None: ...


class RangeStream(Protocol):
    """A byte range of one input, read in order: each `readinto` fills `buf` with the next len(buf) bytes."""

    def readinto(self, buf: memoryview) -> None: ...

    def close(self) -> None: ...


class AtOffsets:
    """A RangeStream over a source whose reads at any offset are cheap (memory, a local file): a read each."""

    def __init__(self, source: RangeSource, begin: int) -> None:
        self.source, self.at = source, begin

    def readinto(self, buf: memoryview) -> None:
        self.source.readinto(self.at, buf)
        self.at += len(buf)

    def close(self) -> None:
        pass


class Held:
    """A RangeStream over bytes already read."""

    def __init__(self, data: memoryview) -> None:
        self.data, self.at = data, 0

    def readinto(self, buf: memoryview) -> None:
        buf[:] = self.data[self.at : self.at + len(buf)]
        self.at += len(buf)

    def close(self) -> None:
        pass


def close_all(streams: Sequence[RangeStream]) -> None:
    for stream in streams:
        with contextlib.suppress(Exception):
            stream.close()


Block = tuple[str, int, int, int]  # dtype, offset in the piece's data, element count, offset in its slice


def slice_blocks(plan: PiecePlan, begin: int, end: int) -> list[list[Block]]:
    """The float blocks of each SLICE_BYTES slice of data range [begin, end) (8-aligned slices cut no element)."""
    out = []
    for lo in range(begin, end, SLICE_BYTES):
        hi = min(lo + SLICE_BYTES, end)
        blocks = []
        for seg in plan.segments(lo, hi):
            if seg.spec.dtype in FLOAT_TAGS:
                item = ITEMSIZE[seg.spec.dtype]
                for b in range(seg.begin, seg.end, BLOCK_BYTES):
                    blocks.append((seg.spec.dtype, b - begin, (min(b + BLOCK_BYTES, seg.end) - b) // item, b - lo))
        out.append(blocks)
    return out


class StateSource(Protocol):
    """The server optimizer's state before the round: of float elements [first, first + count) of the model, in
    data order (`shared.server_opt`)."""

    def load(self, first: int, count: int) -> dict[str, np.ndarray]: ...


class NoState:
    """The state before the first round: zeros."""

    def __init__(self, slots: tuple[str, ...]) -> None:
        self.slots = slots

    def load(self, first: int, count: int) -> dict[str, np.ndarray]:
        return new_state(self.slots, count)


class ArraySource:
    """A RangeSource over tensors in memory (tests, and the witnesses' small models)."""

    def __init__(self, manifest: Manifest, arrays: dict[str, np.ndarray]) -> None:
        layout = manifest.layout()
        self.data = bytearray(manifest.nbytes)
        for name, (begin, end) in layout.items():
            raw = np.ascontiguousarray(arrays[name], numpy_dtype(manifest.tensors[name].dtype)).tobytes()
            self.data[begin:end] = raw

    def readinto(self, begin: int, buf: memoryview) -> None:
        buf[:] = self.data[begin : begin + len(buf)]

    def stream(self, begin: int, end: int) -> AtOffsets:
        return AtOffsets(self, begin)


@dataclass(frozen=True)
class WeightedInput:
    participant: str
    samples: int
    digest: str
    source: RangeSource
    norm: float = -1.0  # L2 distance from the round's global model, as measured at ingest (clipping needs it)


def row_bytes(inputs: int) -> int:
    """How much of each input a row-wise strategy (or a pre-pass) reads at a time: all inputs' together about one
    piece, and never less than ROBUST_ROW_BYTES each (8-aligned: no element is cut)."""
    return max(ROBUST_ROW_BYTES, (PIECE_BYTES // inputs) // 8 * 8)


class WholeRows:
    """Every input's float elements over the whole model, a block at a time (`shared.strategies.WholeInputs`):
    a configure half's pre-pass, reading each input once, into reused buffers."""

    def __init__(self, plan: PiecePlan, sources: Sequence[RangeSource]) -> None:
        self.plan, self.sources = plan, sources

    def blocks(self) -> Iterator[np.ndarray]:
        step, size = row_bytes(len(self.sources)), self.plan.manifest.nbytes
        buffers = [bytearray(min(step, size)) for _ in self.sources]
        for lo in range(0, size, step):
            hi = min(lo + step, size)
            for source, buf in zip(self.sources, buffers, strict=True):
                source.readinto(lo, memoryview(buf)[: hi - lo])
            for seg in self.plan.segments(lo, hi):
                if seg.spec.dtype in FLOAT_TAGS:
                    flat = TensorSpec(seg.spec.dtype, (seg.count,))
                    yield np.stack([tensor_view(buf, seg.begin - lo, flat).astype(np.float64) for buf in buffers])


class PieceAggregator:
    """Computes pieces of a round's global model from ranged reads of its inputs, as the run's strategy says
    (`shared.strategies`): its configure half once, here, then its aggregate half for each piece."""

    def __init__(self, config: RunConfig, plan: PiecePlan, inputs: list[WeightedInput], base: RangeSource | None,
                 state: StateSource | None = None) -> None:
        if not inputs:
            raise ValueError("nothing to aggregate")
        if any(i.samples <= 0 for i in inputs):
            raise ValueError("an update's sample count must be positive")
        self.config, self.plan, self.base = config, plan, base
        self.strategy = strategy_of(config)
        if self.strategy.state_slots:
            raise NotImplementedError(f"the {self.strategy.name} strategy keeps state from round to round, which "
                                      "the aggregation does not carry")
        if self.strategy.needs_base and base is None:
            raise ValueError(f"the {self.strategy.name} strategy needs the round's global model")
        everyone = sorted(inputs, key=lambda i: i.participant)
        whole = WholeRows(plan, [i.source for i in everyone]) if self.strategy.reads_inputs else None
        self.configured = self.strategy.configure(everyone, whole)
        self.inputs = [everyone[k] for k in self.configured.selected]  # the inputs combined, in order
        self.weights = self.configured.coefficients  # a weighted sum's
        self.step = ServerStep.of(config)
        if self.step is not None and base is None:
            raise ValueError("a server optimizer needs the round's global model")
        self.state = state or NoState(self.step.slots if self.step else ())
        self.download = config.download
        if self.download.is_delta and base is None:
            raise ValueError("a compressed download needs the round's global model")
        if plan.synced is not None and base is None:
            raise ValueError("a fragment's round needs the round's global model (the other tensors are its)")
        layout = plan.manifest.layout()
        self._tensors = sorted((a, name) for name, (a, b) in layout.items() if b > a)  # by data-section offset
        self._piece: _PieceState | None = None  # the piece being computed's base values and optimizer state
        self._buffers: list[bytearray] = []  # for inputs that do not stream: two piece-sized read buffers, reused
        self._slice = bytearray(SLICE_BYTES)  # the slice of an input being summed
        self._read_ahead: ThreadPoolExecutor | None = None  # opens the next group of inputs
        self._opening: ThreadPoolExecutor | None = None  # sends a group's requests at once
        self._groups = self._read_groups()
        # accumulators for one piece, indexed by byte offset / 2 (a bf16/f16 element is 2 bytes) or / 8 (float64);
        # float32 tensors are summed in the output piece itself, where no server step or download delta needs
        # them apart (untouched, np.empty's pages cost nothing)
        self._acc32 = np.empty(PIECE_BYTES // 2, np.float32)
        self._acc64 = np.empty(PIECE_BYTES // 8, np.float64)
        self._tmp32 = np.empty(BLOCK_BYTES // 2, np.float32)  # one block's temporary
        self._tmp64 = np.empty(BLOCK_BYTES // 8, np.float64)

    def piece(self, index: int) -> bytearray:
        """The bytes of piece `index` of the output file (a new buffer: it may be uploaded while the next piece
        is computed)."""
        return self.piece_output(index).data

    def piece_output(self, index: int, into: bytearray | None = None) -> PieceOutput:
        """Piece `index` of the output file and, with a server optimizer, the state file of that piece after
        the round's step; with a compressed download, the piece's delta file (`shared.delta`). Its bytes are
        written into `into` when that is a buffer of the piece's size that the caller no longer needs (every
        byte of it is overwritten): a worker that reuses the buffer of a piece already uploaded makes no new
        memory its own for each piece (fresh pages cost a page fault each, the dearest part of a short shard)."""
        layout = self.plan.layout(index)
        start = layout.index * PIECE_BYTES
        size = layout.in_header + layout.data_bytes
        out = into if into is not None and len(into) == size else bytearray(size)
        out[: layout.in_header] = self.plan.header[start : start + layout.in_header]
        data = memoryview(out)[layout.in_header :]
        if self.step is not None or self.download.is_delta or self.plan.synced is not None:
            assert self.base is not None
            self._piece = _PieceState(layout, self.base, self.download.is_delta)
            self._piece.values = (self.state.load(self.plan.floats_before(layout.data_begin), layout.count)
                                  if self.step is not None else {})
        if layout.data_bytes:
            self._data(layout.data_begin, layout.data_end, data)
        if self._piece is None:
            return PieceOutput(out)
        piece, self._piece = self._piece, None
        delta = (piece.finish_delta(self.download, bytes(out[: layout.in_header]), data)
                 if self.download.is_delta else None)
        # (after the delta: with topk downloads it updates the state's error feedback)
        state = None if self.step is None else encode_piece(self.step, index, piece.values)
        return PieceOutput(out, state, delta)

    def _emit(self, out: memoryview, offset: int, spec: TensorSpec, values: np.ndarray) -> None:
        """Store the strategy's aggregate of elements at byte `offset` of the piece's data — or, with a server
        optimizer, the next global values its step makes from them; with a compressed download, keep them until
        the piece's delta is made (`_PieceState.finish_delta`)."""
        if self._piece is not None:
            first = self._piece.first(offset)
            if self.plan.synced is not None and self._tensor_at(offset) not in self.plan.synced:
                # a tensor the round does not sync: the round's global's, byte for byte; no step, state untouched
                kept = tensor_view(self._piece.base, offset, spec)
                if self._piece.targets is not None:
                    self._piece.targets[first : first + spec.numel] = kept
                else:
                    out[offset : offset + spec.nbytes] = self._piece.base[offset : offset + spec.nbytes]
                return
            if self.step is not None and not self.step.rule.identity:
                x = tensor_view(self._piece.base, offset, spec).astype(np.float32)
                state = {slot: v[first : first + spec.numel] for slot, v in self._piece.values.items()}
                values = self.step.apply(x, values, state)
            if self._piece.targets is not None:
                self._piece.targets[first : first + spec.numel] = values
                return
        store(out, offset, spec, values)

    def _tensor_at(self, offset: int) -> str:
        """The tensor at byte `offset` of the data of the piece being computed."""
        assert self._piece is not None
        at = self._piece.layout.data_begin + offset
        return self._tensors[bisect.bisect_right(self._tensors, (at, "\uffff")) - 1][1]

    def _data(self, begin: int, end: int, out: memoryview) -> None:
        if isinstance(self.strategy, WeightedSum):
            self._fedavg(begin, end, out)
            return
        step = row_bytes(len(self.inputs))
        for lo in range(begin, end, step):
            self._rows(lo, min(lo + step, end), out, begin)

    def _fedavg(self, begin: int, end: int, out: memoryview) -> None:
        """A weighted sum of the selected inputs (`shared.strategies.WeightedSum`: FedAvg's). They are summed into
        the piece's accumulator a slice (SLICE_BYTES) at a time: for each slice, every input of a group in turn,
        so a slice of input and of the accumulator stay in a core's own cache,
        and K shard workers on K cores do not evict each other from a shared last-level cache. A group is up to
        STREAMS inputs that stream (`RangeSource.stream`: one request each over the piece's range, all open at
        once, read a slice at a time) or one input that does not (read whole into a reused buffer). The next
        group is opened (its requests sent, or its input read) while this one is summed. Every element is
        summed in the same order (inputs by participant), whatever the shard."""
        blocks = slice_blocks(self.plan, begin, end)
        groups = self._groups
        last = len(self.inputs) - 1
        opening: Future[list[RangeStream]] | None = self._ahead().submit(self._open, groups[0], begin, end, 0)
        try:
            for g, group in enumerate(groups):
                assert opening is not None
                streams, opening = opening.result(), None
                if g + 1 < len(groups):
                    opening = self._ahead().submit(self._open, groups[g + 1], begin, end, g + 1)
                try:
                    self._sum_group(group, streams, blocks, begin, end, last, out)
                finally:
                    close_all(streams)
        finally:
            if opening is not None:  # a failure left the next group opened: its requests are closed too
                with contextlib.suppress(Exception):
                    close_all(opening.result())

    def _sum_group(self, group: list[int], streams: list[RangeStream], blocks: list[list[Block]], begin: int,
                   end: int, last: int, out: memoryview) -> None:
        view = memoryview(self._slice)
        for j, lo in enumerate(range(begin, end, SLICE_BYTES)):
            part = view[: min(lo + SLICE_BYTES, end) - lo]
            whole = sum(count * ITEMSIZE[dtype] for dtype, _, count, _ in blocks[j]) == len(part)
            for k, stream in zip(group, streams, strict=True):
                stream.readinto(part)
                if k == 0 and not whole:  # tensors not averaged (integer counters, flags) come from the first input
                    out[lo - begin : lo - begin + len(part)] = part
                for block in blocks[j]:
                    self._block(block, part, k, k == last, out)

    def _read_groups(self) -> list[list[int]]:
        """The inputs, in order, cut into the groups read together: runs of up to STREAMS that stream, and each
        one that does not on its own."""
        streaming = [hasattr(i.source, "stream") for i in self.inputs]
        groups: list[list[int]] = []
        for k, streams in enumerate(streaming):
            if streams and groups and streaming[groups[-1][0]] and len(groups[-1]) < STREAMS:
                groups[-1].append(k)
            else:
                groups.append([k])
        return groups

    def _open(self, group: list[int], begin: int, end: int, g: int) -> list[RangeStream]:
        """The group's inputs, ready to be read from `begin` a slice at a time."""
        sources = [self.inputs[k].source for k in group]
        if not hasattr(sources[0], "stream"):  # one input read whole, into the buffer the group before did not use
            while len(self._buffers) < 2:
                self._buffers.append(bytearray(PIECE_BYTES))
            buf = memoryview(self._buffers[g % 2])[: end - begin]
            sources[0].readinto(begin, buf)
            return [Held(buf)]
        opened = [self._openers().submit(s.stream, begin, end) for s in sources]  # type: ignore[attr-defined]
        streams: list[RangeStream] = []
        failure: BaseException | None = None
        for f in opened:  # every request is answered (or fails) before any failure is raised: none is left open
            try:
                streams.append(f.result())
            except BaseException as exc:  # noqa: BLE001 - raised below, once the others are closed
                failure = failure or exc
        if failure is not None:
            close_all(streams)
            raise failure
        return streams

    def _ahead(self) -> ThreadPoolExecutor:
        if self._read_ahead is None:
            self._read_ahead = ThreadPoolExecutor(max_workers=1, thread_name_prefix="read-ahead")
        return self._read_ahead

    def _openers(self) -> ThreadPoolExecutor:
        if self._opening is None:
            self._opening = ThreadPoolExecutor(max_workers=STREAMS, thread_name_prefix="open")
        return self._opening

    def _block(self, block: Block, view: memoryview, k: int, last: bool, out: memoryview) -> None:
        """Add input `k`'s elements of `block` (read into `view`, the block's slice) into the accumulator; after
        the last input, emit them."""
        dtype, offset, count, at = block
        wide = dtype == "F64"
        flat = TensorSpec(dtype, (count,))
        direct = dtype == "F32" and self._piece is None  # summed in the output itself: its bytes are the sum's
        if direct:
            acc = tensor_view(out, offset, flat)
        else:
            acc = (self._acc64 if wide else self._acc32)[offset // (8 if wide else 2) :][:count]
        tmp = (self._tmp64 if wide else self._tmp32)[:count]
        x = tensor_view(view, at, flat)
        if x.dtype != acc.dtype:  # bf16 / f16: widened to float32 first
            np.copyto(tmp, x, casting="unsafe")
            x = tmp
        weight = acc.dtype.type(self.weights[k])
        if k == 0:
            np.multiply(x, weight, out=acc)
        else:
            np.multiply(x, weight, out=tmp)
            np.add(acc, tmp, out=acc)
        if last and not direct:
            self._emit(out, offset, flat, acc)

    def _rows(self, begin: int, end: int, out: memoryview, out_begin: int) -> None:
        """Data range [begin, end) by a row-wise strategy (`shared.strategies.RowWise`): every input's range read
        whole, each float tensor's part of it combined as the strategy's aggregate half says."""
        assert isinstance(self.strategy, RowWise)
        rows = []
        for item in self.inputs:
            buf = bytearray(end - begin)
            item.source.readinto(begin, memoryview(buf))
            rows.append(buf)
        base = None
        if self.strategy.needs_base:
            assert self.base is not None
            base = bytearray(end - begin)
            self.base.readinto(begin, memoryview(base))
        out[begin - out_begin : end - out_begin] = rows[0]
        for seg in self.plan.segments(begin, end):
            if seg.spec.dtype not in FLOAT_TAGS:
                continue
            flat = TensorSpec(seg.spec.dtype, (seg.count,))
            stack = np.stack([tensor_view(r, seg.begin - begin, flat).astype(np.float64) for r in rows])
            ref = None if base is None else tensor_view(base, seg.begin - begin, flat).astype(np.float64)
            self._emit(out, seg.begin - out_begin, flat, self.strategy.aggregate(stack, ref, self.configured))


@dataclass
class PieceOutput:
    data: bytearray  # the piece of the global model
    state: bytes | None = None  # its server optimizer state file
    delta: bytes | None = None  # its download delta file


class _PieceState:
    """One piece's base values, optimizer state and (compressed download) targets, addressed by byte offset in
    the piece's data: state and targets hold the piece's float elements in data order (`shared.plan`)."""

    def __init__(self, layout: PieceLayout, base: RangeSource, delta: bool) -> None:
        self.layout = layout
        self.base = bytearray(layout.data_bytes)
        if layout.data_bytes:
            base.readinto(layout.data_begin, memoryview(self.base))
        self.starts = [offset for offset, _, _ in layout.floats]
        self.values: dict[str, np.ndarray] = {}
        self.targets = np.zeros(layout.count, np.float32) if delta else None

    def first(self, offset: int) -> int:
        """The index, among the piece's float elements, of the element at byte `offset` of its data."""
        k = bisect.bisect_right(self.starts, offset) - 1
        start, seg, first = self.layout.floats[k]
        return first + (offset - start) // ITEMSIZE[seg.dtype]

    def finish_delta(self, encoding: Encoding, head: bytes, data: memoryview) -> bytes:
        """Write the piece's float elements as base + decoded delta (`shared.delta`: what every participant
        rebuilds) and return the delta file. With the coordinator's error feedback (a FEEDBACK slot in the
        state: topk downloads) the delta encodes the change plus the feedback, and the feedback becomes what
        the stored model did not take of that (in its own dtype): over rounds, the changes the global made plus
        the feedback left add up to the changes asked for."""
        assert self.targets is not None
        x = self.layout.gather_floats(self.base)
        with np.errstate(over="ignore", invalid="ignore"):
            step = np.subtract(self.targets, x, dtype=np.float32)
            feedback = self.values.get(FEEDBACK)
            if feedback is not None:
                step += feedback
            codes = codes_of(step, encoding)
            self.layout.scatter_floats(data, applied(x, codes, encoding))
            if feedback is not None:
                feedback[:] = step - (self.layout.gather_floats(data) - x)
        return encode_delta_piece(self.layout, encoding, head, self.layout.gather_others(data), codes)


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


def round_plan(config: RunConfig, manifest: Manifest, out_round: int, inputs: Iterable[WeightedInput]) -> PiecePlan:
    """The output file of the round that makes the global of `out_round` — with `fragments`, of a round that changes
    only the fragment it syncs (which its header names)."""
    listed = list(inputs)
    metadata = global_metadata(config.run_id, out_round, listed, config.strategy.value)
    synced = round_fragment(manifest, config.fragments, out_round - 1)
    if synced is not None:
        metadata["fed.fragment"] = f"{synced_in(out_round - 1, config.fragments)}/{config.fragments}"
    return PiecePlan.of(manifest, metadata | strategy_of(config).metadata(len(listed)), synced)


@dataclass(frozen=True)
class RoundOutput:
    """A round's global model file and, with a server optimizer, its state: piece files and index."""

    model: bytes
    state_pieces: tuple[bytes, ...] = ()
    state_index: bytes = b""
    state_counts: tuple[int, ...] = ()  # the float elements each state piece holds
    delta_pieces: tuple[bytes, ...] = ()  # with a compressed download: each piece's delta file

    @property
    def digest(self) -> str:
        return digest(self.model)

    @property
    def state_digest(self) -> str:
        return digest(self.state_index) if self.state_index else ""


class MemoryState:
    """A StateSource over a round's state piece files in memory (tests and small models)."""

    def __init__(self, step: ServerStep, pieces: tuple[bytes, ...], counts: tuple[int, ...]) -> None:
        self.step, self.pieces, self.counts = step, pieces, counts

    @classmethod
    def of(cls, step: ServerStep, out: RoundOutput) -> MemoryState:
        return cls(step, out.state_pieces, out.state_counts)

    def load(self, first: int, count: int) -> dict[str, np.ndarray]:
        return gather(self.step.slots, self.counts, first, count,
                      lambda j: decode_piece(self.step, j, self.pieces[j], self.counts[j]))


def aggregate_round(config: RunConfig, manifest: Manifest, out_round: int, inputs: list[WeightedInput],
                    base: RangeSource | None, state: StateSource | None = None) -> RoundOutput:
    """The whole output of a round in memory (small models and tests)."""
    plan = round_plan(config, manifest, out_round, inputs)
    worker = PieceAggregator(config, plan, inputs, base, state)
    made = [worker.piece_output(i) for i in range(plan.pieces)]
    model = b"".join(p.data for p in made)
    deltas = tuple(p.delta for p in made if p.delta is not None)
    if worker.step is None:
        return RoundOutput(model, delta_pieces=deltas)
    pieces = tuple(p.state for p in made if p.state is not None)
    counts = tuple(plan.layout(i).count for i in range(plan.pieces))
    index = encode_index(worker.step, out_round, digest(model), [digest(p) for p in pieces], counts)
    return RoundOutput(model, pieces, index, state_counts=counts, delta_pieces=deltas)


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
        made = worker.piece_output(i)
        hashes.append(piece_hash(made.data))
        if made.state is not None:
            states.append(digest(made.state))
    model = combine(hashes)
    if worker.step is None:
        return model, ""
    return model, digest(encode_index(worker.step, out_round, model, states,
                                      [plan.layout(i).count for i in range(plan.pieces)]))
