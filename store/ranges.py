"""Model files in the bucket read by byte range, as the pure aggregator asks for them (`shared.aggregate`'s
`RangeSource` and `RangeStream`): one version of an object, or a small one held in memory. The adapters implement the
core's port here, so a read the aggregator makes goes down to the bucket and never back into the service that
called it. A range that is not there (the object gone, or shorter than recorded) is a `CorruptInput` naming whose
upload it is.
"""

from __future__ import annotations

from shared.aggregate import AtOffsets
from shared.wire import header_length
from store.blobs import Bucket, NotFound, RangeReader


class CorruptInput(RuntimeError):
    """A stored object no longer matches what was recorded for it (or cannot be read back at all)."""

    def __init__(self, message: str, participant: str = "", missing: bool = False) -> None:
        super().__init__(message)
        self.participant = participant  # whose recorded update it is, if it is one
        self.missing = missing  # the object is gone (expired or deleted), rather than changed


class ObjectRange:
    """One version of a model file in the bucket, read by ranges of its data section (`shared.aggregate`)."""

    def __init__(self, bucket: Bucket, key: str, version_id: str, data_offset: int = -1, owner: str = "") -> None:
        self.bucket, self.key, self.version_id, self.owner = bucket, key, version_id, owner
        self._data_offset = data_offset

    @property
    def data_offset(self) -> int:
        if self._data_offset < 0:  # one small read: where this file's data section starts
            first = bytearray(8)
            self._get(0, memoryview(first))
            self._data_offset = 8 + header_length(bytes(first), 1 << 62)
        return self._data_offset

    def readinto(self, begin: int, buf: memoryview) -> None:
        self._get(self.data_offset + begin, buf)

    def stream(self, begin: int, end: int) -> ObjectStream:
        """Data-section bytes [begin, end) by one ranged GET, read in order a slice at a time."""
        try:
            return ObjectStream(self, self.bucket.open_range(self.key, self.data_offset + begin, end - begin,
                                                             self.version_id))
        except NotFound as exc:
            raise self.corrupt(exc) from None

    def _get(self, begin: int, buf: memoryview) -> None:
        try:
            self.bucket.read_range(self.key, begin, buf, self.version_id)
        except NotFound as exc:
            raise self.corrupt(exc) from None

    def corrupt(self, exc: NotFound) -> CorruptInput:
        return CorruptInput(f"{self.key[:200]} (version {self.version_id[:64]!r}) is not in the bucket, or "
                            f"shorter than recorded ({str(exc)[-200:]})", self.owner, missing=True)


class ObjectStream:
    """A ranged GET of an `ObjectRange`, read in order (`shared.aggregate.RangeStream`)."""

    def __init__(self, source: ObjectRange, reader: RangeReader) -> None:
        self.source, self.reader = source, reader

    def readinto(self, buf: memoryview) -> None:
        try:
            self.reader.readinto(buf)
        except NotFound as exc:
            raise self.source.corrupt(exc) from None

    def close(self) -> None:
        self.reader.close()


class HeldRange:
    """A small model's data section, held in memory, read by ranges as `ObjectRange` reads the bucket."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def readinto(self, begin: int, buf: memoryview) -> None:
        end = begin + len(buf)
        if end > len(self.data):
            raise CorruptInput(f"a read of bytes {begin}-{end} past the end of a {len(self.data)}-byte data section")
        buf[:] = self.data[begin:end]

    def stream(self, begin: int, end: int) -> AtOffsets:
        return AtOffsets(self, begin)
