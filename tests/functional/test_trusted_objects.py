"""Objects the coordinator wrote are trusted only as its committed state records them.

Locally (and on any bucket whose policy a user loosened) anyone can overwrite `manifest.json` or a global
model's key. The coordinator must read the version its state authenticates (by digest), never what is at
the key now: a forged object can neither make valid updates be refused nor change what is aggregated.
"""

from __future__ import annotations

import contextlib
import threading

import numpy as np
import pytest

from coordinator import model_files as models
from coordinator.verify import verify_run
from shared import keys, wire
from store.blobs import Verified
from tests.functional.conftest import MODEL, Harness


def test_a_forged_manifest_does_not_make_valid_updates_be_refused(harness: Harness) -> None:
    # Given a run training round 0, whose manifest.json an attacker replaced by one of another model
    harness.start(["alice", "bob"])
    other = wire.Manifest({"evil": wire.TensorSpec("F32", (7,))})
    harness.s3.put_object(Bucket=harness.res.bucket, Key=keys.manifest_key(harness.config.run_id),
                          Body=other.to_json().encode())
    # When both upload updates shaped like the real model
    a = harness.upload("alice", {k: v + 1 for k, v in MODEL.items()}, samples=10)
    b = harness.upload("bob", {k: v + 3 for k, v in MODEL.items()}, samples=10)
    # Then both are accepted and averaged
    assert a["accepted"] and b["accepted"], (a, b)
    assert harness.state().round == 1
    np.testing.assert_allclose(harness.global_model(1)["dense.bias"], 2.0)


def test_a_global_model_overwritten_at_its_key_is_not_what_the_round_trains_from(harness: Harness) -> None:
    # Given a run training round 0, whose global model's key an attacker overwrote with other weights
    harness.start(["alice", "bob"])
    forged = {k: np.full_like(v, 1000.0) for k, v in MODEL.items()}
    harness.s3.put_object(Bucket=harness.res.bucket, Key=harness.global_key(0), Body=wire.encode(forged))
    # When the round closes
    harness.upload("alice", {k: v + 1 for k, v in MODEL.items()}, samples=10)
    harness.upload("bob", {k: v + 3 for k, v in MODEL.items()}, samples=10)
    # Then the aggregate is computed from the authenticated version (the updates' mean, nothing of the
    # forgery), the run goes on, and anyone can still recompute it from the bucket
    state = harness.state()
    assert state.round == 1
    np.testing.assert_allclose(harness.global_model(1)["dense.bias"], 2.0)
    assert all(check.ok for check in verify_run(harness.deps)), [c for c in verify_run(harness.deps) if not c.ok]


def test_updates_ingested_together_authenticate_the_global_model_once(harness: Harness,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a run training round 0, whose global model no function of this process has read yet, and a bucket that
    # holds each authentication of it until four have begun (or half a second has passed)
    harness.start(["alice", "bob"])
    state = harness.state()
    harness.deps.models.verified.clear()
    harness.deps.models.held.clear()
    together = threading.Barrier(4, timeout=0.5)
    calls: list[str] = []
    verified_read = harness.deps.bucket.verified_read

    def held_back(key: str, want: str, keep: int) -> Verified:
        calls.append(key)
        with contextlib.suppress(threading.BrokenBarrierError):
            together.wait()
        return verified_read(key, want, keep)

    monkeypatch.setattr(harness.deps.bucket, "verified_read", held_back)
    # When four ingests read it at once, as a round's updates arriving together are
    read: list[models.GlobalModel] = []

    def ingest() -> None:
        model = models.read_global(harness.deps, state.round, state.global_digest)
        model.source(harness.deps)
        read.append(model)

    threads = [threading.Thread(target=ingest) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # Then one of them authenticated it (hashing it, reading its header) and the others used what it found
    assert len(read) == 4 and len({id(m) for m in read}) == 1
    assert calls == [harness.global_key(0)]
