"""The ingest and tick handlers against moto, driven by recorded EventBridge event JSON."""

from __future__ import annotations

import json
import threading
import time

import numpy as np

from coordinator.service import run_tick
from shared import keys, wire
from shared.state import MemberStatus, Phase
from tests.functional.conftest import MODEL, Harness


def scaled(k: float) -> dict[str, np.ndarray]:
    return {name: (arr + k).astype(arr.dtype) for name, arr in MODEL.items()}


def test_first_tick_publishes_the_config_and_creates_the_state(harness: Harness) -> None:
    # When the schedule fires on a new run
    result = harness.scheduled_tick()
    # Then the state exists and participants can read the run's configuration
    assert result["committed"] and result["phase"] == Phase.WAITING
    body = harness.s3.get_object(Bucket=harness.res.bucket, Key=keys.config_key(harness.config.run_id))["Body"]
    assert json.loads(body.read())["run_id"] == harness.config.run_id


def test_a_round_end_to_end_and_the_global_equals_fedavg_of_accepted_files(harness: Harness) -> None:
    # Given two members training round 0
    state = harness.start(["alice", "bob"])
    assert state.phase is Phase.TRAIN and set(state.selected) == {"alice", "bob"}
    # When both upload (with different sample counts, within a fair share of each other: max_share_ratio)
    first = harness.upload("alice", scaled(1.0), samples=30)
    result = harness.upload("bob", scaled(3.0), samples=18)
    # Then the first is recorded without a tick (it cannot close the round), and the last upload's tick closes the
    # round at once
    assert first["accepted"] and "tick" not in first and harness.state().phase is Phase.TRAIN
    assert result["tick"]["fired"][:2] == ["round_closed", "aggregate_next_round"]
    state = harness.state()
    assert state.round == 1 and state.aggregated == 1
    # And the new global model equals FedAvg recomputed independently from the accepted update files
    expected = {}
    files = {}
    for pid in ("alice", "bob"):
        obj = harness.s3.get_object(Bucket=harness.res.bucket, Key=keys.update_key(harness.config.run_id, 0, pid))
        files[pid] = wire.decode(obj["Body"].read())
    total = sum(int(h.metadata["fed.samples"]) for _, h in files.values())
    for name in MODEL:
        acc = sum(arrays[name].astype(np.float64) * int(h.metadata["fed.samples"]) for arrays, h in files.values())
        expected[name] = (acc / total).astype(np.float32)
    got = harness.global_model(1)
    for name in MODEL:
        np.testing.assert_array_equal(got[name], expected[name])
    np.testing.assert_allclose(got["dense.bias"], np.full(4, (30 * 1.0 + 18 * 3.0) / 48))
    # And the state points at exactly those bytes
    raw = harness.s3.get_object(Bucket=harness.res.bucket, Key=harness.global_key(1))["Body"]
    assert wire.digest(raw.read()) == state.global_digest
    (summary,) = harness.deps.store.rounds()
    assert summary.counted == ("alice", "bob") and summary.samples == 48
    assert summary.global_digest == state.global_digest


def test_duplicate_event_changes_nothing(harness: Harness) -> None:
    harness.start(["alice", "bob"])
    event = harness.put(keys.update_key(harness.config.run_id, 0, "alice"), harness.update_bytes("alice", scaled(1)))
    first = harness.deliver(event)
    version = harness.state().version
    # When the same event is delivered again
    again = harness.deliver(event)
    # Then nothing is recorded twice and the state does not move
    assert first["recorded"] and not again["recorded"]
    assert harness.state().version == version
    assert len(harness.deps.store.updates(0)) == 1
    assert harness.deps.store.refusals() == []


def test_duplicate_join_event_is_a_rejoin_not_a_new_member(harness: Harness) -> None:
    harness.scheduled_tick()
    event = harness.put(keys.join_key(harness.config.run_id, "alice"), harness.join_bytes("alice"))
    assert harness.deliver(event)["reason"] == ""
    assert harness.deliver(event)["reason"] == "rejoined"
    assert list(harness.deps.store.participants()) == ["alice"]


def test_out_of_order_events(harness: Harness) -> None:
    harness.start(["alice", "bob"])
    run = harness.config.run_id
    # Given two heartbeats of alice, the newer delivered first
    old = harness.put(keys.heartbeat_key(run, "alice"), harness.heartbeat_bytes("alice", sent_at=1893456000.0))
    new = harness.put(keys.heartbeat_key(run, "alice"), harness.heartbeat_bytes("alice", sent_at=1893456060.0))
    old["time"], new["time"] = "2030-01-01T00:00:00Z", "2030-01-01T00:01:00Z"
    harness.deliver(new)
    harness.deliver(old)
    # Then last_seen does not move back
    assert harness.deps.store.participants()["alice"].last_seen == 1893456060.0
    # Given bob's update event delivered before alice's, and a late copy of alice's after the round moved on
    bob = harness.put(keys.update_key(run, 0, "bob"), harness.update_bytes("bob", scaled(2)))
    alice = harness.put(keys.update_key(run, 0, "alice"), harness.update_bytes("alice", scaled(1)))
    harness.deliver(bob)
    harness.deliver(alice)
    assert harness.state().round == 1
    late = harness.deliver(alice)
    # Then the late duplicate is recognised and changes nothing
    assert late["recorded"] is False
    assert [s.counted for s in harness.deps.store.rounds()] == [("alice", "bob")]


def test_two_ticks_racing_exactly_one_commits(harness_factory) -> None:  # type: ignore[no-untyped-def]
    # Given a round whose deadline has passed, so a tick has something to do
    harness = harness_factory(liveness_timeout=3600)
    harness.start(["alice", "bob"])
    harness.upload("alice", scaled(1))
    deps = harness.deps
    later = time.time() + harness.config.max_round_train_time + 1
    barrier = threading.Barrier(2)
    loads = {"n": 0}
    original = type(deps.store).load_snapshot

    def synchronised_load(self):  # type: ignore[no-untyped-def]
        snap = original(self)
        loads["n"] += 1
        if loads["n"] <= 2:  # both first loads see the same version, then race to commit
            barrier.wait(timeout=10)
        return snap

    results = []
    try:
        type(deps.store).load_snapshot = synchronised_load  # type: ignore[method-assign]
        threads = [threading.Thread(target=lambda: results.append(run_tick(deps, later))) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
    finally:
        type(deps.store).load_snapshot = original  # type: ignore[method-assign]
    # Then exactly one committed; the other retried and found nothing to do
    assert sorted(r.committed for r in results) == [False, True]
    loser = next(r for r in results if not r.committed)
    assert loser.attempts == 2
    state = harness.state()
    assert state.aggregated == 1
    assert [(s.round, s.counted) for s in harness.deps.store.rounds()] == [(0, ("alice",))]
    assert "missed the deadline" in harness.deps.store.rounds()[0].dropped["bob"]


def test_deadline_drops_the_silent_participant_and_aggregates_the_rest(harness_factory) -> None:  # type: ignore[no-untyped-def]
    harness = harness_factory(liveness_timeout=3600)
    harness.start(["alice", "bob", "carol"])
    harness.upload("alice", scaled(1))
    harness.upload("bob", scaled(2))
    result = run_tick(harness.deps, time.time() + harness.config.max_round_train_time + 1)
    assert result.fired[0] == "round_closed"
    state = harness.state()
    assert state.members["carol"].status is MemberStatus.DROPPED
    assert "deadline" in state.members["carol"].reason
    assert harness.deps.store.rounds()[0].counted == ("alice", "bob")


def test_events_that_are_not_s3_uploads_are_ignored(harness: Harness) -> None:
    harness.scheduled_tick()
    version = harness.state().version
    out = harness.deliver({"source": "aws.events", "detail-type": "Scheduled Event", "detail": {}})
    assert "ignored" in out and harness.state().version == version


def test_coordinator_objects_are_not_treated_as_uploads(harness: Harness) -> None:
    harness.start(["alice", "bob"])
    out = harness.deliver(harness.put(keys.global_key(harness.config.run_id, 5, "0" * 64), b"x"))
    assert out["recorded"] is False and harness.deps.store.refusals() == []
