"""The content digest of every model file (updates, global models, initial offers): a tree of SHA-256.

    digest(data) = hex( SHA-256( SHA-256(piece_0) || SHA-256(piece_1) || ... ) )

where the pieces are `data` cut into PIECE_BYTES (8 MiB) pieces, the last one shorter (an empty file is
one empty piece). Why not SHA-256 of the whole file: a model is aggregated in parameter shards by
separate workers, each writing its own pieces of the new global model; each worker hashes the pieces it
writes and the coordinator combines them, so the digest needs no second read of the file. And the
pieces of one file hash in parallel (hashlib releases the GIL), so one large file hashes at the speed
of all cores instead of one. Anyone can recompute it with this module or a dozen lines of any language.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

PIECE_BYTES = 8 * 1024 * 1024
Data = bytes | bytearray | memoryview
_PARALLEL_FROM = 4 * PIECE_BYTES  # below this, threads cost more than they save


def piece_hash(piece: Data) -> bytes:
    return hashlib.sha256(piece).digest()


def combine(piece_hashes: Iterable[bytes]) -> str:
    """The digest of a file from its pieces' hashes, in order."""
    return hashlib.sha256(b"".join(piece_hashes)).hexdigest()


def piece_count(size: int) -> int:
    return max(1, -(-size // PIECE_BYTES))


def piece_hashes(data: Data) -> list[bytes]:
    view = memoryview(data)
    spans = [view[i * PIECE_BYTES : (i + 1) * PIECE_BYTES] for i in range(piece_count(len(view)))]
    if len(view) < _PARALLEL_FROM:
        return [piece_hash(s) for s in spans]
    with ThreadPoolExecutor(max_workers=min(len(spans), os.cpu_count() or 1)) as pool:
        return list(pool.map(piece_hash, spans))


def digest(data: Data) -> str:
    return combine(piece_hashes(data))


class TreeHasher:
    """The same digest over bytes arriving in chunks of any size (a stream, a file read in blocks)."""

    def __init__(self) -> None:
        self._pieces: list[bytes] = []
        self._current = hashlib.sha256()
        self._filled = 0
        self.size = 0

    def update(self, chunk: Data) -> None:
        view = memoryview(chunk).cast("B")
        self.size += len(view)
        while len(view):
            take = min(PIECE_BYTES - self._filled, len(view))
            self._current.update(view[:take])
            self._filled += take
            view = view[take:]
            if self._filled == PIECE_BYTES:
                self._pieces.append(self._current.digest())
                self._current, self._filled = hashlib.sha256(), 0

    def piece_hashes(self) -> list[bytes]:
        tail = [self._current.digest()] if self._filled or not self._pieces else []
        return self._pieces + tail

    def hexdigest(self) -> str:
        return combine(self.piece_hashes())


def digest_file(path: Path, block: int = PIECE_BYTES) -> str:
    """A file's digest, read in blocks (memory: one block)."""
    hasher = TreeHasher()
    with path.open("rb") as f:
        while chunk := f.read(block):
            hasher.update(chunk)
    return hasher.hexdigest()


def digest_of_pieces(pieces: Sequence[Data]) -> str:
    """The digest of the concatenation of `pieces`, each exactly one piece long but the last."""
    return combine(piece_hash(p) for p in pieces)
