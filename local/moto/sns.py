"""moto's SNS publishes a message to the first 100 of a topic's subscriptions only (it reads them through its own
paginated listing, `list_subscriptions_by_topic`, and drops the page token); SNS delivers to every subscription.
With a participant queue subscribed per participant, a run of more than 100 would leave the rest unwoken (measured
with 200: exactly 100 received each state change). `apply()` makes a publish go to every subscription of the
topic, as SNS does. It also hands a binary message attribute to a raw-delivery SQS subscription as bytes, as SNS
delivers it (moto passes on the base64 text it keeps, which its SQS cannot take: the push's roster,
`store.push`). And it makes the topic's subscriptions safe to change while they are read: moto's server serves
requests in threads, and a subscribe that looked for an existing subscription while another was added failed
("OrderedDict mutated during iteration", a 500 to one of a thousand participants opening their queues at once;
a publish reading them meanwhile would fail the same way), as did the subscribe's setting of its attributes
(raw delivery: moto looks the new subscription up among all of them, outside the subscribe). And each delivery of
a publish is its own, as in SNS: moto stopped at the first that failed (the queue of a participant that finished
and deleted it, its subscription still on the topic), and failed the publish, so that the subscriptions after it
got nothing. Idempotent; used by the local stack and the functional tests."""

from __future__ import annotations

import base64
import functools
import logging
import threading
from typing import Any

log = logging.getLogger("local.sns")

_applied = False
_SUBSCRIPTIONS = threading.RLock()  # held while a backend's subscriptions are changed or listed


def apply() -> None:
    global _applied
    if _applied:
        return
    from moto.moto_api._internal import mock_random
    from moto.sns import models

    def publish(self: Any, message: str, subject: str | None = None,
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

    models.Topic.publish = publish  # type: ignore[method-assign]
    for name in ("subscribe", "unsubscribe", "_get_topic_subscriptions", "list_subscriptions",
                 "list_subscriptions_by_topic", "delete_topic_subscriptions", "set_subscription_attributes",
                 "get_subscription_attributes"):
        setattr(models.SNSBackend, name, _locked(getattr(models.SNSBackend, name)))
    _applied = True


def _locked(method: Any) -> Any:
    @functools.wraps(method)
    def locked(*args: Any, **kwargs: Any) -> Any:
        with _SUBSCRIPTIONS:
            return method(*args, **kwargs)

    return locked


def _binary_as_bytes(attributes: dict[str, Any]) -> dict[str, Any]:
    return {name: {**value, "Value": base64.b64decode(value["Value"])} if value["Type"].startswith("Binary") else value
            for name, value in attributes.items()}
