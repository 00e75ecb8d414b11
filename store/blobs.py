"""The run's bucket: the small S3 surface the coordinator and participants use."""

from __future__ import annotations

import base64
import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import boto3
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import ClientError

from shared.digest import TreeHasher, digest

STREAM_CHUNK = 8 * 1024 * 1024
COPY_CONFIG = TransferConfig(multipart_threshold=5 * 1000**3, multipart_chunksize=512 * 1024**2, max_concurrency=8)


class NotFound(Exception):
    """A missing key, version or range. `denied`: the answer was S3's 403 to a caller that may not list the bucket,
    which is all S3 says of a missing key to such a caller, and also what it says of a key the caller may not read:
    the caller that knows the object must exist (`participant.remote.Remote.must_exist`) tells the two apart."""

    def __init__(self, *args: object, denied: bool = False) -> None:
        super().__init__(*args)
        self.denied = denied


class UploadGone(Exception):
    """A multipart upload that no longer takes parts: it was completed or aborted."""


class Tampered(Exception):
    """No stored version of a content-addressed object holds the bytes its digest names."""


# A verified read of an object whose version is not known (`Bucket.known_version`) and whose current version does
# not match looks back through its older versions: it reads (hashes) at most MAX_VERSIONS_TRIED of them, the oldest
# first, among the first MAX_VERSIONS_LISTED versions that S3 lists (newest first, LIST_PAGE a request, one page held
# at a time). The coordinator writes a content-addressed key before anyone can know its name, so the oldest version
# is its own: versions written over it, however many, cost a listing page per thousand, never a read each.
MAX_VERSIONS_TRIED = 20
MAX_VERSIONS_LISTED = 10_000
LIST_PAGE = 1000
KNOWN_VERSIONS = 4096  # object versions a Bucket remembers (key and version id: a few hundred bytes each)

T = TypeVar("T")


@dataclass(frozen=True)
class Verified:
    """A version authenticated by its digest: its id, its size, and its bytes where they were kept."""

    version_id: str
    size: int
    data: bytes | None = None


@dataclass(frozen=True)
class Blob:
    data: bytes
    etag: str
    metadata: dict[str, str]
    version_id: str = ""
    last_modified: float = 0.0  # when S3 stored it (seconds since the epoch); 0: not known


def s3_addressing(endpoint: str | None) -> dict[str, str]:
    """How an S3 client names the bucket in its requests (botocore's `s3` config), for every S3 client of the
    product: on AWS (no endpoint) in the host name, bucket.s3.<region>.amazonaws.com, as AWS wants (it deprecated
    path-style requests); at a custom endpoint (the local stack's moto server on 127.0.0.1, which has no host name
    per bucket) in the path."""
    return {"addressing_style": "path" if endpoint else "virtual"}


def s3_client(endpoint: str | None = None, region: str = "us-east-1") -> Any:
    # Checksums are sent as headers where we have them (parts carry their SHA-256, which is their digest piece
    # hash); botocore's default would stream every large body through a CRC in aws-chunked encoding instead.
    # Reads are checked by our own digest (a multipart object's checksum is of its parts, not of its bytes).
    # Connections: an aggregation reads up to 2 x STREAMS ranges at once (`shared.aggregate`), beside its uploads.
    config = Config(retries={"max_attempts": 8, "mode": "standard"}, s3=s3_addressing(endpoint),
                    request_checksum_calculation="when_required", response_checksum_validation="when_required",
                    max_pool_connections=32)
    return boto3.client("s3", endpoint_url=endpoint, region_name=region, config=config)


class RangeReader:
    """An open ranged GET: `readinto` fills each buffer with the next bytes (NotFound if the object ends first)."""

    def __init__(self, key: str, body: Any, length: int) -> None:
        self.key, self.body, self.length, self.read = key, body, length, 0
        self.raw = body._raw_stream  # urllib3's response: readinto avoids a copy per chunk

    def readinto(self, buf: memoryview) -> None:
        filled = 0
        while filled < len(buf):
            n = self.raw.readinto(buf[filled:])
            if not n:
                raise NotFound(f"{self.key}: short ranged read ({self.read + filled} of {self.length} bytes)")
            filled += n
        self.read += filled

    def close(self) -> None:
        self.body.close()


# The codes S3 answers a read of a missing key (or version) with, and those it answers instead to a caller that may
# not list the bucket (s3:ListBucket): so that such a caller cannot tell which keys exist.
MISSING_CODES = frozenset({"NoSuchKey", "NoSuchVersion", "404", "NotFound"})
UNLISTED_MISSING_CODES = frozenset({"AccessDenied", "403", "Forbidden"})


def older_versions(client: Any, bucket: str, key: str, skip: set[str], max_bytes: int | None) -> tuple[list[str], int]:
    """The versions of `key` a verified read tries after the named and current ones, oldest first: at most
    MAX_VERSIONS_TRIED, none in `skip` or larger than `max_bytes`, among the first MAX_VERSIONS_LISTED listed;
    and how many were listed. One page is held at a time."""
    tail: deque[str] = deque(maxlen=MAX_VERSIONS_TRIED)  # the oldest seen so far: S3 lists newest first
    listed = 0
    marker: dict[str, str] = {}
    while listed < MAX_VERSIONS_LISTED:
        page = client.list_object_versions(Bucket=bucket, Prefix=key, **marker,
                                           MaxKeys=min(LIST_PAGE, MAX_VERSIONS_LISTED - listed))
        for v in page.get("Versions", []):
            if v["Key"] != key:  # S3 lists keys in order: past `key`'s versions, into longer keys
                return list(reversed(tail)), listed
            listed += 1
            if v["VersionId"] not in skip and (max_bytes is None or int(v.get("Size", 0)) <= max_bytes):
                tail.append(v["VersionId"])
        if not page.get("IsTruncated") or not page.get("NextKeyMarker"):
            break
        marker = {"KeyMarker": page["NextKeyMarker"], "VersionIdMarker": page.get("NextVersionIdMarker", "")}
    return list(reversed(tail)), listed


class Bucket:
    """`unlisted`: the caller holds no s3:ListBucket (a participant), so S3 answers a read of a missing key with 403
    AccessDenied, and that answer, for a key the caller may read, means "not there" (and neither listing versions nor
    reading one by its id is possible: a verified read that finds the current version altered reports it as
    tampered).

    The bucket is versioned, and what the coordinator wrote is read back only by a verified read (`read_verified`,
    `verified_version`): the version whose bytes match the digest the committed state names, never whatever was
    written at the key since. The Bucket remembers the version id of each object it wrote and of each version a
    verified read authenticated, and the state store tells it the versions a committed state records (`remember`),
    so such a read goes straight to that version (one GET) however many versions were written over it."""

    def __init__(self, name: str, client: Any, unlisted: bool = False) -> None:
        self.name = name
        self.client = client
        self.unlisted = unlisted
        self._known: OrderedDict[str, str] = OrderedDict()  # key -> version id, least recently used first
        self._known_lock = threading.Lock()

    def _missing(self, exc: ClientError) -> bool:
        code = exc.response["Error"]["Code"]
        return code in MISSING_CODES or self._denied(exc)

    def _denied(self, exc: ClientError) -> bool:
        return self.unlisted and exc.response["Error"]["Code"] in UNLISTED_MISSING_CODES

    # --- versions known to hold what the coordinator wrote ------------------------------------------------

    def remember(self, key: str, version_id: str) -> None:
        """Take `version_id` as the version of `key` a verified read tries first (it still checks its digest)."""
        if not version_id:
            return
        with self._known_lock:
            self._known[key] = version_id
            self._known.move_to_end(key)
            while len(self._known) > KNOWN_VERSIONS:
                self._known.popitem(last=False)

    def known_version(self, key: str) -> str:
        """The version of `key` this Bucket wrote, authenticated or was told of last ("": none)."""
        with self._known_lock:
            version = self._known.get(key, "")
            if version:
                self._known.move_to_end(key)
            return version

    # --- reads ---------------------------------------------------------------------------------------------

    def _get_object(self, key: str, version_id: str = "", **extra: Any) -> dict[str, Any]:
        """GetObject (a given version if named); NotFound for a missing key, version or range."""
        if version_id:
            extra["VersionId"] = version_id
        try:
            return dict(self.client.get_object(Bucket=self.name, Key=key, **extra))
        except ClientError as exc:
            code = exc.response["Error"]["Code"]
            # (a version id S3 cannot parse is answered InvalidArgument: no such version either)
            if self._missing(exc) or code == "InvalidRange" or (version_id and code == "InvalidArgument"):
                raise NotFound(f"{key}: {exc}" if "Range" in extra else key, denied=self._denied(exc)) from None
            raise

    def get(self, key: str, max_bytes: int | None = None, version_id: str = "") -> Blob:
        """Read an object (a given version if named); with max_bytes, refuse (ValueError) a larger one."""
        resp = self._get_object(key, version_id)
        body = resp["Body"]
        if max_bytes is not None and resp["ContentLength"] > max_bytes:
            body.close()
            raise ValueError(f"object is {resp['ContentLength']} bytes, over the {max_bytes}-byte limit")
        modified = resp.get("LastModified")
        return Blob(
            body.read(), resp["ETag"].strip('"'), dict(resp.get("Metadata", {})), resp.get("VersionId") or "",
            modified.timestamp() if modified is not None else 0.0,
        )

    def read_range(self, key: str, begin: int, buf: memoryview, version_id: str = "") -> None:
        """Fill `buf` with the object's bytes from `begin` (one ranged GET, read straight into `buf`)."""
        if not len(buf):
            return
        reader = self.open_range(key, begin, len(buf), version_id)
        try:
            reader.readinto(buf)
        finally:
            reader.close()

    def open_range(self, key: str, begin: int, length: int, version_id: str = "") -> RangeReader:
        """The object's bytes [begin, begin + length) by one ranged GET, to be read in order."""
        resp = self._get_object(key, version_id, Range=f"bytes={begin}-{begin + max(length, 1) - 1}")
        return RangeReader(key, resp["Body"], length)

    def stream(self, key: str, version_id: str = "", chunk: int = STREAM_CHUNK) -> tuple[dict[str, Any], Any]:
        """The object's GET response and an iterator over its bytes in chunks (never the whole object)."""
        resp = self._get_object(key, version_id)
        return resp, resp["Body"].iter_chunks(chunk)

    def verified_version(self, key: str, want: str, version_id: str = "") -> tuple[str, int]:
        """(version id, size) of the version of `key` whose digest is `want`, hashed as it streams (memory: one
        chunk). Objects the coordinator wrote are read back only this way (or by `read_verified`), so bytes written
        over them (locally nothing stops anyone; on AWS, IAM does) are never taken for the coordinator's own."""
        found = self.verified_read(key, want, 0, version_id)
        return found.version_id, found.size

    def verified_read(self, key: str, want: str, keep: int, version_id: str = "") -> Verified:
        """As `verified_version`, and the bytes too where the version is at most `keep` bytes long: one GET, where
        reading a small object's bytes after authenticating it would take another."""

        def read(version: str) -> tuple[Verified | None, str, str]:
            found, got, size, data = self.digest_of(key, version, keep)
            return Verified(got, size, data), got, found

        return self._verified(key, want, version_id, read)

    def read_verified(self, key: str, want: str, max_bytes: int, version_id: str = "") -> Blob:
        """The version of `key` whose digest is `want` (a small object, read whole; versions over `max_bytes` are
        not it)."""

        def read(version: str) -> tuple[Blob | None, str, str]:
            try:
                blob = self.get(key, max_bytes, version)
            except ValueError:  # too large to be it
                return None, version, ""
            return blob, blob.version_id, digest(blob.data)

        return self._verified(key, want, version_id, read, max_bytes)

    def get_verified(self, key: str, want: str, max_bytes: int, version_id: str = "") -> bytes:
        """The bytes of the version of `key` whose digest is `want` (a small object, read whole)."""
        return self.read_verified(key, want, max_bytes, version_id).data

    def _verified(self, key: str, want: str, version_id: str, read: Callable[[str], tuple[T | None, str, str]],
                  max_bytes: int | None = None) -> T:
        """The first version whose digest is `want` of: the one named (`version_id`, else the one known: a committed
        state names it), the current one, and the look-back (`MAX_VERSIONS_TRIED`). `read(version)` ("": the
        current one) gives (what to return, its version id, its digest: "" if it cannot be the one wanted)."""
        tried: set[str] = set()
        named = "" if self.unlisted else (version_id or self.known_version(key))
        candidates = [named] if named else []
        candidates.append("")
        missing = True
        for version in candidates:
            try:
                result, got, found = read(version)
            except NotFound:
                continue  # a version named but gone (a restored run wrote the object again): look further
            missing = False
            if found == want and result is not None:
                self.remember(key, got or version)
                return result
            tried.update(v for v in (version, got) if v)
        if self.unlisted:
            if missing:
                raise NotFound(key)
            raise Tampered(f"{key[:200]} does not match its digest {want[:64]}")
        older, listed = older_versions(self.client, self.name, key, tried, max_bytes)
        for version in older:
            try:
                result, got, found = read(version)
            except NotFound:
                continue  # deleted since it was listed
            if found == want and result is not None:
                self.remember(key, got or version)
                return result
        if missing and not listed:
            raise NotFound(key)
        raise Tampered(f"no version of {key[:200]} matches its digest {want[:64]} (the current one and "
                       f"{len(older)} of the {listed} listed were tried)")

    def digest_of(self, key: str, version_id: str = "", keep: int = 0) -> tuple[str, str, int, bytes | None]:
        """(content digest, version id, size, the bytes where there are at most `keep` of them, else None) of an
        object version, hashed as it streams (memory: one chunk, or `keep` bytes)."""
        resp, chunks = self.stream(key, version_id)
        hasher = TreeHasher()
        kept: bytearray | None = bytearray() if int(resp.get("ContentLength", keep + 1)) <= keep else None
        for chunk in chunks:
            hasher.update(chunk)
            if kept is not None:
                kept += chunk
        data = bytes(kept) if kept is not None and len(kept) == hasher.size else None
        return hasher.hexdigest(), resp.get("VersionId") or "", hasher.size, data

    # --- multipart: a large object written in parts, by several writers ----------------------------------

    def start_multipart(self, key: str) -> str:
        resp = self.client.create_multipart_upload(Bucket=self.name, Key=key, ChecksumAlgorithm="SHA256")
        return str(resp["UploadId"])

    def put_part(self, key: str, upload_id: str, number: int, data: bytes | bytearray, sha256: bytes) -> str:
        """Upload part `number`; S3 checks it against `sha256` (its SHA-256, which the caller has anyway)."""
        try:
            resp = self.client.upload_part(Bucket=self.name, Key=key, UploadId=upload_id, PartNumber=number,
                                           Body=bytes(data), ChecksumSHA256=base64.b64encode(sha256).decode())
        except ClientError as exc:
            if exc.response["Error"]["Code"] == "NoSuchUpload":
                raise UploadGone(f"the upload {upload_id} of {key} was completed or aborted") from exc
            raise
        return str(resp["ETag"]).strip('"')

    def complete_multipart(self, key: str, upload_id: str, written: list[tuple[str, bytes]]) -> str:
        """Stitch parts 1..n (their ETags and SHA-256s, in order) into one object; its version id."""
        parts = [{"PartNumber": n, "ETag": f'"{etag}"', "ChecksumSHA256": base64.b64encode(sha).decode()}
                 for n, (etag, sha) in enumerate(written, start=1)]
        resp = self.client.complete_multipart_upload(Bucket=self.name, Key=key, UploadId=upload_id,
                                                     MultipartUpload={"Parts": parts})
        version = str(resp.get("VersionId") or "")
        self.remember(key, version)
        return version

    def abort_multipart(self, key: str, upload_id: str) -> None:
        try:
            self.client.abort_multipart_upload(Bucket=self.name, Key=key, UploadId=upload_id)
        except ClientError:
            pass  # already completed or aborted: nothing left to clean up

    def has_version(self, key: str, version_id: str) -> bool:
        try:
            self.client.head_object(Bucket=self.name, Key=key, VersionId=version_id)
            return True
        except ClientError as exc:
            if self._missing(exc) or exc.response["Error"]["Code"] == "400":
                return False
            raise

    def head(self, key: str) -> dict[str, Any] | None:
        try:
            return dict(self.client.head_object(Bucket=self.name, Key=key))
        except ClientError as exc:
            if self._missing(exc):
                return None
            raise

    def put(self, key: str, data: bytes | bytearray, metadata: dict[str, str] | None = None) -> str:
        """Write an object whole; its ETag (its version is remembered: `known_version`)."""
        resp = self.client.put_object(Bucket=self.name, Key=key, Body=bytes(data), Metadata=metadata or {})
        self.remember(key, str(resp.get("VersionId") or ""))
        return str(resp["ETag"]).strip('"')

    def copy(self, source: str, dest: str, version_id: str = "") -> None:
        """Server-side copy of `source` (a given version if named) to `dest`: one CopyObject up to S3's 5 GB limit
        for it (the version it makes is remembered), beyond that a multipart copy (UploadPartCopy) in parallel
        parts (whose version a verified read finds: the oldest at a content-addressed key)."""
        which = {"VersionId": version_id} if version_id else {}
        origin = {"Bucket": self.name, "Key": source} | which
        head = self.client.head_object(Bucket=self.name, Key=source, **which)
        if int(head["ContentLength"]) < COPY_CONFIG.multipart_threshold:
            resp = self.client.copy_object(Bucket=self.name, Key=dest, CopySource=origin)
            self.remember(dest, str(resp.get("VersionId") or ""))
            return
        self.client.copy(origin, self.name, dest, Config=COPY_CONFIG)

    def keys(self, prefix: str) -> list[str]:
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.name, Prefix=prefix)
        return [o["Key"] for page in pages for o in page.get("Contents", [])]
