"""moto's S3 handles an object's bytes whole, several times over; at model sizes (1 GB updates and globals) that is
gigabytes of copies in the local server for each request. These patches (`PATCHES`) make it move them in blocks,
as S3 would, and fix two of its answers. The objects, ETags and checksums are moto's own, byte for byte
(tests/functional/test_local_objects.py and test_moto_patches.py compare them).

Objects are never changed in place, so the files a completed upload or a copy is made of are shared, each closed
when the last object made of it is disposed. On this machine writing a GB into the server's temporary files costs
~2.5 CPU-s once a few GB are held (page cache writeback), so each GB not written is seconds of a round at 1 GB."""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import os
import re
import threading
from collections.abc import Iterator
from typing import Any

from local.moto.patches import BUG, SPEED, Patch

_SIMPLE_RANGE = re.compile(r"bytes=(\d+)-(\d*)")
_state = threading.local()

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


class _SharedFile:
    """A (rolled-over) spooled file that objects' values are made of: a completed upload's part, a copied object's
    bytes. Closed when the last value using it lets go."""

    def __init__(self, file: Any) -> None:
        file.flush()
        self.file, self.fd = file, file.fileno()  # (a spooled file still in memory rolls over to disk here)
        self.users = 0
        self.lock = threading.Lock()

    def take(self) -> _SharedFile:
        with self.lock:
            self.users += 1
        return self

    def drop(self) -> None:
        with self.lock:
            self.users -= 1
            last = self.users == 0
        if last:
            self.file.close()


Segments = list[tuple[_SharedFile, int, int]]  # (file, offset in it, length)


class _Joined:
    """A new object's value made of byte ranges of shared files, in order: what `set_value` makes the object's
    buffer of (`_Span`), no byte copied."""

    def __init__(self, segments: Segments) -> None:
        self.segments = segments

    def __len__(self) -> int:
        return sum(length for _, _, length in self.segments)


def _pread(fd: int, length: int, offset: int) -> bytes:
    chunks = []
    while length > 0:
        chunk = os.pread(fd, length, offset)
        if not chunk:
            raise OSError(f"a shared object file ended {length} bytes early")
        chunks.append(chunk)
        length, offset = length - len(chunk), offset + len(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


class _Span:
    """What a FakeKey keeps in place of its spooled file (`_value_buffer`) when its bytes are ranges of shared
    files: read-only, positioned as a file is (seek, tell, read), read with `os.pread` (readers of other objects
    sharing a file never move each other's position). `close` lets go of the files."""

    def __init__(self, segments: Segments) -> None:
        self.segments = [(shared.take(), offset, length) for shared, offset, length in segments]
        self.size = sum(length for _, _, length in segments)
        self.position = 0
        self.closed = False

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: self.size}[whence]
        self.position = max(0, base + offset)
        return self.position

    def tell(self) -> int:
        return self.position

    def read(self, size: int | None = -1) -> bytes:
        if self.closed:
            raise ValueError("read of a closed object file")
        end = self.size if size is None or size < 0 else min(self.size, self.position + size)
        chunks, base = [], 0
        for shared, offset, length in self.segments:
            low, high = max(self.position, base), min(end, base + length)
            if low < high:
                chunks.append(_pread(shared.fd, high - low, offset + low - base))
            base += length
        self.position = max(self.position, end)
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            for shared, _, _ in self.segments:
                shared.drop()


def _shared(key: Any) -> Segments:
    """The segments of an object's bytes, its spooled file made shareable first (under the object's lock: readers
    find its buffer there)."""
    with key.lock:
        if not isinstance(key._value_buffer, _Span):
            span = _Span([(_SharedFile(key._value_buffer), 0, int(key.contentsize))])
            key._value_buffer = span
        return list(key._value_buffer.segments)


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

    @classmethod
    def of(cls, upload: Any) -> _UploadChecksum:
        """The checksum a multipart upload (`FakeMultipart`) asked for when it was started."""
        return cls(upload.metadata.get("x-amz-checksum-algorithm"), upload.metadata.get("x-amz-checksum-type"))

    def update(self, block: bytes) -> None:
        (self.part if self.kind == "COMPOSITE" else self.whole).update(block)

    def end_part(self) -> None:
        if self.kind == "COMPOSITE":
            self.of_parts += self.part.digest()
            self.part = _Running(self.algorithm)
        self.parts += 1

    def taken_part(self, checksum: bytes) -> None:
        """A composite checksum's part, its own checksum taken as it arrived (`_part_checksum`)."""
        self.of_parts += checksum
        self.parts += 1

    def build(self) -> tuple[str, str, int]:
        if self.kind == "COMPOSITE":
            of_parts = _Running(self.algorithm)
            of_parts.update(bytes(self.of_parts))
            return self.kind, base64.b64encode(of_parts.digest()).decode(), self.parts
        return self.kind, base64.b64encode(self.whole.digest()).decode(), 1


def _part_checksum(upload: Any, value: bytes) -> bytes | None:
    """A part's own checksum for its upload's composite checksum, taken as it arrives (None: the upload's checksum
    is of the whole object, computed at completion)."""
    checksum = _UploadChecksum.of(upload)
    if checksum.kind != "COMPOSITE":
        return None
    running = _Running(checksum.algorithm)
    running.update(value)
    return running.digest()


def _complete(self: Any, body: Any) -> tuple[_Joined, str, tuple[str, str, int]]:
    """`FakeMultipart.complete`: the same checks and results; the new object is the parts' files as they are."""
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
    checksum = _UploadChecksum.of(self)
    md5s = bytearray()
    for part in parts:
        md5s += bytes.fromhex(part.etag.replace('"', ""))
        taken = getattr(part, "fed_checksum", None)
        if checksum.kind == "COMPOSITE" and taken is not None:
            checksum.taken_part(taken)
            continue
        for block in _read(part._value_buffer, int(part.contentsize)):
            checksum.update(block)
        checksum.end_part()
    segments: Segments = []
    for part in parts:  # (the parts' files are the new object's bytes: kept open past moto's closing of the parts)
        segments.append((_SharedFile(part._value_buffer), 0, int(part.contentsize)))
        part._value_buffer = tempfile.SpooledTemporaryFile()
    return _Joined(segments), f"{hashlib.md5(md5s, usedforsecurity=False).hexdigest()}-{len(parts)}", \
        checksum.build()


def _object_bytes_in_blocks(whole_value: Any, get_object: Any, copy_object: Any) -> tuple[object, ...]:
    """FakeKey.value (a property), S3Response.get_object, S3Backend.copy_object."""
    import tempfile

    def value(self: Any) -> Any:
        size, held = int(self.contentsize), self._value_buffer
        if getattr(_state, "copying", None) is self and (size >= STREAM_FROM or isinstance(held, _Span)):
            return _Joined(_shared(self))  # the source of a CopyObject: the copy is made of its files
        first = getattr(_state, "first", None)
        if first is not None and first < size:  # a valid range: moto slices the view
            return _RangeView(self)
        if getattr(_state, "stream", False) and size >= STREAM_FROM:
            return _blocks(self)  # the server's response streams it (its content-length is set from the key)
        return whole_value.fget(self)

    def set_value(self: Any, new_value: Any) -> None:
        if isinstance(self._value_buffer, _Span):  # (bytes written over shared ones go to a file of the object's own)
            self._value_buffer.close()
            self._value_buffer = tempfile.SpooledTemporaryFile(self._max_buffer_size)
        if not isinstance(new_value, _Joined):
            whole_value.fset(self, new_value)
            return
        self._value_buffer.close()  # (a new object: nobody else holds it yet)
        self._value_buffer = _Span(new_value.segments)
        self.contentsize = len(new_value)

    def ranged_get_object(self: Any) -> Any:
        from flask import has_request_context

        match = _SIMPLE_RANGE.fullmatch(self.headers.get("range", "") or "")
        _state.first = int(match.group(1)) if match else None
        _state.stream = match is None and not self.headers.get("range") and has_request_context()
        try:
            return get_object(self)
        finally:
            _state.first, _state.stream = None, False

    def sharing_copy_object(self: Any, src_key: Any, *args: Any, **kwargs: Any) -> Any:
        _state.copying = src_key
        try:
            return copy_object(self, src_key, *args, **kwargs)
        finally:
            _state.copying = None

    return property(value, set_value), ranged_get_object, sharing_copy_object


def _completion_of_the_parts_files(complete: Any, set_part: Any) -> tuple[object, ...]:
    """FakeMultipart.complete, FakeMultipart.set_part."""

    def checksummed_set_part(self: Any, part_id: int, value: Any) -> Any:
        part: Any = set_part(self, part_id, value)
        part.fed_checksum = _part_checksum(self, bytes(value))
        return part

    return _complete, checksummed_set_part


def _etag_under_the_lock(whole_etag: Any) -> tuple[object, ...]:
    """FakeKey.etag (a property)."""

    def etag(self: Any) -> Any:
        with self.lock:
            return whole_etag.fget(self)

    return (property(etag),)


def _no_such_upload(upload_part: Any) -> tuple[object, ...]:
    """S3Backend.upload_part."""

    def upload_part_of_a_live_upload(self: Any, bucket_name: str, multipart_id: str, *args: Any,
                                     **kwargs: Any) -> Any:
        from moto.s3.exceptions import NoSuchUpload

        if multipart_id not in self.get_bucket(bucket_name).multiparts:
            raise NoSuchUpload(upload_id=multipart_id)
        return upload_part(self, bucket_name, multipart_id, *args, **kwargs)

    return (upload_part_of_a_live_upload,)


PATCHES = (
    Patch(
        "s3_object_bytes_in_blocks", SPEED,
        ("moto.s3.models:FakeKey.value", "moto.s3.responses:S3Response.get_object",
         "moto.s3.models:S3Backend.copy_object"),
        "A ranged GET (`bytes=a-b`, `bytes=a-`; a shard worker reads 8 MiB ranges of 1 GB updates) reads only its "
        "bytes from the object's spooled file (moto read the whole object and sliced it). Behind moto's server (a "
        "request context), a whole large object streams from that file in blocks instead of being read into memory "
        "first. A CopyObject of a large object makes the copy of the source's files (moto read the source whole "
        "and wrote it again).",
        _object_bytes_in_blocks),
    Patch(
        "s3_completion_of_the_parts_files", SPEED,
        ("moto.s3.models:FakeMultipart.complete", "moto.s3.models:FakeMultipart.set_part"),
        "Completing a multipart upload makes the new object of the parts' files as they are, no byte copied or read "
        "again: each part's checksum for the upload's composite checksum is taken when the part arrives. moto "
        "joined the parts into one bytearray, copied it to bytes, joined them again for a whole-object checksum and "
        "copied that too: four copies of the object in memory, 7.9 GB of server peak in `make bench-big` at 1 GB; "
        "then, written into a new file block by block, still 1 GB written to disk and 1 GB read back for the "
        "checksum on the global's serial path.",
        _completion_of_the_parts_files, needs=("s3_object_bytes_in_blocks",)),  # (the value setter takes _Joined)
    Patch(
        "s3_etag_under_the_object_lock", BUG,
        ("moto.s3.models:FakeKey.etag",),
        "An object's first ETag computation holds the object's lock: moto hashes the spooled file unlocked, so a "
        "concurrent read of the object (which moves the file's position, under the lock) makes it the MD5 of part "
        "of the bytes.",
        _etag_under_the_lock),
    Patch(
        "s3_part_of_a_gone_upload_is_no_such_upload", BUG,
        ("moto.s3.models:S3Backend.upload_part",),
        "A part sent to an upload that was completed or aborted is refused with NoSuchUpload, as S3 refuses it "
        "(moto failed the request with an internal error, a KeyError): a shard worker delivered after its tick "
        "gave up tells its upload is gone from that, and leaves no outcome (`functions.shard`).",
        _no_such_upload),
)
