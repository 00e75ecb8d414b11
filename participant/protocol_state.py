"""What a participant's poll loop (`participant.protocol.Participant`) remembers between two decisions.

Two records, apart from the loop's steps: `ParticipantState`, what we know and did in this incarnation of the run
(our join and ready reports, the global model we hold, the rounds we dealt with), from which `decide`'s `Local` is
built; and `RunView`, how current our copy of the run state is and how long its rounds take, which paces the
loop's reads, long polls and quiet waits. Their methods take the clock's readings as arguments, so that the loop
keeps the one clock (tests replace it).
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from pathlib import Path

from participant.decide import Local, join_resend_due
from participant.journal import Journal
from shared.state import Phase, RunState


@dataclass
class ParticipantState:
    """What we know and did in this incarnation of the run (`forget` starts a new one): the facts `decide` weighs,
    kept up to date from what we send and read."""

    # joining (times from the monotonic clock)
    joined_at: float | None = None  # our join time as the coordinator recorded it; None: not recorded (yet)
    join_sent: float = 0.0  # when we last sent the join request
    join_sends: int = 0  # how many times this process has sent it
    record_looked_at: int | None = None  # the state's version when we last looked for our join's record
    record_checked: float = 0.0  # when we last made sure, not being a member, that our record still exists
    offered: bool = False  # we sent an initial-model offer in this process
    # readiness
    reported_ready: int = 0  # the last epoch we reported ready for
    ready_sent: float = 0.0  # when we sent that report
    ready_sends: int = 0  # how many times we sent it for that epoch
    ready_sent_at: float = 0.0  # the `sent_at` of that report (the clock its messages carry)
    # the global model
    held: str = ""  # digest of the global model we hold
    held_model: bytes | Path = b""  # its file (the daemon), or its bytes (the load test's simulation)
    unfit: str = ""  # digest of the latest global model found not to fit our task
    # rounds
    stored: set[int] = field(default_factory=set)  # rounds with an update of ours found in the bucket or table
    skipped: set[int] = field(default_factory=set)  # rounds trained but not sent (the round closed meanwhile)
    rounds_uploaded: int = 0  # by this process

    def sent_join(self, now: float) -> None:
        self.join_sent, self.join_sends = now, self.join_sends + 1

    def sent_ready(self, epoch: int, now: float, sent_at: float, again: bool) -> None:
        self.reported_ready, self.ready_sent, self.ready_sent_at = epoch, now, sent_at
        self.ready_sends = self.ready_sends + 1 if again else 1

    def join_may_show(self, version: int, listening: bool, now: float) -> bool:
        """Whether to look at our record for our join now, the state being at `version`. Polling (not `listening`
        on a push queue), on every poll. Listening, only when a change was pushed (an epoch that admits us starts),
        before a re-send of the join (if it is recorded by then, none is needed), and once at first: a thousand
        joiners queued for minutes would otherwise read their records on every wake-up."""
        if not listening or self.record_looked_at is None or version != self.record_looked_at:
            return True
        return now - self.join_sent >= join_resend_due(self.join_sends)

    def done(self, journal: Journal) -> frozenset[int]:
        """The rounds not to train again: uploaded (the journal knows of uploads before a restart too) or skipped."""
        return journal.uploaded_rounds | self.skipped

    def forget(self) -> None:
        """Before joining again as a new incarnation of the run: drop what we knew about the old one."""
        self.joined_at = None
        self.record_looked_at = None  # look at once after joining again
        self.stored.clear()
        self.skipped.clear()
        self.reported_ready = 0

    def local(self, pid: str, now: float, journal: Journal, ready_recorded: int, ready_in_flight: bool,
              recorded: bool) -> Local:
        """What `decide` needs to know about us, with what was read for it: the ready epoch the coordinator has
        recorded for us, whether our report is still queued, whether our update of the round is stored."""
        return Local(pid=pid, joined=self.joined_at is not None, join_age=now - self.join_sent,
                     join_sends=self.join_sends, offered=self.offered, held=self.held, unfit=self.unfit,
                     reported_ready=self.reported_ready, ready_age=now - self.ready_sent, ready_sends=self.ready_sends,
                     ready_recorded=ready_recorded, ready_in_flight=ready_in_flight, uploaded=self.done(journal),
                     recorded=recorded, witnessed=frozenset(journal.witnessed),
                     health_reported=frozenset(journal.health_reported))


@dataclass
class RunView:
    """How current our copy of the run state is, and how long its rounds take (times from the monotonic clock)."""

    read_at: float = -math.inf  # when we last read the state item or were pushed it
    known_at: float = -math.inf  # up to when we know of every change: a read, or a listen's end
    read_version: int = 0  # the version of the state item we last read ourselves
    first_round: int | None = None  # the round of the first state this process saw
    round_seen: tuple[int, float] | None = None  # the latest training round we saw begin, and when
    shortest_round: float | None = None  # the shortest round we saw from its start to the next's
    last_upload: tuple[int, float] | None = None  # the latest round we uploaded an update for, and when
    shortest_wait: float | None = None  # the shortest wait we saw from our upload to the next round

    def read(self, state: RunState, now: float) -> None:
        """We read `state` from the state item ourselves."""
        self.read_at = self.known_at = now
        self.read_version = state.version
        if self.first_round is None:
            self.first_round = state.round

    def stale(self) -> None:
        """Our copy may have missed a change (the push queue failed): read the state item next."""
        self.read_at = self.known_at = -math.inf

    def note_round(self, state: RunState, now: float) -> None:
        """Time the rounds as we see them begin (the loop's quiet waits expect none much shorter than the
        shortest)."""
        if state.phase is not Phase.TRAIN or (self.round_seen and self.round_seen[0] == state.round):
            return
        if self.round_seen is not None and self.round_seen[0] == state.round - 1:
            length = now - self.round_seen[1]
            self.shortest_round = length if self.shortest_round is None else min(self.shortest_round, length)
        if self.last_upload is not None and self.last_upload[0] == state.round - 1:
            wait = now - self.last_upload[1]
            self.shortest_wait = wait if self.shortest_wait is None else min(self.shortest_wait, wait)
        self.round_seen = (state.round, now)

    def started(self, round_no: int) -> float | None:
        """When we saw `round_no` begin; None: we did not."""
        return self.round_seen[1] if self.round_seen is not None and self.round_seen[0] == round_no else None

    def uploaded(self, round_no: int) -> float | None:
        """When we uploaded our update of `round_no`; None: we did not (or not last)."""
        return self.last_upload[1] if self.last_upload is not None and self.last_upload[0] == round_no else None


class SentClock:
    """The `sent_at` of our messages (join requests, heartbeats): the clock, but strictly increasing (ingest refuses
    a message not sent after the last one it accepted from us, to stop replays). Heartbeats are sent from a thread
    of their own: hence the lock."""

    def __init__(self) -> None:
        self.last = 0.0
        self._lock = threading.Lock()

    def next(self, now: float) -> float:
        with self._lock:
            self.last = max(now, self.last + 0.001)
            return self.last
