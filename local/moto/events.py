"""S3's notifications to EventBridge, as the local stack runs them (`PATCHES`): delivered again where a delivery
raises, and a completed multipart upload announced once."""

from __future__ import annotations

import copy
import inspect
import logging
import threading
from typing import Any

from local.moto.patches import BUG, Patch

log = logging.getLogger("local.events")

ATTEMPTS = 3
_completing = threading.local()


def _delivered_again(send: Any) -> tuple[object, ...]:
    """moto.s3.notifications._send_event_bridge_message (send_event looks it up on each call)."""
    return (deliver,)


def _upload_announced_once(complete: Any, put: Any) -> tuple[object, ...]:
    """S3Backend.complete_multipart_upload, S3Backend.put_object."""

    def complete_multipart_upload(self: Any, *args: Any, **kwargs: Any) -> Any:
        _completing.active = True
        try:
            return complete(self, *args, **kwargs)
        finally:
            _completing.active = False

    signature = inspect.signature(put)

    def put_object(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not getattr(_completing, "active", False):
            return put(self, *args, **kwargs)
        call = signature.bind(self, *args, **kwargs)
        call.arguments["disable_notification"] = True  # the completion's own event follows
        return put(*call.args, **call.kwargs)

    return complete_multipart_upload, put_object


def deliver(account_id: str, bucket: Any, event_name: str, key: Any) -> None:
    """S3's EventBridge notification of `event_name` on `key` to every rule of the account's event buses."""
    for attempt in range(1, ATTEMPTS + 1):
        try:
            event = _event(account_id, bucket, event_name, key)
            _send(account_id, bucket.region_name, event)
            return
        except Exception:
            level = logging.ERROR if attempt == ATTEMPTS else logging.WARNING
            log.log(level, "delivering the S3 event %s of %s/%s failed (attempt %d of %d)", event_name, bucket.name,
                    key.name, attempt, ATTEMPTS, exc_info=True)


def _event(account_id: str, bucket: Any, event_name: str, key: Any) -> dict[str, Any]:
    from moto.core.utils import unix_time
    from moto.events.utils import _BASE_EVENT_MESSAGE
    from moto.s3.notifications import _detail_type

    event = dict(copy.deepcopy(_BASE_EVENT_MESSAGE))
    event.update({
        "detail-type": _detail_type(event_name), "source": "aws.s3", "account": account_id, "time": unix_time(),
        "region": bucket.region_name, "resources": [bucket.arn],
        "detail": {
            "version": "0",
            "bucket": {"name": bucket.name},
            "object": {"key": key.name, "size": key.size, "eTag": key.etag.replace('"', ""),
                       "version-id": key.version_id, "sequencer": "0"},
            "reason": event_name.split(":")[1],  # s3:ObjectCreated:Put -> ObjectCreated
        },
    })
    return event


def _send(account_id: str, region: str, event: Any) -> None:
    from moto.events.models import events_backends

    backend = events_backends[account_id][region]
    for bus in list(backend.event_buses.values()):
        for rule in list(bus.rules.values()):
            rule.send_to_targets(event, transform_input=False)


PATCHES = (
    Patch(
        "events_s3_delivery_tried_again", BUG,
        ("moto.s3.notifications:_send_event_bridge_message",),
        "An S3 event whose delivery to EventBridge raises (a race in the stand-in: moto's server serves requests in "
        "threads) is logged with its traceback and tried again, a few times (ATTEMPTS): moto hands each object's "
        "event to EventBridge inside the request that wrote the object, and drops it without a word if anything on "
        "the way raises (a bare `except: pass`). On AWS, EventBridge retries a delivery for 24 hours; a lost event "
        "here leaves an upload unseen until a tick's catch-up looks for it (`coordinator.catchup`, at the round's "
        "deadline). An event may then reach a rule twice, which ingest takes as S3's at-least-once delivery.",
        _delivered_again),
    Patch(
        "events_multipart_upload_announced_once", BUG,
        ("moto.s3.models:S3Backend.complete_multipart_upload", "moto.s3.models:S3Backend.put_object"),
        "A completed multipart upload is announced once, as S3 does (`ObjectCreated:CompleteMultipartUpload`): "
        "moto stores the object with its ordinary PUT, which announces `ObjectCreated:Put`, and then announces the "
        "completion too. Every large upload (a participant's update, the staged global) was thus ingested twice, "
        "at once: at 1 GB the second ingest streamed and hashed the update again while the round was aggregated, "
        "4-5 CPU-s of each 15 s aggregation in `make bench-big`.",
        _upload_announced_once),
)
