"""moto's SQS, as the local stack runs it (`PATCHES`): sends and receives whose cost does not grow with the queue's
backlog, deletes that lose no message sent meanwhile, and long polls that sleep until something comes. Everything
else is served by moto unchanged."""

from __future__ import annotations

import threading
from typing import Any

from local.moto.patches import BUG, SPEED, Patch

_state = threading.local()


def _send_reads_one_attribute(every_attribute: Any, send: Any) -> tuple[object, ...]:
    """Queue.attributes (a property), SQSBackend.send_message."""

    def attributes(self: Any) -> dict[str, Any]:
        if not getattr(_state, "sending", False):
            return dict(every_attribute.fget(self))
        if not self.fifo_queue:  # the one attribute a send reads: only a FIFO queue has it
            return {}
        return {"ContentBasedDeduplication": str(bool(getattr(self, "content_based_deduplication", False))).lower()}

    def send_message(self: Any, *args: Any, **kwargs: Any) -> Any:
        _state.sending = True
        try:
            return send(self, *args, **kwargs)
        finally:
            _state.sending = False

    return property(attributes), send_message


def _retention_read_alone(is_valid: Any) -> tuple[object, ...]:
    """SQSBackend.is_message_valid_based_on_retention_period."""
    from moto.core.utils import unix_time

    def is_message_valid_based_on_retention_period(self: Any, queue_name: str, message: Any) -> bool:
        retention = int(self.get_queue(queue_name).message_retention_period)
        return bool(retention + message.sent_timestamp / 1000 > unix_time())

    return (is_message_valid_based_on_retention_period,)


def _delete_excludes_sends(delete: Any) -> tuple[object, ...]:
    """Queue.delete_message."""

    def delete_message(self: Any, receipt_handle: str) -> None:
        with self._messages_lock:  # (the lock a send appends under)
            delete(self, receipt_handle)

    return (delete_message,)


def _long_poll_sleeps_until_due(wait: Any, receive: Any, change: Any) -> tuple[object, ...]:
    """Queue.wait_for_messages, SQSBackend.receive_message, SQSBackend.change_message_visibility."""
    from moto.core.utils import unix_time

    def receive_message(self: Any, queue_name: str, count: int, wait_seconds_timeout: int,
                        *args: Any, **kwargs: Any) -> Any:
        _state.poll_end = unix_time() + wait_seconds_timeout
        try:
            return receive(self, queue_name, count, wait_seconds_timeout, *args, **kwargs)
        finally:
            _state.poll_end = None

    def wait_for_messages(self: Any, timeout: int) -> None:
        """Wait once: for a send or a change of visibility, the first hidden message's return, or the poll's end.
        (moto's receive looks again after each wait.)"""
        poll_end = getattr(_state, "poll_end", None)
        with self._messages_lock:  # (a send appends and notifies under it)
            if self.messages:
                return
            now = unix_time()
            until = now + timeout if poll_end is None else poll_end + 0.01
            for message in self._messages:  # in flight or delayed
                until = min(until, max(message.visible_at, message.delayed_until) / 1000)
            if until > now:
                self._messages_lock.wait(until - now)

    def change_message_visibility(self: Any, queue_name: str, *args: Any, **kwargs: Any) -> None:
        change(self, queue_name, *args, **kwargs)
        queue = self.get_queue(queue_name)
        with queue._messages_lock:  # a message may be visible now, or sooner: waiting receives look again
            queue._messages_lock.notify_all()

    return wait_for_messages, receive_message, change_message_visibility


PATCHES = (
    Patch(
        "sqs_send_reads_one_attribute", SPEED,
        ("moto.sqs.models:Queue.attributes", "moto.sqs.models:SQSBackend.send_message"),
        "A send reads the one attribute it needs (content-based deduplication). moto computes every attribute of "
        "the queue to read one, three of them by scanning all its messages: a send cost time in proportion to the "
        "queue's backlog. With a backlog of thousands of events (1,000 participants joining) the S3 uploads that "
        "emit them (each sends one through EventBridge) slowed the local server until the backlog grew and the run "
        "never caught up.",
        _send_reads_one_attribute),
    Patch(
        "sqs_retention_read_alone", SPEED,
        ("moto.sqs.models:SQSBackend.is_message_valid_based_on_retention_period",),
        "A receive reads the queue's retention period alone for each message it looks at; moto computed every "
        "attribute of the queue (three scans of its messages) each time, so a receive cost the square of the "
        "backlog.",
        _retention_read_alone),
    Patch(
        "sqs_delete_excludes_sends", BUG,
        ("moto.sqs.models:Queue.delete_message",),
        "Deletes and sends exclude each other. moto deletes a message by walking the queue's list into a new list "
        "of the other messages and putting that in place of the list, without the lock a send appends under. With "
        "two deletes at once, the slower one walks the old list while the faster one has put its new list in place "
        "and a send has appended to that: the slower one's list, put in place last, lacks the message sent (and "
        "brings back the one the faster one deleted). At 1,000 participants uploading within the same second five "
        "S3 events were lost this way (a load test in CI).",
        _delete_excludes_sends),
    Patch(
        "sqs_long_poll_sleeps_until_due", SPEED,
        ("moto.sqs.models:Queue.wait_for_messages", "moto.sqs.models:SQSBackend.receive_message",
         "moto.sqs.models:SQSBackend.change_message_visibility"),
        "A long poll on an empty queue sleeps until a message is sent or a message's visibility is changed, the "
        "first message in flight or delayed is due back, or the poll ends (a participant's queue keeps the changes "
        "it received in flight until they expire: they are never due back). moto wakes every waiting receive once a "
        "second to look again, though a send already wakes them: with a thousand participants each holding a 20 s "
        "poll, a thousand wake-ups a second in one Python process, whose threads then queued for the interpreter "
        "lock faster than it served them (a load test whose server stopped answering: 875 of its 1,178 threads in "
        "long polls).",
        _long_poll_sleeps_until_due),
)
