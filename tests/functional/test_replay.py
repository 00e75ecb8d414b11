"""Signed control messages cannot be replayed: a join request or heartbeat is accepted only if it was sent
after the last one accepted from its participant, and within `max_clock_skew` of its arrival."""

from __future__ import annotations

import time
from typing import Any

from shared import keys
from tests.functional.conftest import Harness


def replay(h: Harness, key: str, body: bytes, metadata: dict[str, str]) -> dict[str, Any]:
    """Upload captured bytes again with the signature they were first uploaded with (what anyone who can
    write the key, and saw the object, can do), and deliver the event S3 emits for that upload."""
    assert h.signer(key.rsplit("/", 1)[-1]).metadata(key, body) == metadata  # Ed25519: the same signature
    return h.send(key, body)


def test_a_replayed_heartbeat_does_not_keep_a_participant_alive(harness: Harness) -> None:
    # Given alice's signed heartbeat, captured by someone who can write her key, and a newer one after it
    harness.start(["alice", "bob"])
    key = keys.heartbeat_key(harness.config.run_id, "alice")
    old = harness.heartbeat_bytes("alice")
    signature = harness.signer("alice").metadata(key, old)
    assert harness.send(key, old)["accepted"]
    assert harness.send(key, harness.heartbeat_bytes("alice", sent_at=time.time() + 1))["accepted"]
    seen = harness.deps.store.participant("alice")
    assert seen is not None
    # When the old heartbeat is uploaded again, correctly signed
    result = replay(harness, key, old, signature)
    # Then it is refused as a replay, and alice's last_seen does not move
    assert result["accepted"] is False and "replayed or out of order" in result["reason"]
    after = harness.deps.store.participant("alice")
    assert after is not None and after.last_seen == seen.last_seen and after.last_sent == seen.last_sent
    assert any("replayed or out of order" in r.reason for r in harness.deps.store.refusals())


def test_a_heartbeat_sent_long_before_it_arrives_is_refused_as_stale(harness: Harness) -> None:
    harness.start(["alice", "bob"])
    body = harness.heartbeat_bytes("alice", sent_at=time.time() - harness.config.max_clock_skew - 60)
    result = harness.send(keys.heartbeat_key(harness.config.run_id, "alice"), body)
    assert result["accepted"] is False and "stale: sent at" in result["reason"]


def test_a_replayed_join_request_is_refused(harness: Harness) -> None:
    # Given alice's signed join request, accepted, then a heartbeat
    harness.scheduled_tick()
    key = keys.join_key(harness.config.run_id, "alice")
    join = harness.join_bytes("alice")
    signature = harness.signer("alice").metadata(key, join)
    assert harness.send(key, join)["accepted"]
    beat = harness.heartbeat_bytes("alice", sent_at=time.time() + 1)
    assert harness.send(keys.heartbeat_key(harness.config.run_id, "alice"), beat)["accepted"]
    # When the join request is uploaded again
    result = replay(harness, key, join, signature)
    # Then it is refused as a replay (a fresh join, sent now, is a rejoin)
    assert result["accepted"] is False and "replayed or out of order" in result["reason"]
    assert harness.send(key, harness.join_bytes("alice", sent_at=time.time() + 2))["reason"] == "rejoined"
