"""`StateStore` hands back plain typed records, never pynamodb items; and ingest copes with a lost join race."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from shared import keys
from shared.state import RoundSummary
from store.table import StateStore
from store.views import ParticipantRecord, ProofRecord, RefusalRecord, UpdateRecord
from tests.functional.conftest import MODEL, Harness


def model(k: float) -> dict[str, np.ndarray]:
    return {name: (arr + k).astype(arr.dtype) for name, arr in MODEL.items()}


def test_records_come_back_as_typed_dataclasses(harness: Harness) -> None:
    harness.start(["alice", "bob"])
    store = harness.deps.store
    alice = store.participant("alice")
    assert isinstance(alice, ParticipantRecord)
    assert alice.public_key == harness.signer("alice").public_key and alice.info == {"host": "test"}
    assert store.participant("nobody") is None
    harness.upload("alice", model(1))
    harness.upload("bob", model(2))
    rec = store.update_record(0, "alice")
    assert isinstance(rec, UpdateRecord) and rec.accepted
    assert rec.key == keys.update_key(harness.config.run_id, 0, "alice")
    assert all(isinstance(u, UpdateRecord) for u in store.all_updates()) and len(store.all_updates()) == 2
    store.record_proof(0, "alice", "{}", "etag", 1.0)
    assert store.proof_record(0, "alice") == ProofRecord(0, "alice", "etag", "{}", 1.0)
    assert store.proof_record(0, "bob") is None
    store.record_refusal("some/key", "e:v", "no reason", 2.0, "bob")
    assert store.refusals() == [RefusalRecord("some/key", "e:v", "no reason", 2.0, "bob")]
    summary = store.round_summary(0)
    assert isinstance(summary, RoundSummary) and summary == store.rounds()[0]
    assert store.round_summary(99) is None


def test_a_join_that_lost_a_race_to_a_record_it_cannot_read_is_refused(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    harness.scheduled_tick()

    def lost(self: StateStore, *args: Any) -> str:
        return "exists"

    # Given a join whose registration loses to a racing one, and the winner's record cannot be read back
    monkeypatch.setattr(StateStore, "create_participant", lost)
    monkeypatch.setattr(StateStore, "participant", lambda self, pid: None)
    # Then the join is refused with the reason, instead of failing
    out = harness.join("alice")
    assert out["accepted"] is False and "raced with another registration" in out["reason"]


def test_every_item_class_and_transaction_of_a_store_sends_through_one_client(harness: Harness) -> None:
    # (each botocore client loads botocore's description of DynamoDB anew: 50-250 ms apiece)
    harness.start(["alice", "bob"])
    harness.upload("alice", model(1))
    harness.upload("bob", model(2))  # a round's close: a transaction with its summary
    m = harness.deps.store.m
    classes = [m.run, m.participant, m.update, m.offer, m.round, m.refusal, m.counter, m.lease, m.proof, m.health]
    assert {id(c._get_connection().connection) for c in classes} == {id(m.connection)}
    assert harness.deps.store._connection() is m.connection
    assert harness.state().aggregated == 1


def test_the_shared_client_is_built_before_any_thread_can_use_it() -> None:
    # (pynamodb builds a Connection's client on first use, unlocked, then registers a hook on it: two threads
    # sending at once through a client not yet built could each see the other's half-built one)
    from store.records import Models

    m = Models("a-table", "http://localhost:1", "us-east-1")
    assert m.connection._client is not None


def test_a_write_that_times_out_raises_its_timeout_not_an_attribute_error(
        harness: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a participant, and the table's endpoint timing out on every conditional write (as the local server did
    # under a thousand participants)
    from botocore.client import BaseClient
    from botocore.exceptions import ReadTimeoutError
    from pynamodb.exceptions import PutError, UpdateError

    harness.start(["alice"])
    store = harness.deps.store
    call = BaseClient._make_api_call

    def timing_out(self: Any, operation: str, kwargs: dict[str, Any]) -> Any:
        if operation in {"UpdateItem", "PutItem"}:
            raise ReadTimeoutError(endpoint_url="http://127.0.0.1:1/")
        return call(self, operation, kwargs)

    monkeypatch.setattr(BaseClient, "_make_api_call", timing_out)
    # When a heartbeat moves alice's last contact, and a lease is claimed
    # Then each raises the write's error caused by the timeout (pynamodb's response code raised AttributeError)
    with pytest.raises(UpdateError) as update:
        store.touch("alice", 10.0**10)
    with pytest.raises(PutError) as put:
        store.claim("aggregate#0", "holder", 2.0, 1.0)
    assert all("Read timeout" in str(e.value.cause) for e in (update, put))
