"""A participant's side of the run protocol, without torch: the poll loop the daemon and the load test share.

`Participant` polls the run state, gathers what `participant.decide` needs to know about itself (`Local`:
its join and ready reports, whether its update of the round is stored, its journal), asks `decide` for the
next action and carries it out through the methods a subclass provides: the daemon (`participant.daemon`)
trains with torch and witnesses; the load test's `SimParticipant` (tests/e2e/load_support.py) uploads a numpy
stand-in. Both therefore read the same records before each decision, re-send what the coordinator has not
recorded on the same schedule, and back off the same way while waiting. What the loop remembers between two
decisions is kept apart from its steps, in `participant.protocol_state`.
"""

from __future__ import annotations

import logging
import random
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Protocol

from participant.decide import (
    Action,
    CheckUpdates,
    Fetch,
    Finish,
    Join,
    Local,
    OfferModel,
    ReportHealth,
    ReportReady,
    SendProof,
    Train,
    Wait,
    decide,
    is_resend,
    still_open,
)
from participant.journal import Journal, JournalKeeper
from participant.protocol_state import ParticipantState, RunView, SentClock
from shared.config import RunConfig
from shared.state import Phase, RunState
from store.push import RETENTION_SECONDS, Pushed
from store.views import ParticipantRecord, UpdateRecord

log = logging.getLogger("participant")

POLL_FIRST, POLL_MAX, POLL_GROWTH = 0.2, 2.0, 1.6
# While not a member: how often, at most, to check that our participant record still exists (it is gone only after
# the run's table was lost and restored, a rare recovery: joining again 30 s late costs little). Every 3 s, a
# thousand non-members woken by each push or long poll read their records 50 times a second.
RECORD_CHECK_SECONDS = 30.0
# With a push queue: read the state item ourselves after this long without news (a lost or undelivered message
# delays us at most this much), and once when the phase's deadline has passed by DEADLINE_READ_SECONDS without news
# (the tick that acts on a deadline runs within a minute of it).
QUIET_READ_SECONDS = 300.0
DEADLINE_READ_SECONDS = 90.0
LISTEN_SECONDS = 20.0  # one long poll
# Until our join request is recorded, what we wait for shows in our own participant record, not in the state item:
# poll the record only, and read the state again after this long (or once the join is recorded). With 1,000
# participants joining at once the join lane takes minutes, and a state read with each record read was half of all
# requests served meanwhile, slowing the join lane itself.
JOIN_WAIT_STATE_SECONDS = 60.0
CLOSE_MARGIN_SECONDS = 5.0  # before a round's deadline less this, only our being dropped can close it to us
# Away from the push queue for longer than this (acting: a download, training), a change announced meanwhile may
# have expired unread (store.push.RETENTION_SECONDS, less a margin for the clocks): read the state item instead.
AWAY_SECONDS = RETENTION_SECONDS - 10.0
# Once our update is in, only the round's close concerns us, and no round closes much sooner than the shortest seen:
# wait without a request until QUIET_SHARE of it (less half a long poll), then listen; the close waits in our queue
# meanwhile. A third, not more: a fleet that learns of a round late idles every host meanwhile, for the sake of a few
# long polls (cents per thousand participants). Measured at 1,000 on the local stack, the first rounds lasted 271 s
# and 332 s (the admission's backlog still being ingested) and the next 115 s and 126 s: 0.9 of the last round's
# length overslept by two minutes, half of the shortest by 30 s.
# The same share of the shortest wait seen from our upload to the round's close counts from our upload: where the
# close waits on the coordinator's backlog rather than on the slowest trainer (a thousand updates ingested one after
# another), a round's training is a small part of it and the wait after it is the same every round (measured at 1,000
# on the local stack: 48 s of training, then ~80 s until the close, all of it in long polls). Where the slowest
# trainer sets the close, a participant that once uploaded last has seen a wait of almost nothing: the rule then
# asks for no quiet at all.
QUIET_SHARE = 1 / 3


def quiet_seconds(now: float, started: float, shortest: float | None, limit: float,
                  uploaded: float | None = None, waited: float | None = None) -> float:
    """How long to wait without a request for the close of a round we saw begin at `started` (monotonic), the shortest
    round seen so far having lasted `shortest` seconds, our update uploaded at `uploaded` and the shortest wait seen
    from an upload of ours to its round's close `waited` seconds (None: not timed); `limit` seconds at most (its
    deadline, how long a pushed message lives); 0 unless it spares a long poll at least."""
    ends = [started + QUIET_SHARE * shortest] if shortest is not None else []
    if uploaded is not None and waited is not None:
        ends.append(uploaded + QUIET_SHARE * waited)
    if not ends:
        return 0.0
    quiet = min(max(ends) - LISTEN_SECONDS / 2 - now, limit)
    return quiet if quiet >= LISTEN_SECONDS else 0.0


class ParticipantError(RuntimeError):
    """A problem the participant cannot work around (wrong task, wrong run, bad device); exit 1."""


class ForeignInitialModel(ParticipantError):
    """Round 0's global model is not the initial model our task builds from the run's seed: the run adopted
    another participant's weights. Training on them would lend our work to a model we never agreed to start from,
    so the participant stops (exit 1) and says which model it was and which one it expected."""


class UnfitModel(ParticipantError):
    """The run's global model does not fit our task (its tensors' names, shapes or dtypes). Not ours to train from,
    and no reason to leave the run: the participant says so and waits for another global model."""


@dataclass
class ParticipantExit:
    """How the participant ended."""

    finished: bool
    rounds: int
    final: dict[str, float] = field(default_factory=dict)
    reason: str = ""


class Reads(Protocol):
    """The coordinator's records the protocol reads (`participant.remote.Remote` for the daemon)."""

    def read_state(self) -> RunState: ...

    def read_config(self) -> RunConfig | None: ...

    def participant_record(self) -> ParticipantRecord | None: ...

    def update_record(self, round_no: int) -> UpdateRecord | None: ...

    def update_stored(self, round_no: int, since: float | None = None) -> bool: ...

    def pushed_state(self, pushed: Pushed) -> RunState: ...  # the state a pushed state item names


class Feed(Protocol):
    """Our push queue (`store.push.StateQueue`)."""

    def wait(self, seconds: float) -> Pushed | None: ...

    def close(self) -> None: ...


def closed_while_training(reads: Reads, a: Train, pid: str) -> bool:
    """True (and say so) if the round closed for our update while we trained. Before its deadline (less a margin
    for the clocks) a round closes without our update only if we were dropped, which the upload's refusal will
    say: no read. After it, read the state."""
    if a.deadline and time.time() < a.deadline - CLOSE_MARGIN_SECONDS:
        return False
    now = reads.read_state()
    if still_open(now, a, pid):
        return False
    log.warning("round %d closed while training (now round %d, %s); update not sent", a.round, now.round,
                now.phase.value)
    return True


def check_outcome(reads: Reads, kept: JournalKeeper, pid: str, state: RunState) -> None:
    """Log, once, whether the coordinator accepted our latest upload (and note it in the journal)."""
    journal = kept.journal
    pending = [r for r in journal.uploaded if r not in journal.outcomes]
    if not pending:
        return
    r = max(pending)
    if state.round <= r:  # still open (or being witnessed): ask once, after it closed
        return
    if state.round == r + 1 and pid in state.counted_last:  # the roster says: aggregated (no read)
        log.info("round %d: update accepted and aggregated", r)
        journal.outcomes[r] = "accepted"
        kept.save()
        return
    rec = reads.update_record(r)
    if rec is None:
        if state.round > r:  # the round closed without a record of ours: do not ask again
            journal.outcomes[r] = "no record"
            kept.save()
        return
    if rec.accepted:
        log.info("round %d: update accepted", r)
        journal.outcomes[r] = "accepted"
    else:
        log.warning("round %d: update refused: %s", r, rec.reason)
        journal.outcomes[r] = rec.reason or "refused"
    kept.save()


class ParticipantHooks(ABC):
    """What a subclass of `Participant` provides, as its loop asks: how it waits and stops, what it sends, how it
    trains (the daemon; the load test's `SimParticipant`). Witness duty and health reports are optional."""

    @abstractmethod
    def _check_stop(self) -> None: ...  # raise to end the loop (asked to stop, out of time)

    @abstractmethod
    def _pause(self, seconds: float) -> None: ...  # wait between polls (raise to end the loop)

    @abstractmethod
    def _send_join(self) -> None: ...

    @abstractmethod
    def _send_ready(self, epoch: int) -> None: ...  # a heartbeat saying we hold the model of `epoch`

    @abstractmethod
    def _offer_model(self) -> None: ...

    @abstractmethod
    def _fetch(self, action: Fetch) -> None: ...  # hold the model (`me.held`, `me.held_model`), or return to retry

    @abstractmethod
    def _train(self, action: Train) -> bool: ...  # train and upload; False if the update was not sent

    @abstractmethod
    def _finish(self, action: Finish) -> ParticipantExit: ...

    def _check_updates(self, action: CheckUpdates, state: RunState) -> None:
        raise NotImplementedError(f"{type(self).__name__} does no witness duty")

    def _send_proof(self, action: SendProof, state: RunState) -> None:
        raise NotImplementedError(f"{type(self).__name__} does no witness duty")

    def _report_health(self, action: ReportHealth, state: RunState) -> None:
        raise NotImplementedError(f"{type(self).__name__} sends no health reports")

    def _observe(self, state: RunState) -> None:  # noqa: B027 (an optional hook)
        """Called with every state read (the daemon logs changes)."""

    def _waiting(self, action: Wait, new_reason: bool) -> None:  # noqa: B027 (an optional hook)
        """Called when the state or the reason to wait changed (`new_reason`: the reason did)."""


class Participant(ParticipantHooks):
    """The poll loop and what `decide` needs to know about us; subclasses send and train.

    What it remembers between decisions is in `me` (what we know and did in this incarnation of the run) and `view`
    (how current our copy of the run state is, how long rounds take): see `participant.protocol_state`."""

    def __init__(self, pid: str, run_id: str, reads: Reads, kept: JournalKeeper, poll_max: float = POLL_MAX,
                 max_rounds: int = 0, rng: random.Random | None = None, feed: Feed | None = None) -> None:
        """`feed`: our push queue; None: poll the state item. `max_rounds`: leave after that many uploads."""
        self.pid, self.run_id, self.reads, self.kept = pid, run_id, reads, kept
        self.feed = feed
        self.poll_max, self.max_rounds = poll_max, max_rounds
        self.rng = rng or random.Random()  # the polls' jitter
        self.me = ParticipantState()
        self.view = RunView()
        self.sent_clock = SentClock()

    def sent_at(self) -> float:
        """The `sent_at` of the next join request or heartbeat (`SentClock`)."""
        return self.sent_clock.next(time.time())

    @property
    def journal(self) -> Journal:
        return self.kept.journal

    # --- the loop ---------------------------------------------------------------------------------------

    def _loop(self) -> ParticipantExit:
        delay, last_wait = POLL_FIRST, None
        state: RunState | None = None
        kept = False  # `state` was kept, not read again, while waiting for our join to be recorded
        while True:
            self._check_stop()
            if state is None:
                state = self._read_state()
            self._observe(state)
            self.view.note_round(state, time.monotonic())
            check_outcome(self.reads, self.kept, self.pid, state)
            local = self._local(state)
            if kept and local.joined:  # our join was just recorded: decide on the current state
                state, kept = None, False
                continue
            action = decide(state, local)
            if isinstance(action, Wait):
                marker = (state.version, action.reason)
                if marker != last_wait:
                    self._waiting(action, last_wait is None or action.reason != last_wait[1])
                    delay, last_wait = POLL_FIRST, marker
                if action.announced and self.feed is not None:
                    if action.round_close:
                        self._quiet(state)
                    state = self._await_announcement(state)
                else:
                    delay = self._backoff(delay)
                    kept = not local.joined and time.monotonic() - self.view.read_at < JOIN_WAIT_STATE_SECONDS
                    state = state if kept else None
                continue
            if isinstance(action, Finish) and self.feed is not None and state.version > self.view.read_version:
                state = None  # the run's end, as pushed: confirmed by the state item itself before we exit
                continue
            resend = is_resend(action, local)
            if not resend:  # a re-send is no progress: keep polling at the slower pace
                delay, last_wait = POLL_FIRST, None
            outcome = self._act(action, state, resend)
            if outcome is not None:
                return outcome
            if self.feed is None:  # with a push queue the state we hold is current until a change is announced
                state = None

    def _read_state(self) -> RunState:
        state = self.reads.read_state()
        self.view.read(state, time.monotonic())
        return state

    def _quiet(self, state: RunState) -> None:
        """Our update is in: wait without a request until the round's close is near (`quiet_seconds`)."""
        v = self.view
        if (started := v.started(state.round)) is None:
            return
        now = time.monotonic()
        limit = v.known_at + AWAY_SECONDS - 1.0 - now  # (then a listen, not a read of the state item)
        if state.deadline:
            limit = min(limit, state.deadline - time.time())
        seconds = quiet_seconds(now, started, v.shortest_round, limit, v.uploaded(state.round), v.shortest_wait)
        if seconds > 0:
            log.info("round %d: waiting %.0fs before listening for its close (the shortest round so far: %.0fs, the "
                     "shortest wait after an upload: %.0fs)", state.round, seconds, v.shortest_round or 0,
                     v.shortest_wait or 0)
            self._pause(seconds)

    def _await_announcement(self, state: RunState) -> RunState | None:
        """Wait on the push queue for a change of the state we hold: the newer state pushed, the same state when
        nothing came (decide again: re-sends are due by time), or None to read the item ourselves (no news for
        QUIET_READ_SECONDS, the phase's deadline long past, or we were away from the queue for longer than a
        message lives)."""
        now = time.monotonic()
        quiet = now - self.view.read_at
        overdue = bool(state.deadline) and time.time() > state.deadline + DEADLINE_READ_SECONDS
        away = now - self.view.known_at >= AWAY_SECONDS
        if away or quiet >= QUIET_READ_SECONDS or (overdue and quiet >= DEADLINE_READ_SECONDS):
            return None
        pushed = self._listen(LISTEN_SECONDS)
        self.view.known_at = time.monotonic()
        if pushed is None or pushed.version <= state.version:
            return state
        self.view.read_at = time.monotonic()
        return self.reads.pushed_state(pushed)

    def _listen(self, seconds: float) -> Pushed | None:
        """One long poll of the push queue (the daemon makes it interruptible by a stop request)."""
        assert self.feed is not None
        return self.feed.wait(seconds)

    def _backoff(self, delay: float) -> float:
        """Pause about `delay` seconds (jittered, so a fleet does not poll in step); return the next delay."""
        self._pause(delay * self.rng.uniform(0.75, 1.25))
        return min(delay * POLL_GROWTH, self.poll_max)

    def _act(self, action: Action, state: RunState, resend: bool) -> ParticipantExit | None:
        """Carry out one action; an outcome ends the loop."""
        if isinstance(action, Finish):
            return self._finish(action)
        if isinstance(action, Join):
            age = time.monotonic() - self.me.join_sent
            log.warning("join request not recorded after %.0fs; sending it again", age)
            self._join()
        elif isinstance(action, OfferModel):
            self._offer_model()
            self.me.offered = True
        elif isinstance(action, Fetch):
            try:
                self._fetch(action)
            except UnfitModel as exc:
                log.warning("round %d: the run's global model %s does not fit our task; waiting for another: %s",
                            action.round, action.digest[:12], exc)
                self.me.unfit = action.digest
        elif isinstance(action, ReportReady):
            self._report_ready(action.epoch, again=resend)
        elif isinstance(action, ReportHealth):
            self._report_health(action, state)
        elif isinstance(action, CheckUpdates):
            self._check_updates(action, state)
        elif isinstance(action, SendProof):
            self._send_proof(action, state)
        elif isinstance(action, Train):
            return self._train_round(action)
        return None

    def _train_round(self, action: Train) -> ParticipantExit | None:
        """Train and upload (`_train`), and note which it came to; an outcome if that was our last round."""
        if self._train(action):
            self.me.rounds_uploaded += 1
            self.view.last_upload = (action.round, time.monotonic())
        else:
            self.me.skipped.add(action.round)
            self.kept.stop_training()
        if self.max_rounds and self.me.rounds_uploaded >= self.max_rounds:
            log.info("leaving after %d uploaded round(s) (--max-rounds)", self.me.rounds_uploaded)
            return ParticipantExit(False, self.me.rounds_uploaded, reason="max-rounds")
        return None

    def _wait_for_config(self) -> RunConfig:
        """The run's configuration, once the coordinator has published it (on its first tick)."""
        delay, announced = POLL_FIRST, False
        while (config := self.reads.read_config()) is None:
            if not announced:
                log.info("waiting for the run configuration (the coordinator publishes it on its first tick)")
                announced = True
            delay = self._backoff(delay)
        if config.run_id != self.run_id:
            raise ParticipantError(f"the published config is for run {config.run_id!r}, not {self.run_id!r}")
        return config

    # --- joining and readiness --------------------------------------------------------------------------

    def _join(self) -> None:
        self._send_join()
        self.me.sent_join(time.monotonic())
        log.info("join request sent for run %s", self.run_id)

    def _report_ready(self, epoch: int, again: bool) -> None:
        self._send_ready(epoch)
        self.me.sent_ready(epoch, time.monotonic(), self.sent_clock.last, again)
        if again:
            log.info("ready for epoch %d: not yet recorded by the coordinator, heartbeat sent again", epoch)
        else:
            log.info("ready for epoch %d (heartbeat sent)", epoch)

    # --- what decide() needs to know about us -----------------------------------------------------------

    def _local(self, state: RunState) -> Local:
        me = self.me
        ready_recorded, ready_in_flight = me.reported_ready, False
        if me.joined_at is not None and self.pid not in state.members:
            self._check_still_registered()
        if me.joined_at is None and me.join_may_show(state.version, self.feed is not None, time.monotonic()):
            me.record_looked_at = state.version
            record = self.reads.participant_record()
            if record is not None:
                self._adopt_incarnation(float(record.joined_at))
        elif (state.phase is Phase.WARMUP and me.reported_ready >= state.epoch
              and state.members.get(self.pid) is not None):
            record = self.reads.participant_record()
            ready_recorded = int(record.ready_epoch or 0) if record is not None else 0
            ready_in_flight = record is not None and record.last_sent < me.ready_sent_at
        recorded = False
        # Only a round that began before this process saw the run can hold an upload this process did not make
        # (before a restart); of later rounds the journal knows every upload.
        first = self.view.first_round
        if (state.phase is Phase.TRAIN and self.pid in state.selected and state.round not in me.done(self.journal)
                and state.round <= (first if first is not None else state.round)):
            recorded = self._update_exists(state.round)
        return me.local(self.pid, time.monotonic(), self.journal, ready_recorded, ready_in_flight, recorded)

    def _update_exists(self, round_no: int) -> bool:
        if round_no in self.me.stored:
            return True
        if self.reads.update_record(round_no) is not None or self.reads.update_stored(round_no, self.me.joined_at):
            log.info("round %d: an update of ours is already stored (uploaded before a restart); not redone", round_no)
            self.me.stored.add(round_no)
            return True
        return False

    def _check_still_registered(self) -> None:
        """Not a member: make sure the coordinator still knows us. A run restored from its checkpoint after
        its table was lost (`fed run restore`) has no participant records: join again, as a new incarnation."""
        if time.monotonic() - self.me.record_checked < RECORD_CHECK_SECONDS:
            return
        self.me.record_checked = time.monotonic()
        if self.reads.participant_record() is not None:
            return
        log.warning("the coordinator has no record of this participant any more (the run's state was lost or "
                    "restored?); joining again")
        self._forget()
        self._join()

    def _forget(self) -> None:
        """Before joining again as a new incarnation of the run: drop what we knew about the old one (the daemon
        drops its witness duty's too)."""
        self.me.forget()

    def _adopt_incarnation(self, joined_at: float) -> None:
        """Tie the journal to this incarnation of the run (see participant.journal)."""
        self.me.joined_at = joined_at
        if (earlier := self.kept.adopt(joined_at)) is not None:
            log.warning("the run was recreated since %s was written (joined at %.3f, now %.3f); discarding "
                        "its progress", self.kept.name, earlier, joined_at)
        log.info("joined run %s as %s", self.run_id, self.pid)
