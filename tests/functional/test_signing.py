"""Upload signatures: the identity layer that holds even where IAM does not (locally, moto enforces none)."""

from __future__ import annotations

import json
import time

import numpy as np

from shared import keys
from shared.signing import Signer
from shared.state import Phase
from tests.functional.conftest import MODEL, Harness


def model(k: float) -> dict[str, np.ndarray]:
    return {name: (arr + k).astype(arr.dtype) for name, arr in MODEL.items()}


def test_unsigned_and_mis_signed_uploads_are_refused_without_taking_the_slot(harness: Harness) -> None:
    harness.start(["alice", "bob"])
    key = keys.update_key(harness.config.run_id, 0, "alice")
    data = harness.update_bytes("alice", model(1))
    unsigned = harness.send(key, data, signed_by=None)
    assert unsigned["accepted"] is False and "unsigned" in unsigned["reason"]
    # an upload by one identity (bob) under another participant's key (alice's)
    forged = harness.send(key, data, signed_by="bob")
    assert forged["accepted"] is False and "does not match" in forged["reason"]
    assert harness.deps.store.update_record(0, "alice") is None, "a forgery must not use alice's slot"
    assert len(harness.deps.store.refusals()) == 2
    # alice's own upload is still accepted and counted
    assert harness.send(key, data)["accepted"]
    harness.upload("bob", model(2))
    assert harness.deps.store.rounds()[0].counted == ("alice", "bob")


def test_a_signature_cannot_be_moved_to_another_key(harness: Harness) -> None:
    harness.start(["alice", "bob"])
    data = harness.update_bytes("alice", model(1))
    signature = harness.signer("alice").metadata(keys.update_key(harness.config.run_id, 0, "alice"), data)
    other = keys.heartbeat_key(harness.config.run_id, "alice")
    harness.s3.put_object(Bucket=harness.res.bucket, Key=other, Body=data, Metadata=signature)
    event = harness.put(other, data)  # re-put with a proper signature to get an event, then replay the moved one
    harness.s3.put_object(Bucket=harness.res.bucket, Key=other, Body=data, Metadata=signature)
    head = harness.s3.head_object(Bucket=harness.res.bucket, Key=other)
    event["detail"]["object"].update(etag=head["ETag"].strip('"'), **{"version-id": head["VersionId"]})
    result = harness.deliver(event)
    assert result["accepted"] is False and "does not match" in result["reason"]


def test_a_second_join_cannot_replace_the_registered_key(harness: Harness) -> None:
    harness.scheduled_tick()
    assert harness.join("alice")["accepted"]
    mallory = Signer.generate()
    body = json.dumps({"run_id": harness.config.run_id, "participant": "alice", "public_key": mallory.public_key,
                       "sent_at": time.time()})
    key = keys.join_key(harness.config.run_id, "alice")
    harness.s3.put_object(Bucket=harness.res.bucket, Key=key, Body=body.encode(),
                          Metadata=mallory.metadata(key, body.encode()))
    event = harness.put(key, body.encode(), signed_by=None)
    harness.s3.put_object(Bucket=harness.res.bucket, Key=key, Body=body.encode(),
                          Metadata=mallory.metadata(key, body.encode()))
    head = harness.s3.head_object(Bucket=harness.res.bucket, Key=key)
    event["detail"]["object"].update(etag=head["ETag"].strip('"'), **{"version-id": head["VersionId"]})
    result = harness.deliver(event)
    assert result["accepted"] is False and "another key" in result["reason"]
    assert harness.deps.store.participant("alice").public_key == harness.signer("alice").public_key
    # and alice's own rejoin still works
    assert harness.join("alice")["reason"] == "rejoined"


def test_a_join_without_a_key_or_signature_is_refused(harness: Harness) -> None:
    harness.scheduled_tick()
    body = json.dumps({"run_id": harness.config.run_id, "participant": "eve"}).encode()
    result = harness.send(keys.join_key(harness.config.run_id, "eve"), body, signed_by=None)
    assert result["accepted"] is False and "join request refused" in result["reason"]
    assert harness.state().phase is Phase.WAITING and harness.deps.store.participants() == {}
