"""The participant's poll loop (participant.protocol), the daemon's and the load test's, against scripted reads."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import replace

import pytest

from participant import protocol
from participant.decide import JOIN_RETRY_SECONDS, Fetch, Finish, Train, still_open
from participant.journal import Journal, JournalKeeper
from participant.protocol import POLL_FIRST, POLL_GROWTH, Participant, ParticipantExit, UnfitModel, quiet_seconds
from shared.config import RunConfig
from shared.state import Member, Phase, RunState
from store.push import Pushed
from store.views import ParticipantRecord, UpdateRecord

G = "a" * 64


class Script:
    """Reads that hand out the given states in turn (the last one from then on); our participant record from the
    `recorded_at`-th read of it on (before: none, our join is not recorded yet)."""

    def __init__(self, *states: RunState, recorded_at: int = 1) -> None:
        self.states = list(states)
        self.record_reads = self.state_reads = 0
        self.recorded_at = recorded_at
        self.pushed: dict[int, RunState] = {}

    def read_state(self) -> RunState:
        self.state_reads += 1
        return self.states.pop(0) if len(self.states) > 1 else self.states[0]

    def pushed_state(self, pushed: Pushed) -> RunState:
        return self.pushed[pushed.version]

    def read_config(self) -> RunConfig | None:
        return RunConfig(run_id="r-run")

    def participant_record(self) -> ParticipantRecord | None:
        self.record_reads += 1
        if self.record_reads < self.recorded_at:
            return None
        return ParticipantRecord("alice", joined_at=100.0, last_seen=100.0)

    def update_record(self, round_no: int) -> UpdateRecord | None:
        return None

    def update_stored(self, round_no: int, since: float | None = None) -> bool:
        return False


class Recorder(Participant):
    def __init__(self, reads: Script) -> None:
        super().__init__("alice", "r-run", reads, JournalKeeper(Journal("r-run", "alice")), poll_max=1.0)
        self.did: list[str] = []
        self.pauses: list[float] = []

    def _check_stop(self) -> None:
        if len(self.pauses) > 50:
            raise TimeoutError("looping")

    def _pause(self, seconds: float) -> None:
        self.pauses.append(seconds)

    def _send_join(self) -> None:
        self.did.append("join")

    def _send_ready(self, epoch: int) -> None:
        self.did.append(f"ready {epoch}")

    def _offer_model(self) -> None:
        self.did.append("offer")

    def _fetch(self, action: Fetch) -> None:
        self.did.append(f"fetch {action.round}")
        self.me.held = action.digest

    def _train(self, action: Train) -> bool:
        self.did.append(f"train {action.round}")
        self.kept.uploaded(action.round, {"digest": "d"})
        return True

    def _finish(self, action: Finish) -> ParticipantExit:
        self.did.append("finish")
        return ParticipantExit(True, self.me.rounds_uploaded)


def run_state(phase: Phase, round_no: int = 0, digest: str = G, version: int = 1) -> RunState:
    return RunState(run_id="r-run", version=version, phase=phase, epoch=1, round=round_no, seed="c" * 64,
                    members={"alice": Member()}, selected=("alice",), global_digest=digest)


def test_a_participant_joins_offers_trains_and_finishes() -> None:
    script = Script(
        run_state(Phase.WAITING, digest=""),
        run_state(Phase.WAITING, digest=""),
        run_state(Phase.TRAIN),
        run_state(Phase.TRAIN),
        run_state(Phase.FINISHED, round_no=1),
    )
    p = Recorder(script)
    p._join()
    outcome = p._loop()
    assert outcome == ParticipantExit(True, 1)
    assert p.did == ["join", "offer", "fetch 0", "train 0", "finish"]  # the final model is the one held
    assert p.me.joined_at == 100.0 and p.journal.joined_at == 100.0  # the journal is tied to this incarnation
    # one wait (for members), jittered around the first poll interval
    assert len(p.pauses) == 1 and POLL_FIRST * 0.75 <= p.pauses[0] <= POLL_FIRST * 1.25


def test_waiting_backs_off_up_to_poll_max() -> None:
    p = Recorder(Script(*[run_state(Phase.COOLDOWN)] * 30, run_state(Phase.FINISHED, digest="")))
    p.me.joined_at = 100.0
    p._loop()
    assert len(p.pauses) == 30
    assert all(b <= a * POLL_GROWTH * 1.25 / 0.75 for a, b in zip(p.pauses, p.pauses[1:], strict=False))
    assert max(p.pauses) <= 1.0 * 1.25 and p.pauses[-1] >= 1.0 * 0.75


def test_until_its_join_is_recorded_it_polls_its_record_not_the_state() -> None:
    # Given a run waiting for members, and alice's join request recorded only at her tenth look at her record
    script = Script(run_state(Phase.WAITING, version=1), run_state(Phase.TRAIN, version=2),
                    run_state(Phase.TRAIN, version=2), run_state(Phase.FINISHED, round_no=1, version=3),
                    recorded_at=10)
    p = Recorder(script)
    p._join()
    # When she runs
    assert p._loop() == ParticipantExit(True, 1)
    # Then she read the state once while waiting for her join (nine record reads, nine pauses), then again as soon as
    # it was recorded: she decided on the current state (trained in round 0), not on the one she kept
    assert script.record_reads >= 10 and len(p.pauses) == 9
    assert p.did == ["join", "fetch 0", "train 0", "finish"]
    assert script.state_reads == 4


class Feed:
    """A push queue that delivers `pushes` (state versions) in turn, one per listen, then nothing."""

    def __init__(self, script: Script, *pushes: RunState) -> None:
        self.script, self.pushes, self.listens = script, list(pushes), 0

    def wait(self, seconds: float) -> Pushed | None:
        self.listens += 1
        if self.listens > 50:
            raise TimeoutError("listening forever")
        if not self.pushes:
            return None
        state = self.pushes.pop(0)
        self.script.pushed[state.version] = state
        return Pushed(state.version, {})

    def close(self) -> None:
        pass


def test_with_a_push_queue_a_joiner_listens_instead_of_polling() -> None:
    # Given a run with a model waiting for members, alice's join request recorded by her second look at her record,
    # and her push queue, which delivers nothing for two long polls, then the epoch's start (round 0 training), then
    # the end
    waiting = replace(run_state(Phase.WAITING, version=1), members={}, selected=())
    finished = run_state(Phase.FINISHED, round_no=1, version=3)
    script = Script(waiting, finished, recorded_at=2)
    p = Recorder(script)
    feed = Feed(script, waiting, waiting, run_state(Phase.TRAIN, version=2), finished)
    p.feed = feed
    p._join()
    # When she runs
    p._loop()
    # Then she never paused to poll: she looked at her record before listening and again only when a change was
    # pushed (two reads: the long polls that brought nothing new did not look), read the state item only at the start
    # and at the end, and trained in the round the push announced
    assert p.pauses == [] and feed.listens >= 4
    assert script.record_reads == 2 and script.state_reads == 2
    assert p.did == ["join", "fetch 0", "train 0", "finish"]


class LongWait(Feed):
    """Nothing is pushed; from the third long poll on, the join request was sent long enough ago to be re-sent."""

    def __init__(self, script: Script, p: Participant) -> None:
        super().__init__(script)
        self.p = p

    def wait(self, seconds: float) -> Pushed | None:
        if self.listens == 2:
            self.p.me.join_sent -= JOIN_RETRY_SECONDS
        return super().wait(seconds)


@pytest.mark.parametrize("recorded_at", [2, 3])
def test_a_listening_joiner_looks_at_its_record_again_before_a_re_send(recorded_at: int) -> None:
    # Given a run with a model waiting for members, alice's join recorded at her second (or third) look at her record,
    # and her push queue, which brings nothing
    waiting = replace(run_state(Phase.WAITING, version=1), members={}, selected=())
    script = Script(waiting, recorded_at=recorded_at)
    p = Recorder(script)
    p.feed = LongWait(script, p)
    p._join()
    # When she runs (until the test's limit of long polls)
    with pytest.raises(TimeoutError):
        p._loop()
    # Then she listened, never polling: she looked at her record once at first and again when a re-send was due, and
    # re-sent her join request only if it was still not recorded then (the next re-send waits twice as long: no
    # further look within the test's long polls; once recorded, a non-member checks its record every 30 s: one more)
    assert p.pauses == [] and p.feed.listens > 10
    if recorded_at == 2:
        assert p.did == ["join"] and script.record_reads == 3
    else:
        assert p.did == ["join", "join"] and script.record_reads == 2


def test_without_a_model_a_joiner_offers_one_at_once_and_listens() -> None:
    # Given a run without a model, alice's join recorded at her third look, and her push queue (nothing comes)
    script = Script(run_state(Phase.WAITING, digest="", version=1), recorded_at=3)
    p = Recorder(script)
    p.feed = Feed(script)
    p._join()
    # When she runs (until the test's limit of long polls)
    with pytest.raises(TimeoutError):
        p._loop()
    # Then she offered her model at once, before her join was recorded (ingest keeps it for the join function), and
    # listened from then on, never polling: her record looked at once at first, then only before a re-send
    assert p.did == ["join", "offer"] and p.pauses == [] and p.feed.listens > 10
    assert script.record_reads <= 2


class Misfit(Recorder):
    """A participant of another task than the one whose model the run adopted: the global model `G` does not fit."""

    def _fetch(self, action: Fetch) -> None:
        self.did.append(f"fetch {action.round}")
        if action.digest == G:
            raise UnfitModel("the run's global model does not fit task t: tensor weight: file has (3, 3)")
        self.me.held = action.digest


def test_a_global_model_that_does_not_fit_is_reported_and_waited_out(caplog: pytest.LogCaptureFixture) -> None:
    # Given a run training round 0 from a global model that does not fit alice's task, and a later one that does
    fits = "f" * 64
    next_round = run_state(Phase.TRAIN, round_no=1, digest=fits, version=3)
    script = Script(*[run_state(Phase.TRAIN, version=2)] * 5, next_round, next_round,
                    run_state(Phase.FINISHED, round_no=2, digest=fits, version=4))
    p = Misfit(script)
    p.me.joined_at = 100.0
    # When she runs
    with caplog.at_level("WARNING", logger="participant"):
        outcome = p._loop()
    # Then she said why, did not download it again, and waited (not exited) until a global model fit her task
    assert "does not fit our task" in caplog.text and "tensor weight" in caplog.text
    assert p.did == ["fetch 0", "fetch 1", "train 1", "finish"]
    assert outcome == ParticipantExit(True, 1) and len(p.pauses) >= 4


def test_still_open() -> None:
    a = Train(3, 1, "s", ("alice", "bob"), G)
    assert still_open(run_state(Phase.TRAIN, round_no=3), a, "alice")
    assert not still_open(run_state(Phase.TRAIN, round_no=4), a, "alice")
    assert not still_open(run_state(Phase.WITNESS, round_no=3), a, "alice")
    assert not still_open(run_state(Phase.TRAIN, round_no=3), a, "carol")


class Clock:
    """`time` for participant.protocol: it moves only when the participant waits (a pause, a long poll) or trains."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return 1.7e9 + self.now


class Timeline(Feed):
    """A push queue that delivers each state when the clock reaches its time: a long poll returns it as soon as it
    is due, or nothing after `seconds`. Counts the long polls made in each round."""

    def __init__(self, script: Script, clock: Clock, *pushes: tuple[float, RunState]) -> None:
        super().__init__(script)
        self.clock, self.timed = clock, list(pushes)
        self.by_round: Counter[int] = Counter()
        self.round = 0

    def wait(self, seconds: float) -> Pushed | None:
        self.listens += 1
        self.by_round[self.round] += 1
        if self.timed and self.timed[0][0] <= self.clock.now + seconds:
            at, state = self.timed.pop(0)
            self.clock.now = max(self.clock.now, at)
            self.script.pushed[state.version] = state
            self.round = state.round
            return Pushed(state.version, {})
        self.clock.now += seconds
        return None


class Trainer(Recorder):
    """Training takes 20 s of the clock; pauses move it too."""

    def __init__(self, script: Script, clock: Clock) -> None:
        super().__init__(script)
        self.clock = clock

    def _pause(self, seconds: float) -> None:
        super()._pause(seconds)
        self.clock.now += seconds

    def _train(self, action: Train) -> bool:
        self.clock.now += 20.0
        return super()._train(action)


# A third of the shortest wait seen after an upload (the first round's: 208 s after 20 s of training), counted from
# the upload 20 s into the round (it ends later than a third of the shortest round, 228 s), less half a long poll
QUIET_UNTIL = 20 + 208 / 3 - 10


@pytest.mark.parametrize(("second_round", "late"), [(228.0, 0.0), (100.0, 0.0), (60.0, QUIET_UNTIL - 60)])
def test_after_its_upload_it_waits_for_a_third_of_the_shortest_wait_seen_without_a_request(
        monkeypatch: pytest.MonkeyPatch, second_round: float, late: float) -> None:
    # Given a run whose first round lasts 228 s (20 s of training, then waiting for a thousand others' updates), pushed
    # to alice's queue as each round begins, and a second round that lasts 228 s, 150 s or 60 s
    clock = Clock()
    monkeypatch.setattr(protocol, "time", clock)
    finished = run_state(Phase.FINISHED, round_no=2, version=4)
    script = Script(run_state(Phase.TRAIN, round_no=0, version=1), finished)
    p = Trainer(script, clock)
    p.me.joined_at = 100.0
    start = clock.now
    feed = Timeline(script, clock, (start + 228, run_state(Phase.TRAIN, round_no=1, version=2)),
                    (start + 228 + second_round, finished))
    p.feed = feed
    # When she runs
    assert p._loop() == ParticipantExit(True, 2)
    # Then in the first round (none before it to time) she listened every 20 s after her upload: 11 long polls; in the
    # second, she waited quietly from her upload for a third of the first round's wait after it, less 10 s, then
    # listened: as many long polls as the rest of the round takes, learning of its close at once — or, of a round far
    # shorter than any before, late by the difference
    assert feed.by_round[0] == 11
    assert len(p.pauses) == 1 and p.pauses[0] == pytest.approx(QUIET_UNTIL - 20)
    assert feed.by_round[1] == max(1, math.ceil((second_round - QUIET_UNTIL) / 20))
    assert clock.now - (start + 228 + second_round) == pytest.approx(late)
    assert p.did == ["fetch 0", "train 0", "train 1", "finish"]


def test_quiet_seconds() -> None:
    # none without a round timed, nor when it would spare no long poll; never beyond the limit
    assert quiet_seconds(now=50, started=0, shortest=None, limit=1e9) == 0.0
    assert quiet_seconds(now=50, started=0, shortest=300, limit=1e9) == pytest.approx(40.0)
    assert quiet_seconds(now=50, started=0, shortest=210, limit=1e9) == 0.0  # 10 s: not a long poll's worth
    assert quiet_seconds(now=50, started=0, shortest=900, limit=100) == 100.0
    # counted from the upload too, with a third of the shortest wait seen after one: whichever ends later
    assert quiet_seconds(now=50, started=0, shortest=150, limit=1e9, uploaded=50, waited=100) == pytest.approx(70 / 3)
    assert quiet_seconds(now=50, started=0, shortest=None, limit=1e9, uploaded=50, waited=120) == pytest.approx(30.0)
    assert quiet_seconds(now=50, started=0, shortest=300, limit=1e9, uploaded=50, waited=30) == pytest.approx(40.0)
    # a participant that once uploaded last has seen almost no wait: no quiet from its upload
    assert quiet_seconds(now=50, started=0, shortest=150, limit=1e9, uploaded=50, waited=2) == 0.0
    assert quiet_seconds(now=80, started=0, shortest=None, limit=1e9, uploaded=50, waited=120) == 0.0  # 0 s left
