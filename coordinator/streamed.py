"""One uploaded model file read once, as it streams: its digest, its header, and the data-section checks
(`shared.scan`) against the round's global model. Memory: a few blocks, whatever the file's size.

A compressed update (`shared.compress`, the run's `update_encoding`) is checked twice: as it streams, as the
encoded file it is (its manifest, its encoding, finite scales and bf16 values); then read again by range and
decoded against the global model, as aggregation will read it, for the finiteness of the weights it stands
for and their distance from the global."""

from __future__ import annotations

from dataclasses import dataclass, field

from coordinator.deps import Deps
from coordinator.model_files import GlobalModel
from shared.compress import CachedRange, CompressError, DecodedSource, Encoding, encoded_manifest
from shared.digest import PIECE_BYTES, TreeHasher
from shared.fragments import round_fragment
from shared.keys import parse_key
from shared.scan import DataScan
from shared.wire import Header, Manifest, WireError, header_length, parse_header_prefix
from store.ranges import ObjectRange

BLOCK = PIECE_BYTES


@dataclass
class Streamed:
    digest: str = ""
    metadata: dict[str, str] = field(default_factory=dict)
    header: Header | None = None
    problem: str = ""  # why the file is not a valid model of the run ("" if it is, or was not checked)
    distance: float = -1.0


def stream_model(deps: Deps, key: str, version_id: str, size: int, model: GlobalModel | None,
                 check: bool = True) -> Streamed:
    """Hash every byte of one object version; if `check`, validate it against `model` (its manifest and
    canonical layout, finiteness, distance) — or, with no model, as a stand-alone file (an initial offer)."""
    resp, chunks = deps.bucket.stream(key, version_id)
    out = Streamed(metadata=dict(resp.get("Metadata", {})))
    hasher, pending = TreeHasher(), bytearray()
    scan: DataScan | None = None
    position = 0  # data-section offset of pending[0]
    encoding = deps.config.encoding if model is not None else Encoding()
    synced = None  # with fragments, an update holds the round's fragment alone
    if model is not None and deps.config.fragments > 1:
        synced = round_fragment(model.manifest, deps.config.fragments, parse_key(key).round or 0)
    reference = bytearray(BLOCK) if model is not None and not encoding.is_delta else None
    for chunk in chunks:
        hasher.update(chunk)
        if not check or out.problem:
            continue
        pending += chunk
        if out.header is None:
            try:
                if len(pending) < 8:
                    continue
                need = 8 + header_length(bytes(pending[:8]), size)
                if len(pending) < need:
                    continue
                out.header = parse_header_prefix(bytes(pending[:need]), size)
                scan = _scan_for(out.header, model, encoding, synced)
                del pending[:need]
            except WireError as exc:
                out.problem = str(exc)
                continue
        assert scan is not None
        while len(pending) >= BLOCK:
            _feed(deps, scan, model, position, memoryview(pending[:BLOCK]), reference)  # (a copy: pending shrinks)
            del pending[:BLOCK]
            position += BLOCK
        out.problem = scan.problem
    out.digest = hasher.hexdigest()
    if hasher.size != size:
        out.problem = out.problem or f"object changed while read: {hasher.size} bytes, {size} announced"
    if check and not out.problem:
        if out.header is None:
            out.problem = f"truncated safetensors file: {size} bytes end inside the header"
        else:
            assert scan is not None
            _feed(deps, scan, model, position, memoryview(pending), reference)
            out.problem = scan.problem
            if model is not None and encoding.is_delta and not out.problem:
                scan = _scan_decoded(deps, ObjectRange(deps.bucket, key, version_id, out.header.data_offset), model,
                                     encoding, synced)
                out.problem = scan.problem
            out.distance = scan.distance if model is not None else -1.0
    return out


def _scan_for(header: Header, model: GlobalModel | None, encoding: Encoding,
              synced: frozenset[str] | None = None) -> DataScan:
    if model is not None:
        try:
            sent = Encoding.of_metadata(header.metadata)
        except CompressError as exc:
            raise WireError(str(exc)) from None
        if sent != encoding:
            raise WireError(f"update encoded as {sent}; this run's updates are {encoding} (update_encoding)")
        expected = encoded_manifest(model.manifest, encoding, synced)
        if reason := expected.mismatch(header):
            said = f" (an update encoded as {encoding}" + (", of this round's fragment" if synced else "") + ")"
            raise WireError(reason + (said if encoding.is_delta else ""))
        return DataScan(expected)
    manifest = Manifest.of(header)
    if not header.tensors:
        raise WireError("the file holds no tensors")
    if reason := manifest.mismatch(header):  # laid out canonically, as every later file must be
        raise WireError(reason)
    return DataScan(manifest)


def _scan_decoded(deps: Deps, encoded: ObjectRange, model: GlobalModel, encoding: Encoding,
                  synced: frozenset[str] | None) -> DataScan:
    """The weights an encoded update stands for, block by block: finite, and their distance from the global."""
    base = CachedRange(model.source(deps))  # (read once a block: by the decoding and as the reference)
    source = DecodedSource(model.manifest, encoding, base, encoded, synced)
    scan = DataScan(model.manifest)
    block, reference = bytearray(BLOCK), bytearray(BLOCK)
    total = model.manifest.nbytes
    for begin in range(0, total, BLOCK):
        n = min(BLOCK, total - begin)
        try:
            source.readinto(begin, memoryview(block)[:n])
        except CompressError as exc:  # (what the encoded bytes say, checked as they are decoded: a topk chunk's)
            scan.problem = str(exc)
            break
        base.readinto(begin, memoryview(reference)[:n])
        scan.feed(begin, memoryview(block)[:n], memoryview(reference)[:n])
        if scan.problem:
            break
    return scan


def _feed(deps: Deps, scan: DataScan, model: GlobalModel | None, begin: int, block: memoryview,
          reference: bytearray | None) -> None:
    if not len(block):
        return
    ref = None
    if model is not None and reference is not None:
        ref = memoryview(reference)[: len(block)]
        model.source(deps).readinto(begin, ref)
    scan.feed(begin, block, ref)
