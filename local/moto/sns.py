"""moto's SNS, as the local stack runs it (`PATCHES`): a publish delivered as SNS delivers it, and a topic's
subscriptions safe to change while they are read."""

from __future__ import annotations

import base64
import functools
import logging
import threading
from typing import Any

from local.moto.patches import BUG, Patch

log = logging.getLogger("local.sns")

_SUBSCRIPTIONS = threading.RLock()  # held while a backend's subscriptions are changed or listed


def _publish_as_sns(publish: Any) -> tuple[object, ...]:
    """Topic.publish."""
    from moto.moto_api._internal import mock_random

    def publish_to_each(self: Any, message: str, subject: str | None = None,
                        message_attributes: dict[str, Any] | None = None, group_id: str | None = None,
                        deduplication_id: str | None = None, message_structure: str | None = None) -> str:
        message_id = str(mock_random.uuid4())
        raw = _binary_as_bytes(message_attributes or {})
        for subscription in self.sns_backend._get_topic_subscriptions(self):  # every one, not a page of them
            is_raw = str(subscription.attributes.get("RawMessageDelivery")).lower() == "true"
            attributes = raw if is_raw else message_attributes
            try:
                subscription.publish(message, message_id, subject=subject, message_attributes=attributes,
                                     group_id=group_id, deduplication_id=deduplication_id,
                                     message_structure=message_structure)
            except Exception as exc:  # (each delivery is its own: a deleted queue's fails, the others' do not)
                log.info("delivering %s to %s failed: %s: %s", message_id, subscription.endpoint,
                         type(exc).__name__, exc)
        return message_id

    return (publish_to_each,)


_LOCKED = ("subscribe", "unsubscribe", "_get_topic_subscriptions", "list_subscriptions", "list_subscriptions_by_topic",
           "delete_topic_subscriptions", "set_subscription_attributes", "get_subscription_attributes")


def _subscriptions_under_one_lock(*methods: Any) -> tuple[object, ...]:
    """SNSBackend's methods that change or list subscriptions (_LOCKED)."""
    return tuple(_locked(method) for method in methods)


def _locked(method: Any) -> Any:
    @functools.wraps(method)
    def locked(*args: Any, **kwargs: Any) -> Any:
        with _SUBSCRIPTIONS:
            return method(*args, **kwargs)

    return locked


def _binary_as_bytes(attributes: dict[str, Any]) -> dict[str, Any]:
    return {name: {**value, "Value": base64.b64decode(value["Value"])} if value["Type"].startswith("Binary") else value
            for name, value in attributes.items()}


PATCHES = (
    Patch(
        "sns_publish_delivers_as_sns", BUG,
        ("moto.sns.models:Topic.publish",),
        "A publish goes to every subscription of the topic, as SNS delivers it: moto reads them through its own "
        "paginated listing and drops the page token, so it delivers to the first 100 only (a run of more than 100 "
        "participants, a queue subscribed each, left the rest unwoken: measured with 200, exactly 100 received each "
        "state change). A binary message attribute reaches a raw-delivery SQS subscription as bytes, as SNS "
        "delivers it (moto passes on the base64 text it keeps, which its SQS refuses: the push's roster, "
        "`store.push`). And each delivery is its own, as in SNS: moto stopped at the first that failed (the queue of "
        "a participant that finished and deleted it, its subscription still on the topic) and failed the publish, "
        "so that the subscriptions after it got nothing.",
        _publish_as_sns),
    Patch(
        "sns_subscriptions_under_one_lock", BUG,
        tuple(f"moto.sns.models:SNSBackend.{name}" for name in _LOCKED),
        "A topic's subscriptions are changed and listed under one lock: moto's server serves requests in threads, "
        "and a subscribe that looked for an existing subscription while another was added failed (\"OrderedDict "
        "mutated during iteration\", a 500 to one of a thousand participants opening their queues at once; a "
        "publish listing them meanwhile fails the same way), as did the subscribe's setting of its attributes (raw "
        "delivery: moto looks the new subscription up among all of them, outside the subscribe).",
        _subscriptions_under_one_lock),
)
