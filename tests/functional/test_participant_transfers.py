"""Model files between the participant's disk and the bucket, against moto's server over HTTP (`local.server`):
multipart uploads checked part by part, parallel ranged downloads, digests, and memory that does not grow with
the model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import numpy as np
import pytest
import torch
from botocore.exceptions import ClientError

from local.server import LocalServer
from participant.decide import Fetch, Train
from participant.journal import Journal, JournalKeeper
from participant.remote import PART_BYTES, Remote, Retrier, Stopped
from participant.tasks.digits import task as digits
from participant.tensors import load_into, save_model, save_model_file, specs_of, to_bytes
from participant.training import Training, Workload, round_work
from participant.ui import Reporter, TransferLog
from participant.witness_eval import PeerUpdate, RoundWitness
from shared import keys, wire
from shared.config import RunConfig
from shared.digest import digest_file
from shared.selection import assignment
from shared.signing import Signer, verify_digest
from store.blobs import NotFound
from store.connection import Connection

RUN = "xfer-run"
BUCKET = "fed-xfer-run"
MB = 1_000_000
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def server() -> Iterator[LocalServer]:
    with pytest.MonkeyPatch.context() as mp:
        for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                            "AWS_DEFAULT_REGION": "us-east-1"}.items():
            mp.setenv(name, value)
        mp.delenv("AWS_SESSION_TOKEN", raising=False)
        mp.delenv("AWS_PROFILE", raising=False)
        with LocalServer() as srv:
            s3 = boto3.client("s3", endpoint_url=srv.endpoint, region_name="us-east-1")
            s3.create_bucket(Bucket=BUCKET)
            s3.put_bucket_versioning(Bucket=BUCKET, VersioningConfiguration={"Status": "Enabled"})
            yield srv


@pytest.fixture
def s3(server: LocalServer) -> Any:
    return boto3.client("s3", endpoint_url=server.endpoint, region_name="us-east-1")


def make_remote(server: LocalServer, stop: threading.Event | None = None) -> Remote:
    conn = Connection(run_id=RUN, bucket=BUCKET, table="unused", endpoint=server.endpoint)
    return Remote(conn, "alice", Retrier(stop or threading.Event(), first_delay=0.01, max_delay=0.05),
                  Signer.generate())


def model_file(path: Path, megabytes: int, seed: int = 0) -> Path:
    """A safetensors file of about `megabytes` MB of float32 values."""
    generator = torch.Generator().manual_seed(seed)
    n = megabytes * MB // 4
    tensors = {"embed.weight": torch.rand(n // 2, generator=generator), "head.weight": torch.rand(n - n // 2)}
    return save_model_file(tensors, path, {"round": "0"})


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []
        self.lock = threading.Lock()

    def __call__(self, done: int, total: int) -> None:
        with self.lock:
            self.calls.append((done, total))


def test_a_40_mb_model_goes_up_in_checked_parts_and_comes_back_with_the_same_digest(
    server: LocalServer, s3: Any, tmp_path: Path
) -> None:
    # Given a 40 MB model file and its digest
    remote = make_remote(server)
    path = model_file(tmp_path / "update.safetensors", 40)
    size, want = path.stat().st_size, digest_file(path)
    key = keys.update_key(RUN, 0, "alice")
    sent: list[tuple[str, str]] = []  # (operation, the SHA-256 checksum header it carried)

    def record(request: Any, event_name: str, **_: Any) -> None:
        sent.append((event_name.rsplit(".", 1)[-1], request.headers.get("x-amz-checksum-sha256", b"")))

    remote.client.meta.events.register("before-send.s3", record)
    # When it is uploaded from the file
    up = Recorder()
    remote.upload_file(key, path, "uploading", up, want)
    # Then it went up in parts of PART_BYTES, each with a SHA-256 checksum for S3 to verify, and signed over its
    # digest
    parts = -(-size // PART_BYTES)
    assert sorted(op for op, _ in sent) == ["CompleteMultipartUpload", "CreateMultipartUpload"] + ["UploadPart"] * parts
    assert all(checksum for op, checksum in sent if op == "UploadPart")
    head = s3.head_object(Bucket=BUCKET, Key=key, ChecksumMode="ENABLED")
    assert head["ContentLength"] == size and head["ETag"].strip('"').endswith(f"-{parts}")
    assert head.get("ChecksumSHA256")
    assert s3.head_object(Bucket=BUCKET, Key=key, PartNumber=1)["ContentLength"] == PART_BYTES
    verify_digest(remote.signer.public_key, key, want, head["Metadata"])
    assert up.calls[-1] == (size, size) and all(d <= t == size for d, t in up.calls)
    # When it is downloaded (ranged GETs in parallel) to a file
    down = Recorder()
    back = tmp_path / "back" / "global.safetensors"
    got = remote.download_file(key, back, down)
    # Then the file is the same, the digest returned is its digest, and nothing is left beside it
    assert got == want == digest_file(back)
    assert back.read_bytes() == path.read_bytes()
    assert down.calls[-1] == (size, size)
    assert list(back.parent.iterdir()) == [back]


def test_missing_objects_and_versions_are_not_found_and_leave_nothing(server: LocalServer, s3: Any,
                                                                      tmp_path: Path) -> None:
    remote = make_remote(server)
    with pytest.raises(NotFound):
        remote.download_file(keys.update_key(RUN, 9, "nobody"), tmp_path / "x.safetensors")
    key = keys.update_key(RUN, 1, "alice")
    remote.upload(key, b"{}", "uploading")
    with pytest.raises(NotFound):
        remote.download_file(key, tmp_path / "x.safetensors", version_id="nosuchversion")
    assert list(tmp_path.iterdir()) == []
    assert remote.download(key) == b"{}"


def test_a_stop_request_ends_a_transfer_and_removes_its_partial_file(server: LocalServer, s3: Any,
                                                                     tmp_path: Path) -> None:
    # Given a 40 MB object and a participant asked to stop as soon as the first bytes of its download arrive
    path = model_file(tmp_path / "m.safetensors", 40)
    key = keys.update_key(RUN, 2, "alice")
    make_remote(server).upload_file(key, path, "uploading")
    stop = threading.Event()
    remote = make_remote(server, stop)
    target = tmp_path / "down" / "m.safetensors"
    # When it downloads
    with pytest.raises(Stopped):
        remote.download_file(key, target, lambda done, total: stop.set())
    # Then nothing of it is left on disk
    assert not target.exists() and list(target.parent.iterdir()) == []
    # And the same for an upload: stopped, its multipart upload aborted, no object written
    stop.clear()
    other = keys.update_key(RUN, 4, "alice")
    with pytest.raises(Stopped):
        remote.upload_file(other, path, "uploading", lambda done, total: stop.set())
    assert not s3.list_multipart_uploads(Bucket=BUCKET).get("Uploads")
    assert "Contents" not in s3.list_objects_v2(Bucket=BUCKET, Prefix=other)


class FailOnce:
    """A botocore hook failing the `nth` request of one operation with a 500, as S3 sometimes does."""

    def __init__(self, nth: int) -> None:
        self.nth, self.seen = nth, 0
        self.lock = threading.Lock()

    def __call__(self, **_: Any) -> None:
        with self.lock:
            self.seen += 1
            if self.seen == self.nth:
                raise ClientError({"Error": {"Code": "InternalError", "Message": "injected"}}, "S3")


def test_a_fault_mid_transfer_restarts_it(server: LocalServer, s3: Any, tmp_path: Path,
                                          caplog: pytest.LogCaptureFixture) -> None:
    # Given a participant whose third part upload, and later third ranged GET, fails with a 500
    remote = make_remote(server)
    path = model_file(tmp_path / "m.safetensors", 40)
    want = digest_file(path)
    key = keys.update_key(RUN, 3, "alice")
    remote.client.meta.events.register("before-send.s3.UploadPart", FailOnce(3))
    remote.client.meta.events.register("before-send.s3.GetObject", FailOnce(3))
    # When it uploads a model file, then downloads it
    with caplog.at_level("WARNING", logger="participant"):
        remote.upload_file(key, path, "uploading the update", content_digest=want)
        got = remote.download_file(key, tmp_path / "back" / "m.safetensors")
    # Then each transfer was retried from the start and succeeded, leaving no partial upload or file behind
    assert [r.getMessage().split(" (")[0] for r in caplog.records if "retry" in r.getMessage()] == [
        "uploading the update failed", f"downloading {key} failed"]
    assert got == want == digest_file(tmp_path / "back" / "m.safetensors")
    assert list((tmp_path / "back").iterdir()) == [tmp_path / "back" / "m.safetensors"]
    assert not s3.list_multipart_uploads(Bucket=BUCKET).get("Uploads")
    verify_digest(remote.signer.public_key, key, want, s3.head_object(Bucket=BUCKET, Key=key)["Metadata"])


def test_transfers_are_logged_every_few_seconds_without_a_terminal(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    progress = TransferLog("download round 3", every=5.0, clock=lambda: now[0])
    with caplog.at_level("INFO", logger="participant"):
        for second in range(1, 13):
            now[0] = float(second)
            progress(second * 20 * MB, 240 * MB)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["download round 3: 100.0 of 240.0 MB (41%), 20.0 MB/s, 7s left",
                     "download round 3: 200.0 of 240.0 MB (83%), 20.0 MB/s, 2s left"]


def training(remote: Remote, tmp_path: Path) -> tuple[Training, Workload]:
    config = RunConfig(run_id=RUN, task="participant.tasks.digits:task")
    kept = JournalKeeper(Journal(RUN, "alice"))
    state = tmp_path / "state"
    return (Training(remote, kept, Reporter(bars=False), threading.Event(), lambda _: None, state / "cache", RUN,
                     "alice"),
            Workload("participant.tasks.digits:task", config, digits, torch.device("cpu"),
                     specs_of(digits.build_model(0))))


def test_a_replaced_global_model_is_detected_by_its_digest_and_never_used(
    server: LocalServer, s3: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Given the round's global model (round 1's: round 0's must also be the initial model the task builds from the
    # run's seed, `Training.check_initial_model`), and a participant's training duty with its cache in its state
    # directory
    remote = make_remote(server)
    duty, work = training(remote, tmp_path)
    good = save_model(digits.build_model(1), tmp_path / "good.safetensors")
    other = save_model(digits.build_model(2), tmp_path / "other.safetensors")
    want = digest_file(good)
    key = keys.global_key(RUN, 1, want)
    # When the object at the model's key is replaced by other bytes before the participant fetches it
    remote.upload_file(key, good, "uploading")
    remote.upload_file(key, other, "replacing")
    with caplog.at_level("WARNING", logger="participant"):
        fetched = duty.fetch_file(work, Fetch(1, want))
    # Then the download is refused by its digest: nothing is held or cached
    assert fetched is None
    assert any("the run says" in r.getMessage() for r in caplog.records)
    assert list(duty.cache_dir.iterdir()) == []
    # When the model's bytes are back, it is fetched, cached under its digest and loads into the task's model
    remote.upload_file(key, good, "restoring")
    fetched = duty.fetch_file(work, Fetch(1, want))
    assert fetched == duty.cache_dir / f"{want}.safetensors" and digest_file(fetched) == want
    model = load_into(digits.build_model(0), fetched)
    assert all(torch.equal(t, digits.build_model(1).state_dict()[n]) for n, t in model.state_dict().items())
    # And a cached copy damaged on disk is noticed and downloaded again (the cache survives restarts: a fresh duty
    # over the same state directory finds it)
    with fetched.open("r+b") as f:
        f.seek(200)
        f.write(b"\xff\xff\xff\xff")
    again, _ = training(remote, tmp_path)
    with caplog.at_level("WARNING", logger="participant"):
        refetched = again.fetch_file(work, Fetch(1, want))
    assert refetched == fetched and digest_file(fetched) == want
    assert any("is corrupt" in r.getMessage() for r in caplog.records)


def test_an_update_is_trained_from_the_cached_file_and_written_as_safetensors_lays_it_out(
    server: LocalServer, tmp_path: Path
) -> None:
    # Given the round's global model as a file in the cache, and the same model as bytes
    duty, work = training(make_remote(server), tmp_path)
    held = save_model(digits.build_model(1), duty.cache_dir / "global.safetensors")
    action = Train(round=0, epoch=1, seed="5eed", selected=("alice", "bob"), digest=digest_file(held))
    mine = round_work(work, action, "alice")
    assert (mine.indices == assignment(action.seed, work.dataset_size, action.selected, "alice")).all()
    duty.round_check = float("inf")  # no run state to ask whether the round is still open
    # When alice trains her assignment from each
    from_file, metrics = duty._fit(work, action, held, mine)
    kept = from_file.rename(tmp_path / "from-file.safetensors")
    from_bytes_, _ = duty._fit(work, action, held.read_bytes(), mine)
    # Then both updates hold the same tensors, in the layout the coordinator expects (safetensors' own, its
    # metadata the round's), and the file is in the outbox, not the cache
    arrays, header = wire.decode(kept.read_bytes())
    assert set(arrays) == set(digits.build_model(0).state_dict())
    assert wire.UpdateMeta.from_metadata(header.metadata).round == 0
    assert all(np.array_equal(arrays[n], a) for n, a in wire.decode(from_bytes_.read_bytes())[0].items())
    assert kept.read_bytes()[header.data_offset:] == to_bytes(load_into(digits.build_model(0), kept).state_dict(),
                                                              header.metadata)[header.data_offset:]
    assert from_bytes_.parent == duty.outbox and metrics["loss"] > 0
    assert mine.units == len(mine.indices) and metrics["train_seconds"] > 0 and duty.rate


def test_a_witness_refuses_a_file_whose_digest_is_not_the_recorded_one(tmp_path: Path) -> None:
    reference = save_model(digits.build_model(0), tmp_path / "global.safetensors")
    witness = RoundWitness(0, digest_file(reference), tmp_path / "witness")
    update = save_model(digits.build_model(3), witness.update_path("bob"))
    record = PeerUpdate("bob", True, digest="0" * 64, version_id="v", samples=10)
    check = witness.verify(record, update, digest_file(update), reference)
    assert check.problem.startswith("digest ") and check.path is None and not update.exists()
    good = save_model(digits.build_model(3), witness.update_path("bob"))
    record = PeerUpdate("bob", True, digest=digest_file(good), version_id="v", samples=10)
    assert witness.verify(record, good, record.digest, reference).path == good


MEASURE = r"""
import json, sys, threading, tracemalloc
from pathlib import Path

from participant.remote import Remote, Retrier
from shared.signing import Signer
from store.connection import Connection


def high_water() -> int:
    # this process's peak resident memory: VmHWM, of its own address space (getrusage's ru_maxrss also counts the
    # image of the parent it was forked from before its exec: the test process, with the moto server's objects)
    status = Path("/proc/self/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmHWM:")).split()[1]) * 1024


endpoint, bucket, key, target = sys.argv[1:5]
remote = Remote(Connection(run_id="xfer-run", bucket=bucket, table="unused", endpoint=endpoint), "alice",
                Retrier(threading.Event()), Signer.generate())
remote.client.head_bucket(Bucket=bucket)  # the client's connection pool is warm: the measure is the transfer's
tracemalloc.start()
Path("/proc/self/clear_refs").write_text("5")  # the peak starts again from what is resident now
before = high_water()
got = remote.download_file(key, Path(target))
after = high_water()
print(json.dumps({"digest": got, "rss_growth": after - before, "traced_peak": tracemalloc.get_traced_memory()[1]}))
"""


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="measures Linux's VmHWM")
def test_downloading_a_200_mb_model_takes_a_fraction_of_its_size_in_memory(server: LocalServer,
                                                                          tmp_path: Path) -> None:
    # Given a 200 MB model in the bucket
    path = model_file(tmp_path / "big.safetensors", 200)
    size, want = path.stat().st_size, digest_file(path)
    key = keys.global_key(RUN, 5, want)
    make_remote(server).upload_file(key, path, "uploading", content_digest=want)
    path.unlink()
    # When another process downloads it to disk, its peak resident memory measured and its Python allocations traced
    target = tmp_path / "cache" / "big.safetensors"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-c", MEASURE, server.endpoint, BUCKET, key, str(target)],
                         capture_output=True, text=True, env=env, timeout=300, check=False)
    assert out.returncode == 0, out.stderr
    measured = json.loads(out.stdout.strip().splitlines()[-1])
    # Then it has the model's digest, and memory grew by a fraction of the model's size (the transfer threads'
    # buffers: the same for any size)
    assert measured["digest"] == want and target.stat().st_size == size
    assert measured["rss_growth"] < size / 2, measured
    assert measured["traced_peak"] < size / 4, measured
