"""A tick that would decide from silence first looks in the bucket (`coordinator.catchup`): a heartbeat or an
update uploaded in time but not yet delivered by the event queue (a backlog, a late S3 event) is ingested
then, with every check; what is not there, or is not valid, changes nothing."""

from __future__ import annotations

import time

import numpy as np

from coordinator.service import run_tick
from coordinator.tick import TickResult
from shared import keys
from shared.state import MemberStatus, Phase
from store.trace import acting_as, function
from tests.functional.conftest import MODEL, Harness

LIVENESS = 30.0


def _started(harness_factory, **overrides) -> Harness:  # type: ignore[no-untyped-def]
    settings = dict(liveness_timeout=LIVENESS, min_clients=2, fraction_per_round=1.0, min_updates=2)
    h: Harness = harness_factory(**(settings | overrides))
    h.scheduled_tick()
    now, run_id = time.time(), h.config.run_id
    for pid in ("alice", "bob", "carol"):  # joined 25 s ago, last heard from 20 s ago
        _deliver_sent_at(h, keys.join_key(run_id, pid), h.join_bytes(pid, sent_at=now - 25), now - 25)
        _deliver_sent_at(h, keys.heartbeat_key(run_id, pid), h.heartbeat_bytes(pid, sent_at=now - 20), now - 20)
    h.offer("alice")
    assert h.state().phase is Phase.TRAIN
    return h


def _deliver_sent_at(h: Harness, key: str, body: bytes, at: float) -> None:
    """An upload whose event says it was made at `at` (seconds ago, as its message's `sent_at` says)."""
    event = h.put(key, body)
    event["time"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at))
    assert h.deliver(event)["accepted"]



def tick_as_the_tick_function(h: Harness, now: float) -> TickResult:
    """The scheduled tick at `now` (its catch-up reads and records what the queue has not delivered: as the tick
    function's role, which the access check judges)."""
    with acting_as(function("tick")):
        return run_tick(h.deps, now=now)

def test_a_heartbeat_the_queue_has_not_delivered_keeps_its_member(harness_factory) -> None:  # type: ignore[no-untyped-def]
    h = _started(harness_factory)
    # Given alice's latest heartbeat in the bucket, its event not yet delivered, carol's delivered, and bob silent
    # since 20 s ago
    late = h.put(keys.heartbeat_key(h.config.run_id, "alice"), h.heartbeat_bytes("alice"))
    h.heartbeat("carol")
    # When a tick runs after bob's and alice's recorded heartbeats are older than the liveness timeout
    result = tick_as_the_tick_function(h, now=time.time() + LIVENESS - 10)
    # Then alice's heartbeat was taken from the bucket, and only bob was dropped
    members = h.state().members
    assert members["alice"].status is MemberStatus.ACTIVE
    assert members["carol"].status is MemberStatus.ACTIVE
    assert members["bob"].status is not MemberStatus.ACTIVE
    assert any("had not delivered" in note for note in result.notes), result.notes
    seen = h.deps.store.participants()["alice"].last_seen
    assert seen > time.time() - 5
    # And the event delivered later is the same message: nothing changes
    assert h.deliver(late)["recorded"] is False
    assert h.deps.store.participants()["alice"].last_seen == seen


def test_a_forged_heartbeat_in_the_bucket_keeps_nobody_alive(harness_factory) -> None:  # type: ignore[no-untyped-def]
    h = _started(harness_factory)
    # Given a heartbeat for alice signed by bob's key (anyone can write the key locally), carol's delivered
    h.put(keys.heartbeat_key(h.config.run_id, "alice"), h.heartbeat_bytes("alice"), signed_by="bob")
    h.heartbeat("carol")
    # When a tick runs once both are silent for longer than the liveness timeout
    result = tick_as_the_tick_function(h, now=time.time() + LIVENESS - 10)
    # Then alice was dropped as silent (with bob: the epoch ends with too few members), and the forgery's refusal
    # was recorded
    dropped = sorted(n.split()[1].rstrip(":") for n in result.notes if n.startswith("dropped"))
    assert dropped == ["alice", "bob"], result.notes
    refusals = [r for r in h.deps.store.refusals() if r.key == keys.heartbeat_key(h.config.run_id, "alice")]
    assert refusals and "signature" in refusals[0].reason, refusals


def test_an_update_uploaded_before_the_deadline_counts_though_its_event_is_late(harness_factory) -> None:  # type: ignore[no-untyped-def]
    h = _started(harness_factory, max_round_train_time=60, liveness_timeout=3600)
    run_id = h.config.run_id
    # Given alice's update ingested, bob's uploaded but its event not delivered, and carol's never uploaded
    h.upload("alice", {k: v + 1 for k, v in MODEL.items()}, samples=10)
    late = h.put(keys.update_key(run_id, 0, "bob"),
                 h.update_bytes("bob", {k: v + 3 for k, v in MODEL.items()}, samples=10))
    # When a tick runs after the round's deadline
    tick_as_the_tick_function(h, now=h.state().deadline + 1)
    # Then the round closed with both updates: the aggregate is their average
    assert h.state().round == 1
    got = h.global_model(1)
    for name, want in MODEL.items():
        np.testing.assert_allclose(got[name], want + 2, rtol=1e-6)
    # And the late event changes nothing
    assert h.deliver(late)["recorded"] is False


def test_a_round_closes_at_its_deadline_without_an_update_never_uploaded(harness_factory) -> None:  # type: ignore[no-untyped-def]
    h = _started(harness_factory, max_round_train_time=60, liveness_timeout=3600, min_updates=1)
    h.upload("alice", {k: v + 1 for k, v in MODEL.items()})
    result = tick_as_the_tick_function(h, now=h.state().deadline + 1)
    assert h.state().round == 1
    assert not any("had not delivered" in note for note in result.notes), result.notes
    for name, want in MODEL.items():
        np.testing.assert_allclose(h.global_model(1)[name], want + 1, rtol=1e-6)


def test_an_update_the_queue_has_not_delivered_keeps_its_uploader_alive(harness_factory) -> None:  # type: ignore[no-untyped-def]
    h = _started(harness_factory, max_round_train_time=600)
    run_id = h.config.run_id
    # Given bob's update of the round in the bucket, its event not delivered (an update upload stands in for a
    # heartbeat, so bob sent none since 20 s ago), carol's heartbeat delivered, and alice silent
    h.put(keys.update_key(run_id, 0, "bob"), h.update_bytes("bob", {k: v + 1 for k, v in MODEL.items()}, samples=10))
    h.heartbeat("carol")
    # When a tick runs once bob's and alice's recorded heartbeats are older than the liveness timeout
    result = tick_as_the_tick_function(h, now=time.time() + LIVENESS - 10)
    # Then bob's update was taken from the bucket and kept bob; only alice was dropped
    members = h.state().members
    assert members["bob"].status is MemberStatus.ACTIVE, result.notes
    assert members["alice"].status is MemberStatus.DROPPED
    assert h.deps.store.updates(0)["bob"].accepted
