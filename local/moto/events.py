"""moto's S3 hands each object's event to EventBridge inside the request that wrote the object, and drops the
event without a word if anything on the way raises (a bare `except: pass` around the delivery). On AWS, EventBridge
retries a delivery for 24 hours; a lost event here leaves an upload unseen until a tick's catch-up looks for it
(`coordinator.catchup`, at the round's deadline: a round that waits for every update waits until then). `apply()`
delivers the same event and, where a delivery raises (a race in the stand-in: moto's server serves requests in
threads), logs it with its traceback and tries again, a few times: an event may then reach a rule twice, which
ingest takes as S3's at-least-once delivery.

And a completed multipart upload is announced once, as S3 does (`ObjectCreated:CompleteMultipartUpload`): moto
stores the object with its ordinary PUT, which announces `ObjectCreated:Put`, and then announces the completion
too. Every large upload (a participant's update, the staged global) was thus ingested twice, at once: at 1 GB the
second ingest streamed and hashed the update again while the round was aggregated, 4-5 CPU-s of each 15 s
aggregation in `make bench-big`. Idempotent; used by the local stack and the functional tests."""

from __future__ import annotations

import copy
import logging
import threading
from typing import Any

log = logging.getLogger("local.events")

ATTEMPTS = 3
_applied = False
_completing = threading.local()


def apply() -> None:
    global _applied
    if _applied:
        return
    from moto.s3 import notifications
    from moto.s3.models import S3Backend

    notifications._send_event_bridge_message = deliver  # send_event looks it up on each call
    complete, put = S3Backend.complete_multipart_upload, S3Backend.put_object

    def complete_multipart_upload(self: Any, *args: Any, **kwargs: Any) -> Any:
        _completing.active = True
        try:
            return complete(self, *args, **kwargs)
        finally:
            _completing.active = False

    def put_object(self: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(_completing, "active", False):  # the completion's own event follows
            kwargs["disable_notification"] = True
        return put(self, *args, **kwargs)

    S3Backend.complete_multipart_upload = complete_multipart_upload  # type: ignore[method-assign]
    S3Backend.put_object = put_object  # type: ignore[method-assign]
    _applied = True


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

    event: dict[str, Any] = copy.deepcopy(_BASE_EVENT_MESSAGE)  # type: ignore[arg-type]
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
