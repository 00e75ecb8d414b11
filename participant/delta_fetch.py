"""A round's global model rebuilt from the previous one and the round's compressed delta (`shared.delta`),
instead of downloaded whole: a quarter of the bytes with int8, half with bf16, a few per cent with topk.

Nothing fetched is trusted: the delta's index must rebuild exactly the model the run state names (its piece
hashes combine to that digest), each delta piece must have the digest the index lists, and each rebuilt piece
must have its listed hash before the next is fetched. Anything else (no delta for this round, the previous
model not in the cache, a piece that does not check) and the caller downloads the full model. Memory: one
piece and its delta.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

from participant.remote import Remote
from shared import keys
from shared.compress import Encoding
from shared.delta import (
    MAX_INDEX_BYTES,
    DeltaError,
    DeltaIndex,
    decode_delta_piece,
    header_of,
    max_piece_file_bytes,
    rebuild_piece,
)
from shared.digest import digest, piece_hash
from shared.plan import PiecePlan
from shared.wire import WireError, header_length
from store.blobs import NotFound

log = logging.getLogger("participant")



class FileRange:
    """A model file on disk, read by data-section range (the previous global model in the cache)."""

    def __init__(self, path: Path) -> None:
        self.file = path.open("rb")
        self.size = os.fstat(self.file.fileno()).st_size
        self.data_offset = 8 + header_length(self.file.read(8), self.size)

    def readinto(self, begin: int, buf: memoryview) -> None:
        self.file.seek(self.data_offset + begin)
        filled = 0
        while filled < len(buf):
            n = self.file.readinto(buf[filled:])
            if not n:
                raise DeltaError(f"the previous model is shorter than the delta needs ({self.data_offset + begin})")
            filled += n

    def close(self) -> None:
        self.file.close()


def rebuild_from_delta(remote: Remote, run_id: str, round_no: int, want: str, encoding: Encoding,
                       previous: Callable[[str], Path | None], out: Path,
                       progress: Callable[[int, int], None] | None = None) -> int | None:
    """Write round `round_no`'s global model (digest `want`) to `out` from its delta and the previous model
    (`previous(digest)`: its file in the cache, or None); the bytes downloaded, or None (and `out` removed)
    when that cannot be done — the caller then downloads the model whole."""
    try:
        blob = remote.retry.call("downloading the delta index", remote.bucket.get,
                                 keys.delta_key(run_id, round_no, want), MAX_INDEX_BYTES)
        index = DeltaIndex.decode(blob.data, want)
    except NotFound:
        log.info("round %d: no download delta for model %s; downloading it whole", round_no, want[:12])
        return None
    except (DeltaError, ValueError) as exc:
        log.warning("round %d: the download delta's index is unusable (%s); downloading the model whole",
                    round_no, str(exc)[:200])
        return None
    base_path = previous(index.base)
    if index.encoding != encoding or base_path is None:
        why = "another encoding" if index.encoding != encoding else f"model {index.base[:12]} is not in the cache"
        log.info("round %d: the delta applies to %s; downloading the model whole", round_no, why)
        return None
    try:
        fetched = len(blob.data) + _rebuild(remote, run_id, round_no, index, FileRange(base_path), out, progress)
    except (DeltaError, WireError, NotFound, ValueError) as exc:
        out.unlink(missing_ok=True)
        log.warning("round %d: rebuilding from the delta failed (%s); downloading the model whole", round_no,
                    str(exc)[:200])
        return None
    return fetched


def _rebuild(remote: Remote, run_id: str, round_no: int, index: DeltaIndex, base: FileRange, out: Path,
             progress: Callable[[int, int], None] | None) -> int:
    fetched, heads = 0, b""
    limit = max_piece_file_bytes(index.encoding)
    plan: PiecePlan | None = None
    try:
        with out.open("wb") as f:
            for i, (want_hash, want_file) in enumerate(zip(index.hashes, index.pieces, strict=True)):
                data = remote.retry.call("downloading a delta piece", remote.bucket.get,
                                         keys.delta_key(run_id, round_no, want_file), limit).data
                fetched += len(data)
                if digest(data) != want_file:
                    raise DeltaError(f"delta piece {i} is not the file the index lists")
                piece = decode_delta_piece(data, i, index.encoding)
                if plan is None:
                    heads += piece.head.tobytes()
                    if (found := header_of(heads, index.size)) is not None:
                        plan = PiecePlan(found[1], found[0])
                if plan is None:
                    raise DeltaError(f"delta piece {i} holds data before the model's header is complete")
                rebuilt = rebuild_piece(plan.layout(i), base, piece, index.encoding)
                if piece_hash(rebuilt) != bytes.fromhex(want_hash):
                    raise DeltaError(f"piece {i} rebuilt from the delta does not have the hash the index lists")
                f.write(rebuilt)
                if progress is not None:
                    progress(fetched, 0)
    finally:
        base.close()
    if plan is None or plan.size != index.size:
        raise DeltaError("the delta's pieces do not make a model of the size the index says")
    return fetched
