"""What a participant with its own identity cannot do to the local stack, or to the coordinator's reads.

`fed local` holds the run in memory: whatever its follower meets reading the run (an altered object, `Tampered`,
or any other error) is reported and read again, never the end of the process. And an object the coordinator wrote
is read back by the version the committed state records, so versions written over it, however many, neither stop a
tick nor make it list or read them all.
"""

from __future__ import annotations

import io
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest
from botocore.client import BaseClient
from rich.console import Console

from fed import localrun
from fed.localrun import RunFollower, default_local_config, run_local
from functions.settings import forget_warm_state
from shared import keys
from shared.digest import digest
from shared.state import Phase, RunState
from shared.table_keys import STATE_SK
from store import blobs
from store.blobs import Tampered
from store.records import GLOBAL, OPTIMIZER, ROSTER, VERSIONS
from store.table import StateStore, named_objects
from tests.functional.conftest import MODEL, Harness

PIDS = ["alice", "bob", "carol"]


# --- fed local's follower -------------------------------------------------------------------------------------


class FlakyStore:
    """A run's store whose reads of the state first raise `failures`, one a read; `stop` is set at read `stop_at`."""

    def __init__(self, store: StateStore, failures: list[Exception], stop: threading.Event | None = None,
                 stop_at: int = 0) -> None:
        self.store, self.run_id, self.failures = store, store.run_id, failures
        self.stop, self.stop_at = stop, stop_at
        self.reads = 0
        self.states: list[RunState] = []  # what the reads that succeeded returned

    def rounds(self) -> Any:
        return self.store.rounds()

    def read_state(self) -> RunState:
        self.reads += 1
        if self.failures:
            raise self.failures.pop(0)
        state = self.store.read_state()
        self.states.append(state)
        if self.stop is not None and self.reads >= self.stop_at:
            self.stop.set()
        return state


@pytest.mark.timeout(300)
def test_fed_local_keeps_serving_its_run_when_its_follower_meets_tampered_and_other_errors(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given `fed local` serving a run, whose follower's first reads of the state meet an altered object and a
    # failing server
    failures: list[Exception] = [Tampered("runs/robust/roster/ab12 does not match its digest ab12"),
                                 ConnectionError("the server hung up")]
    stop = threading.Event()
    followed: list[FlakyStore] = []

    def flaky_store_for(connection: Any) -> Any:
        followed.append(FlakyStore(StateStore.of(connection), failures, stop, stop_at=4))
        return followed[-1]

    monkeypatch.setattr(localrun, "store_for", flaky_store_for)
    out = io.StringIO()
    config = default_local_config("robust", min_clients=2)
    # When it runs until its follower has read the state twice more
    code = run_local(config, 0, 0.2, tmp_path / "local.json", tmp_path / "local.log", "WARNING",
                     Console(file=out, width=400, force_terminal=False), stop)
    # Then it went on following after both errors, and the stack it held still held the run (its state read back
    # after them: the run the stack started, committed by its ticks)
    text = out.getvalue()
    assert code == 0, text
    store = followed[0]
    assert store.reads >= 4 and not store.failures
    assert store.states and all(s.run_id == "robust" and s.version >= 1 for s in store.states), store.states
    # and reported each error once, saying what it was reading and what failed
    assert "reading the run state of run 'robust' failed: Tampered: runs/robust/roster/ab12" in text, text
    assert "something wrote over it" in text
    assert "reading the run state of run 'robust' failed: ConnectionError: the server hung up" in text, text
    assert "reading the run state works again" in text


def test_the_follower_reports_every_round_once_and_the_end_when_reads_failed_in_between(harness_factory: Any) -> None:
    # Given a follower of a run of two rounds, whose reads fail in round 1: an altered object, then another error
    h: Harness = harness_factory(total_rounds=2)
    h.start(["alice", "bob"])
    flaky = FlakyStore(h.deps.store, [])
    follower = RunFollower(flaky)  # type: ignore[arg-type]
    assert follower.poll() == []
    for pid in ("alice", "bob"):
        h.upload(pid, {k: v + 1 for k, v in MODEL.items()}, samples=10)
    round_0 = follower.poll()
    flaky.failures += [Tampered("a roster does not match its digest"), RuntimeError("throttled")]
    failed = follower.poll() + follower.poll()
    # When the run goes on to its end meanwhile
    for pid in ("alice", "bob"):
        h.upload(pid, {k: v + 2 for k, v in MODEL.items()}, samples=10)
    assert h.state().phase is Phase.FINISHED
    after = follower.poll()
    # Then each round was reported once, each failure once, and the end of the run once the reads worked again
    assert [line.split(" aggregated")[0] for line in round_0] == ["round 0"], round_0
    assert len(failed) == 2 and "Tampered" in failed[0] and "RuntimeError: throttled" in failed[1], failed
    assert [line.split(" aggregated")[0] for line in after if line.startswith("round")] == ["round 1"], after
    assert "reading the run state works again" in after and any("run finished" in line for line in after), after
    assert follower.poll() == []


# --- objects buried under forged versions ---------------------------------------------------------------------


class Call(NamedTuple):
    operation: str
    key: str
    version_id: str
    max_keys: int
    ranged: bool


class S3Calls:
    """The S3 requests a client makes, as its callers passed them: (operation, Key or Prefix, VersionId, MaxKeys,
    whether it reads a range)."""

    def __init__(self, client: BaseClient) -> None:
        self.made: list[Call] = []
        client.meta.events.register("provide-client-params.s3", self._record)

    def _record(self, params: dict[str, Any], model: Any, **_: Any) -> None:
        self.made.append(Call(model.name, str(params.get("Key") or params.get("Prefix") or ""),
                              str(params.get("VersionId") or ""), int(params.get("MaxKeys") or 0),
                              "Range" in params))

    def on(self, key: str) -> list[Call]:
        return [c for c in self.made if c.key == key]

    def whole_reads(self, key: str) -> list[Call]:
        return [c for c in self.on(key) if c.operation == "GetObject" and not c.ranged]

    def listings(self) -> list[Call]:
        return [c for c in self.made if c.operation == "ListObjectVersions"]


def cold_start(h: Harness) -> S3Calls:
    """The functions start afresh (nothing remembered from the objects this process wrote or read); the S3
    requests they make from now on."""
    forget_warm_state()
    return S3Calls(h.deps.bucket.client)


def bury(h: Harness, key: str, versions: int) -> None:
    """Write `versions` versions over `key`, as anyone with write access to it could."""
    for n in range(versions):
        h.s3.put_object(Bucket=h.res.bucket, Key=key, Body=b'{"forged": %d}' % n)


def recorded_versions(h: Harness) -> dict[str, str]:
    store = h.deps.store
    return dict(store.m.run.get(store.pk, STATE_SK, consistent_read=True).body.get(VERSIONS) or {})


@pytest.fixture
def optimizer_run(harness_factory: Any) -> Iterator[Harness]:
    h: Harness = harness_factory(server_optimizer="fedadam", min_clients=3, min_per_round=3, total_rounds=3,
                                 norm_outlier_factor=0)
    h.start(PIDS)
    rng = np.random.default_rng(7)
    base = h.global_model(0)
    for pid in PIDS:
        assert h.upload(pid, {k: (v + rng.normal(0, 0.1, v.shape)).astype(np.float32) for k, v in base.items()},
                        samples=10)["accepted"]
    yield h


@pytest.mark.parametrize("role", [OPTIMIZER, ROSTER, GLOBAL])
def test_an_object_buried_under_forged_versions_is_read_by_the_version_the_state_records(
        optimizer_run: Harness, role: str) -> None:
    # Given round 1 of a FedAdam run, whose committed state records the version of each object it names
    h = optimizer_run
    state = h.state()
    assert state.round == 1 and state.optimizer_digest
    item = h.deps.store.m.run.get(h.deps.store.pk, STATE_SK, consistent_read=True).body
    key = named_objects(h.config.run_id, state, item[ROSTER])[role]
    version = recorded_versions(h)[role]
    base = h.global_model(1)
    # and someone wrote more versions over one of them than a verified read used to look back through
    bury(h, key, blobs.MAX_VERSIONS_TRIED + 5)
    # When functions that never saw the run close the round
    calls = cold_start(h)
    rng = np.random.default_rng(8)
    for pid in PIDS:
        assert h.upload(pid, {k: (v + rng.normal(0, 0.1, v.shape)).astype(np.float32) for k, v in base.items()},
                        samples=10)["accepted"]
    # Then the round is aggregated from the committed objects
    after = h.state()
    assert after.round == 2 and after.aggregated == 2 and after.optimizer_digest != state.optimizer_digest
    # reading the buried one by the version the state records (hashed once, a small model's data read once more),
    # no forgery read, nothing listed
    gets = [c for c in calls.on(key) if c.operation == "GetObject"]
    assert gets and all(c.version_id == version for c in gets), gets
    assert 1 <= len(calls.whole_reads(key)) <= 2, gets
    assert not calls.listings(), calls.listings()


def test_an_item_recording_no_versions_finds_its_roster_past_forged_versions_oldest_first(
        optimizer_run: Harness) -> None:
    # Given a state item committed before items recorded versions, whose roster has more versions written over it
    # than a verified read tries
    h = optimizer_run
    store = h.deps.store
    item = store.m.run.get(store.pk, STATE_SK, consistent_read=True)
    item.body = {k: v for k, v in item.body.items() if k != VERSIONS}
    item.save()
    key = keys.roster_key(h.config.run_id, item.body[ROSTER])
    bury(h, key, blobs.MAX_VERSIONS_TRIED + 5)
    # When a function that never saw the run reads the state
    calls = cold_start(h)
    state = h.deps.store.read_state()
    # Then it finds the committed roster (the oldest version: the coordinator's) with one listing and two reads
    assert set(state.members) == set(PIDS)
    assert [c.operation for c in calls.on(key)] == ["GetObject", "ListObjectVersions", "GetObject"], calls.on(key)
    assert calls.on(key)[1].max_keys == blobs.LIST_PAGE


def test_a_look_back_lists_and_reads_a_bounded_number_of_versions(optimizer_run: Harness,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a roster named by no recorded version and buried under more versions than a look-back lists
    h = optimizer_run
    monkeypatch.setattr(blobs, "LIST_PAGE", 4)
    monkeypatch.setattr(blobs, "MAX_VERSIONS_LISTED", 12)
    monkeypatch.setattr(blobs, "MAX_VERSIONS_TRIED", 3)
    item = h.deps.store.m.run.get(h.deps.store.pk, STATE_SK, consistent_read=True).body
    key = keys.roster_key(h.config.run_id, item[ROSTER])
    bury(h, key, 20)
    calls = cold_start(h)
    # When a verified read looks for it
    with pytest.raises(Tampered, match="3 of the 12 listed"):
        h.deps.bucket.get_verified(key, item[ROSTER], 1 << 20)
    # Then it listed three pages of four versions and read the current version and three of those, nothing more
    assert [c.max_keys for c in calls.listings()] == [4, 4, 4], calls.listings()
    assert len(calls.whole_reads(key)) == 4, calls.on(key)
    # and with the committed version named, it reads that one alone
    calls.made.clear()
    named = h.deps.bucket.read_verified(key, item[ROSTER], 1 << 20, recorded_versions(h)[ROSTER])
    assert digest(named.data) == item[ROSTER] and [c.operation for c in calls.made] == ["GetObject"]
