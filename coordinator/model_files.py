"""Model files in the bucket as the coordinator reads them: authenticated by digest, read by byte range (the range
readers the aggregator is handed are the adapters', `store.ranges`)."""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.deps import Deps
from shared import keys
from shared.wire import Header, Manifest, WireError, header_length, parse_header, parse_header_prefix
from store.blobs import Bucket, NotFound, Tampered
from store.ranges import CorruptInput, HeldRange, ObjectRange


@dataclass(frozen=True)
class GlobalModel:
    """A committed global model, authenticated by its digest (read as it streams: memory is one chunk); its
    header is the run's manifest."""

    key: str
    manifest: Manifest
    version_id: str
    data_offset: int
    size: int

    def held(self, deps: Deps) -> bool:
        """Its data section is in this function's memory (`source`)."""
        return (self.key, self.version_id) in deps.models.held

    def source(self, deps: Deps) -> ObjectRange | HeldRange:
        """Its data section by ranges: from the bucket, or for a small model from memory (one GET per warm function
        instead of one per update that ingest measures against it)."""
        if self.size > SMALL_MODEL_BYTES:
            return ObjectRange(deps.bucket, self.key, self.version_id, self.data_offset)
        models = deps.models
        held: HeldRange | None = models.held.get((self.key, self.version_id))
        if held is not None:
            return held
        with models.lock:  # the round's first updates arrive together: one of them reads it, the others wait for it
            held = models.held.get((self.key, self.version_id))
            if held is None:
                data = deps.bucket.get(self.key, max_bytes=SMALL_MODEL_BYTES, version_id=self.version_id).data
                held = self.hold(deps, data)
            return held

    def hold(self, deps: Deps, data: bytes) -> HeldRange:
        """Keep the data section of `data` (this model's bytes, authenticated) in this function's memory."""
        models = deps.models
        with models.lock:
            if len(models.held) >= 4:
                models.held.clear()
            held = models.held[(self.key, self.version_id)] = HeldRange(data[self.data_offset:])
            return held


SMALL_MODEL_BYTES = 1 << 20  # a global model this small is held in memory by a warm function once read (`WarmModels`)


def read_global(deps: Deps, round_no: int, want: str, in_bucket: bool = False) -> GlobalModel:
    """The global model that round `round_no` trains from, authenticated by the digest the state records
    (never `manifest.json` or whatever else was written at the key since: those are not trusted). Hashing it
    streams the whole model, so a warm function remembers the version it authenticated (a version never changes;
    one that is gone — a restored run wrote the model again — is authenticated afresh). A small model whose data
    this function holds needs nothing more from the bucket, so whether its version is still there is not asked
    (one HEAD less per update ingested) unless `in_bucket` (the caller uses the version itself: a copy)."""
    key = keys.global_key(deps.config.run_id, round_no, want)
    cached = (deps.bucket.name, key)
    verified = deps.models.verified
    known: GlobalModel | None = verified.get(cached)
    if known is not None and ((known.held(deps) and not in_bucket) or deps.bucket.has_version(key, known.version_id)):
        return known
    with deps.models.lock:
        fresh: GlobalModel | None = verified.get(cached)
        if fresh is not None and fresh is not known:  # authenticated meanwhile, by the invocation we waited for
            return fresh
        model = _authenticate(deps, round_no, want, key)
        _remember(deps, model)
        return model


def _authenticate(deps: Deps, round_no: int, want: str, key: str) -> GlobalModel:
    """Hash the model as it streams; a small one is kept whole on the way, so its header and data need no more GETs
    (one request instead of four)."""
    try:
        found = deps.bucket.verified_read(key, want, keep=SMALL_MODEL_BYTES)
        if found.data is not None:
            header = parse_header(found.data)
        else:
            header = read_header(deps.bucket, key, found.version_id, found.size)
    except (NotFound, Tampered, WireError) as exc:
        raise CorruptInput(f"the global model of round {round_no} cannot be read back: {exc}",
                           missing=isinstance(exc, NotFound)) from None
    model = GlobalModel(key, Manifest.of(header), found.version_id, header.data_offset, found.size)
    if found.data is not None:
        model.hold(deps, found.data)
    return model


def written_global(deps: Deps, round_no: int, written: str, data: bytes | bytearray) -> None:
    """A global model this function has just written whole (`data`, whose digest `written` names it): known to it
    as authenticated, and held if small, so the round's ingests and the next aggregation read nothing of it back.
    It is the coordinator's own bytes, just written, at their version: what `_authenticate` would find."""
    key = keys.global_key(deps.config.run_id, round_no, written)
    version_id = deps.bucket.known_version(key)
    if not version_id:  # (an unversioned bucket: the next reader authenticates it from the bucket, as before)
        return
    header = parse_header(memoryview(data))
    model = GlobalModel(key, Manifest.of(header), version_id, header.data_offset, len(data))
    _remember(deps, model)
    if len(data) <= SMALL_MODEL_BYTES:
        model.hold(deps, bytes(data))


def _remember(deps: Deps, model: GlobalModel) -> None:
    """Note a global model as authenticated in this warm function (a few at most)."""
    verified = deps.models.verified
    with deps.models.lock:
        if len(verified) >= 4:
            verified.clear()
        verified[(deps.bucket.name, model.key)] = model


def read_header(bucket: Bucket, key: str, version_id: str, size: int) -> Header:
    """A model file's header, read by range (two small GETs) and checked against the file's size."""
    first = bytearray(8)
    bucket.read_range(key, 0, memoryview(first), version_id)
    prefix = bytearray(8 + header_length(bytes(first), size))
    bucket.read_range(key, 0, memoryview(prefix), version_id)
    return parse_header_prefix(bytes(prefix), size)


def copy_global(deps: Deps, round_no: int, want: str, dest: str) -> None:
    """Copy the authenticated version of a committed global model (not whatever was written over it)."""
    version = read_global(deps, round_no, want, in_bucket=True).version_id
    deps.bucket.copy(keys.global_key(deps.config.run_id, round_no, want), dest, version_id=version)
