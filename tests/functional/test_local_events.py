"""local.moto.events: an S3 event whose delivery to EventBridge raises is logged and delivered again, where moto
dropped it without a word; a delivery that never succeeds is logged as an error."""

from __future__ import annotations

import json
import logging
from typing import Any

import boto3
import pytest

from local.moto import events as moto_events
from local.resources import create_resources
from shared import keys


def received(sqs: Any, url: str) -> list[dict[str, Any]]:
    messages = sqs.receive_message(QueueUrl=url, MaxNumberOfMessages=10).get("Messages", [])
    return [json.loads(m["Body"]) for m in messages]


def failing(times: int, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Make the next `times` deliveries raise (as a race inside moto's server would); returns the attempts seen."""
    attempts: list[int] = []
    send = moto_events._send

    def flaky(account_id: str, region: str, event: dict[str, Any]) -> None:
        if event["detail-type"] != "Object Created":  # (moto also announces the upload's tagging)
            return send(account_id, region, event)
        attempts.append(len(attempts) + 1)
        if len(attempts) <= times:
            raise RuntimeError("dictionary changed size during iteration")
        send(account_id, region, event)

    monkeypatch.setattr(moto_events, "_send", flaky)
    return attempts


def test_an_event_whose_delivery_raises_is_delivered_again_and_the_failure_logged(
        aws: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # Given the run's resources, and the next delivery of an S3 event failing once
    resources = create_resources("events")
    s3, sqs = boto3.client("s3"), boto3.client("sqs")
    attempts = failing(1, monkeypatch)
    # When a participant's heartbeat is uploaded
    key = keys.heartbeat_key("events", "p1")
    with caplog.at_level(logging.WARNING, logger="local.events"):
        s3.put_object(Bucket=resources.bucket, Key=key, Body=b"{}")
    # Then its event reaches the ingest queue all the same, after a second attempt, and the first failure is logged
    events = received(sqs, resources.queue_url)
    assert [e["detail"]["object"]["key"] for e in events] == [key] and attempts == [1, 2]
    assert events[0]["source"] == "aws.s3" and events[0]["detail-type"] == "Object Created"
    assert events[0]["detail"]["object"]["size"] == 2 and events[0]["detail"]["object"]["version-id"]
    assert "failed (attempt 1 of 3)" in caplog.text and "dictionary changed size" in caplog.text


def test_an_event_that_cannot_be_delivered_is_logged_as_an_error(
        aws: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # Given every delivery failing
    resources = create_resources("events")
    s3, sqs = boto3.client("s3"), boto3.client("sqs")
    attempts = failing(moto_events.ATTEMPTS, monkeypatch)
    # When an object is uploaded
    with caplog.at_level(logging.WARNING, logger="local.events"):
        s3.put_object(Bucket=resources.bucket, Key=keys.heartbeat_key("events", "p1"), Body=b"{}")
    # Then the upload succeeded, nothing was delivered, and the loss is an error in the log (not silence)
    assert received(sqs, resources.queue_url) == [] and len(attempts) == moto_events.ATTEMPTS
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "attempt 3 of 3" in errors[0].getMessage()


def test_a_completed_multipart_upload_is_announced_once(aws: None) -> None:
    # Given the run's resources
    resources = create_resources("events")
    s3, sqs = boto3.client("s3"), boto3.client("sqs")
    key = keys.update_key("events", 0, "p1")
    # When an update is uploaded in two parts
    started = s3.create_multipart_upload(Bucket=resources.bucket, Key=key)
    parts = [s3.upload_part(Bucket=resources.bucket, Key=key, UploadId=started["UploadId"], PartNumber=n, Body=body)
             for n, body in ((1, b"x" * 5 * 1024 * 1024), (2, b"y"))]
    s3.complete_multipart_upload(Bucket=resources.bucket, Key=key, UploadId=started["UploadId"], MultipartUpload={
        "Parts": [{"PartNumber": n, "ETag": p["ETag"]} for n, p in enumerate(parts, start=1)]})
    # Then one event reaches the ingest queue, as S3 sends one (moto announced the object's PUT as well)
    events = received(sqs, resources.queue_url)
    assert [e["detail"]["object"]["key"] for e in events] == [key]
    assert events[0]["detail"]["object"]["size"] == 5 * 1024 * 1024 + 1
    # And an ordinary PUT is still announced
    s3.put_object(Bucket=resources.bucket, Key=keys.heartbeat_key("events", "p1"), Body=b"{}")
    assert [e["detail"]["object"]["key"] for e in received(sqs, resources.queue_url)] == [
        keys.heartbeat_key("events", "p1")]
