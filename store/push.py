"""The push of run-state changes: the coordinator publishes, each participant's own queue receives.

A commit that changes the run's phase, round, epoch or model publishes the committed state item to the run's
SNS topic (`StateTopic`, `shared.naming.state_topic_name`). Each participant creates one SQS queue of its own
(`shared.naming.participant_queue_name`), subscribes it to the topic with raw delivery, and long-polls it
(`StateQueue.wait`): one request per 20 s while nothing happens, woken as soon as something does. Locally the
same topic and queues exist on moto, whose SNS delivers to its SQS.

The push is an optimisation, never the truth: a message carries the state item exactly as stored, and the
participant treats it as a read of that item it did not have to make; messages may come late, twice or out of
order (the highest version wins), and a participant that hears nothing for long reads the item itself.

A message also carries the roster the item names (`store.rosters`: who is selected, the round's plan), gzipped, as
a binary message attribute, when the whole message stays within one 64 KiB billing chunk (SNS and SQS bill a
request per 64 KiB of payload): about a thousand members' roster. A participant woken by it then has the round
without a GET of the roster; a bigger roster, or one whose bytes do not match the digest the item names, is read
from the bucket as before. An attribute, not a field of the message: daemons that do not ask for it get the same
message as before.
"""

from __future__ import annotations

import gzip
import json
import logging
import zlib
from dataclasses import dataclass
from typing import Any

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from shared.messages import BILLED_CHUNK_BYTES, MAX_STATE_CHANGE_BYTES, MessageError, StateChange, parse_message
from shared.naming import participant_queue_name
from store.rosters import MAX_ROSTER_BYTES

log = logging.getLogger("fed-push")

LONG_POLL_SECONDS = 20  # SQS's longest receive wait
# A message is received once and never deleted: it stays invisible (VISIBILITY_SECONDS) until SQS drops it at the end
# of its retention (RETENTION_SECONDS). That spares a DeleteMessage per wake-up; the price is that a participant away
# from its queue for longer than the retention (a long download or training) may have missed a change, and reads the
# state item instead (participant.protocol). Five minutes: a participant back from training a round of minutes finds
# what it missed on its queue (SQS's shortest, 60 s, cost a read after every round of more than 50 s of training);
# what it finds beyond the newest is older news, ten to a receive.
RETENTION_SECONDS = 300
VISIBILITY_SECONDS = 12 * 3600  # SQS's longest
ROSTER_ATTRIBUTE = "roster"
ATTRIBUTE_OVERHEAD = 64  # the attribute's name and type, counted in the message's size


@dataclass(frozen=True)
class Pushed:
    """A state item as a push delivered it: its version and body, and the roster's canonical bytes if the message
    carried them (b"" otherwise; `store.rosters.state_of_item` reads them)."""

    version: int
    body: dict[str, Any]
    roster: bytes = b""


class StateTopic:
    """The coordinator's side: publish committed state items (best effort: a failed publish only makes the
    participants find the change by their own reads, later)."""

    def __init__(self, arn: str, client: Any) -> None:
        self.arn, self.client = arn, client
        self.published = 0

    @classmethod
    def connect(cls, arn: str, endpoint: str | None, region: str) -> StateTopic | None:
        return cls(arn, boto3.client("sns", endpoint_url=endpoint, region_name=region)) if arn else None

    def publish(self, run_id: str, version: int, body: dict[str, Any], roster: bytes = b"") -> None:
        """Publish the state item `body` at `version`, with the canonical bytes of its `roster` if they fit."""
        message = StateChange(run_id=run_id, version=version, state=body).model_dump_json(by_alias=True)
        attributes = {}
        if roster:
            packed = gzip.compress(roster, compresslevel=6, mtime=0)
            if len(message.encode()) + ATTRIBUTE_OVERHEAD + len(packed) <= BILLED_CHUNK_BYTES:
                attributes[ROSTER_ATTRIBUTE] = {"DataType": "Binary", "BinaryValue": packed}
        try:
            self.client.publish(TopicArn=self.arn, Message=message, MessageAttributes=attributes)
            self.published += 1
        except (ClientError, BotoCoreError) as exc:
            log.warning("could not publish state version %d to %s: %s", version, self.arn, exc)


class StateQueue:
    """A participant's side: its queue, subscribed to the run's state topic."""

    def __init__(self, run_id: str, url: str, sqs: Any) -> None:
        self.run_id, self.url, self.sqs = run_id, url, sqs

    @classmethod
    def connect(cls, run_id: str, pid: str, topic_arn: str, endpoint: str | None, region: str) -> StateQueue | None:
        """`open` with clients of its own."""
        config = Config(retries={"max_attempts": 3, "mode": "standard"},
                        read_timeout=LONG_POLL_SECONDS + 10)  # a long poll holds the connection 20 s
        return cls.open(run_id, pid, topic_arn, boto3.client("sqs", endpoint_url=endpoint, region_name=region,
                                                             config=config),
                        boto3.client("sns", endpoint_url=endpoint, region_name=region))

    @classmethod
    def open(cls, run_id: str, pid: str, topic_arn: str, sqs: Any, sns: Any) -> StateQueue | None:
        """Create (or find) our queue and subscribe it to the topic; None where there is no push to listen to
        (no topic, or a queue name SQS cannot hold). Raises ClientError / BotoCoreError (say, a role that may not
        create it): the caller polls instead. Four requests, once per process."""
        name = participant_queue_name(run_id, pid)
        if not topic_arn or name is None:
            return None
        attributes = {"ReceiveMessageWaitTimeSeconds": str(LONG_POLL_SECONDS),
                      "MessageRetentionPeriod": str(RETENTION_SECONDS)}
        try:
            url = sqs.create_queue(QueueName=name, Attributes=attributes)["QueueUrl"]
        except ClientError as exc:  # an earlier daemon's queue, with other attributes: take it as it is
            if exc.response.get("Error", {}).get("Code") not in {"QueueAlreadyExists", "QueueNameExists"}:
                raise
            url = sqs.get_queue_url(QueueName=name)["QueueUrl"]
        arn = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
        sqs.set_queue_attributes(QueueUrl=url, Attributes={  # (an earlier daemon's queue gets them too)
            **attributes, "Policy": json.dumps(_delivery_policy(arn, topic_arn))})
        sns.subscribe(TopicArn=topic_arn, Protocol="sqs", Endpoint=arn, Attributes={"RawMessageDelivery": "true"})
        return cls(run_id, url, sqs)

    def wait(self, seconds: float) -> Pushed | None:
        """The newest state change delivered within `seconds` (at most LONG_POLL_SECONDS; 0: what is there
        now), or None. One request: what is received stays invisible until it expires (see RETENTION_SECONDS)."""
        resp = self.sqs.receive_message(QueueUrl=self.url, MaxNumberOfMessages=10,
                                        VisibilityTimeout=VISIBILITY_SECONDS,
                                        WaitTimeSeconds=max(0, min(LONG_POLL_SECONDS, int(seconds))),
                                        MessageAttributeNames=[ROSTER_ATTRIBUTE])
        messages = resp.get("Messages", [])
        newest: tuple[Pushed, dict[str, Any]] | None = None
        for m in messages:
            got = self._parse(m.get("Body", ""))
            if got is not None and (newest is None or got.version > newest[0].version):
                newest = (got, m)
        if newest is None:
            return None
        pushed, message = newest
        packed = message.get("MessageAttributes", {}).get(ROSTER_ATTRIBUTE, {}).get("BinaryValue", b"")
        return Pushed(pushed.version, pushed.body, _unpacked(packed)) if packed else pushed

    def _parse(self, body: str) -> Pushed | None:
        if len(body.encode()) > MAX_STATE_CHANGE_BYTES:
            log.warning("ignored a %d-byte message on %s: not a state change", len(body), self.url)
            return None
        try:
            change = parse_message(StateChange, body)
        except MessageError as exc:
            log.warning("ignored a message on %s: %s", self.url, exc)
            return None
        if change.run_id != self.run_id:
            log.warning("ignored a state change of run %r on the queue of run %r", change.run_id, self.run_id)
            return None
        return Pushed(change.version, dict(change.state))

    def close(self) -> None:
        """Delete the queue (the run is over for us): nothing is left to bill or to deliver to."""
        try:
            self.sqs.delete_queue(QueueUrl=self.url)
        except (ClientError, BotoCoreError) as exc:
            log.warning("could not delete %s: %s", self.url, exc)


def _unpacked(packed: bytes) -> bytes:
    """A pushed roster's bytes, gunzipped (b"": not a gzip stream, or bigger than any roster: read it instead)."""
    try:
        inflater = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
        data = inflater.decompress(packed, MAX_ROSTER_BYTES + 1)
    except zlib.error as exc:
        log.warning("ignored a pushed roster: %s", exc)
        return b""
    if len(data) > MAX_ROSTER_BYTES or inflater.unconsumed_tail:
        log.warning("ignored a pushed roster of more than %d bytes", MAX_ROSTER_BYTES)
        return b""
    return data


def _delivery_policy(queue_arn: str, topic_arn: str) -> dict[str, Any]:
    """The queue's policy: the run's state topic may send to it; nothing else is granted."""
    return {
        "Version": "2012-10-17",
        "Statement": [{
            "Sid": "StateTopicDelivers",
            "Effect": "Allow",
            "Principal": {"Service": "sns.amazonaws.com"},
            "Action": "sqs:SendMessage",
            "Resource": queue_arn,
            "Condition": {"ArnEquals": {"aws:SourceArn": topic_arn}},
        }],
    }
