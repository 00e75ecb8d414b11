"""Readiness reaches the coordinator even when a heartbeat lands in the same second as the join.

EventBridge event times are whole seconds. A participant that downloads the model and reports
"ready" within a second of joining must still end warmup early; before the fix in
`StateStore.touch`, the heartbeat's ready_epoch was dropped with its last_seen update.
"""

from __future__ import annotations

from datetime import UTC, datetime

from shared import keys
from tests.functional.conftest import Harness


def heartbeat(harness: Harness, pid: str, ready_epoch: int, time: str) -> dict:  # type: ignore[type-arg]
    sent = datetime.fromisoformat(time.replace("Z", "+00:00")).timestamp()
    body = harness.heartbeat_bytes(pid, sent_at=sent + 0.5, ready_epoch=ready_epoch, info={"activity": "ready"})
    event = harness.put(keys.heartbeat_key(harness.config.run_id, pid), body)
    event["time"] = time
    return event


def test_ready_in_the_same_second_as_the_join_is_recorded(harness: Harness) -> None:
    # Given a participant that joined at 12:00:00
    harness.scheduled_tick()
    join = harness.put(keys.join_key(harness.config.run_id, "alice"),
                       harness.join_bytes("alice", sent_at=datetime(2026, 11, 22, 12, tzinfo=UTC).timestamp()))
    join["time"] = "2026-11-22T12:00:00Z"
    harness.deliver(join)
    # When its "ready for epoch 1" heartbeat is stamped with the same second
    harness.deliver(heartbeat(harness, "alice", 1, "2026-11-22T12:00:00Z"))
    # Then the readiness is recorded
    record = harness.deps.store.participant("alice")
    assert record is not None and int(record.ready_epoch) == 1


def test_an_older_heartbeat_never_lowers_readiness(harness: Harness) -> None:
    harness.scheduled_tick()
    join = harness.put(keys.join_key(harness.config.run_id, "alice"),
                       harness.join_bytes("alice", sent_at=datetime(2030, 1, 1, tzinfo=UTC).timestamp()))
    join["time"] = "2030-01-01T00:00:00Z"
    harness.deliver(join)
    harness.deliver(heartbeat(harness, "alice", 2, "2030-01-01T00:00:05Z"))
    # an out-of-order, older heartbeat that still says epoch 1
    harness.deliver(heartbeat(harness, "alice", 1, "2030-01-01T00:00:05Z"))
    harness.deliver(heartbeat(harness, "alice", 1, "2030-01-01T00:00:04Z"))
    record = harness.deps.store.participant("alice")
    assert record is not None and int(record.ready_epoch) == 2
