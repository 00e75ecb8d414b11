"""A participant's side of the run protocol, without torch: the poll loop the daemon and the load test share.

`Participant` polls the run state, gathers what `participant.decide` needs to know about itself (`Local`:
its join and ready reports, whether its update of the round is stored, its journal), asks `decide` for the
next action and carries it out through the methods a subclass provides: the daemon (`participant.daemon`)
trains with torch and witnesses; the load test's `SimParticipant` (tests/e2e/load_support.py) uploads a numpy
stand-in. Both therefore read the same records before each decision, re-send what the coordinator has not
recorded on the same schedule, and back off the same way while waiting.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
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
from shared.config import RunConfig
from shared.state import Phase, RunState
from store.views import ParticipantRecord, UpdateRecord

log = logging.getLogger("participant")

POLL_FIRST, POLL_MAX, POLL_GROWTH = 0.2, 2.0, 1.6
RECORD_CHECK_SECONDS = 3.0  # while not a member: how often to check that our participant record still exists


class ParticipantError(RuntimeError):
    """A problem the participant cannot work around (wrong task, wrong run, bad device); exit 1."""


@dataclass
class Outcome:
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


def closed_while_training(reads: Reads, a: Train, pid: str) -> bool:
    """Read the state again after training: True (and say so) if the round closed for our update meanwhile."""
    now = reads.read_state()
    if still_open(now, a, pid):
        return False
    log.warning("round %d closed while training (now round %d, %s); update not sent", a.round, now.round,
                now.phase.value)
    return True


class Participant(ABC):
    """The poll loop and what `decide` needs to know about us; subclasses send and train."""

    def __init__(self, pid: str, run_id: str, reads: Reads, kept: JournalKeeper, poll_max: float = POLL_MAX,
                 max_rounds: int = 0, rng: random.Random | None = None) -> None:
        self.pid, self.run_id, self.reads, self.kept = pid, run_id, reads, kept
        self.poll_max, self.max_rounds = poll_max, max_rounds  # max_rounds: leave after that many uploads
        self.rng = rng or random.Random()  # the polls' jitter
        self.joined_at: float | None = None  # our join time as the coordinator recorded it
        self.join_sent, self.join_sends = 0.0, 0
        self.offered = False
        self.held = ""  # digest of the global model we hold
        self.held_model: bytes | Path = b""  # its file (the daemon), or its bytes (the load test's simulation)
        self.reported_ready = 0
        self.ready_sent, self.ready_sends = 0.0, 0
        self.stored: set[int] = set()  # rounds with an update of ours found in the bucket or table
        self.skipped: set[int] = set()  # rounds trained but not sent (the round closed meanwhile)
        self.rounds_uploaded = 0
        self.record_checked = 0.0
        self._last_sent = 0.0
        self._sent_lock = threading.Lock()

    def sent_at(self) -> float:
        """The `sent_at` of the next join request or heartbeat: the clock, but strictly increasing (ingest
        refuses a message not sent after the last one it accepted from us, to stop replays)."""
        with self._sent_lock:
            self._last_sent = max(time.time(), self._last_sent + 0.001)
            return self._last_sent

    @property
    def journal(self) -> Journal:
        return self.kept.journal

    # --- what a subclass provides: how it waits and stops, what it sends, how it trains -----------------

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
    def _fetch(self, action: Fetch) -> None: ...  # hold the model (`held`, `held_model`), or return to retry

    @abstractmethod
    def _train(self, action: Train) -> bool: ...  # train and upload; False if the update was not sent

    @abstractmethod
    def _finish(self, action: Finish) -> Outcome: ...

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

    # --- the loop ---------------------------------------------------------------------------------------

    def _loop(self) -> Outcome:
        delay, last_wait = POLL_FIRST, None
        while True:
            self._check_stop()
            state = self.reads.read_state()
            self._observe(state)
            self._check_outcome(state)
            local = self._local(state)
            action = decide(state, local)
            if isinstance(action, Wait):
                marker = (state.version, action.reason)
                if marker != last_wait:
                    self._waiting(action, last_wait is None or action.reason != last_wait[1])
                    delay, last_wait = POLL_FIRST, marker
                delay = self._backoff(delay)
                continue
            resend = is_resend(action, local)
            if not resend:  # a re-send is no progress: keep polling at the slower pace
                delay, last_wait = POLL_FIRST, None
            outcome = self._act(action, state, resend)
            if outcome is not None:
                return outcome

    def _backoff(self, delay: float) -> float:
        """Pause about `delay` seconds (jittered, so a fleet does not poll in step); return the next delay."""
        self._pause(delay * self.rng.uniform(0.75, 1.25))
        return min(delay * POLL_GROWTH, self.poll_max)

    def _act(self, action: Action, state: RunState, resend: bool) -> Outcome | None:
        """Carry out one action; an outcome ends the loop."""
        if isinstance(action, Finish):
            return self._finish(action)
        if isinstance(action, Join):
            age = time.monotonic() - self.join_sent
            log.warning("join request not recorded after %.0fs; sending it again", age)
            self._join()
        elif isinstance(action, OfferModel):
            self._offer_model()
            self.offered = True
        elif isinstance(action, Fetch):
            self._fetch(action)
        elif isinstance(action, ReportReady):
            self._report_ready(action.epoch, again=resend)
        elif isinstance(action, ReportHealth):
            self._report_health(action, state)
        elif isinstance(action, CheckUpdates):
            self._check_updates(action, state)
        elif isinstance(action, SendProof):
            self._send_proof(action, state)
        elif isinstance(action, Train):
            if self._train(action):
                self.rounds_uploaded += 1
            else:
                self.skipped.add(action.round)
                self.kept.stop_training()
            if self.max_rounds and self.rounds_uploaded >= self.max_rounds:
                log.info("leaving after %d uploaded round(s) (--max-rounds)", self.rounds_uploaded)
                return Outcome(False, self.rounds_uploaded, reason="max-rounds")
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
        self.join_sent, self.join_sends = time.monotonic(), self.join_sends + 1
        log.info("join request sent for run %s", self.run_id)

    def _report_ready(self, epoch: int, again: bool) -> None:
        self._send_ready(epoch)
        self.reported_ready, self.ready_sent = epoch, time.monotonic()
        self.ready_sends = self.ready_sends + 1 if again else 1
        if again:
            log.info("ready for epoch %d: not yet recorded by the coordinator, heartbeat sent again", epoch)
        else:
            log.info("ready for epoch %d (heartbeat sent)", epoch)

    # --- what decide() needs to know about us -----------------------------------------------------------

    def _local(self, state: RunState) -> Local:
        ready_recorded = self.reported_ready
        if self.joined_at is not None and self.pid not in state.members:
            self._check_still_registered()
        if self.joined_at is None:
            record = self.reads.participant_record()
            if record is not None:
                self._adopt_incarnation(float(record.joined_at))
        elif (state.phase is Phase.WARMUP and self.reported_ready >= state.epoch
              and state.members.get(self.pid) is not None):
            record = self.reads.participant_record()
            ready_recorded = int(record.ready_epoch or 0) if record is not None else 0
        recorded = False
        if state.phase is Phase.TRAIN and self.pid in state.selected and state.round not in self._done():
            recorded = self._update_exists(state.round)
        now = time.monotonic()
        return Local(pid=self.pid, joined=self.joined_at is not None, join_age=now - self.join_sent,
                     join_sends=self.join_sends, offered=self.offered, held=self.held,
                     reported_ready=self.reported_ready, ready_age=now - self.ready_sent, ready_sends=self.ready_sends,
                     ready_recorded=ready_recorded, uploaded=self._done(), recorded=recorded,
                     witnessed=frozenset(self.journal.witnessed),
                     health_reported=frozenset(self.journal.health_reported))

    def _done(self) -> frozenset[int]:
        return self.journal.uploaded_rounds | self.skipped

    def _update_exists(self, round_no: int) -> bool:
        if round_no in self.stored:
            return True
        if self.reads.update_record(round_no) is not None or self.reads.update_stored(round_no, self.joined_at):
            log.info("round %d: an update of ours is already stored (uploaded before a restart); not redone", round_no)
            self.stored.add(round_no)
            return True
        return False

    def _check_still_registered(self) -> None:
        """Not a member: make sure the coordinator still knows us. A run restored from its checkpoint after
        its table was lost (`fed run restore`) has no participant records: join again, as a new incarnation."""
        if time.monotonic() - self.record_checked < RECORD_CHECK_SECONDS:
            return
        self.record_checked = time.monotonic()
        if self.reads.participant_record() is not None:
            return
        log.warning("the coordinator has no record of this participant any more (the run's state was lost or "
                    "restored?); joining again")
        self._forget()
        self._join()

    def _forget(self) -> None:
        """Before joining again as a new incarnation of the run: drop what we knew about the old one."""
        self.joined_at = None
        self.stored.clear()
        self.skipped.clear()
        self.reported_ready = 0

    def _adopt_incarnation(self, joined_at: float) -> None:
        """Tie the journal to this incarnation of the run (see participant.journal)."""
        self.joined_at = joined_at
        j = self.journal
        if j.joined_at is not None and abs(j.joined_at - joined_at) > 1e-3:
            log.warning("the run was recreated since %s was written (joined at %.3f, now %.3f); discarding "
                        "its progress", self.kept.name, j.joined_at, joined_at)
            self.kept.restart()
        if self.journal.joined_at is None:
            self.journal.joined_at = joined_at
            self.kept.save()
        log.info("joined run %s as %s", self.run_id, self.pid)

    def _check_outcome(self, state: RunState) -> None:
        """Log, once, whether the coordinator accepted our latest upload."""
        pending = [r for r in self.journal.uploaded if r not in self.journal.outcomes]
        if not pending:
            return
        r = max(pending)
        rec = self.reads.update_record(r)
        if rec is None:
            if state.round > r:  # the round closed without a record of ours: do not ask again
                self.journal.outcomes[r] = "no record"
                self.kept.save()
            return
        if rec.accepted:
            log.info("round %d: update accepted", r)
            self.journal.outcomes[r] = "accepted"
        else:
            log.warning("round %d: update refused: %s", r, rec.reason)
            self.journal.outcomes[r] = rec.reason or "refused"
        self.kept.save()
