"""The in-memory fakes (tests/fakes) answer as the moto-backed store and bucket do: the same assertions run against
both. This is what keeps the service layer's unit tests (tests/unit/test_service_rules.py) honest."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime

import pytest
from botocore.exceptions import ClientError

import store.blobs
from local.resources import create_resources
from shared.digest import digest
from shared.state import Member, MemberStatus, Phase, RoundSummary, RunState
from shared.witness import Proof
from store.blobs import Bucket, NotFound, Tampered, UploadGone, s3_client
from store.table import Conflict, StateStore, UpdateRecord
from tests.fakes import FakeBucket, FakeStateStore

RUN = "contract-run"
MiB = 1024 * 1024


@dataclass
class Stores:
    store: StateStore
    bucket: Bucket

    def another_bucket(self) -> Bucket:
        """The same bucket through a Bucket that remembers no versions (another process: a cold function)."""
        return Bucket(self.bucket.name, self.bucket.client)


@pytest.fixture(params=["fake", "moto"])
def stores(request: pytest.FixtureRequest) -> Iterator[Stores]:
    if request.param == "fake":
        bucket: Bucket = FakeBucket()
        yield Stores(FakeStateStore(RUN, bucket), bucket)
        return
    request.getfixturevalue("aws")
    res = create_resources(RUN)
    bucket = Bucket(res.bucket, s3_client())
    yield Stores(StateStore(res.table, RUN, bucket), bucket)


def md5(data: bytes) -> str:
    return hashlib.md5(data, usedforsecurity=False).hexdigest()


def code(exc: pytest.ExceptionInfo[ClientError]) -> str:
    return str(exc.value.response["Error"]["Code"])


# --- the state store -----------------------------------------------------------------------------------------


def a_state(version: int = 0, **changes: object) -> RunState:
    members = {"alice": Member(MemberStatus.ACTIVE, 10.0, "", 11.0), "bob": Member(MemberStatus.DROPPED, 12.0, "gone")}
    return RunState(RUN, version, Phase.TRAIN, epoch=1, round=2, members=members, selected=("alice",),
                    global_digest="ab" * 32).evolve(**changes)


def test_a_commit_on_a_stale_version_conflicts(stores: Stores) -> None:
    store = stores.store
    assert store.read_state() == RunState(RUN)
    assert store.commit(a_state(), 0) == 1
    with pytest.raises(Conflict):
        store.commit(a_state(round=3), 0)  # the run exists: version 0 is stale
    assert store.commit(a_state(round=3), 1) == 2
    with pytest.raises(Conflict):
        store.commit(a_state(round=4), 1)
    with pytest.raises(Conflict):
        store.commit(a_state(round=4), 7)  # a version never committed
    state = store.read_state()
    assert state == a_state(version=2, round=3)  # the roster (members, selection) round-trips through the bucket


def test_a_commit_records_its_round_summaries_in_round_order(stores: Stores) -> None:
    summaries = tuple(RoundSummary(r, 1, ("alice",), ("alice",), {}, {}, 10, 0.5, None, 1.0, 2.0, True)
                      for r in (10, 9))
    stores.store.commit(a_state(), 0, summaries)
    assert [s.round for s in stores.store.rounds()] == [9, 10]
    assert stores.store.round_summary(10) == summaries[0] and stores.store.round_summary(11) is None
    with pytest.raises(Conflict):  # a lost commit records none of its summaries
        stores.store.commit(a_state(), 0, (RoundSummary(11, 1, (), (), {}, {}, 0, None, None, 3.0, 4.0, False),))
    assert stores.store.round_summary(11) is None


def test_records_are_created_once(stores: Stores) -> None:
    store = stores.store
    first = UpdateRecord(2, "alice", "k", True, samples=10, digest="d1", etag="e", version_id="v", received_at=5.0,
                         metrics={"loss": 0.5})
    assert store.record_update(first)
    assert not store.record_update(UpdateRecord(2, "alice", "k", False, reason="again"))
    assert store.record_update(UpdateRecord(3, "alice", "k", False, reason="later", received_at=6.0))
    assert store.record_update(UpdateRecord(2, "bob", "k", False, reason="bad", received_at=7.0))
    assert store.update_record(2, "alice") == first
    assert {p: u.accepted for p, u in store.updates(2).items()} == {"alice": True, "bob": False}
    assert [(u.round, u.pid) for u in store.all_updates()] == [(2, "alice"), (2, "bob"), (3, "alice")]
    assert [store.count_update(2), store.count_update(2), store.count_update(3)] == [1, 2, 1]

    assert store.record_refusal("key", "etag:v1", "no", 1.0, "mallory")
    assert not store.record_refusal("key", "etag:v1", "no again", 2.0)
    assert store.record_refusal("key", "etag:v2", "no", 3.0)
    assert [(r.etag, r.reason) for r in store.refusals()] in (
        [("etag:v1", "no"), ("etag:v2", "no")], [("etag:v2", "no"), ("etag:v1", "no")])  # (ordered by a hash)

    proof = Proof.build(RUN, 2, "carol", 0, {"alice": "d1"}, 1, complete=True).to_json()
    assert store.record_proof(2, "carol", proof, "e", 4.0)
    assert not store.record_proof(2, "carol", "", "e2", 5.0, refused="late")
    assert store.record_proof(2, "dave", "", "e3", 5.0, refused="spoofed")
    assert store.proof_record(2, "carol") is not None and store.proof_record(2, "carol").body == proof  # type: ignore[union-attr]
    accepted, refused = store.proof_records(2)
    assert list(accepted) == ["carol"] and accepted["carol"].attests("alice", "d1") and refused == {"dave": "spoofed"}

    assert store.record_health_report(2, "alice", ["bob"], 6.0)
    assert not store.record_health_report(2, "alice", [], 7.0)
    assert store.health_reports(2) == {"alice": ("bob",)} and store.health_reports(3) == {}


def test_participants_join_once_and_never_past_the_limit(stores: Stores) -> None:
    store = stores.store
    assert store.create_participant("alice", 1.0, "key-a", {"host": "a"}, limit=2, sent_at=0.5) == "created"
    assert store.create_participant("alice", 2.0, "key-b", {}, limit=2) == "exists"
    assert store.create_participant("bob", 2.0, "key-b", {}, limit=2, samples=7) == "created"
    assert store.create_participant("carol", 3.0, "key-c", {}, limit=2) == "full"
    assert store.create_participant("bob", 3.0, "key-c", {}, limit=2) == "exists"
    assert store.participant_count() == 2 and sorted(store.participants()) == ["alice", "bob"]
    alice = store.participant("alice")
    assert alice is not None and (alice.public_key, alice.info, alice.last_sent, alice.heard_at) == (
        "key-a", {"host": "a"}, 0.5, 0.0)
    assert store.participant("carol") is None and store.participant_records()["bob"].samples == 7


def test_a_message_is_taken_only_if_sent_after_the_last(stores: Stores) -> None:
    store = stores.store
    assert store.accept_message("alice", 1.0, 1.0) == "unknown"
    store.create_participant("alice", 1.0, "key-a", {}, limit=5, sent_at=1.0)
    assert store.accept_message("alice", 1.0, 2.0) == "duplicate"
    progress = {"round": 2, "done": 5, "total": 10}
    assert store.accept_message("alice", 3.0, 3.5, ready_epoch=1, progress=progress, progress_moved=True,
                                rate=2.5) == "accepted"
    assert store.accept_message("alice", 2.0, 4.0) == "stale"
    assert store.accept_message("alice", 4.0, 4.5, progress=progress, progress_moved=False) == "accepted"
    record = store.participant("alice")
    assert record is not None
    assert (record.last_sent, record.last_seen, record.heard_at, record.ready_epoch) == (4.0, 4.5, 4.5, 1)
    assert (record.progress, record.progress_at, record.rate) == ((2, 5, 10), 3.5, 2.5)
    assert store.touch("alice", 4.0) and store.participant("alice").last_seen == 4.5  # type: ignore[union-attr]
    assert store.touch("alice", 9.0) and store.participant("alice").last_seen == 9.0  # type: ignore[union-attr]
    assert not store.touch("bob", 9.0)


def test_offers_kept_and_recorded(stores: Stores) -> None:
    store = stores.store
    assert store.kept_offer("alice", "key-a") == ("", "")
    store.keep_offer("alice", "d1", "key-a", "v1")
    assert store.kept_offer("alice", "key-a") == ("d1", "v1") and store.kept_offer("alice", "key-x") == ("", "")
    store.create_participant("alice", 1.0, "key-a", {}, limit=5)
    store.set_init_offer("alice", "d1", "v1")
    assert store.participants()["alice"].init_digest == "d1"
    assert store.participant("alice").init_version == "v1"  # type: ignore[union-attr]
    with pytest.raises(Exception):  # noqa: B017 (pynamodb's UpdateError: no record to offer for)
        store.set_init_offer("nobody", "d1")


def test_a_lease_is_taken_only_if_free_expired_or_its_holders(stores: Stores) -> None:
    store = stores.store
    assert store.claim("aggregate#0", "a", until=100.0, now=50.0)
    assert not store.claim("aggregate#0", "b", until=120.0, now=60.0)
    assert store.claim("aggregate#0", "a", until=130.0, now=60.0)  # its holder extends it
    store.release("aggregate#0", "b")  # not b's: nothing changes
    assert not store.claim("aggregate#0", "b", until=140.0, now=129.0)
    assert store.claim("aggregate#0", "b", until=200.0, now=131.0)  # expired
    store.release("aggregate#0", "b")
    assert store.claim("aggregate#0", "c", until=300.0, now=150.0)


def test_a_snapshot_is_derived_from_the_records(stores: Stores) -> None:
    store = stores.store
    store.create_participant("alice", 1.0, "key-a", {}, limit=5, sent_at=1.0)
    store.accept_message("alice", 2.0, 2.0)
    store.commit(a_state(round=0), 0)
    store.record_update(UpdateRecord(0, "alice", "k", True, samples=3, received_at=20.0))
    store.record_update(UpdateRecord(1, "bob", "k", True, samples=3, received_at=30.0))
    snap = store.load_snapshot()
    assert snap.state.version == 1 and list(snap.updates) == ["alice"] and list(snap.participants) == ["alice"]
    assert (snap.participants["alice"].heard_at, snap.participants["alice"].last_seen) == (20.0, 20.0)


# --- the bucket ------------------------------------------------------------------------------------------------


def test_every_put_is_a_new_version_read_back_by_its_id(stores: Stores) -> None:
    bucket = stores.bucket
    assert bucket.put("runs/x/a", b"one", {"fed-signature": "s1"}) == md5(b"one")
    first = bucket.known_version("runs/x/a")
    assert bucket.put("runs/x/a", b"two") == md5(b"two")
    second = bucket.known_version("runs/x/a")
    assert first and second and first != second
    assert bucket.get("runs/x/a").data == b"two" and bucket.get("runs/x/a", version_id=first).data == b"one"
    blob = bucket.get("runs/x/a", version_id=first)
    assert (blob.etag, blob.metadata, blob.version_id) == (md5(b"one"), {"fed-signature": "s1"}, first)
    assert bucket.has_version("runs/x/a", first) and not bucket.has_version("runs/x/a", "no-such-version")
    with pytest.raises(NotFound):
        bucket.get("runs/x/missing")
    with pytest.raises(NotFound):
        bucket.get("runs/x/a", version_id="no-such-version")
    with pytest.raises(ValueError, match="over the 2-byte limit"):
        bucket.get("runs/x/a", max_bytes=2)


def test_head_fields(stores: Stores) -> None:
    bucket = stores.bucket
    bucket.put("runs/x/h", b"hello", {"Fed-Signature": "s"})
    head = bucket.head("runs/x/h")
    assert head is not None
    assert head["ETag"] == f'"{md5(b"hello")}"' and head["ContentLength"] == 5
    assert head["VersionId"] == bucket.known_version("runs/x/h") and head["Metadata"] == {"fed-signature": "s"}
    modified = head["LastModified"]
    assert isinstance(modified, datetime) and modified.tzinfo is not None and modified.microsecond == 0
    assert bucket.get("runs/x/h").last_modified == modified.timestamp()
    assert bucket.head("runs/x/nothing") is None


def test_a_verified_read_takes_the_version_its_digest_names(stores: Stores, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store.blobs, "LIST_PAGE", 2)  # the look-back pages through the listing
    bucket, key = stores.bucket, "runs/x/global"
    bucket.put(key, b"the model")
    bucket.put("runs/x/global2", b"a longer key, listed after it")
    for i in range(4):  # written over it
        bucket.put(key, f"not the model {i}".encode())
    want = digest(b"the model")
    cold = stores.another_bucket()  # knows no version: looks back through the listing
    assert cold.get_verified(key, want, 1000) == b"the model"
    version, size = stores.another_bucket().verified_version(key, want)
    assert size == len(b"the model") and cold.known_version(key) == version
    assert bucket.read_verified(key, want, 1000).version_id == version
    with pytest.raises(Tampered):
        cold.read_verified(key, digest(b"never written"), 1000)
    with pytest.raises(Tampered):  # the version it names is too large to be the one wanted
        stores.another_bucket().read_verified(key, want, 3)
    with pytest.raises(NotFound):
        cold.verified_version("runs/x/none", want)


def test_multipart_uploads(stores: Stores) -> None:
    bucket, key = stores.bucket, "runs/x/staging"
    parts = [b"a" * (5 * MiB), b"b" * 100]
    upload = bucket.start_multipart(key)
    written = [(bucket.put_part(key, upload, n, data, hashlib.sha256(data).digest()), hashlib.sha256(data).digest())
               for n, data in enumerate(parts, start=1)]
    assert [etag for etag, _ in written] == [md5(p) for p in parts]
    version = bucket.complete_multipart(key, upload, written)
    head = bucket.head(key)
    assert head is not None and head["VersionId"] == version and head["ContentLength"] == 5 * MiB + 100
    assert head["ETag"] == f'"{md5(bytes.fromhex(md5(parts[0])) + bytes.fromhex(md5(parts[1])))}-2"'
    with pytest.raises(UploadGone):
        bucket.put_part(key, upload, 3, b"late", hashlib.sha256(b"late").digest())
    buf = bytearray(4)
    bucket.read_range(key, 5 * MiB - 2, memoryview(buf), version)
    assert bytes(buf) == b"aabb"
    with pytest.raises(NotFound):
        bucket.read_range(key, 5 * MiB + 100, memoryview(bytearray(1)))
    # copied (one CopyObject): an object of one part, whose ETag is its MD5
    bucket.copy(key, "runs/x/copy", version_id=version)
    assert bucket.head("runs/x/copy")["ETag"] == f'"{md5(b"".join(parts))}"'  # type: ignore[index]


def test_multipart_refusals(stores: Stores) -> None:
    bucket, key = stores.bucket, "runs/x/refused"
    small = bucket.start_multipart(key)
    tiny = [(bucket.put_part(key, small, n, b"x", hashlib.sha256(b"x").digest()), hashlib.sha256(b"x").digest())
            for n in (1, 2)]
    with pytest.raises(ClientError) as too_small:
        bucket.complete_multipart(key, small, tiny)
    assert code(too_small) == "EntityTooSmall"
    with pytest.raises(ClientError) as wrong:
        bucket.complete_multipart(key, small, [("0" * 32, hashlib.sha256(b"x").digest())])
    assert code(wrong) == "InvalidPart"
    bucket.abort_multipart(key, small)
    with pytest.raises(UploadGone):
        bucket.put_part(key, small, 3, b"x", hashlib.sha256(b"x").digest())
    bucket.abort_multipart(key, small)  # again: nothing to do
    assert bucket.head(key) is None


def test_copies_and_listing(stores: Stores) -> None:
    bucket = stores.bucket
    bucket.put("runs/x/src", b"first", {"fed-signature": "s"})
    first = bucket.known_version("runs/x/src")
    bucket.put("runs/x/src", b"second")
    bucket.copy("runs/x/src", "runs/x/dst", version_id=first)
    copied = bucket.get("runs/x/dst")
    assert (copied.data, copied.metadata, copied.version_id) == (b"first", {"fed-signature": "s"},
                                                                 bucket.known_version("runs/x/dst"))
    bucket.put("runs/y/other", b"z")
    assert bucket.keys("runs/x/") == ["runs/x/dst", "runs/x/src"] and bucket.keys("runs/z/") == []
    with pytest.raises(ClientError):
        bucket.copy("runs/x/missing", "runs/x/dst2")
    resp, chunks = bucket.stream("runs/x/src", chunk=4)
    assert b"".join(chunks) == b"second" and resp["ContentLength"] == 6


def test_uploads_are_counted_within_the_budget_and_dropped_past_it(stores: Stores) -> None:
    s, at = stores.store, 1_000_000_030.0  # (a window is a minute: 1_000_000_020 to _080)
    assert [s.count_upload("mallory", at + i, budget=3) for i in range(5)] == [True, True, True, False, False]
    assert s.count_upload("alice", at, budget=3)  # another participant's budget
    assert s.count_upload("mallory", at + 60, budget=3)  # the next window's
    assert s.uploads_counted("mallory", at) == 3 and s.uploads_counted("mallory", at + 60) == 1
    dropped = s.dropped_uploads()
    assert set(dropped) == {"mallory"}
    assert (dropped["mallory"].dropped, dropped["mallory"].last_at) == (2, at + 4)
