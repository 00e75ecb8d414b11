"""Participant daemons (threads) against in-process moto, with the real ingest and tick handlers.

A pump thread plays the local dispatcher: it delivers the S3 events queued by the bucket's
EventBridge rule to the ingest handler and ticks on a short schedule. Every wait is on a condition
with a deadline.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import boto3
import numpy as np
import pytest
import torch

from coordinator import service
from functions import ingest, tick
from local.context import LocalContext
from participant.daemon import Daemon, Options
from participant.journal import JournalFile
from participant.protocol import ForeignInitialModel, ParticipantError, ParticipantExit
from participant.tasks import digits_meta
from participant.tasks.digits import Digits
from participant.tensors import from_bytes, load_into
from participant.training import train_seed
from participant.ui import Reporter
from shared import keys, wire
from shared.selection import assignment
from shared.state import Phase
from store.connection import Connection
from tests.functional.conftest import Harness

DEADLINE = 120.0
TASK = "tests.functional.test_participant_daemon:task"


class InterruptibleDigits(Digits):
    """The digits task, with a hook that can stop its participant mid-training (a crash stand-in)."""

    def __init__(self) -> None:
        super().__init__()
        # (participant, its stop event): set the event when that participant reaches training step 3
        self.interrupt: tuple[str, threading.Event] | None = None

    def train(self, model, indices, config, device, progress=None, seed=0):  # type: ignore[no-untyped-def]
        def hooked(done: int, total: int) -> None:
            target = self.interrupt
            if target is not None and done == 3 and threading.current_thread().name == target[0]:
                target[1].set()
                self.interrupt = None
            if progress is not None:
                progress(done, total)

        return super().train(model, indices, config, device, hooked, seed)


task = InterruptibleDigits()


class Pump:
    """Deliver queued S3 events to ingest and tick every `every` seconds, on a thread. With `start_with`, after
    the run's first commit no tick runs (scheduled, or after an ingest) until that many participants have joined
    and proven live, as if the whole fleet had started before the coordinator looked again: the first epoch then
    admits them all, not the first `min_clients` whose heartbeats the pump happened to ingest."""

    def __init__(self, harness: Harness, every: float = 0.3, start_with: int = 0) -> None:
        self.harness, self.every, self.start_with = harness, every, start_with
        self.sqs = boto3.client("sqs", region_name="us-east-1")
        self.done = threading.Event()
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self._run, name="pump", daemon=True)

    def _run(self) -> None:
        last = 0.0
        try:
            while not self.done.is_set():
                messages = []
                # both lanes (join requests have their own queue), joins first: a heartbeat uploaded right after
                # its join is then not refused as coming from a participant that never joined
                for url in (self.harness.res.join_queue_url, self.harness.res.queue_url):
                    batch = self.sqs.receive_message(QueueUrl=url, MaxNumberOfMessages=10).get("Messages", [])
                    for m in batch:
                        ingest.handler(json.loads(m["Body"]), LocalContext())
                        self.sqs.delete_message(QueueUrl=url, ReceiptHandle=m["ReceiptHandle"])
                    messages += batch
                if time.monotonic() - last >= self.every and self.gathered():
                    tick.handler({}, LocalContext())
                    last = time.monotonic()
                if not messages:
                    self.done.wait(0.02)
        except BaseException as exc:  # surfaced by the test
            self.errors.append(exc)

    def gathered(self) -> bool:
        """Whether ticks may run: always once `start_with` participants were proven live, and before the run's
        first commit (it publishes the run's configuration, which participants wait for before their first
        heartbeat: nobody can be proven before it)."""
        if self.start_with:
            snap = self.harness.deps.store.load_snapshot()
            if snap.state.version == 0:
                return True
            if sum(p.proven for p in snap.participants.values()) < self.start_with:
                return False
            self.start_with = 0
        return True


@pytest.fixture
def run(harness_factory: Callable[..., Harness], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
        ) -> Iterator[Callable[..., Harness]]:
    pumps: list[Pump] = []

    def start(start_with: int = 0, **overrides: Any) -> Harness:
        settings: dict[str, Any] = dict(
            dataset_size=0, max_update_bytes=1 << 20, warmup_time=300, max_round_train_time=300,
            liveness_timeout=300, total_rounds=3, learning_rate=0.1, local_epochs=2, batch_size=16, task=TASK,
        )
        settings.update(overrides)
        harness = harness_factory(**settings)
        pump = Pump(harness, start_with=start_with)
        if start_with:  # the tick an ingest makes waits for the fleet too
            after_upload = service._ticked
            monkeypatch.setattr(service, "_ticked", lambda deps, ingested, now=None: after_upload(deps, ingested, now)
                                if pump.gathered() else service.Handled(ingested, deferred="gathering"))
        pump.thread.start()
        pumps.append(pump)
        return harness

    yield start
    for pump in pumps:
        pump.done.set()
        pump.thread.join(timeout=10)
        assert not pump.errors, pump.errors


class Participant:
    def __init__(self, harness: Harness, pid: str, state_dir: Path, stop: threading.Event | None = None,
                 prepare: Callable[[Daemon], None] | None = None, **options: Any) -> None:
        self.pid, self.stop = pid, stop or threading.Event()
        conn = Connection(run_id=harness.config.run_id, bucket=harness.res.bucket, table=harness.res.table)
        opts = Options(pid=pid, state_dir=state_dir, threads=1, poll_max=0.2, **options)
        self.daemon = Daemon(conn, opts, self.stop, Reporter(bars=False))
        if prepare is not None:
            prepare(self.daemon)
        self.outcome: ParticipantExit | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name=pid, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.outcome = self.daemon.run()
        except BaseException as exc:
            self.error = exc

    def wait(self, deadline: float = DEADLINE) -> ParticipantExit:
        self.thread.join(timeout=deadline)
        assert not self.thread.is_alive(), f"{self.pid} did not finish within {deadline}s"
        if self.error is not None:
            raise self.error
        assert self.outcome is not None
        return self.outcome


def versions(harness: Harness, key: str) -> int:
    resp = harness.s3.list_object_versions(Bucket=harness.res.bucket, Prefix=key)
    return sum(1 for v in resp.get("Versions", []) if v["Key"] == key)


def test_two_participants_train_the_run_to_the_end(run: Callable[..., Harness], tmp_path: Path) -> None:
    # Given a 3-round run whose warmup would last 5 minutes unless every member reports ready
    harness = run(total_rounds=3)
    # When two participants start
    alice = Participant(harness, "alice", tmp_path / "alice")
    bob = Participant(harness, "bob", tmp_path / "bob")
    # Then both finish (well before the warmup deadline: readiness ended it) with the same final model
    a, b = alice.wait(), bob.wait()
    assert a.finished and b.finished and a.rounds == b.rounds == 3
    assert a.final == b.final and a.final["test_accuracy"] > 0.85
    state = harness.state()
    assert state.phase is Phase.FINISHED and state.aggregated == 3
    # And every round counted both updates, each claiming exactly its assignment and carrying metrics
    summaries = sorted(harness.deps.store.rounds(), key=lambda s: s.round)
    assert [s.counted for s in summaries] == [("alice", "bob")] * 3
    for rec in harness.deps.store.all_updates():
        assert rec.accepted, rec.reason
        assert set(rec.metrics) >= {"loss", "test_accuracy", "global_test_accuracy", "train_seconds"}
    assert summaries[0].samples == Digits.train_size
    result = json.loads((tmp_path / "alice" / "result.json").read_text())
    assert result["digest"] == state.global_digest and result["test_accuracy"] == a.final["test_accuracy"]
    # And accuracy rose round over round as the global models improved
    accs = [s.accuracy for s in summaries]
    assert accs[-1] is not None and accs[-1] > 0.85


def test_restart_resumes_without_redoing_an_uploaded_round(run: Callable[..., Harness], tmp_path: Path) -> None:
    harness = run(total_rounds=3)
    # Given alice leaves right after uploading round 0, while bob stays
    alice = Participant(harness, "alice", tmp_path / "alice", max_rounds=1)
    bob = Participant(harness, "bob", tmp_path / "bob")
    first = alice.wait()
    assert not first.finished and first.rounds == 1
    # When alice starts again with the same state directory
    again = Participant(harness, "alice", tmp_path / "alice")
    # Then the run finishes with both, and no update key was ever written twice
    assert again.wait().finished and bob.wait().finished
    assert again.outcome is not None and again.outcome.rounds == 2  # rounds 1 and 2; round 0 was not redone
    for round_no in range(3):
        for pid in ("alice", "bob"):
            assert versions(harness, keys.update_key(harness.config.run_id, round_no, pid)) == 1
    # (an initial-model offer that lost the race to another is refused, harmlessly, and so is a heartbeat whose
    # event arrived after a newer one's on a loaded machine: it would not move last_seen forward; nothing else)
    assert [r.key for r in harness.deps.store.refusals() if "/init/" not in r.key and "/heartbeat/" not in r.key] == []
    journal, _ = JournalFile(tmp_path / "alice", harness.config.run_id, "alice").load()
    assert sorted(journal.uploaded) == [0, 1, 2] and journal.training is None


def test_interrupted_training_is_retrained_identically(run: Callable[..., Harness], tmp_path: Path) -> None:
    harness = run(total_rounds=1)
    # Given alice is stopped in the middle of training round 0
    stop = threading.Event()
    task.interrupt = ("alice", stop)
    alice = Participant(harness, "alice", tmp_path / "alice", stop=stop)
    bob = Participant(harness, "bob", tmp_path / "bob")
    stopped = alice.wait()
    assert not stopped.finished and stopped.rounds == 0
    journal, _ = JournalFile(tmp_path / "alice", harness.config.run_id, "alice").load()
    assert journal.training is not None and journal.training["round"] == 0 and journal.uploaded == {}
    # When she restarts
    again = Participant(harness, "alice", tmp_path / "alice")
    assert again.wait().finished and bob.wait().finished
    # Then her round 0 update is exactly what training the assignment from the round's model gives
    rec = harness.deps.store.update_record(0, "alice")
    assert rec is not None and rec.accepted
    summary = harness.deps.store.rounds()[0]
    state = harness.state()
    assert summary.selected == ("alice", "bob") and state.phase is Phase.FINISHED
    update = harness.s3.get_object(Bucket=harness.res.bucket, Key=keys.update_key(harness.config.run_id, 0, "alice"))
    uploaded = from_bytes(update["Body"].read())
    global0 = harness.s3.get_object(Bucket=harness.res.bucket, Key=harness.global_key(0))
    model = load_into(task.build_model(0), global0["Body"].read())
    seed = _round_seed(harness, 0)
    indices = assignment(seed, task.train_size, summary_selection(harness, 0), "alice")

    def recompute() -> None:  # as the daemon trains: its own thread, one torch thread (sums in the same order)
        torch.set_num_threads(1)
        Digits.train(task, model, indices, harness.config, torch.device("cpu"), seed=train_seed(seed, "alice"))

    worker = threading.Thread(target=recompute)
    worker.start()
    worker.join(timeout=60)
    for name, tensor in model.state_dict().items():
        assert torch.equal(uploaded[name], tensor), name


def _round_seed(harness: Harness, round_no: int) -> str:
    from shared.selection import round_seed

    return round_seed(harness.config.seed, 1, round_no)


def summary_selection(harness: Harness, round_no: int) -> tuple[str, ...]:
    from shared.selection import select

    return select(_round_seed(harness, round_no), ["alice", "bob"], 1.0, harness.config.min_per_round)


def test_a_late_joiner_waits_for_the_next_epoch(run: Callable[..., Harness], tmp_path: Path) -> None:
    # Given a run of two epochs of two rounds, started by alice and bob
    # (cooldown_time > 0: with 0, one tick ends epoch 1 and starts epoch 2 before the aggregate's digest
    # is resolved, and the coordinator re-adopts the initial model under round 2's key; reported.)
    harness = run(total_rounds=4, rounds_per_epoch=2, cooldown_time=1.0)
    alice = Participant(harness, "alice", tmp_path / "alice")
    bob = Participant(harness, "bob", tmp_path / "bob")
    deadline = time.monotonic() + DEADLINE
    while harness.state().phase is not Phase.TRAIN:
        assert time.monotonic() < deadline, "the first round never started"
        alice.stop.wait(0.05)
    # When carol joins during epoch 1
    carol = Participant(harness, "carol", tmp_path / "carol")
    # Then everybody finishes; carol trained only in epoch 2
    for p in (alice, bob, carol):
        assert p.wait().finished
    by_round: dict[int, set[str]] = {}
    for rec in harness.deps.store.all_updates():
        assert rec.accepted, rec.reason
        by_round.setdefault(int(rec.round), set()).add(rec.pid)
    first_epoch = [r for r, pids in by_round.items() if "carol" not in pids]
    assert len(first_epoch) >= 2 and "carol" in by_round[max(by_round)]
    assert carol.outcome is not None and carol.outcome.rounds == 2


def test_a_dataset_size_the_task_does_not_have_is_a_clear_error(run: Callable[..., Harness], tmp_path: Path) -> None:
    harness = run(dataset_size=100)
    alice = Participant(harness, "alice", tmp_path / "alice")
    with pytest.raises(ParticipantError, match="dataset_size is 100, but task .* has 1437 training samples"):
        alice.wait()


def test_a_round_0_model_other_than_the_one_its_task_builds_stops_the_participant_with_the_reason(
        run: Callable[..., Harness], tmp_path: Path) -> None:
    # Given a run whose file pins no initial model (its task is no built-in one: no schema either), whose first epoch
    # starts from "adversary"'s offer, first by id: the digits model's tensors with weights of its own
    harness = run(min_clients=2, min_per_round=2)
    harness.join_alive("adversary")
    other = {name: np.full(spec.shape, 0.25, np.float32) for name, spec in digits_meta.mlp_tensors().items()}
    assert harness.offer("adversary", other)["accepted"] is True
    # When alice, of the digits task, joins the run
    alice = Participant(harness, "alice", tmp_path / "alice")
    # Then she refuses to train on it: she stops, saying which model the run adopted and which one her task builds
    with pytest.raises(ForeignInitialModel) as refused:
        alice.wait()
    state = harness.state()
    assert state.model_source == "adversary"
    own = alice.daemon.training.initial_digest
    assert own and own != state.global_digest
    assert f"round 0's global model {state.global_digest[:16]} is not the initial model" in str(refused.value)
    assert own[:16] in str(refused.value)
    # and she trained nothing on it
    assert harness.deps.store.updates(0) == {}


def test_the_final_model_is_the_one_evaluated(run: Callable[..., Harness], tmp_path: Path) -> None:
    # A participant that starts after the run finished evaluates the final model and exits
    harness = run(total_rounds=1)
    for p in [Participant(harness, pid, tmp_path / pid) for pid in ("alice", "bob")]:
        assert p.wait().finished
    late = Participant(harness, "dave", tmp_path / "dave").wait()
    assert late.finished and late.rounds == 0
    raw = harness.s3.get_object(Bucket=harness.res.bucket, Key=harness.global_key(1))
    model = load_into(task.build_model(0), raw["Body"].read())
    assert late.final == task.evaluate(model, torch.device("cpu"))
    assert wire.digest(
        harness.s3.get_object(Bucket=harness.res.bucket, Key=harness.global_key(1))["Body"].read()
    ) == harness.state().global_digest
    assert np.isfinite(late.final["test_loss"])


class Flaky:
    """Wrap an object so that every `every`-th call of the named methods fails with a transient error."""

    def __init__(self, inner: Any, methods: set[str], every: int, error: Callable[[], Exception]) -> None:
        self._inner, self._methods, self._every, self._error = inner, methods, every, error
        self.calls = self.failures = 0

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if name not in self._methods:
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            if self.calls % self._every == 0:
                self.failures += 1
                raise self._error()
            return attr(*args, **kwargs)

        return call


def test_transient_s3_and_dynamodb_faults_are_retried(run: Callable[..., Harness], tmp_path: Path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    from botocore.exceptions import ClientError, EndpointConnectionError

    harness = run(total_rounds=2)
    flaky: list[Flaky] = []

    def inject(daemon: Daemon) -> None:
        # Given a participant whose S3 calls fail every 3rd time and state reads every 4th time
        s3 = Flaky(daemon.remote.client, {"put_object", "get_object", "head_object"}, 3,
                   lambda: EndpointConnectionError(endpoint_url="http://s3.invalid"))
        daemon.remote.client = daemon.remote.bucket.client = s3
        store = Flaky(daemon.remote.store, {"read_state", "update_record", "participant"}, 4,
                      lambda: ClientError({"Error": {"Code": "ThrottlingException", "Message": "slow down"}}, "Get"))
        daemon.remote.store = store  # type: ignore[assignment]
        daemon.remote.retry.first_delay, daemon.remote.retry.max_delay = 0.01, 0.05
        flaky.extend([s3, store])

    with caplog.at_level("WARNING", logger="participant"):
        alice = Participant(harness, "alice", tmp_path / "alice", prepare=inject)
        bob = Participant(harness, "bob", tmp_path / "bob")
        # Then the run still finishes, each fault logged and retried
        assert alice.wait().finished and bob.wait().finished
    assert all(f.failures > 0 for f in flaky)
    retried = [r for r in caplog.records if r.threadName in {"alice", "heartbeat"} and "retry" in r.getMessage()]
    assert len(retried) >= sum(f.failures for f in flaky) - 2  # (a heartbeat may be cut short at the end)
    assert harness.state().aggregated == 2
