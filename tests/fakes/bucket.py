"""An in-memory S3 bucket: `FakeBucket` is the real `store.blobs.Bucket` over `FakeS3`, a client that keeps the
objects in a dict.

Faking the client, not the `Bucket`, keeps every decision the coordinator's reads make the real code's: which
version a verified read takes, when it reports `Tampered` or `NotFound`, `UploadGone`, the versions it remembers.
What `FakeS3` answers is what S3 (and moto, tests/functional/test_fakes_contract.py) answers where the `Bucket`
reads it: a versioned bucket (each put a new version), ETags (the MD5 of the body; a multipart object's
`md5(part MD5s)-N`), multipart uploads (parts of 5 MiB but the last, checked against their SHA-256), copies,
ranged reads, version listings newest first, and the error codes of each miss. LastModified is whole seconds of
`now` (None: the wall clock), so a test fixes what ingest reads of upload times.
"""

from __future__ import annotations

import base64
import hashlib
import io
import re
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from itertools import count
from types import SimpleNamespace
from typing import Any

from botocore.exceptions import ClientError
from botocore.response import StreamingBody

from store.blobs import Bucket

MIN_PART = 5 * 1024 * 1024  # S3's smallest part but the last
_names = count(1)


@dataclass(frozen=True)
class Version:
    data: bytes
    etag: str
    metadata: dict[str, str]
    version_id: str
    modified: float


def md5(data: bytes) -> str:
    return hashlib.md5(data, usedforsecurity=False).hexdigest()


def error(code: str, status: int, operation: str) -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": code}, "ResponseMetadata": {"HTTPStatusCode": status}},
                       operation)


class FakeS3:
    """The S3 client calls `store.blobs.Bucket` makes, against one versioned bucket held in memory."""

    def __init__(self, name: str, now: float | None = None) -> None:
        self.name, self.now = name, now
        self.objects: dict[str, list[Version]] = {}  # key -> its versions, oldest first
        self.uploads: dict[str, tuple[str, dict[int, bytes]]] = {}  # upload id -> (key, parts by number)
        self._ids = count(1)
        self._lock = threading.RLock()  # each call atomic, as S3's are

    def _store(self, key: str, data: bytes, metadata: dict[str, str], etag: str = "") -> Version:
        with self._lock:
            version = Version(data, etag or md5(data), {k.lower(): v for k, v in metadata.items()},
                              f"v{next(self._ids):08d}", time.time() if self.now is None else self.now)
            self.objects.setdefault(key, []).append(version)
        return version

    def _bucket(self, bucket: str, operation: str) -> None:
        if bucket != self.name:
            raise error("NoSuchBucket", 404, operation)

    def _version(self, bucket: str, key: str, version_id: str | None, operation: str) -> Version:
        self._bucket(bucket, operation)
        versions = self.objects.get(key, [])
        found = [v for v in versions if v.version_id == version_id] if version_id else versions[-1:]
        if not found:  # (HEAD has no body, so botocore names its error by the status alone)
            code = "404" if operation == "HeadObject" else "NoSuchVersion" if version_id else "NoSuchKey"
            raise error(code, 404, operation)
        return found[0]

    @staticmethod
    def _head(v: Version) -> dict[str, Any]:
        return {"ETag": f'"{v.etag}"', "VersionId": v.version_id, "ContentLength": len(v.data),
                "LastModified": datetime.fromtimestamp(int(v.modified), UTC), "Metadata": dict(v.metadata)}

    # --- objects -------------------------------------------------------------------------------------------

    def put_object(self, Bucket: str, Key: str, Body: bytes, Metadata: dict[str, str] | None = None) -> dict[str, Any]:
        self._bucket(Bucket, "PutObject")
        v = self._store(Key, bytes(Body), Metadata or {})
        return {"ETag": f'"{v.etag}"', "VersionId": v.version_id}

    def head_object(self, Bucket: str, Key: str, VersionId: str | None = None) -> dict[str, Any]:
        return self._head(self._version(Bucket, Key, VersionId, "HeadObject"))

    def get_object(self, Bucket: str, Key: str, VersionId: str | None = None, Range: str = "") -> dict[str, Any]:
        v = self._version(Bucket, Key, VersionId, "GetObject")
        data = v.data
        if Range:
            begin, end = re.fullmatch(r"bytes=(\d+)-(\d*)", Range).groups()  # type: ignore[union-attr]
            if int(begin) >= len(data):
                raise error("InvalidRange", 416, "GetObject")
            data = data[int(begin):int(end) + 1 if end else None]
        return {**self._head(v), "ContentLength": len(data), "Body": StreamingBody(io.BytesIO(data), len(data))}

    def copy_object(self, Bucket: str, Key: str, CopySource: dict[str, str]) -> dict[str, Any]:
        source = self._version(CopySource["Bucket"], CopySource["Key"], CopySource.get("VersionId"), "CopyObject")
        v = self._store(Key, source.data, source.metadata)  # (one part: the copy's ETag is its MD5)
        return {"VersionId": v.version_id, "CopyObjectResult": {"ETag": f'"{v.etag}"'}}

    def delete_object(self, Bucket: str, Key: str, VersionId: str) -> dict[str, Any]:
        """Delete one version (a test's way to make a recorded version go missing)."""
        with self._lock:
            self.objects[Key] = [v for v in self.objects.get(Key, []) if v.version_id != VersionId]
        return {"VersionId": VersionId}

    def list_object_versions(self, Bucket: str, Prefix: str = "", KeyMarker: str = "", VersionIdMarker: str = "",
                             MaxKeys: int = 1000) -> dict[str, Any]:
        self._bucket(Bucket, "ListObjectVersions")
        with self._lock:
            listed = [(key, v) for key in sorted(self.objects) if key.startswith(Prefix)
                      for v in reversed(self.objects[key])]  # by key, each key's newest first
        after = [i + 1 for i, (key, v) in enumerate(listed) if (key, v.version_id) == (KeyMarker, VersionIdMarker)]
        start = after[0] if after else 0
        page = listed[start:start + MaxKeys]
        out: dict[str, Any] = {"Versions": [{"Key": key, "VersionId": v.version_id, "Size": len(v.data),
                                             "ETag": f'"{v.etag}"', "IsLatest": v is self.objects[key][-1]}
                                            for key, v in page],
                               "IsTruncated": start + MaxKeys < len(listed)}
        if out["IsTruncated"]:
            out |= {"NextKeyMarker": page[-1][0], "NextVersionIdMarker": page[-1][1].version_id}
        return out

    def get_paginator(self, operation: str) -> Any:
        assert operation == "list_objects_v2", operation

        def paginate(Bucket: str, Prefix: str = "") -> list[dict[str, Any]]:
            self._bucket(Bucket, "ListObjectsV2")
            with self._lock:
                return [{"Contents": [{"Key": key, "Size": len(versions[-1].data)}
                                      for key, versions in sorted(self.objects.items())
                                      if key.startswith(Prefix) and versions]}]

        return SimpleNamespace(paginate=paginate)

    # --- multipart -----------------------------------------------------------------------------------------

    def _upload(self, upload_id: str, operation: str) -> tuple[str, dict[int, bytes]]:
        if upload_id not in self.uploads:
            raise error("NoSuchUpload", 404, operation)
        return self.uploads[upload_id]

    def create_multipart_upload(self, Bucket: str, Key: str, **_: Any) -> dict[str, Any]:
        self._bucket(Bucket, "CreateMultipartUpload")
        with self._lock:
            upload_id = f"u{next(self._ids):08d}"
            self.uploads[upload_id] = (Key, {})
        return {"UploadId": upload_id}

    def upload_part(self, Bucket: str, Key: str, UploadId: str, PartNumber: int, Body: bytes,
                    ChecksumSHA256: str = "") -> dict[str, Any]:
        if ChecksumSHA256 and base64.b64encode(hashlib.sha256(Body).digest()).decode() != ChecksumSHA256:
            raise error("BadDigest", 400, "UploadPart")  # (S3 checks it; moto does not)
        with self._lock:
            self._upload(UploadId, "UploadPart")[1][PartNumber] = bytes(Body)
        return {"ETag": f'"{md5(Body)}"'}

    def complete_multipart_upload(self, Bucket: str, Key: str, UploadId: str,
                                  MultipartUpload: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            _, parts = self._upload(UploadId, "CompleteMultipartUpload")
            chosen: list[bytes] = []
            for part in MultipartUpload["Parts"]:
                data = parts.get(part["PartNumber"])
                if data is None or md5(data) != part["ETag"].strip('"'):
                    raise error("InvalidPart", 400, "CompleteMultipartUpload")
                if chosen and len(chosen[-1]) < MIN_PART:
                    raise error("EntityTooSmall", 400, "CompleteMultipartUpload")
                chosen.append(data)
            del self.uploads[UploadId]
            etag = f"{md5(b''.join(bytes.fromhex(md5(d)) for d in chosen))}-{len(chosen)}"
            v = self._store(Key, b"".join(chosen), {}, etag)
        return {"ETag": f'"{v.etag}"', "VersionId": v.version_id}

    def abort_multipart_upload(self, Bucket: str, Key: str, UploadId: str) -> dict[str, Any]:
        with self._lock:
            self._upload(UploadId, "AbortMultipartUpload")
            del self.uploads[UploadId]
        return {}


class FakeBucket(Bucket):
    """The run's bucket, in memory (`FakeS3`); `now` fixes the LastModified of what is written from then on."""

    client: FakeS3

    def __init__(self, name: str = "", now: float | None = None) -> None:
        # a name of its own: nothing a process holds by bucket name (models it authenticated) crosses fakes
        name = name or f"fake-bucket-{next(_names)}"
        super().__init__(name, FakeS3(name, now))

    @property
    def now(self) -> float | None:
        return self.client.now

    @now.setter
    def now(self, value: float | None) -> None:
        self.client.now = value
