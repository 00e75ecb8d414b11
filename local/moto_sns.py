"""moto's SNS publishes a message to the first 100 of a topic's subscriptions only (it reads them through its own
paginated listing, `list_subscriptions_by_topic`, and drops the page token); SNS delivers to every subscription.
With a participant queue subscribed per participant, a run of more than 100 would leave the rest unwoken (measured
with 200: exactly 100 received each state change). `apply()` makes a publish go to every subscription of the
topic, as SNS does. Idempotent; used by the local stack and the functional tests."""

from __future__ import annotations

from typing import Any

_applied = False


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
        for subscription in self.sns_backend._get_topic_subscriptions(self):  # every one, not a page of them
            subscription.publish(message, message_id, subject=subject, message_attributes=message_attributes,
                                 group_id=group_id, deduplication_id=deduplication_id,
                                 message_structure=message_structure)
        return message_id

    models.Topic.publish = publish  # type: ignore[method-assign]
    _applied = True
