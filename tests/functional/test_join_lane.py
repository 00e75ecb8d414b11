"""The join lane locally: join requests have their own rule, queue and dispatcher worker, so a backlog of
joins never delays a heartbeat (the attack: hundreds of signed identities joining within seconds held the
heartbeats of honest members back until they were dropped as silent)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import boto3
import pytest

from coordinator.intake import heartbeat as heartbeat_intake
from fed.localrun import wait_until
from local.dispatcher import Dispatcher
from local.stack import LocalStack
from shared import keys, wire
from shared.config import RunConfig
from shared.messages import Heartbeat, JoinRequest
from shared.signing import Signer
from shared.state import Phase
from store.table import StateStore
from tests.functional.conftest import MODEL, Harness

RUN = "lane-test"
FLOOD = 300


@pytest.fixture()
def stack() -> Iterator[LocalStack]:
    config = RunConfig(run_id=RUN, min_clients=2, min_per_round=1, total_rounds=1, liveness_timeout=600)
    with LocalStack(config, tick_interval=0.5, log_level="WARNING") as s:
        yield s


def until(predicate: Callable[[], bool], timeout: float = 30.0) -> None:
    assert wait_until(predicate, timeout, 0.05), "condition not reached in time"


class Uploader:
    def __init__(self, stack: LocalStack) -> None:
        c = stack.connection
        self.bucket = c.bucket
        self.s3 = boto3.client("s3", endpoint_url=c.endpoint, region_name=c.region)
        self.signers: dict[str, Signer] = {}

    def put(self, key: str, body: bytes, pid: str) -> None:
        signer = self.signers.setdefault(pid, Signer.generate())
        self.s3.put_object(Bucket=self.bucket, Key=key, Body=body, Metadata=signer.metadata(key, body))

    def join(self, pid: str) -> None:
        signer = self.signers.setdefault(pid, Signer.generate())
        request = JoinRequest(run_id=RUN, participant=pid, public_key=signer.public_key, sent_at=time.time())
        self.put(keys.join_key(RUN, pid), request.model_dump_json().encode(), pid)

    def heartbeat(self, pid: str) -> float:
        beat = Heartbeat(participant=pid, sent_at=time.time())
        self.put(keys.heartbeat_key(RUN, pid), beat.model_dump_json().encode(), pid)
        return beat.sent_at


def queued(stack: LocalStack, url: str) -> int:
    sqs = boto3.client("sqs", endpoint_url=stack.endpoint, region_name="us-east-1")
    attrs = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["All"])["Attributes"]
    return int(attrs["ApproximateNumberOfMessages"]) + int(attrs["ApproximateNumberOfMessagesNotVisible"])


def drain(stack: LocalStack, url: str) -> list[str]:
    """Every key queued on `url` (removed from it)."""
    sqs = boto3.client("sqs", endpoint_url=stack.endpoint, region_name="us-east-1")
    found: list[str] = []
    while messages := sqs.receive_message(QueueUrl=url, MaxNumberOfMessages=10, WaitTimeSeconds=1).get("Messages"):
        for m in messages:
            found.append(json.loads(m["Body"])["detail"]["object"]["key"])
            sqs.delete_message(QueueUrl=url, ReceiptHandle=m["ReceiptHandle"])
    return found


def test_join_requests_go_down_the_join_lane_other_uploads_down_the_main_one_and_coordinator_objects_nowhere() -> None:
    # Given the local stack's resources (moto's EventBridge matching the lanes' patterns), nobody delivering
    config = RunConfig(run_id=RUN, min_clients=2, min_per_round=1, total_rounds=1)
    with LocalStack(config, dispatch=False, log_level="WARNING") as stack:
        assert stack.resources is not None
        up = Uploader(stack)
        # When a join request, a heartbeat, an update, an offer, a witness proof, a health report and keys outside
        # the layout are uploaded, and an object of every kind the coordinator writes
        up.join("alice")
        others = [keys.heartbeat_key(RUN, "alice"), keys.update_key(RUN, 3, "alice"), keys.init_key(RUN, "alice"),
                  keys.witness_key(RUN, 3, "alice"), keys.health_key(RUN, 3, "alice"),
                  f"{keys.run_prefix(RUN)}joined/alice", f"{keys.run_prefix(RUN)}join"]
        digest = "ab" * 32
        coordinators = [keys.global_key(RUN, 3, digest), keys.optimizer_key(RUN, 3, digest),
                        keys.delta_key(RUN, 3, digest), keys.staging_key(RUN, 3, digest),
                        keys.shard_result_key(RUN, 3, digest, 0), keys.roster_key(RUN, digest),
                        keys.checkpoint_global_key(RUN, 3), keys.checkpoint_state_key(RUN, 3),
                        keys.checkpoint_optimizer_key(RUN, 3, digest), keys.latest_checkpoint_key(RUN),
                        keys.manifest_key(RUN), keys.config_key(RUN)]
        for key in others + coordinators:
            up.put(key, b"{}", "alice")
        # Then the join request is queued on the join lane only, every other upload on the main lane only, and
        # none of the coordinator's objects on either
        assert drain(stack, stack.resources.join_queue_url) == [keys.join_key(RUN, "alice")]
        assert sorted(drain(stack, stack.resources.queue_url)) == sorted(others)


def test_a_heartbeat_is_delivered_while_hundreds_of_joins_wait_in_their_lane(stack: LocalStack) -> None:
    # Given alice, a registered participant, and the dispatcher stopped while a flood of 300 signed join
    # requests from distinct identities is uploaded, then alice's heartbeat
    assert stack.resources is not None and stack.dispatcher is not None
    c = stack.connection
    store = StateStore.of(c)
    up = Uploader(stack)
    up.join("alice")
    until(lambda: store.participant("alice") is not None)
    stack.dispatcher.stop()
    for i in range(FLOOD):
        up.join(f"flood{i:03d}")
    sent = up.heartbeat("alice")
    until(lambda: queued(stack, stack.resources.join_queue_url) == FLOOD)  # type: ignore[union-attr]

    # When a dispatcher delivers them (the stack's lanes: 3 main-lane workers, 1 join-lane worker), with the real
    # ingest and join functions
    began = time.monotonic()
    dispatcher = Dispatcher(stack.resources, tick_interval=0.5)
    stats: dict[str, Any] = {}
    with dispatcher:
        until(lambda: (r := store.participant("alice")) is not None and r.last_sent == sent)
        stats["heartbeat after"] = time.monotonic() - began
        stats["joins registered by then"] = len(store.participants()) - 1
        stats["joins still queued then"] = queued(stack, stack.resources.join_queue_url)
        # (the join lane goes on meanwhile, one join request at a time)
        until(lambda: dispatcher.stats.joins_delivered >= 3)
    print(f"\njoin-lane backlog: {stats}")

    # Then the heartbeat was recorded before the join lane was drained: before most joins were even registered
    assert stats["joins registered by then"] < FLOOD / 2, stats
    assert stats["joins still queued then"] > FLOOD / 2, stats
    record = store.participant("alice")
    assert record is not None and record.heard_at > 0
    assert dispatcher.stats.failed == 0


# --- a heartbeat that overtakes its join request -----------------------------------------------------------


def test_a_heartbeat_that_overtook_the_join_counts_once_the_join_is_registered(harness: Harness) -> None:
    # Given alice's join request still waiting in its lane while her first heartbeat is delivered: early, kept for
    # the join (which takes it), and no refusal of an honest participant
    run = harness.config.run_id
    join = harness.put(keys.join_key(run, "alice"), harness.join_bytes("alice"))
    beat = harness.send(keys.heartbeat_key(run, "alice"), harness.heartbeat_bytes("alice", ready_epoch=0))
    assert beat["accepted"] is False and beat["reason"].startswith("early")
    assert harness.deps.store.refusals() == []
    # When the join request is delivered
    assert harness.deliver(join)["accepted"] is True
    # Then her heartbeat is taken now: she has been heard from since her join, and may be admitted
    record = harness.deps.store.participant("alice")
    assert record is not None and record.heard_at > 0
    assert harness.deps.store.participants()["alice"].proven


@pytest.mark.parametrize("case", ["sent before the join", "signed by another key", "names another participant"])
def test_a_heartbeat_found_at_registration_counts_only_if_it_is_alices_and_later(harness: Harness, case: str) -> None:
    # Given, in alice's heartbeat key, a heartbeat that is not hers or not sent after her join request
    run = harness.config.run_id
    now = time.time()
    if case == "sent before the join":
        harness.put(keys.heartbeat_key(run, "alice"), harness.heartbeat_bytes("alice", sent_at=now - 5))
    elif case == "signed by another key":
        harness.put(keys.heartbeat_key(run, "alice"), harness.heartbeat_bytes("alice", sent_at=now + 1),
                    signed_by="mallory")
    else:
        harness.put(keys.heartbeat_key(run, "alice"), harness.heartbeat_bytes("bob", sent_at=now + 1))
    # When her join request (sent now) is registered
    assert harness.send(keys.join_key(run, "alice"), harness.join_bytes("alice", sent_at=now))["accepted"]
    # Then she is registered but not yet heard from since: no epoch would admit her yet
    assert not harness.deps.store.participants()["alice"].proven


# --- an initial-model offer that overtakes its join request ------------------------------------------------------


def test_an_offer_sent_before_the_join_is_registered_is_kept_and_taken_at_registration(harness: Harness) -> None:
    # Given a run without a model, and alice's join request still waiting in its lane when her offer is delivered
    run = harness.config.run_id
    harness.scheduled_tick()
    join = harness.put(keys.join_key(run, "alice"), harness.join_bytes("alice"))
    offer = harness.offer("alice")
    # Then the offer is accepted, checked against the key her join request registers, and kept (no tick)
    assert offer["accepted"] is True and "kept" in offer["reason"] and "tick" not in offer
    assert harness.deps.store.participant("alice") is None
    # When her join request is delivered (the join function reads no model: it takes the offer's digest)
    assert harness.deliver(join)["accepted"] is True
    # Then she is registered with her offer, and a run of alice and bob starts from it
    record = harness.deps.store.participant("alice")
    assert record is not None and record.init_digest == wire.digest(wire.encode(MODEL))
    harness.heartbeat("alice")
    harness.join_alive("bob")
    state = harness.state()
    assert state.phase is Phase.TRAIN and state.model_source == "alice"
    assert state.global_digest == record.init_digest


def test_an_offer_kept_while_its_sender_was_being_registered_is_not_lost(harness: Harness,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    # Given alice's join registered after ingest found no record for her offer, and before it kept the offer (so
    # the join function found nothing kept)
    run = harness.config.run_id
    harness.scheduled_tick()
    join = harness.put(keys.join_key(run, "alice"), harness.join_bytes("alice"))
    keep = StateStore.keep_offer

    def registered_meanwhile(self: StateStore, pid: str, digest: str, public_key: str, version_id: str = "") -> None:
        assert harness.deliver(join)["accepted"] is True
        assert harness.deps.store.participant("alice").init_digest == ""  # type: ignore[union-attr]
        keep(self, pid, digest, public_key, version_id)

    monkeypatch.setattr(StateStore, "keep_offer", registered_meanwhile)
    # When her offer is delivered
    offer = harness.offer("alice")
    # Then ingest, looking again after keeping it, found her registered and recorded the offer itself
    assert offer["accepted"] is True and not offer["reason"]
    record = harness.deps.store.participant("alice")
    assert record is not None and record.init_digest == wire.digest(wire.encode(MODEL))


@pytest.mark.parametrize("case", ["no join request", "signed by another key"])
def test_an_offer_from_no_joiner_is_refused_with_the_reason(harness: Harness, case: str) -> None:
    # Given a run without a model, and an offer for alice with no join request of hers, or signed by mallory
    run = harness.config.run_id
    harness.scheduled_tick()
    if case == "signed by another key":
        harness.put(keys.join_key(run, "alice"), harness.join_bytes("alice"))
    offer = harness.send(keys.init_key(run, "alice"), wire.encode(MODEL),
                         signed_by="owner" if case == "no join request" else "mallory")
    # Then it is refused, the reason recorded, and nothing kept for a later registration to take
    assert offer["accepted"] is False and "initial model refused" in offer["reason"]
    assert harness.deps.store.kept_offer("alice", harness.signer("alice").public_key) == ("", "")
    assert any("initial model refused" in r.reason for r in harness.deps.store.refusals())


def test_a_heartbeat_during_a_round_does_not_tick(harness: Harness) -> None:
    # Given a round in progress with alice and bob, and carol registered since (she waits for the next epoch)
    harness.start(["alice", "bob"])
    harness.join_alive("carol")
    assert "carol" not in harness.state().members
    # When carol and alice heartbeat
    outsider, member = harness.heartbeat("carol"), harness.heartbeat("alice")
    # Then both are recorded, but neither ticks: an outsider's liveness changes nothing before the next epoch
    # starts, and a member's only keeps it from being dropped (a flood of registered identities, or a thousand
    # members heartbeating, must not cost a tick each: a tick reads every participant record)
    assert outsider["accepted"] and outsider["recorded"] and "tick" not in outsider
    assert member["accepted"] and member["recorded"] and "tick" not in member
    assert harness.deps.store.participants()["carol"].proven


def test_while_waiting_only_a_heartbeat_that_makes_its_sender_eligible_ticks(harness_factory,  # type: ignore[no-untyped-def]
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a run waiting for three members: alice and bob heard from since they joined, carol only registered
    h = harness_factory(min_clients=3)
    h.scheduled_tick()
    h.join_alive("alice")
    h.join_alive("bob")
    h.join("carol")
    # When alice heartbeats again
    again = h.heartbeat("alice")
    # Then it is recorded but does not tick: she was eligible already, so nothing an epoch's start depends on changed
    # (a thousand eligible participants heartbeating while an epoch could not start cost a tick each, and each tick
    # reads every participant record: the queue of their heartbeats grew until none arrived in time)
    assert again["accepted"] and again["recorded"] and "tick" not in again
    # When carol heartbeats for the first time since she joined
    first = h.heartbeat("carol")
    # Then it ticks: she just became eligible, and may complete the admission
    assert first["accepted"] and "tick" in first
    # When dave's first heartbeat overtakes his join request, which takes it (the join function never ticks)
    join = h.put(keys.join_key(h.config.run_id, "dave"), h.join_bytes("dave"))
    assert h.heartbeat("dave")["accepted"] is False
    assert h.deliver(join)["accepted"] is True and h.deps.store.participants()["dave"].proven
    # Then his next heartbeat ticks for him, once
    assert "tick" in h.heartbeat("dave")
    assert "tick" not in h.heartbeat("dave")
    # When bob heartbeats after a silence longer than the liveness timeout
    later = time.time() + h.config.liveness_timeout + 1
    monkeypatch.setattr(heartbeat_intake, "time", SimpleNamespace(time=lambda: later))
    back = h.heartbeat("bob")
    # Then it ticks: he was no longer eligible, and is again
    assert back["accepted"] and "tick" in back
    assert h.state().phase is Phase.WAITING  # (no model offered: no epoch can start)


# --- events held until everyone asked to join (`fed demo`, the e2e harness) -----------------------------------


def test_released_joins_are_all_registered_before_a_tick_runs() -> None:
    # Given a stack holding its events while twelve participants ask to join and heartbeat, and ticks that note
    # how many participants are registered each time they run (one every 0.1 s: far more often than the join
    # lane, one worker, registers twelve)
    config = RunConfig(run_id=RUN, min_clients=2, min_per_round=1, total_rounds=1, liveness_timeout=600)
    names = [f"p{i:02d}" for i in range(12)]
    with LocalStack(config, dispatch=False, log_level="WARNING") as stack:
        assert stack.resources is not None
        store = StateStore.of(stack.connection)
        seen: list[int] = []
        dispatcher = Dispatcher(stack.resources, tick_interval=0.1,
                                tick=lambda event, context: seen.append(len(store.participants())))
        up = Uploader(stack)
        dispatcher.start(deliver=False)
        try:
            for name in names:
                up.join(name)
                up.heartbeat(name)
            until(lambda: len(seen) >= 3)
            # When the held events are released
            dispatcher.release()
            until(lambda: dispatcher.stats.delivered >= 2 * len(names) and len(seen) >= 20)
        finally:
            dispatcher.stop()
        # Then no tick ran while only some of them were registered: the first epoch could admit them all
        assert 0 < len(set(seen)) and set(seen) <= {0, len(names)}, seen
        assert all(r.proven for r in store.participants().values())
        assert sorted(store.participants()) == names


def test_a_forged_heartbeat_beside_a_pending_join_is_still_refused(harness: Harness) -> None:
    # Given alice's join request waiting in its lane, and a heartbeat at her key signed by another key
    run = harness.config.run_id
    harness.put(keys.join_key(run, "alice"), harness.join_bytes("alice"))
    forged = harness.send(keys.heartbeat_key(run, "alice"), harness.heartbeat_bytes("alice"), signed_by="mallory")
    # Then it is refused, and shown as a refusal
    assert forged["accepted"] is False and "never joined" in forged["reason"]
    (refusal,) = harness.deps.store.refusals()
    assert refusal.pid == "alice" and "never joined" in refusal.reason
