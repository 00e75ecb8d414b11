"""local.moto.sqs: a send or a receive no longer reads every attribute of its queue (three scans of its messages),
and SQS behaves as before: counts, deduplication on a FIFO queue, delivery, retention."""

from __future__ import annotations

import threading

import boto3
import pytest


def counts(sqs: object, url: str) -> tuple[int, int]:
    attrs = sqs.get_queue_attributes(  # type: ignore[attr-defined]
        QueueUrl=url, AttributeNames=["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"]
    )["Attributes"]
    return int(attrs["ApproximateNumberOfMessages"]), int(attrs["ApproximateNumberOfMessagesNotVisible"])


def test_a_send_or_a_receive_reads_one_value_not_every_attribute(aws: None, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a queue with a backlog, and moto's count of queued messages watched
    from moto.sqs import models

    sqs = boto3.client("sqs", region_name="us-east-1")
    url = sqs.create_queue(QueueName="backlog")["QueueUrl"]
    for i in range(50):
        sqs.send_message(QueueUrl=url, MessageBody=f"m{i}")
    scans = []
    counted = models.Queue.approximate_number_of_messages.fget
    monkeypatch.setattr(models.Queue, "approximate_number_of_messages",
                        property(lambda q: scans.append(q.name) or counted(q)))
    # When one more message is sent, and ten are received
    sqs.send_message(QueueUrl=url, MessageBody="one more")
    received = sqs.receive_message(QueueUrl=url, MaxNumberOfMessages=10)["Messages"]
    # Then neither counted the queue's messages, while the queue's attributes still count every message
    assert scans == [] and len(received) == 10
    assert counts(sqs, url) == (41, 10)
    assert scans  # (the attributes read the count)


def test_a_message_past_the_retention_period_is_not_received(aws: None, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a queue keeping messages 60 s, and a message sent 61 s ago
    from moto.sqs import models

    sqs = boto3.client("sqs", region_name="us-east-1")
    url = sqs.create_queue(QueueName="short", Attributes={"MessageRetentionPeriod": "60"})["QueueUrl"]
    sqs.send_message(QueueUrl=url, MessageBody="old")
    sent = models.sqs_backends["123456789012"]["us-east-1"].get_queue("short")._messages[0]
    monkeypatch.setattr(sent, "sent_timestamp", sent.sent_timestamp - 61_000)
    # When the queue is read
    response = sqs.receive_message(QueueUrl=url, MaxNumberOfMessages=10)
    # Then the message does not come
    assert "Messages" not in response


def test_a_fifo_queue_still_deduplicates_by_content(aws: None) -> None:
    # Given a FIFO queue with content-based deduplication
    sqs = boto3.client("sqs", region_name="us-east-1")
    url = sqs.create_queue(QueueName="dedup.fifo",
                           Attributes={"FifoQueue": "true", "ContentBasedDeduplication": "true"})["QueueUrl"]
    # When the same body is sent twice, and another once
    for body in ("same", "same", "other"):
        sqs.send_message(QueueUrl=url, MessageBody=body, MessageGroupId="g")
    # Then the queue holds two messages
    assert counts(sqs, url) == (2, 0)


def test_a_message_sent_while_two_are_deleted_is_kept(aws: None, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a queue with two delivered messages, deleted by two requests at once, and a send between them (the local
    # server serves each request in a thread of its own): the second delete walks the queue's messages while the
    # first one replaces the list and the send appends to the new one
    from moto.sqs import models

    sqs = boto3.client("sqs", region_name="us-east-1")
    url = sqs.create_queue(QueueName="events")["QueueUrl"]
    for body in ("first", "second"):
        sqs.send_message(QueueUrl=url, MessageBody=body)
    first, second = (m["ReceiptHandle"] for m in sqs.receive_message(QueueUrl=url, MaxNumberOfMessages=10)["Messages"])
    backend = models.sqs_backends["123456789012"]["us-east-1"]

    def delete_and_send() -> None:
        backend.delete_message("events", first)
        backend.send_message("events", "sent meanwhile")

    other = threading.Thread(target=delete_and_send)
    walked = models.Message.had_receipt_handle
    calls = []

    def walking(self: models.Message, receipt_handle: str) -> bool:
        calls.append(receipt_handle)
        if receipt_handle == second and len(calls) == 3:  # (the lookup took two; now the rebuild walks the list)
            other.start()
            other.join(0.5)  # a delete and send not held off by this delete are done by now
        return walked(self, receipt_handle)

    monkeypatch.setattr(models.Message, "had_receipt_handle", walking)
    # When the second message is deleted
    backend.delete_message("events", second)
    other.join()
    # Then the message sent meanwhile is there to receive, and neither deleted message is
    bodies = [m["Body"] for m in sqs.receive_message(QueueUrl=url, MaxNumberOfMessages=10).get("Messages", [])]
    assert bodies == ["sent meanwhile"]


def counted_looks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list that grows by one each time a receive lists a queue's visible messages."""
    from moto.sqs import models

    looks: list[int] = []
    visible = models.Queue.messages.fget
    monkeypatch.setattr(models.Queue, "messages", property(lambda q: looks.append(1) or visible(q)))
    return looks


def test_a_long_poll_on_an_empty_queue_looks_again_only_when_a_message_comes(
        aws: None, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given an empty queue whose visible messages are counted each time a receive looks (moto looked once a second)
    sqs = boto3.client("sqs", region_name="us-east-1")
    url = sqs.create_queue(QueueName="push")["QueueUrl"]
    looks = counted_looks(monkeypatch)
    # When a poll of 2 s gets nothing, and another gets a message sent while it waits
    assert "Messages" not in sqs.receive_message(QueueUrl=url, WaitTimeSeconds=2)
    quiet = len(looks)
    sender = threading.Timer(0.5, lambda: sqs.send_message(QueueUrl=url, MessageBody="new round"))
    sender.start()
    bodies = [m["Body"] for m in sqs.receive_message(QueueUrl=url, WaitTimeSeconds=20)["Messages"]]
    sender.join()
    # Then the quiet poll looked at its start, when it began to wait, and at its end; the other got the message
    assert quiet <= 3 and bodies == ["new round"]


def test_a_long_poll_gets_a_message_that_becomes_visible_again_while_it_waits(aws: None) -> None:
    # Given a queue whose one message was received and not deleted, hidden for 1 s (nothing announces its return)
    sqs = boto3.client("sqs", region_name="us-east-1")
    url = sqs.create_queue(QueueName="redelivery")["QueueUrl"]
    sqs.send_message(QueueUrl=url, MessageBody="again")
    assert len(sqs.receive_message(QueueUrl=url, VisibilityTimeout=1)["Messages"]) == 1
    # When a poll of 5 s waits
    response = sqs.receive_message(QueueUrl=url, WaitTimeSeconds=5)
    # Then it gets the message again within its poll
    assert [m["Body"] for m in response["Messages"]] == ["again"]


def test_a_long_poll_gets_a_message_whose_visibility_is_changed_while_it_waits(aws: None) -> None:
    # Given a queue whose one message was received and not deleted, hidden for a minute
    sqs = boto3.client("sqs", region_name="us-east-1")
    url = sqs.create_queue(QueueName="retry")["QueueUrl"]
    sqs.send_message(QueueUrl=url, MessageBody="retry me")
    handle = sqs.receive_message(QueueUrl=url, VisibilityTimeout=60)["Messages"][0]["ReceiptHandle"]
    # When a poll of 5 s waits, and meanwhile the message is made visible now (as the local dispatcher does to retry)
    changer = threading.Timer(0.5, lambda: sqs.change_message_visibility(QueueUrl=url, ReceiptHandle=handle,
                                                                         VisibilityTimeout=0))
    changer.start()
    response = sqs.receive_message(QueueUrl=url, WaitTimeSeconds=5)
    changer.join()
    # Then the poll gets it
    assert [m["Body"] for m in response.get("Messages", [])] == ["retry me"]


def test_a_long_poll_on_a_queue_of_changes_received_long_ago_sleeps_until_its_end(
        aws: None, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a participant's queue: the changes it received stay in flight for hours (store.push never deletes them)
    sqs = boto3.client("sqs", region_name="us-east-1")
    url = sqs.create_queue(QueueName="participant")["QueueUrl"]
    sqs.send_message(QueueUrl=url, MessageBody="round 1")
    assert len(sqs.receive_message(QueueUrl=url, VisibilityTimeout=12 * 3600)["Messages"]) == 1
    looks = counted_looks(monkeypatch)
    # When a poll of 2 s gets nothing
    assert "Messages" not in sqs.receive_message(QueueUrl=url, WaitTimeSeconds=2)
    # Then it looked at its start, when it began to wait, and at its end
    assert len(looks) <= 3
