"""The push of state changes (`store.push`) on moto: a commit that changes the run's phase or round publishes
the committed state item to the run's topic; a participant's own subscribed queue receives it and reads it as
the state item; other commits publish nothing; what is not a state change of this run is ignored."""

from __future__ import annotations

import copy
import gzip
import json
import sys
import threading
from collections import OrderedDict
from typing import Any

import boto3
import numpy as np
import pytest

from shared import keys
from shared.digest import digest
from shared.messages import StateChange
from shared.naming import participant_queue_name
from shared.state import Phase
from store import push
from store.push import StateQueue
from store.records import ROSTER
from store.rosters import encoded
from store.table import StateStore
from tests.functional.conftest import MODEL, Harness


def _queue(h: Harness, pid: str) -> tuple[StateQueue, Any]:
    sqs, sns = boto3.client("sqs", region_name="us-east-1"), boto3.client("sns", region_name="us-east-1")
    queue = StateQueue.open(h.config.run_id, pid, h.res.state_topic, sqs, sns)
    assert queue is not None
    return queue, sqs


def _drain(queue: StateQueue) -> None:
    while queue.wait(0) is not None:
        pass


def test_a_new_round_is_pushed_as_the_committed_state_item(harness: Harness) -> None:
    # Given alice's queue subscribed before the run starts
    queue, _ = _queue(harness, "alice")

    # When the run starts round 0
    harness.start(["alice", "bob"])

    # Then the newest message is the committed state, read exactly as the state item reads
    pushed = queue.wait(0)
    state = harness.state()
    assert state.phase is Phase.TRAIN and pushed is not None and pushed.version == state.version
    assert harness.deps.store.state_of(pushed.body, pushed.version) == state
    assert queue.wait(0) is None, "a message is received once (it stays invisible until it expires)"


def reader(h: Harness) -> tuple[StateStore, list[str]]:
    """A participant's view of the store (no roster held yet), and the roster GETs it makes."""
    store = StateStore(h.deps.store.m.run.Meta.table_name, h.config.run_id, h.deps.bucket, h.deps.store.m.run.Meta.host)
    gets: list[str] = []
    get_verified = store.rosters.bucket.get_verified

    def counted(key: str, *args: Any, **kwargs: Any) -> bytes:
        gets.append(key)
        return get_verified(key, *args, **kwargs)

    store.rosters.bucket = copy.copy(store.rosters.bucket)
    store.rosters.bucket.get_verified = counted  # type: ignore[method-assign]
    return store, gets


def test_a_push_carries_the_roster_so_a_woken_participant_reads_no_roster(harness: Harness) -> None:
    # Given alice's queue, and the run starting round 0 with a roster of its members, selection and plan
    queue, _ = _queue(harness, "alice")
    harness.start(["alice", "bob"])
    # When she is woken by the new round
    pushed = queue.wait(0)
    assert pushed is not None and pushed.roster
    # Then the message had the roster's canonical bytes (gzipped), and the state it names is whole without a GET
    store, gets = reader(harness)
    assert store.state_of(pushed.body, pushed.version, pushed.roster) == harness.state()
    assert gets == []
    assert digest(pushed.roster) == pushed.body[ROSTER]


def test_a_roster_that_would_take_the_message_past_one_billed_chunk_is_read_instead(
        harness: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given pushes billed by chunks smaller than any message with its roster (64 KiB on AWS: a thousand members')
    monkeypatch.setattr(push, "BILLED_CHUNK_BYTES", 100)
    queue, _ = _queue(harness, "alice")
    harness.start(["alice", "bob"])
    # When she is woken by the new round
    pushed = queue.wait(0)
    assert pushed is not None and not pushed.roster
    # Then she reads the roster the item names from the bucket
    store, gets = reader(harness)
    assert store.state_of(pushed.body, pushed.version, pushed.roster) == harness.state()
    assert gets == [keys.roster_key(harness.config.run_id, pushed.body[ROSTER])]


def test_pushed_roster_bytes_that_are_not_the_named_roster_are_not_taken(harness: Harness) -> None:
    # Given the run training round 0 and a push whose roster bytes were swapped for another document
    queue, _ = _queue(harness, "alice")
    harness.start(["alice", "bob"])
    pushed = queue.wait(0)
    assert pushed is not None
    roster = json.loads(pushed.roster)
    roster["members"]["mallory"] = roster["members"]["alice"]
    forged = encoded(roster)  # a whole roster, with every field, that is not the one the item names
    # When she reads the state it names
    store, gets = reader(harness)
    state = store.state_of(pushed.body, pushed.version, forged)
    # Then the roster is the one the item names, read from the bucket
    assert state == harness.state() and "mallory" not in state.members
    assert len(gets) == 1


def test_a_pushed_roster_that_inflates_past_any_roster_is_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(push, "MAX_ROSTER_BYTES", 1000)
    assert push._unpacked(gzip.compress(b"x" * 1000)) == b"x" * 1000
    assert push._unpacked(gzip.compress(b"x" * 1001)) == b""
    assert push._unpacked(b"not gzip") == b""


def test_only_commits_that_change_phase_round_or_model_are_pushed(harness: Harness) -> None:
    harness.start(["alice", "bob"])
    queue, _ = _queue(harness, "alice")
    _drain(queue)
    more = {k: v + 1 for k, v in MODEL.items()}

    # When the first of two updates is recorded (no tick), then a scheduled tick that changes nothing
    assert harness.upload("alice", more)["accepted"]
    harness.scheduled_tick()
    # Then nothing was pushed
    assert queue.wait(0) is None

    # When the round's last update closes it and the next round begins
    assert harness.upload("bob", more)["accepted"]
    # Then that commit is pushed: round 1, training
    pushed = queue.wait(0)
    assert pushed is not None
    state = harness.deps.store.state_of(pushed.body, pushed.version)
    assert (state.round, state.phase) == (1, Phase.TRAIN) and state == harness.state()
    assert np.allclose(harness.global_model(1)["dense.bias"], 1.0)


def test_what_is_not_a_state_change_of_this_run_is_ignored_and_the_newest_wins(harness: Harness) -> None:
    queue, sqs = _queue(harness, "alice")
    body = {"phase": "train", "round": 3}

    def send(text: str) -> None:
        sqs.send_message(QueueUrl=queue.url, MessageBody=text)

    send(StateChange(run_id=harness.config.run_id, version=7, state=body).model_dump_json(by_alias=True))
    send(StateChange(run_id=harness.config.run_id, version=5, state={}).model_dump_json(by_alias=True))
    send(StateChange(run_id="another-run", version=99, state={}).model_dump_json(by_alias=True))
    send(json.dumps({"version": 100, "state": {}, "run_id": harness.config.run_id, "extra": 1}))  # not the schema
    send("x" * 20_000)  # over the size a state change can have
    got, seen = [], 0
    while (pushed := queue.wait(0)) is not None or seen < 1:
        seen += 1
        if pushed is not None:
            got.append(pushed)
    assert max(p.version for p in got) == 7 and all(p.version in (5, 7) for p in got)
    assert next(p for p in got if p.version == 7).body == body


def test_no_queue_without_a_topic_or_for_an_id_too_long_for_a_queue_name(harness: Harness) -> None:
    sqs, sns = boto3.client("sqs", region_name="us-east-1"), boto3.client("sns", region_name="us-east-1")
    assert StateQueue.open(harness.config.run_id, "alice", "", sqs, sns) is None
    assert participant_queue_name(harness.config.run_id, "p" * 63) == f"fed-{harness.config.run_id}-p-{'p' * 63}"
    assert participant_queue_name("r" * 40, "p" * 63) is None  # 107 characters: that participant polls


def test_a_closed_queue_is_gone(harness: Harness) -> None:
    queue, sqs = _queue(harness, "alice")
    queue.close()
    assert all(not url.endswith("-p-alice") for url in sqs.list_queues().get("QueueUrls", []))


def test_a_change_reaches_every_participant_queue_past_a_hundred(harness: Harness) -> None:
    # (moto alone delivers a publish to a topic's first 100 subscriptions: local.moto.sns)
    queues = [_queue(harness, f"p{i:03d}")[0] for i in range(120)]
    harness.start(["alice", "bob"])
    version = harness.state().version
    assert all((p := q.wait(0)) is not None and p.version == version for q in queues)


def test_a_change_reaches_every_queue_after_one_whose_participant_finished(harness: Harness) -> None:
    # Given three participants' queues, the first of them closed (its participant finished: the queue is deleted,
    # its subscription is still on the topic)
    first, second, third = (_queue(harness, pid)[0] for pid in ("alice", "bob", "carol"))
    first.close()
    # When a commit publishes a change
    harness.start(["bob", "carol"])
    version = harness.state().version
    # Then the queues after the deleted one receive it (SNS delivers to each subscription on its own)
    assert all((p := q.wait(0)) is not None and p.version == version for q in (second, third))


@pytest.mark.parametrize("looking_in", ["_find_subscription", "set_subscription_attributes"])
def test_a_subscribe_while_another_looks_through_the_subscriptions_fails_neither(
        harness: Harness, monkeypatch: pytest.MonkeyPatch, looking_in: str) -> None:
    # (moto's server serves requests in threads: a thousand participants subscribing their queues at once, each
    # with raw delivery, which moto sets after the subscribe by looking the subscription up among all of them)
    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.sns import models

    sqs, sns = boto3.client("sqs", region_name="us-east-1"), boto3.client("sns", region_name="us-east-1")
    arns = [sqs.get_queue_attributes(QueueUrl=sqs.create_queue(QueueName=f"q{i}")["QueueUrl"],
                                     AttributeNames=["QueueArn"])["Attributes"]["QueueArn"] for i in range(4)]
    for arn in arns[:2]:
        sns.subscribe(TopicArn=harness.res.state_topic, Protocol="sqs", Endpoint=arn)
    looking, looked, errors = threading.Event(), threading.Event(), []

    class Subscriptions(OrderedDict):  # type: ignore[type-arg]
        def values(self) -> Any:
            # the first subscribe pauses after the first subscription it looked at, in `looking_in`, until the
            # other is done (or, where the other waits for it to finish, for half a second)
            for n, value in enumerate(super().values()):
                yield value
                callers = (sys._getframe(1).f_code.co_name, sys._getframe(2).f_code.co_name)  # (a comprehension's)
                if n == 0 and threading.current_thread().name == "first" and looking_in in callers:
                    looking.set()
                    looked.wait(0.5)

    backend = models.sns_backends[DEFAULT_ACCOUNT_ID]["us-east-1"]
    monkeypatch.setattr(backend, "subscriptions", Subscriptions(backend.subscriptions))
    attributes = {"RawMessageDelivery": "true"} if looking_in == "set_subscription_attributes" else {}

    def subscribe(arn: str) -> None:
        try:
            sns.subscribe(TopicArn=harness.res.state_topic, Protocol="sqs", Endpoint=arn, Attributes=attributes)
        except Exception as exc:  # what a participant would have got: a 500
            errors.append(exc)

    first = threading.Thread(target=subscribe, args=(arns[2],), name="first")
    first.start()
    assert looking.wait(5)
    subscribe(arns[3])  # while the first looks through the subscriptions
    looked.set()
    first.join()
    assert errors == []
    listed = sns.list_subscriptions_by_topic(TopicArn=harness.res.state_topic)["Subscriptions"]
    assert {s["Endpoint"] for s in listed} == set(arns)
