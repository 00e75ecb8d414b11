"""The run's bucket and table as the participant sees them, with retries through transient faults.

Every call goes through `Retrier.call`: network errors, throttling and 5xx responses are logged and
retried with jittered exponential backoff until they succeed or the participant is asked to stop.
Credentials or permission errors are not transient and surface at once.

Model files (hundreds of MB to several GB) go between the bucket and the disk through boto3's transfer
manager (`download_file`, `upload_file`): parts of PART_BYTES in parallel, never the whole object in memory.
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
import random
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import CancelledError
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

import boto3
from boto3.s3.transfer import TransferConfig, create_transfer_manager
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError, PartialCredentialsError
from pynamodb.exceptions import PynamoDBException
from s3transfer.exceptions import RetriesExceededError
from s3transfer.futures import TransferFuture
from s3transfer.manager import TransferManager

from shared import keys
from shared.config import RunConfig
from shared.digest import digest, digest_file
from shared.signing import SignatureError, Signer, verify_digest
from shared.state import RoundSummary, RunState
from store.blobs import MISSING_CODES, UNLISTED_MISSING_CODES, Bucket, NotFound, s3_addressing
from store.connection import Connection
from store.push import Pushed
from store.table import StateStore
from store.views import ParticipantRecord, UpdateRecord

log = logging.getLogger("participant")

T = TypeVar("T")
# bytes done, bytes total
ByteProgress = Callable[[int, int], None]

FATAL_CODES = frozenset({
    "AccessDenied", "AccessDeniedException", "InvalidAccessKeyId", "SignatureDoesNotMatch",
    "UnrecognizedClientException", "InvalidClientTokenId", "ExpiredToken", "ExpiredTokenException",
    "MissingAuthenticationToken", "InvalidSignatureException",
    "403", "Forbidden",  # a HEAD's AccessDenied has no body, only its status (a missing key's 403 never gets here)
})
PART_BYTES = 8 * 1024 * 1024  # one part of a multipart upload, one ranged GET of a download
MULTIPART_THRESHOLD = 2 * PART_BYTES  # smaller objects go in one PUT or GET
TRANSFER_THREADS = 8  # parts in flight at once, per transfer
IO_QUEUE_CHUNKS = 32  # downloaded chunks (256 KiB each) waiting to be written to disk, at most
STOP_POLL = 0.2  # seconds between checks for a stop request while a transfer runs
# How long an object that must exist (the published config once the run has started, a global model the state names)
# may answer 403 before the participant takes it as a denial, not as "not there yet", and stops saying so. S3 reads
# are consistent after a write, so an object the state names is there at once: the wait covers a clock step, a
# restore in progress, a policy change being propagated.
DENIED_PATIENCE = 60.0


def transfer_config() -> TransferConfig:
    return TransferConfig(
        multipart_threshold=MULTIPART_THRESHOLD, multipart_chunksize=PART_BYTES, max_concurrency=TRANSFER_THREADS,
        max_io_queue=IO_QUEUE_CHUNKS, use_threads=True,
        preferred_transfer_client="classic",  # (not the CRT client: progress, cancellation and retries as here)
    )


class Stopped(Exception):
    """The participant was asked to stop (SIGTERM / SIGINT) while waiting or retrying."""


class FatalRemoteError(RuntimeError):
    """An AWS error that retrying cannot fix (credentials, permissions)."""


class DeniedRead(FatalRemoteError):
    """A read of an object that must exist kept answering 403: this host's credentials may not read it."""


def denied_message(what: str, key: str, seconds: float) -> str:
    return (f"{what} ({key}) has been refused (403 AccessDenied) for {seconds:.0f} s although the run says it exists: "
            "this host's credentials may not read the run's objects. Check them with `fed-participant check` (with "
            "the same --invite, --stack or profile); on AWS, the participant role's policy, the bucket policy and the "
            "session's tags (docs/deploy.md)")


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
        max_pool_connections=TRANSFER_THREADS + 4,  # a transfer's parts, and heartbeats beside them
        connect_timeout=5,
        read_timeout=60,
        s3=s3_addressing(endpoint),
        # models are checked by their content digest; a global model written in parts has a checksum of its
        # parts' checksums, which is not a checksum of the bytes a GET returns
        response_checksum_validation="when_required",
    )
    return boto3.client("s3", endpoint_url=endpoint, region_name=region, config=config)


class Remote:
    """Reads and writes of one participant in one run."""

    def __init__(self, conn: Connection, pid: str, retrier: Retrier, signer: Signer,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.conn, self.run_id, self.pid = conn, conn.run_id, pid
        self.retry = retrier
        self.signer = signer  # every upload carries its signature (shared/signing.py)
        self.clock = clock
        self._denied_since: dict[str, float] = {}  # key of an object that must exist -> its first 403 in a row
        self.client = participant_s3_client(conn.endpoint, conn.region)
        # A participant may not list the bucket: S3 answers its read of a missing key 403, which means "not there".
        self.bucket = Bucket(conn.bucket, self.client, unlisted=True)
        self.store = StateStore.of(conn, self.bucket)

    # --- reads ------------------------------------------------------------------------------------

    def read_state(self) -> RunState:
        return self.retry.call("reading the run state", self.store.read_state)

    def pushed_state(self, pushed: Pushed) -> RunState:
        """The state a pushed state item names (its roster read if it is neither the one we hold nor pushed)."""
        return self.retry.call("reading the run state's roster", self.store.state_of, pushed.body, pushed.version,
                               pushed.roster)

    def read_config(self) -> RunConfig | None:
        """The run's configuration as the coordinator published it; None until its first tick. Once the run has
        started (its state committed), the config is there: a 403 that lasts DENIED_PATIENCE is a denial
        (`DeniedRead`), said plainly instead of waiting forever."""
        key = keys.config_key(self.run_id)
        try:
            blob = self.retry.call("reading the run config", self.bucket.get, key)
        except NotFound as exc:
            seconds = self._denied_for(key, exc)
            if seconds >= DENIED_PATIENCE and self.read_state().version > 0:
                raise DeniedRead(denied_message("the run config", key, seconds)) from None
            return None
        self._denied_since.pop(key, None)
        return RunConfig.model_validate_json(blob.data)

    def must_exist(self, key: str, exc: NotFound, what: str) -> None:
        """Note that `key`, which the run says exists, was not found: a 403 that lasts DENIED_PATIENCE raises
        `DeniedRead`. A plain 404, or a 403 of a caller that may list the bucket, is "not there" (nothing noted)."""
        seconds = self._denied_for(key, exc)
        if seconds >= DENIED_PATIENCE:
            raise DeniedRead(denied_message(what, key, seconds)) from None

    def found(self, key: str) -> None:
        """`key` was read: a 403 before it was not a denial."""
        self._denied_since.pop(key, None)

    def _denied_for(self, key: str, exc: NotFound) -> float:
        """Seconds `key` has answered 403 in a row (0 for a NotFound that is no 403)."""
        if not exc.denied:
            self._denied_since.pop(key, None)
            return 0.0
        now = self.clock()
        return now - self._denied_since.setdefault(key, now)

    def participant_record(self) -> ParticipantRecord | None:
        """Our participant record (joined_at, last_seen, ready_epoch), or None before the join is recorded."""
        return self.retry.call("reading our participant record", self.store.participant, self.pid)

    def update_record(self, round_no: int, pid: str | None = None) -> UpdateRecord | None:
        """The coordinator's record of our update of a round (or, for a witness, another participant's)."""
        who = pid or self.pid
        return self.retry.call(f"reading the round {round_no} record of {who}", self.store.update_record, round_no,
                               who)

    def round_summary(self, round_no: int) -> RoundSummary | None:
        """A closed round's summary (one GetItem); None if it is not recorded."""
        return self.retry.call(f"reading the summary of round {round_no}", self.store.round_summary, round_no)

    def update_stored(self, round_no: int, since: float | None = None) -> bool:
        return self.ours_since(keys.update_key(self.run_id, round_no, self.pid), since)

    def ours_since(self, key: str, since: float | None = None) -> bool:
        """Whether the object at `key` is one we uploaded: it exists, was written at or after `since` (an object
        left by an earlier incarnation of the run, before its state was restored, does not count) and carries our
        signature of its own bytes. Anything else there (locally nothing stops another writer; on AWS IAM does)
        is not ours: the caller sends its own over it, which ingest takes, the squatter's having been refused."""
        head = self.retry.call(f"checking for {key}", self.bucket.head, key)
        if head is None:
            return False
        modified = head.get("LastModified")
        if not (since is None or modified is None or modified.timestamp() >= math.floor(since)):
            return False
        with tempfile.TemporaryDirectory(prefix="fed-check-") as tmp:
            try:  # exactly the version looked at: its metadata and its bytes belong together
                got = self.download_file(key, Path(tmp) / "object", version_id=str(head.get("VersionId") or ""))
            except NotFound:
                return False
        try:
            verify_digest(self.signer.public_key, key, got, dict(head.get("Metadata") or {}))
        except SignatureError as exc:
            log.warning("%s holds an object we did not upload (%s): sending ours over it", key, exc)
            return False
        return True

    def download_file(self, key: str, path: Path, progress: ByteProgress | None = None, version_id: str = "") -> str:
        """Download an object (a given version if named) to `path` and return its content digest
        (`shared.digest`). Parallel ranged GETs of PART_BYTES write into a temporary file beside `path`, renamed
        over it once complete and hashed; memory stays a few parts whatever the object's size. A fault
        mid-transfer restarts it (`Retrier`); SIGTERM stops it (`Stopped`); a missing object (or version) raises
        NotFound. The caller compares the digest with the one it expects: the file is not trusted until then."""
        return self.retry.call(f"downloading {key}", self._download_file_once, key, Path(path), progress, version_id)

    def _download_file_once(self, key: str, path: Path, progress: ByteProgress | None, version_id: str) -> str:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".part")
        tmp = Path(name)
        try:
            with os.fdopen(fd, "wb") as out:
                self._download_to(key, out, progress, version_id)
            content_digest = digest_file(tmp)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return content_digest

    def download(self, key: str, progress: ByteProgress | None = None, version_id: str = "") -> bytes:
        """The same for a small object, into memory."""
        return self.retry.call(f"downloading {key}", self._download_bytes_once, key, progress, version_id)

    def _download_bytes_once(self, key: str, progress: ByteProgress | None, version_id: str) -> bytes:
        buf = io.BytesIO()
        self._download_to(key, buf, progress, version_id)
        return buf.getvalue()

    def _download_to(self, key: str, out: BinaryIO, progress: ByteProgress | None, version_id: str) -> None:
        extra = {"VersionId": version_id} if version_id else {}
        try:
            self._transfer(lambda manager, subscribers: manager.download(
                self.conn.bucket, key, out, extra_args=extra, subscribers=subscribers), progress, 0)
        except ClientError as exc:
            if _error_code(exc) in MISSING_CODES | UNLISTED_MISSING_CODES:  # (403: see Bucket's `unlisted`)
                raise NotFound(key, denied=_error_code(exc) in UNLISTED_MISSING_CODES) from None
            raise

    # --- writes -----------------------------------------------------------------------------------

    def put_json(self, key: str, body: dict[str, Any], what: str) -> None:
        self.put_fresh_json(key, lambda: body, what)

    def put_fresh_json(self, key: str, body: Callable[[], dict[str, Any]], what: str) -> None:
        """`put_json` of a message that says when it was sent (a heartbeat, a join request), built anew for each
        attempt: ingest refuses one that arrives more than `max_clock_skew` after it was sent, so a heartbeat
        retried through minutes of outage would be refused when it finally got through, and its sender dropped as
        silent an interval later."""

        def once() -> None:
            data = json.dumps(body(), sort_keys=True).encode()
            self.bucket.put(key, data, self.signer.metadata(key, data))

        self.retry.call(what, once)

    def upload_file(self, key: str, path: Path, what: str, progress: ByteProgress | None = None,
                    content_digest: str | None = None) -> None:
        """Upload a file to `key`, signed over the key and its content digest (`shared.digest`; computed from the
        file if not given). Multipart above MULTIPART_THRESHOLD, PART_BYTES parts sent in parallel, each with a
        SHA-256 checksum S3 verifies; read from disk part by part (memory: a few parts)."""
        path = Path(path)
        signature = self.signer.metadata_for_digest(key, content_digest or digest_file(path))
        self.retry.call(what, self._upload_once, key, str(path), path.stat().st_size, signature, progress)

    def upload(self, key: str, data: bytes, what: str, progress: ByteProgress | None = None) -> None:
        """The same for a small object held in memory (a witness proof)."""
        signature = self.signer.metadata_for_digest(key, digest(data))
        self.retry.call(what, self._upload_once, key, data, len(data), signature, progress)

    def _upload_once(self, key: str, source: str | bytes, size: int, signature: dict[str, str],
                     progress: ByteProgress | None) -> None:
        body: str | BinaryIO = source if isinstance(source, str) else io.BytesIO(source)  # a fresh stream each try
        extra = {"ChecksumAlgorithm": "SHA256", "Metadata": signature}
        self._transfer(lambda manager, subscribers: manager.upload(
            body, self.conn.bucket, key, extra_args=extra, subscribers=subscribers), progress, size)

    # --- the transfer manager -----------------------------------------------------------------------------------

    def _transfer(self, start: Callable[[TransferManager, list[Any]], TransferFuture],
                  progress: ByteProgress | None, size: int) -> None:
        """Run one transfer on boto3's transfer manager, reporting progress, until it is done or we are asked to
        stop (then it is cancelled). Its own retries exhausted mid-stream, it fails as a connection error, which
        `Retrier` retries."""
        stop = self.retry.stop
        counter = _Progress(progress, size, stop)
        with create_transfer_manager(self.client, transfer_config()) as manager:
            future = start(manager, [counter])
            while not future.done():
                counter.finished.wait(STOP_POLL)
                if stop.is_set() and not future.done():
                    future.cancel()  # the manager's exit waits for the parts in flight, which stop at their next chunk
                    raise Stopped()
            try:
                future.result()
            except RetriesExceededError as exc:
                raise ConnectionError(f"transfer failed: {exc}") from exc
            except CancelledError:
                if stop.is_set():
                    raise Stopped() from None
                raise
        if progress is not None and counter.total:
            progress(counter.total, counter.total)


class _Progress:
    """Adds up a transfer's progress, reported from its worker threads (a part retried inside the transfer manager
    reports negative progress), and hands `(done, total)` on; asked to stop, it cancels the transfer at once. A
    subscriber of s3transfer's: it calls `on_progress` and `on_done`."""

    def __init__(self, report: ByteProgress | None, size: int, stop: threading.Event) -> None:
        self.report, self.total, self.stop = report, size, stop
        self.done = 0
        self.finished = threading.Event()
        self._lock = threading.Lock()

    def on_done(self, future: Any, **kwargs: Any) -> None:
        self.finished.set()

    def on_progress(self, future: Any, bytes_transferred: int, **kwargs: Any) -> None:
        if self.stop.is_set():
            future.cancel()  # the parts in flight end at their next chunk
            return
        with self._lock:
            self.done += bytes_transferred
            self.total = int(future.meta.size or self.total)
            done, total = max(0, min(self.done, self.total)), self.total
            if self.report is not None:
                self.report(done, total)
