"""`fed-participant check`: what a host should know before it starts, one line per item, each failure with what to do.

Every item asks AWS (or the local stack) the way the participant will: with its own session, for its own keys. The
bandwidth is measured on the run's own objects without creating any: the download is a ranged read of the latest
global model, the upload the parts of a multipart upload to this participant's own update key that is aborted,
never completed, so no "Object Created" event reaches the coordinator and nothing is recorded against it.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

from participant.remote import participant_s3_client
from shared import keys
from shared.config import RunConfig
from store.blobs import MISSING_CODES, UNLISTED_MISSING_CODES
from store.connection import Connection
from store.push import StateQueue
from store.table import StateStore

MAX_SKEW_SECONDS = 60.0  # join requests and heartbeats carry their send time; renewals allow 300 s
PROBE_BYTES = 8 * 1024 * 1024  # one part up, at most this much down
FAR_ROUND = 999_999_999  # a round no run reaches: the probe's key (its multipart upload is aborted, never completed)
DISK_FACTOR = 3  # the global model cached, the update written, one more in flight
NO_CREDENTIALS = ("give the host an invite (`fed hosts invite`, then --invite), or an identity allowed to assume the "
                  "participant role with its tag (docs/deploy.md §4)")


@dataclass(frozen=True)
class Item:
    ok: bool
    what: str
    detail: str
    todo: str = ""  # what to do when not ok

    def line(self) -> str:
        mark = "✓" if self.ok else "✗"
        return f"{mark} {self.what}: {self.detail}" + (f"\n    → {self.todo}" if not self.ok and self.todo else "")


def _code(exc: BaseException) -> str:
    return str(getattr(exc, "response", {}).get("Error", {}).get("Code", type(exc).__name__))


@dataclass
class Preflight:
    """The checks for participant `pid` of the run `conn` names; `s3` is its S3 client (the participant's)."""

    conn: Connection
    pid: str
    state_dir: Path
    device: str = "auto"
    s3: Any = None
    clock: Callable[[], float] = time.time

    def __post_init__(self) -> None:
        self.s3 = self.s3 or participant_s3_client(self.conn.endpoint, self.conn.region)
        self.config: RunConfig | None = None
        self.model_bytes = 0
        self.skew: float | None = None
        self._global: str | None = None  # the latest global model's key, once read

    def run(self) -> list[Item]:
        items = [self.credentials(), self.run_config(), self.own_missing_key(), self.push_queue(), self.clock_skew(),
                 self.disk(), self.devices()]
        items.extend(self.bandwidth())
        return items

    def credentials(self) -> Item:
        """Asked of S3 itself, with the request the participant makes first (STS's GetCallerIdentity would tell who,
        but not whether this run's bucket takes them)."""
        try:
            self.s3.head_object(Bucket=self.conn.bucket, Key=keys.config_key(self.conn.run_id))
        except NoCredentialsError:
            return Item(False, "credentials", "none found", NO_CREDENTIALS)
        except ClientError as exc:
            if _code(exc) in {"InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken",
                              "AccessDenied", "403"}:
                return Item(False, "credentials", f"refused by S3 ({_code(exc)})", NO_CREDENTIALS)
        except BotoCoreError as exc:
            return Item(False, "credentials", f"S3 cannot be reached ({exc})",
                        "check the network (and a proxy's settings) to the bucket's region")
        return Item(True, "credentials", f"accepted by the run's bucket {self.conn.bucket}")

    def run_config(self) -> Item:
        key = keys.config_key(self.conn.run_id)
        try:
            got = self.s3.get_object(Bucket=self.conn.bucket, Key=key)
            self.config = RunConfig.model_validate_json(got["Body"].read())
            date = got["ResponseMetadata"]["HTTPHeaders"].get("date", "")
            if date:
                self.skew = self.clock() - parsedate_to_datetime(date).timestamp()
        except ClientError as exc:
            if _code(exc) in {"NoSuchKey", "404"}:
                return Item(False, "run config", f"{key} does not exist yet",
                            "the coordinator publishes it on its first tick: is the stack deployed and ticking?")
            return Item(False, "run config", f"cannot be read ({_code(exc)})",
                        "the session is not the participant role's, or not for this run's bucket")
        c = self.config
        return Item(True, "run config", f"run {c.run_id}: task {c.task or '(from the participant)'}, "
                                        f"{c.total_rounds} rounds, {c.data_mode} data")

    def own_missing_key(self) -> Item:
        key = keys.update_key(self.conn.run_id, FAR_ROUND, self.pid)
        try:
            self.s3.head_object(Bucket=self.conn.bucket, Key=key)
        except ClientError as exc:
            code = _code(exc)
            if code in MISSING_CODES:
                return Item(True, "a missing own key", f"reads as missing ({code}), as the participant expects")
            if code in UNLISTED_MISSING_CODES:
                return Item(True, "a missing own key", f"reads as {code}: the participant role may not list the "
                                                       "bucket, and the participant takes that as missing")
            return Item(False, "a missing own key", f"reads as {code}, neither missing nor forbidden",
                        "the session is not the participant role's for this run, or the stack is out of date")
        return Item(False, "a missing own key", f"{key} exists", "another run wrote here: check --run and --id")

    def push_queue(self) -> Item:
        if not self.conn.state_topic:
            return Item(True, "push queue", "the run has no state topic: the participant polls")
        try:
            queue = StateQueue.connect(self.conn.run_id, self.pid, self.conn.state_topic, self.conn.endpoint,
                                       self.conn.region)
        except (ClientError, BotoCoreError) as exc:
            return Item(False, "push queue", f"cannot be created ({_code(exc)})",
                        "the participant will poll instead (slower to notice rounds); check the role's SQS grant")
        if queue is None:
            return Item(True, "push queue", "the id is too long for a queue's name: the participant polls")
        return Item(True, "push queue", f"created and subscribed ({queue.url.rsplit('/', 1)[-1]}); kept for the "
                                        "participant")

    def clock_skew(self) -> Item:
        if self.skew is None:
            return Item(False, "clock", "no Date header to compare with (the run config could not be read)")
        if abs(self.skew) > MAX_SKEW_SECONDS:
            return Item(False, "clock", f"{abs(self.skew):.0f} s {'ahead of' if self.skew > 0 else 'behind'} S3",
                        "synchronise the clock (chrony or systemd-timesyncd): messages carry their send time")
        return Item(True, "clock", f"within {max(1.0, abs(self.skew)):.0f} s of S3's")

    def _latest_global(self) -> str:
        """The latest global model's key ("": none yet), its size in `model_bytes`; read once for every item."""
        if self._global is None:
            state = StateStore.of(self.conn).read_state()
            self._global = ""
            if state.global_digest:
                key = keys.global_key(self.conn.run_id, state.round, state.global_digest)
                self.model_bytes = int(self.s3.head_object(Bucket=self.conn.bucket, Key=key)["ContentLength"])
                self._global = key
        return self._global

    def disk(self) -> Item:
        try:
            self._latest_global()
        except (ClientError, BotoCoreError) as exc:
            return Item(False, "disk", f"the model's size cannot be read ({_code(exc)})")
        where = self.state_dir if self.state_dir.exists() else Path.home()
        free = shutil.disk_usage(where).free
        need = DISK_FACTOR * self.model_bytes
        detail = f"{free / 1e9:.1f} GB free in {where}"
        if not self.model_bytes:
            return Item(True, "disk", f"{detail} (no global model yet to size it by)")
        if free < need:
            return Item(False, "disk", f"{detail}; a {self.model_bytes / 1e6:.0f} MB model needs {need / 1e9:.1f} GB",
                        "free space, or pass --state-dir on a larger disk")
        return Item(True, "disk", f"{detail}, for a {self.model_bytes / 1e6:.0f} MB model")

    def devices(self) -> Item:
        import torch

        if torch.cuda.is_available():
            names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
            bf16 = "bf16 supported" if torch.cuda.is_bf16_supported() else "no bf16"
            return Item(True, "device", f"{torch.cuda.device_count()} CUDA device(s): {', '.join(names)}; {bf16}")
        if self.device.startswith("cuda"):
            return Item(False, "device", "no CUDA device", "install a CUDA build of torch, or start with --device cpu")
        return Item(True, "device", f"CPU only ({os.cpu_count()} cores): trains, slowly for large models")

    def bandwidth(self) -> list[Item]:
        return [self._download(), self._upload()]

    def _download(self) -> Item:
        try:
            key = self._latest_global()
        except (ClientError, BotoCoreError) as exc:
            return Item(False, "download", f"cannot be measured ({_code(exc)})")
        if not key:
            return Item(True, "download", "no global model yet to measure with")
        took = time.perf_counter()
        body = self.s3.get_object(Bucket=self.conn.bucket, Key=key,
                                  Range=f"bytes=0-{min(PROBE_BYTES, self.model_bytes) - 1}")["Body"].read()
        rate = len(body) / max(time.perf_counter() - took, 1e-6)
        return Item(True, "download", f"{rate / 1e6:.0f} MB/s: the {self.model_bytes / 1e6:.0f} MB global model in "
                                      f"{self.model_bytes / rate:.1f} s")

    def _upload(self) -> Item:
        key = keys.update_key(self.conn.run_id, FAR_ROUND, self.pid)
        try:
            upload = self.s3.create_multipart_upload(Bucket=self.conn.bucket, Key=key)["UploadId"]
        except (ClientError, BotoCoreError) as exc:
            return Item(False, "upload", f"refused ({_code(exc)})", "the session may not write this participant's "
                                                                     "update keys: is --id the invite's host?")
        try:
            took = time.perf_counter()
            self.s3.upload_part(Bucket=self.conn.bucket, Key=key, UploadId=upload, PartNumber=1,
                                Body=os.urandom(PROBE_BYTES))
            rate = PROBE_BYTES / max(time.perf_counter() - took, 1e-6)
        finally:
            self.s3.abort_multipart_upload(Bucket=self.conn.bucket, Key=key, UploadId=upload)
        size = self.model_bytes or PROBE_BYTES
        return Item(True, "upload", f"{rate / 1e6:.0f} MB/s: an update of {size / 1e6:.0f} MB in {size / rate:.1f} s"
                                    " (no object written)")
