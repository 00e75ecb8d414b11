"""moto's SQS computes every attribute of a queue, three of them by scanning all its messages, to read one value:
content-based deduplication on each message sent, and the retention period for each message a receive looks at.
A send thus costs time in proportion to the queue's backlog, and a receive its square. With a backlog of
thousands of events (1,000 participants joining) the S3 uploads that emit them (each sends one through
EventBridge) and the dispatcher's receives slowed the local server until it spent most of its time there, the
backlog grew, and the run never caught up. `apply()` makes both read the one value they need, as SQS's cost does
not grow with the queue.

And it makes deletes and sends exclude each other. moto deletes a message by walking the queue's list into a new
list of the other messages and putting that in place of the list, without the lock a send appends under. With two
deletes at once, the slower one walks the old list while the faster one has put its new list in place and a send
has appended to that: the slower one's list, put in place last, lacks the message sent (and brings back the one the
faster one deleted). The local server serves each request in a thread of its own, so at 1,000 participants
uploading within the same second five S3 events were lost this way, and their updates stayed in the bucket
unrecorded until the round's deadline (a load test in CI).

And a long poll on an empty queue sleeps until a message comes or the poll ends, not one second at a time. moto
wakes every waiting receive once a second to look again, though a send already wakes them: with a thousand
participants each holding a 20 s poll, that is a thousand wake-ups a second in one Python process, and once enough
of them wake together their threads queue for the interpreter lock faster than it serves them (a load test whose
server stopped answering: 875 of its 1,178 threads in long polls). A waiting receive wakes when a message is sent
or a message's visibility is changed, when the first message in flight or delayed is due back, or at the poll's end
(a participant's queue keeps the changes it received in flight until they expire: they are never due back).
Everything else is served by moto unchanged. Idempotent; used by the local stack and the functional tests."""

from __future__ import annotations

import threading
from typing import Any

_state = threading.local()
_applied = False


def apply() -> None:
    global _applied
    if _applied:
        return
    from moto.core.utils import unix_time
    from moto.sqs import models

    every_attribute: Any = vars(models.Queue)["attributes"].fget
    send = models.SQSBackend.send_message
    delete = models.Queue.delete_message
    receive = models.SQSBackend.receive_message
    change = models.SQSBackend.change_message_visibility

    def attributes(self: Any) -> dict[str, Any]:
        if not getattr(_state, "sending", False):
            return dict(every_attribute(self))
        if not self.fifo_queue:  # the one attribute a send reads: only a FIFO queue has it
            return {}
        return {"ContentBasedDeduplication": str(bool(getattr(self, "content_based_deduplication", False))).lower()}

    def send_message(self: Any, *args: Any, **kwargs: Any) -> Any:
        _state.sending = True
        try:
            return send(self, *args, **kwargs)
        finally:
            _state.sending = False

    def is_message_valid_based_on_retention_period(self: Any, queue_name: str, message: Any) -> bool:
        retention = int(self.get_queue(queue_name).message_retention_period)
        return bool(retention + message.sent_timestamp / 1000 > unix_time())

    def delete_message(self: Any, receipt_handle: str) -> None:
        with self._messages_lock:  # (the lock a send appends under)
            delete(self, receipt_handle)

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

    models.Queue.attributes = property(attributes)  # type: ignore[method-assign,assignment]
    models.Queue.delete_message = delete_message  # type: ignore[method-assign]
    models.Queue.wait_for_messages = wait_for_messages  # type: ignore[method-assign]
    models.SQSBackend.receive_message = receive_message  # type: ignore[method-assign]
    models.SQSBackend.change_message_visibility = change_message_visibility  # type: ignore[method-assign]
    models.SQSBackend.send_message = send_message  # type: ignore[method-assign]
    models.SQSBackend.is_message_valid_based_on_retention_period = (  # type: ignore[method-assign]
        is_message_valid_based_on_retention_period)
    _applied = True
