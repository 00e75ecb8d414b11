"""Parsing the EventBridge events the functions receive (the edge: nothing past here sees raw JSON).

Read as plain dicts, not through powertools' `EventBridgeEvent`: importing its package imports every event data
class it has (~15 ms of each cold start of ingest and join), for the two fields read here."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from coordinator.intake import ObjectCreated


class BadEvent(ValueError):
    pass


def event_time(event: dict[str, Any]) -> float:
    try:
        return datetime.fromisoformat(event["time"].replace("Z", "+00:00")).timestamp()
    except (KeyError, ValueError, AttributeError):
        raise BadEvent(f"event has no valid time: {event.get('time')!r}") from None


def object_created(raw: dict[str, Any]) -> ObjectCreated:
    """The S3 object an "Object Created" EventBridge event announces."""
    if raw.get("source") != "aws.s3" or raw.get("detail-type") != "Object Created":
        raise BadEvent(f"not an S3 Object Created event: {raw.get('source')!r} {raw.get('detail-type')!r}")
    detail = raw["detail"]
    try:
        obj = detail["object"]
        return ObjectCreated(
            bucket=str(detail["bucket"]["name"]),
            key=str(obj["key"]),
            size=int(obj.get("size", 0)),
            etag=str(obj.get("etag") or obj.get("eTag") or "").strip('"'),
            version_id=str(obj.get("version-id", "") or ""),
            time=event_time(raw),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise BadEvent(f"malformed Object Created event: {exc}") from None
