"""moto serves a ranged GET by reading the whole object and slicing it; at model sizes (a shard worker reads
8 MiB ranges of 1 GB updates) that is a full copy of the object per request. `apply()` makes a simple
single range (`bytes=a-b`, `bytes=a-`) read only its bytes from the object's spooled file, as S3 does; and,
behind moto's server (a request context), a whole large object streams from that file in blocks instead of
being read into memory first; and an object's first ETag computation holds the object's lock (moto hashes the
file unlocked, so a concurrent ranged read moving the file's position would corrupt it). Everything else is
served by moto unchanged. Idempotent; used by the local stack and the functional tests."""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from typing import Any

_SIMPLE_RANGE = re.compile(r"bytes=(\d+)-(\d*)")
_state = threading.local()
_applied = False


class _RangeView:
    """What moto slices a ranged response from: the object's length, and reads of its spooled file."""

    def __init__(self, key: Any) -> None:
        self.key = key

    def __len__(self) -> int:
        return int(self.key.contentsize)

    def __getitem__(self, span: slice) -> bytes:
        start, stop, _ = span.indices(len(self))
        with self.key.lock:
            self.key._value_buffer.seek(start)
            return bytes(self.key._value_buffer.read(max(0, stop - start)))


STREAM_FROM = 16 * 1024 * 1024  # whole objects at least this large stream (server only)
STREAM_BLOCK = 8 * 1024 * 1024


def _blocks(key: Any) -> Iterator[bytes]:
    position, size = 0, int(key.contentsize)
    while position < size:
        with key.lock:
            key._value_buffer.seek(position)
            block = key._value_buffer.read(min(STREAM_BLOCK, size - position))
        if not block:
            return
        position += len(block)
        yield bytes(block)


def apply() -> None:
    global _applied
    if _applied:
        return
    from moto.s3.models import FakeKey
    from moto.s3.responses import S3Response

    whole_value: Any = FakeKey.__dict__["value"]  # the property object itself
    original_get_object = S3Response.get_object

    def value(self: Any) -> Any:
        first = getattr(_state, "first", None)
        if first is not None and first < int(self.contentsize):  # a valid range: moto slices the view
            return _RangeView(self)
        if getattr(_state, "stream", False) and int(self.contentsize) >= STREAM_FROM:
            return _blocks(self)  # the server's response streams it (its content-length is set from the key)
        return whole_value.fget(self)

    def get_object(self: Any) -> Any:
        from flask import has_request_context

        match = _SIMPLE_RANGE.fullmatch(self.headers.get("range", "") or "")
        _state.first = int(match.group(1)) if match else None
        _state.stream = match is None and not self.headers.get("range") and has_request_context()
        try:
            return original_get_object(self)
        finally:
            _state.first, _state.stream = None, False

    whole_etag: Any = FakeKey.__dict__["etag"]

    def etag(self: Any) -> Any:  # moto hashes the spooled file unlocked the first time: ranged reads move its position
        with self.lock:
            return whole_etag.fget(self)

    FakeKey.value = property(value, whole_value.fset)  # type: ignore[method-assign,assignment]
    FakeKey.etag = property(etag)  # type: ignore[method-assign,assignment]
    S3Response.get_object = get_object  # type: ignore[method-assign]
    _applied = True
