"""moto's S3 handles an object's bytes whole, several times over; at model sizes (1 GB updates and globals) that is
gigabytes of copies in the local server for each request. `apply()` makes it move them in blocks, as S3 would:

- a ranged GET (`bytes=a-b`, `bytes=a-`; a shard worker reads 8 MiB ranges of 1 GB updates) reads only its bytes
  from the object's spooled file (moto read the whole object and sliced it);
- behind moto's server (a request context), a whole large object streams from that file in blocks instead of
  being read into memory first;
- completing a multipart upload writes the parts' files into the new object block by block, and its checksum is
  computed as the blocks go by (moto joined the parts into one bytearray, copied it to bytes, joined them again
  for a whole-object checksum and copied that too: four copies of the object in memory, 7.9 GB of server peak in
  `make bench-big` at 1 GB);
- a CopyObject writes the source's file into the copy block by block (moto read the source whole);
- an object's first ETag computation holds the object's lock (moto hashes the file unlocked, so a concurrent
  ranged read moving the file's position would corrupt it).

The objects, ETags and checksums are moto's own, byte for byte (tests/functional/test_local_objects.py compares
them). Idempotent; used by the local stack and the functional tests."""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
import threading
from collections.abc import Iterator
from typing import Any

_SIMPLE_RANGE = re.compile(r"bytes=(\d+)-(\d*)")
_state = threading.local()
_applied = False
_moto: dict[str, Any] = {}  # moto's own methods this replaces (tests compare against them)

STREAM_FROM = 16 * 1024 * 1024  # whole objects at least this large stream (server only)
STREAM_BLOCK = 8 * 1024 * 1024


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


class _Blocks:
    """A new object's value made of other objects' bytes, in order (a completed upload's parts, a copy's source):
    written into the new object block by block, never whole in memory. `sources` are each an iterator of blocks;
    `owned`, files to close once written (the parts' files, taken from them: moto closes the parts' own before it
    stores the completed object)."""

    def __init__(self, sources: list[Iterator[bytes]], size: int, owned: tuple[Any, ...] = ()) -> None:
        self.sources, self.size, self.owned = sources, size, owned

    def __len__(self) -> int:
        return self.size


def _read(buffer: Any, size: int) -> Iterator[bytes]:
    """A file's first `size` bytes, a block at a time (a file nobody else reads meanwhile)."""
    buffer.seek(0)
    while size > 0:
        block = buffer.read(min(STREAM_BLOCK, size))
        if not block:
            return
        size -= len(block)
        yield bytes(block)


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


class _Running:
    """One checksum of moto's (`moto.s3.utils.compute_checksum`: the same algorithms and fallbacks), fed in
    blocks."""

    def __init__(self, algorithm: str) -> None:
        self.algorithm, self.crc = algorithm, 0
        self.hash: Any = None
        self.crc32c: Any = None
        self.crc64: Any = None
        if algorithm == "SHA1":
            self.hash = hashlib.sha1(usedforsecurity=False)
        elif algorithm == "CRC32C":
            try:
                import crc32c

                self.crc32c = crc32c.crc32c
            except ImportError:  # (moto falls back to CRC32 too)
                pass
        elif algorithm == "CRC64NVME":
            try:
                from awscrt import checksums

                self.crc64 = checksums.crc64nvme
            except ImportError:  # (moto falls back to CRC32 too)
                pass
        elif algorithm != "CRC32":
            self.hash = hashlib.sha256(usedforsecurity=False)

    def update(self, block: bytes) -> None:
        if self.hash is not None:
            self.hash.update(block)
        elif self.crc32c is not None:
            self.crc = self.crc32c(block, self.crc)
        elif self.crc64 is not None:
            self.crc = self.crc64(block, self.crc)
        else:
            self.crc = binascii.crc32(block, self.crc)

    def digest(self) -> bytes:
        if self.hash is not None:
            return bytes(self.hash.digest())
        return self.crc.to_bytes(8 if self.crc64 is not None else 4, "big")


class _UploadChecksum:
    """moto's checksum of a completed multipart upload (`MultipartChecksumBuilder`), fed the parts' blocks."""

    def __init__(self, algorithm: str | None, kind: str | None) -> None:
        self.algorithm = algorithm or "CRC64NVME"  # (moto's defaults)
        self.kind = kind or ("FULL_OBJECT" if self.algorithm == "CRC64NVME" else "COMPOSITE")
        self.whole, self.part = _Running(self.algorithm), _Running(self.algorithm)
        self.of_parts = bytearray()
        self.parts = 0

    def update(self, block: bytes) -> None:
        (self.part if self.kind == "COMPOSITE" else self.whole).update(block)

    def end_part(self) -> None:
        if self.kind == "COMPOSITE":
            self.of_parts += self.part.digest()
            self.part = _Running(self.algorithm)
        self.parts += 1

    def build(self) -> tuple[str, str, int]:
        if self.kind == "COMPOSITE":
            of_parts = _Running(self.algorithm)
            of_parts.update(bytes(self.of_parts))
            return self.kind, base64.b64encode(of_parts.digest()).decode(), self.parts
        return self.kind, base64.b64encode(self.whole.digest()).decode(), 1


def _complete(self: Any, body: Any) -> tuple[_Blocks, str, tuple[str, str, int]]:
    """`FakeMultipart.complete`: the same checks and results, the parts' bytes read once, in blocks."""
    import tempfile

    from moto.s3.exceptions import EntityTooSmall, InvalidPart, MalformedXML
    from moto.settings import S3_UPLOAD_PART_MIN_SIZE

    parts: list[Any] = []
    for number, etag in body:  # every check first: a refused completion leaves the upload as it was
        part = self.parts.get(number)
        if part is None or part.etag.replace('"', "") != etag.replace('"', ""):
            raise InvalidPart()
        if parts and parts[-1].contentsize < S3_UPLOAD_PART_MIN_SIZE:
            raise EntityTooSmall()
        parts.append(part)
    if not parts:
        raise MalformedXML
    checksum = _UploadChecksum(self.metadata.get("x-amz-checksum-algorithm"),
                               self.metadata.get("x-amz-checksum-type"))
    md5s = bytearray()
    for part in parts:
        md5s += bytes.fromhex(part.etag.replace('"', ""))
        for block in _read(part._value_buffer, int(part.contentsize)):
            checksum.update(block)
        checksum.end_part()
    owned = []
    for part in parts:  # (the parts' files are the new object's bytes: kept open past moto's closing of the parts)
        owned.append(part._value_buffer)
        part._value_buffer = tempfile.SpooledTemporaryFile()
    value = _Blocks([_read(f, int(p.contentsize)) for f, p in zip(owned, parts, strict=True)],
                    sum(int(p.contentsize) for p in parts), tuple(owned))
    return value, f"{hashlib.md5(md5s, usedforsecurity=False).hexdigest()}-{len(parts)}", checksum.build()


def apply() -> None:
    global _applied
    if _applied:
        return
    from moto.s3.models import FakeKey, FakeMultipart, S3Backend
    from moto.s3.responses import S3Response

    _moto["complete"] = FakeMultipart.complete
    whole_value: Any = FakeKey.__dict__["value"]  # the property object itself
    original_get_object = S3Response.get_object
    original_copy_object = S3Backend.copy_object

    def value(self: Any) -> Any:
        size = int(self.contentsize)
        if getattr(_state, "copying", None) is self:  # the source of a CopyObject: written into the copy in blocks
            return _Blocks([_blocks(self)], size)
        first = getattr(_state, "first", None)
        if first is not None and first < int(self.contentsize):  # a valid range: moto slices the view
            return _RangeView(self)
        if getattr(_state, "stream", False) and int(self.contentsize) >= STREAM_FROM:
            return _blocks(self)  # the server's response streams it (its content-length is set from the key)
        return whole_value.fget(self)

    def set_value(self: Any, new_value: Any) -> None:
        if not isinstance(new_value, _Blocks):
            whole_value.fset(self, new_value)
            return
        self._value_buffer.seek(0)  # (a new object: nobody else holds it yet)
        self._value_buffer.truncate()
        try:
            for source in new_value.sources:
                for block in source:
                    self._value_buffer.write(block)
        finally:
            for owned in new_value.owned:
                owned.close()
        self.contentsize = len(new_value)

    def get_object(self: Any) -> Any:
        from flask import has_request_context

        match = _SIMPLE_RANGE.fullmatch(self.headers.get("range", "") or "")
        _state.first = int(match.group(1)) if match else None
        _state.stream = match is None and not self.headers.get("range") and has_request_context()
        try:
            return original_get_object(self)
        finally:
            _state.first, _state.stream = None, False

    def copy_object(self: Any, src_key: Any, *args: Any, **kwargs: Any) -> Any:
        _state.copying = src_key
        try:
            return original_copy_object(self, src_key, *args, **kwargs)
        finally:
            _state.copying = None

    whole_etag: Any = FakeKey.__dict__["etag"]

    def etag(self: Any) -> Any:  # moto hashes the spooled file unlocked the first time: ranged reads move its position
        with self.lock:
            return whole_etag.fget(self)

    FakeKey.value = property(value, set_value)  # type: ignore[method-assign,assignment]
    FakeKey.etag = property(etag)  # type: ignore[method-assign,assignment]
    FakeMultipart.complete = _complete  # type: ignore[method-assign,assignment]
    S3Response.get_object = get_object  # type: ignore[method-assign]
    S3Backend.copy_object = copy_object  # type: ignore[method-assign]
    _applied = True
