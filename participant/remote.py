"""The run's bucket and table as the participant sees them, with retries through transient faults.

Every call goes through `Retrier.call`: network errors, throttling and 5xx responses are logged and
retried with jittered exponential backoff until they succeed or the participant is asked to stop.
Credentials or permission errors are not transient and surface at once.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import logging
import math
import random
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import boto3
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError, PartialCredentialsError
from pynamodb.exceptions import PynamoDBException

from shared import keys
from shared.blobs import Bucket, NotFound
from shared.config import RunConfig
from shared.connection import Connection
from shared.records import round_sk, summary_from_body
from shared.signing import Signer
from shared.state import RoundSummary, RunState
from shared.store import StateStore

log = logging.getLogger("participant")

T = TypeVar("T")
# bytes done, bytes total
ByteProgress = Callable[[int, int], None]

FATAL_CODES = frozenset({
    "AccessDenied", "AccessDeniedException", "InvalidAccessKeyId", "SignatureDoesNotMatch",
    "UnrecognizedClientException", "InvalidClientTokenId", "ExpiredToken", "ExpiredTokenException",
    "MissingAuthenticationToken", "InvalidSignatureException",
})
MULTIPART_THRESHOLD = 64 * 1024 * 1024
CHUNK = 1024 * 1024


class Stopped(Exception):
    """The participant was asked to stop (SIGTERM / SIGINT) while waiting or retrying."""


class FatalRemoteError(RuntimeError):
    """An AWS error that retrying cannot fix (credentials, permissions)."""


def _error_code(exc: BaseException) -> str:
    if isinstance(exc, ClientError):
        return str(exc.response.get("Error", {}).get("Code", ""))
    return str(getattr(exc, "cause_response_code", "") or "")


def is_fatal(exc: BaseException) -> bool:
    """Errors retrying cannot fix: no or bad credentials, no permission."""
    root = exc.cause if isinstance(exc, PynamoDBException) and exc.cause is not None else exc
    return isinstance(root, NoCredentialsError | PartialCredentialsError) or _error_code(exc) in FATAL_CODES


def is_transient(exc: BaseException) -> bool:
    """Network faults, throttling, 5xx and the like: worth retrying."""
    if is_fatal(exc):
        return False
    return isinstance(exc, ClientError | PynamoDBException | BotoCoreError | OSError)


class Retrier:
    def __init__(self, stop: threading.Event, first_delay: float = 0.5, max_delay: float = 15.0) -> None:
        self.stop = stop
        self.first_delay, self.max_delay = first_delay, max_delay

    def call(self, what: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        delay, failures = self.first_delay, 0
        while True:
            if self.stop.is_set():
                raise Stopped()
            try:
                return fn(*args, **kwargs)
            except (NotFound, Stopped):
                raise
            except Exception as exc:
                if is_fatal(exc):
                    raise FatalRemoteError(f"{what}: {exc}") from exc
                if not is_transient(exc):
                    raise
                failures += 1
                pause = delay * random.uniform(0.8, 1.2)
                log.warning("%s failed (%s: %s); retry %d in %.1fs", what, type(exc).__name__, exc, failures, pause)
                if self.stop.wait(pause):
                    raise Stopped() from None
                delay = min(delay * 2, self.max_delay)


def participant_s3_client(endpoint: str | None, region: str) -> Any:
    """Few retries inside botocore (its backoff sleeps cannot be interrupted); `Retrier` does the rest
    and stops promptly on SIGTERM."""
    config = Config(
        retries={"max_attempts": 3, "mode": "standard"},
        connect_timeout=5,
        read_timeout=60,
        s3={"addressing_style": "path"},
    )
    return boto3.client("s3", endpoint_url=endpoint, region_name=region, config=config)


class Remote:
    """Reads and writes of one participant in one run."""

    def __init__(self, conn: Connection, pid: str, retrier: Retrier, signer: Signer) -> None:
        self.conn, self.run_id, self.pid = conn, conn.run_id, pid
        self.retry = retrier
        self.signer = signer  # every upload carries its signature (shared/signing.py)
        self.client = participant_s3_client(conn.endpoint, conn.region)
        self.bucket = Bucket(conn.bucket, self.client)
        self.store = StateStore(conn.table, conn.run_id, conn.endpoint, conn.region)

    # --- reads ------------------------------------------------------------------------------------

    def read_state(self) -> RunState:
        return self.retry.call("reading the run state", self.store.read_state)

    def read_config(self) -> RunConfig | None:
        """The run's configuration as the coordinator published it; None until its first tick."""
        try:
            blob = self.retry.call("reading the run config", self.bucket.get, keys.config_key(self.run_id))
        except NotFound:
            return None
        return RunConfig.model_validate_json(blob.data)

    def participant_record(self) -> Any | None:
        """Our participant record (joined_at, last_seen, ready_epoch), or None before the join is recorded."""
        return self.retry.call("reading our participant record", self.store.participant, self.pid)

    def update_record(self, round_no: int, pid: str | None = None) -> Any | None:
        """The coordinator's record of our update of a round (or, for a witness, another participant's)."""
        who = pid or self.pid
        return self.retry.call(f"reading the round {round_no} record of {who}", self.store.update_record, round_no,
                               who)

    def round_summary(self, round_no: int) -> RoundSummary | None:
        """A closed round's summary (one GetItem); None if it is not recorded."""
        return self.retry.call(f"reading the summary of round {round_no}", self._round_summary, round_no)

    def _round_summary(self, round_no: int) -> RoundSummary | None:
        from pynamodb.exceptions import DoesNotExist

        try:
            item = self.store.m.round.get(self.store.pk, round_sk(round_no), consistent_read=True)
        except DoesNotExist:
            return None
        return summary_from_body(item.body)

    def update_stored(self, round_no: int, since: float | None = None) -> bool:
        return self.stored_since(keys.update_key(self.run_id, round_no, self.pid), since)

    def stored_since(self, key: str, since: float | None = None) -> bool:
        """Whether the object exists (and, with `since`, was written at or after that time: an object left by
        an earlier incarnation of the run, before its state was restored, does not count)."""
        head = self.retry.call(f"checking for {key}", self.bucket.head, key)
        if head is None:
            return False
        modified = head.get("LastModified")
        return since is None or modified is None or modified.timestamp() >= math.floor(since)

    def download(self, key: str, progress: ByteProgress | None = None, version_id: str = "") -> bytes:
        """GET an object (a given version if named) in chunks, reporting progress; a fault mid-stream restarts
        the download."""
        return self.retry.call(f"downloading {key}", self._download_once, key, progress, version_id)

    def _download_once(self, key: str, progress: ByteProgress | None, version_id: str = "") -> bytes:
        extra = {"VersionId": version_id} if version_id else {}
        try:
            resp = self.client.get_object(Bucket=self.conn.bucket, Key=key, **extra)
        except ClientError as exc:
            if _error_code(exc) in {"NoSuchKey", "NoSuchVersion", "404"}:
                raise NotFound(key) from None
            raise
        total = int(resp["ContentLength"])
        buf = io.BytesIO()
        for chunk in resp["Body"].iter_chunks(CHUNK):
            buf.write(chunk)
            if progress is not None:
                progress(buf.tell(), total)
        if buf.tell() != total:
            raise ConnectionError(f"short read: {buf.tell()} of {total} bytes")
        return buf.getvalue()

    # --- writes -----------------------------------------------------------------------------------

    def put_json(self, key: str, body: dict[str, Any], what: str) -> None:
        data = json.dumps(body, sort_keys=True).encode()
        self.retry.call(what, self.bucket.put, key, data, self.signer.metadata(key, data))

    def upload(self, key: str, data: bytes, what: str, progress: ByteProgress | None = None) -> None:
        """PUT with a SHA-256 checksum S3 verifies; multipart above 64 MiB."""
        self.retry.call(what, self._upload_once, key, data, progress)

    def _upload_once(self, key: str, data: bytes, progress: ByteProgress | None) -> None:
        total = len(data)
        signature = self.signer.metadata(key, data)
        if total < MULTIPART_THRESHOLD:
            checksum = base64.b64encode(hashlib.sha256(data).digest()).decode()
            self.client.put_object(
                Bucket=self.conn.bucket, Key=key, Body=data, ChecksumSHA256=checksum, Metadata=signature
            )
            if progress is not None:
                progress(total, total)
            return
        sent = [0]

        def callback(n: int) -> None:
            sent[0] += n
            if progress is not None:
                progress(min(sent[0], total), total)

        config = TransferConfig(multipart_threshold=MULTIPART_THRESHOLD, multipart_chunksize=16 * 1024 * 1024)
        self.client.upload_fileobj(
            io.BytesIO(data), self.conn.bucket, key,
            ExtraArgs={"ChecksumAlgorithm": "SHA256", "Metadata": signature}, Callback=callback, Config=config,
        )
