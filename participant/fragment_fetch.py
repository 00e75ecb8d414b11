"""A fragmented run's global model (`fragments` > 1) rebuilt from the one before and the bytes its round changed.

Round r's aggregate changes only the fragment it syncs (`shared.fragments`): every other tensor of the new global
is the previous global's, byte for byte, at the same place of the data section (the canonical layout depends on
the tensors alone). So a participant holding the previous global fetches the new one's header and the byte ranges
of the synced tensors (ranged GETs), copies the rest from the file it holds, and checks the whole file's digest
against the one the run records: about 1/F of the model's bytes instead of all of them. Anything that does not
check (the file held is not the previous global: a gap) and the caller downloads the model whole.
Memory: one read buffer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from participant.remote import Remote
from shared.digest import PIECE_BYTES, digest_file
from shared.fragments import round_fragment
from shared.wire import Manifest, WireError, header_length, parse_header_prefix
from store.blobs import NotFound

log = logging.getLogger("participant")

HEADER_READ = 64 * 1024  # the first ranged read: most headers fit


def _header(remote: Remote, key: str) -> tuple[bytes, int]:
    """The new global's header bytes (8-byte length and JSON) and the file's size."""
    found = remote.retry.call("reading the global model's size", remote.bucket.head, key)
    if found is None:
        raise NotFound(key)
    size = int(found["ContentLength"])
    first = bytearray(min(size, HEADER_READ))
    remote.retry.call("reading the global model's header", remote.bucket.read_range, key, 0, memoryview(first))
    need = 8 + header_length(bytes(first[:8]), size)
    if need > len(first):
        rest = bytearray(need - len(first))
        remote.retry.call("reading the global model's header", remote.bucket.read_range, key, len(first),
                          memoryview(rest))
        first += rest
    return bytes(first[:need]), size


def rebuild_from_fragment(remote: Remote, key: str, want: str, previous: Path, fragments: int, round_no: int,
                          out: Path, progress: Callable[[int, int], None] | None = None) -> int | None:
    """Write round `round_no`'s global model (object `key`, digest `want`) to `out` from `previous` (the global
    round `round_no - 1` trained from, as held) and the ranges of the tensors round `round_no - 1` synced; the bytes
    downloaded, or None (and `out` removed) when the result is not `want` or cannot be made."""
    try:
        head, size = _header(remote, key)
        manifest = Manifest.of(parse_header_prefix(head, size))
        with previous.open("rb") as held:
            first8 = held.read(8)
            held_size = previous.stat().st_size
            held_header = parse_header_prefix(first8 + held.read(header_length(first8, held_size)), held_size)
            synced = round_fragment(manifest, fragments, round_no - 1)
            if synced is None or Manifest.of(held_header) != manifest:
                return None
            fetched = len(head)
            with out.open("wb") as f:
                f.write(head)
                buf = bytearray(PIECE_BYTES)
                for begin, end, new in _runs(manifest, synced):
                    for lo in range(begin, end, PIECE_BYTES):
                        view = memoryview(buf)[: min(PIECE_BYTES, end - lo)]
                        if new:
                            remote.retry.call("downloading the synced fragment", remote.bucket.read_range, key,
                                              len(head) + lo, view)
                            fetched += len(view)
                        else:
                            held.seek(held_header.data_offset + lo)
                            if held.readinto(view) != len(view):
                                raise WireError("the held model ends early")
                        f.write(view)
                        if progress is not None:
                            progress(fetched, size)
    except (NotFound, WireError, OSError, ValueError) as exc:
        out.unlink(missing_ok=True)
        log.info("round %d: rebuilding from the previous global and the synced fragment failed (%s); downloading "
                 "the model whole", round_no, str(exc)[:200])
        return None
    if digest_file(out) != want:
        out.unlink(missing_ok=True)
        log.info("round %d: the model held is not the previous global (the rebuilt file is not %s); downloading the "
                 "model whole", round_no, want[:12])
        return None
    return fetched


def _runs(manifest: Manifest, synced: frozenset[str]) -> list[tuple[int, int, bool]]:
    """The data section as runs [begin, end) of tensors all synced (True: fetched) or all kept (False: copied)."""
    runs: list[list[int | bool]] = []
    for name, (a, b) in sorted(manifest.layout().items(), key=lambda item: item[1]):
        if b == a:
            continue
        new = name in synced
        if runs and runs[-1][2] == new and runs[-1][1] == a:
            runs[-1][1] = b
        else:
            runs.append([a, b, new])
    return [(int(a), int(b), bool(n)) for a, b, n in runs]
