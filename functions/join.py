"""Lambda: join requests, from the join lane's SQS queue. Register each joiner; never tick.

The join lane (`shared.naming.join_request_pattern`) is its own EventBridge rule and queue, drained by this
function through an event source mapping with a maximum concurrency, so a burst of join requests waits in
its queue instead of taking the concurrency that heartbeats and updates need (they reach `ingest` by the
main rule). Each SQS record's body is the EventBridge "Object Created" event. A record that fails is
reported in `batchItemFailures`: the queue delivers it again, and after a few failures moves it to the
dead-letter queue. No tick follows: a join request alone admits nobody (an epoch admits only participants
heard from after their join), and the heartbeat that follows it ticks.
"""

from __future__ import annotations

import json
from typing import Any

from coordinator.deps import Deps
from coordinator.intake.common import Ingested
from coordinator.service import on_upload
from functions.events import BadEvent, object_created
from functions.observability import lambda_handler, logger
from shared.keys import join_prefix


def join_request(deps: Deps, event: dict[str, Any]) -> Ingested | None:
    """Ingest one join request's "Object Created" event; None if the event is not one (logged, not retried)."""
    try:
        obj = object_created(event)
    except BadEvent as exc:
        logger.error("ignored event", reason=str(exc))
        return None
    if not obj.key.startswith(join_prefix(deps.config.run_id)):  # the rule routes nothing else here
        logger.error("ignored event: not a join request", key=obj.key[:300])
        return None
    outcome = on_upload(deps, obj, may_tick=False).ingested
    assert outcome is not None
    logger.info("ingested", kind=outcome.kind, key=obj.key, accepted=outcome.accepted,
                reason=outcome.reason, recorded=outcome.recorded)
    return outcome


def join_batch(deps: Deps, event: dict[str, Any]) -> dict[str, Any]:
    failures: list[dict[str, str]] = []
    for record in event.get("Records", []):
        message_id = str(record.get("messageId", ""))
        try:
            join_request(deps, json.loads(record["body"]))
        except Exception:  # this record is delivered again; the batch's others are not
            logger.exception("join request failed; the queue delivers it again", message_id=message_id)
            failures.append({"itemIdentifier": message_id})
    return {"batchItemFailures": failures}


handler = lambda_handler(join_batch)
