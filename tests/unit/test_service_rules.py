"""The service's rules end to end, through intake and the tick, on the in-memory store and bucket (tests/fakes): no
AWS and no moto, at a fixed clock. What needs AWS's own semantics stays in tests/functional, on moto, and
tests/functional/test_fakes_contract.py holds the fakes to moto's answers."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from coordinator.intake import ObjectCreated
from coordinator.intake.common import Ingested
from coordinator.service import on_upload, run_tick
from coordinator.tick import TickResult
from shared import keys, wire
from shared.config import RunConfig
from shared.selection import assigned_count
from shared.signing import Signer
from shared.state import MemberStatus, Phase, RunState
from store.table import Conflict
from tests.fakes import fake_deps

RUN = "unit-run"
# In the past: intake's own wall-clock look at a heartbeat's sender (`_heartbeat_matters_now`) finds every record
# long silent, whatever the day the tests run.
NOW = 1_700_000_000.0
MODEL = {"dense.weight": np.full((4, 3), 0.5, np.float32), "dense.bias": np.zeros(4, np.float32)}


def plus(k: float) -> dict[str, np.ndarray]:
    return {name: (arr + k).astype(arr.dtype) for name, arr in MODEL.items()}


def signer(pid: str) -> Signer:
    """`pid`'s key, the same on every run."""
    return Signer(Ed25519PrivateKey.from_private_bytes(hashlib.sha256(pid.encode()).digest()))


class Run:
    """One run on the fakes. Participants' uploads are their own writes to the bucket (signed by their key, a second
    later each), each ingested as its S3 event would be and followed by a tick when the ingest handler would tick
    (`coordinator.service.on_upload`), all at the run's clock `now`."""

    def __init__(self, **overrides: Any) -> None:
        settings: dict[str, Any] = dict(
            run_id=RUN, min_clients=2, min_per_round=2, min_updates=1, total_rounds=3, warmup_time=0,
            max_round_train_time=60, round_witness_time=0, cooldown_time=0, liveness_timeout=600, dataset_size=100,
            max_update_bytes=4096,
            # no built-in task's (whose initial model's schema the config would take, `shared.initial_models`):
            # the participants here offer and train MODEL
            task="tests.unit.test_service_rules:MODEL",
        )
        self.config = RunConfig(**(settings | overrides))
        self.now = NOW
        self.deps = fake_deps(self.config, now=NOW)
        self.store, self.bucket = self.deps.store, self.deps.bucket
        self.ticked: TickResult | None = None  # the tick that followed the last upload, if one did

    def at(self, now: float) -> None:
        self.now = now
        self.bucket.now = now  # type: ignore[attr-defined]

    def state(self) -> RunState:
        return self.store.read_state()

    def tick(self) -> TickResult:
        return run_tick(self.deps, self.now)

    # --- uploads -----------------------------------------------------------------------------------------------

    def put(self, key: str, body: bytes, signed_by: str | None = "owner") -> ObjectCreated:
        """Upload an object as a participant does (signed by its key's participant, by `signed_by`, or unsigned),
        a second after the last; the event S3 would emit for it."""
        self.at(self.now + 1)
        owner = key.rsplit("/", 1)[-1]
        metadata = {} if signed_by is None else signer(owner if signed_by == "owner" else signed_by).metadata(key, body)
        resp = self.bucket.client.put_object(Bucket=self.bucket.name, Key=key, Body=body, Metadata=metadata)
        return ObjectCreated(self.bucket.name, key, len(body), resp["ETag"].strip('"'), resp["VersionId"], self.now)

    def deliver(self, obj: ObjectCreated) -> Ingested:
        """What the ingest function does with the object's event: one service call."""
        handled = on_upload(self.deps, obj, now=self.now)
        assert handled.ingested is not None and not handled.deferred
        self.ticked = handled.tick
        return handled.ingested

    def send(self, key: str, body: bytes, signed_by: str | None = "owner") -> Ingested:
        return self.deliver(self.put(key, body, signed_by))

    def join(self, pid: str, run_id: str = RUN) -> Ingested:
        body = {"run_id": run_id, "participant": pid, "info": {"host": "test"},
                "public_key": signer(pid).public_key, "sent_at": self.now + 1}
        return self.send(keys.join_key(RUN, pid), json.dumps(body).encode())

    def heartbeat(self, pid: str) -> Ingested:
        body = {"participant": pid, "sent_at": self.now + 1}
        return self.send(keys.heartbeat_key(RUN, pid), json.dumps(body).encode())

    def offer(self, pid: str) -> Ingested:
        return self.send(keys.init_key(RUN, pid), wire.encode(MODEL))

    def update_bytes(self, pid: str, arrays: dict[str, np.ndarray], round_no: int | None = None,
                     samples: int | None = None, **metadata: str) -> bytes:
        s = self.state()
        rnd = s.round if round_no is None else round_no
        if samples is None:
            samples = assigned_count(self.config.dataset_size, s.plan or s.selected, pid)
        meta = wire.UpdateMeta(RUN, rnd, pid, samples, {"loss": 1.0})
        return wire.encode(arrays, {**meta.to_metadata(), **metadata})

    def upload(self, pid: str, arrays: dict[str, np.ndarray], round_no: int | None = None, **kw: Any) -> Ingested:
        rnd = self.state().round if round_no is None else round_no
        return self.send(keys.update_key(RUN, rnd, pid), self.update_bytes(pid, arrays, rnd, **kw))

    def start(self, pids: list[str]) -> RunState:
        """Everyone joins and heartbeats, the first offers the initial model: round 0 is then training."""
        self.tick()
        for pid in pids:
            self.join(pid)
            self.heartbeat(pid)
        self.offer(pids[0])
        return self.state()

    def reasons(self, round_no: int = 0) -> list[str]:
        """Every refusal recorded: of the round's updates, and of objects refused before taking a slot."""
        refused = [u.reason for u in self.store.updates(round_no).values() if not u.accepted]
        return refused + [r.reason for r in self.store.refusals()]


@pytest.fixture
def run() -> Run:
    return Run()


# --- admission ------------------------------------------------------------------------------------------------


def test_the_first_tick_creates_the_state_and_publishes_the_config(run: Run) -> None:
    result = run.tick()
    assert result.committed and result.state.version == 1 and result.state.phase is Phase.WAITING
    assert json.loads(run.bucket.get(keys.config_key(RUN)).data)["run_id"] == RUN
    assert not run.tick().committed  # nothing new: nothing written


def test_joins_are_admitted_and_an_epoch_starts_once_min_clients_are_proven(run: Run) -> None:
    run.tick()
    # Given two registered joiners, the first heard from since and offering the initial model
    for pid in ("alice", "bob"):
        assert run.join(pid).accepted
    assert run.heartbeat("alice").accepted
    assert run.offer("alice").accepted
    assert run.store.participant_count() == 2 and run.state().phase is Phase.WAITING  # bob is not proven yet
    assert not run.store.participants()["bob"].proven
    # When the second is heard from
    assert run.heartbeat("bob").accepted
    # Then its heartbeat's tick admits both and starts the first epoch from alice's model
    assert run.ticked is not None and run.ticked.fired[0] == "epoch_start"
    state = run.state()
    assert state.phase is Phase.TRAIN and state.epoch == 1 and state.round == 0
    assert set(state.members) == {"alice", "bob"} and set(state.selected) == {"alice", "bob"}
    assert state.model_source == "alice" and state.global_digest == wire.digest(wire.encode(MODEL))


def test_a_heartbeat_from_a_participant_that_never_joined_is_refused_with_its_reason(run: Run) -> None:
    run.tick()
    version = run.state().version
    result = run.heartbeat("mallory")
    assert not result.accepted and "never joined" in result.reason and run.ticked is None
    (refusal,) = run.store.refusals()
    assert refusal.pid == "mallory" and refusal.key == keys.heartbeat_key(RUN, "mallory")
    assert "never joined" in refusal.reason
    assert "mallory" not in run.store.participants() and run.state().version == version


def test_a_join_for_another_run_is_refused(run: Run) -> None:
    run.tick()
    result = run.join("mallory", run_id="other-run")
    assert not result.accepted and "other-run" in result.reason
    assert "mallory" not in run.store.participants()


def test_a_join_delivered_twice_is_a_rejoin_not_a_new_member(run: Run) -> None:
    run.tick()
    body = json.dumps({"run_id": RUN, "participant": "alice", "info": {}, "public_key": signer("alice").public_key,
                       "sent_at": run.now + 1}).encode()
    event = run.put(keys.join_key(RUN, "alice"), body)
    assert run.deliver(event).reason == "" and run.deliver(event).reason == "rejoined"
    assert list(run.store.participants()) == ["alice"] and run.store.participant_count() == 1


# --- updates --------------------------------------------------------------------------------------------------


def test_an_update_is_accepted_and_counted_and_the_last_closes_the_round() -> None:
    # Given a round of two in training, combined by FedAvg (whose weighting by sample count is checked here)
    run = Run(strategy="fedavg")
    state = run.start(["alice", "bob"])
    assert state.phase is Phase.TRAIN and set(state.selected) == {"alice", "bob"}
    # When the first update lands, it is recorded, and no tick follows (it cannot close the round)
    first = run.upload("alice", plus(1.0), samples=30)
    assert first.accepted and not first.ticks and run.ticked is None
    recorded = run.store.updates(0)["alice"]
    assert recorded.accepted and recorded.samples == 30 and run.state().phase is Phase.TRAIN
    # When the last lands, its tick closes the round at once
    last = run.upload("bob", plus(3.0), samples=18)
    assert last.accepted and last.ticks
    assert run.ticked is not None and run.ticked.fired[:2] == ("round_closed", "aggregate_next_round")
    state = run.state()
    assert state.round == 1 and state.aggregated == 1
    # And the new global is committed under its digest: its bytes are FedAvg of the two, by their sample counts
    key = keys.global_key(RUN, 1, state.global_digest)
    assert f"/global/{state.global_digest}" in key
    data = run.bucket.get_verified(key, state.global_digest, 1 << 20)
    np.testing.assert_allclose(wire.decode(data)[0]["dense.bias"], np.full(4, (30 * 1.0 + 18 * 3.0) / 48))
    (summary,) = run.store.rounds()
    assert summary.counted == ("alice", "bob") and summary.samples == 48
    assert summary.global_digest == state.global_digest


def padded(run: Run, pid: str) -> bytes:
    return run.update_bytes(pid, plus(1.0), 0, 10, padding="x" * run.config.max_update_bytes)


def with_nan() -> dict[str, np.ndarray]:
    arrays = plus(1.0)
    arrays["dense.bias"][1] = np.nan
    return arrays


# name -> (how alice sends it, words its recorded reason holds)
BAD: dict[str, tuple[Any, str]] = {
    "malformed metadata": (lambda r: r.send(keys.update_key(RUN, 0, "alice"), wire.encode(
        plus(1.0), {"fed.schema": "1", "fed.run": RUN, "fed.round": "zero"})), "malformed metadata"),
    "over the size limit": (lambda r: r.send(keys.update_key(RUN, 0, "alice"), padded(r, "alice")), "size limit"),
    "wrong round": (lambda r: r.upload("alice", plus(1.0), round_no=3), "wrong round"),
    "not a safetensors file": (lambda r: r.send(keys.update_key(RUN, 0, "alice"), b"\x80\x04K\x01." * 10),
                               "safetensors"),
    "wrong shape": (lambda r: r.upload("alice", {**plus(1.0), "dense.bias": np.zeros(5, np.float32)}),
                    "wrong shape"),
    "NaN": (lambda r: r.upload("alice", with_nan()), "non-finite"),
    "too many samples": (lambda r: r.upload("alice", plus(1.0), samples=10_000), "more than the"),
    "unsigned": (lambda r: r.send(keys.update_key(RUN, 0, "alice"), r.update_bytes("alice", plus(1.0)), None),
                 "unsigned"),
    "signed by another": (lambda r: r.send(keys.update_key(RUN, 0, "alice"), r.update_bytes("alice", plus(1.0)),
                                           "bob"), "signature"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_update_is_refused_with_its_reason_and_the_run_goes_on(run: Run, case: str) -> None:
    run.start(["alice", "bob"])
    send, words = BAD[case]
    result = send(run)
    assert not result.accepted and words in result.reason, result
    assert any(words in r for r in run.reasons()), run.reasons()
    assert run.state().phase is Phase.TRAIN and run.state().round == 0
    # The round goes on: with alice's real update if her slot is still free, else bob's alone at the deadline
    if "alice" not in run.store.updates(0):
        assert run.upload("alice", plus(1.0)).accepted
    assert run.upload("bob", plus(2.0)).accepted
    if run.state().round == 0:
        run.at(run.state().deadline + 1)
        run.tick()
    state = run.state()
    assert state.round == 1 and state.aggregated == 1


def test_a_duplicate_event_changes_nothing_and_a_second_update_is_refused(run: Run) -> None:
    run.start(["alice", "bob", "carol"])
    event = run.put(keys.update_key(RUN, 0, "alice"), run.update_bytes("alice", plus(1.0)))
    assert run.deliver(event).recorded
    version = run.state().version
    again = run.deliver(event)
    assert not again.recorded and again.accepted and run.state().version == version
    second = run.upload("alice", plus(9.0))
    assert not second.accepted and second.reason.startswith("duplicate")
    assert len(run.store.updates(0)) == 1 and run.store.updates(0)["alice"].accepted


def test_the_deadline_drops_the_silent_member_and_aggregates_the_rest() -> None:
    run = Run(liveness_timeout=3600)
    run.start(["alice", "bob", "carol"])
    run.upload("alice", plus(1.0))
    run.upload("bob", plus(2.0))
    run.at(run.state().deadline + 1)
    result = run.tick()
    assert result.fired[0] == "round_closed"
    state = run.state()
    assert state.members["carol"].status is MemberStatus.DROPPED and "deadline" in state.members["carol"].reason
    assert run.store.rounds()[0].counted == ("alice", "bob")


def test_the_committed_global_is_read_by_its_digest_whatever_was_written_over_it(run: Run) -> None:
    run.start(["alice", "bob"])
    run.upload("alice", plus(1.0))
    run.upload("bob", plus(1.0))
    state = run.state()
    key = keys.global_key(RUN, 1, state.global_digest)
    run.bucket.client.put_object(Bucket=run.bucket.name, Key=key, Body=wire.encode(plus(100.0)))  # written over it
    assert run.upload("alice", plus(2.0)).accepted  # checked against the committed model
    run.upload("bob", plus(2.0))
    assert run.state().round == 2
    np.testing.assert_allclose(wire.decode(run.bucket.get_verified(
        keys.global_key(RUN, 2, run.state().global_digest), run.state().global_digest, 1 << 20))[0]["dense.bias"], 2.0)


def test_an_update_that_cannot_be_read_back_is_left_out_and_the_round_goes_on() -> None:
    # Given a round of three in which alice's recorded update version is gone by the time the round closes
    run = Run(liveness_timeout=3600, min_clients=3, min_per_round=3)
    run.start(["alice", "bob", "carol"])
    run.upload("alice", plus(1.0), samples=10)
    run.upload("bob", plus(2.0), samples=10)
    recorded = run.store.update_record(0, "alice")
    assert recorded is not None and recorded.accepted
    run.bucket.client.delete_object(Bucket=run.bucket.name, Key=recorded.key, VersionId=recorded.version_id)
    # When the last update closes the round
    run.upload("carol", plus(4.0), samples=10)
    # Then it is aggregated from the two readable updates, and alice's is refused with its reason
    state = run.state()
    assert state.round == 1 and state.aggregated == 1
    (summary,) = run.store.rounds()
    assert summary.counted == ("bob", "carol") and "unreadable as recorded" in summary.refused["alice"]
    global_model = run.bucket.get_verified(keys.global_key(RUN, 1, state.global_digest), state.global_digest, 1 << 20)
    np.testing.assert_allclose(wire.decode(global_model)[0]["dense.bias"], 3.0)


# --- races ----------------------------------------------------------------------------------------------------


def before_the_next_commit(run: Run, monkeypatch: pytest.MonkeyPatch, rival: Callable[[], object]) -> list[Conflict]:
    """Run `rival` (once) just before the store's next commit, which then finds that the version it was decided on
    has moved, as when another writer wins the race; the Conflicts commits met, as they meet them."""
    commit, started, lost = run.store.commit, [], []

    def raced(state: RunState, expected_version: int, *rest: Any) -> int:
        if not started:
            started.append(True)
            rival()
        try:
            return commit(state, expected_version, *rest)
        except Conflict as exc:
            lost.append(exc)
            raise

    monkeypatch.setattr(run.store, "commit", raced)
    return lost


def test_a_commit_that_lost_its_race_is_read_again_and_retried(run: Run, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a round whose last update's tick is about to commit it closed, when another writer commits first
    run.start(["alice", "bob"])
    run.upload("alice", plus(1.0))
    before = run.state()
    lost = before_the_next_commit(run, monkeypatch, lambda: run.store.commit(before, before.version))
    run.upload("bob", plus(3.0))
    # Then the tick's commit met Conflict, it read the state again, decided again and committed: the round closed once
    assert len(lost) == 1
    assert run.ticked is not None and run.ticked.committed and run.ticked.attempts == 2
    state = run.state()
    assert state.round == 1 and state.aggregated == 1 and state.version == before.version + 2
    assert [s.counted for s in run.store.rounds()] == [("alice", "bob")]


def test_two_ticks_racing_exactly_one_closes_the_round(monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a round whose deadline has passed, and a second tick that decides as this one does and commits first
    run = Run(liveness_timeout=3600)
    run.start(["alice", "bob"])
    run.upload("alice", plus(1.0))
    run.at(run.state().deadline + 1)
    rival: list[TickResult] = []
    lost = before_the_next_commit(run, monkeypatch, lambda: rival.append(run.tick()))
    result = run.tick()
    # Then the rival closed the round; this tick lost its commit, read again and found nothing to do
    assert rival[0].committed and rival[0].fired[0] == "round_closed"
    assert len(lost) == 1 and not result.committed and result.attempts == 2
    assert run.state().aggregated == 1
    assert [(s.round, s.counted) for s in run.store.rounds()] == [(0, ("alice",))]
    assert "missed the deadline" in run.store.rounds()[0].dropped["bob"]


# --- no moto --------------------------------------------------------------------------------------------------


def test_these_tests_run_without_moto() -> None:
    """This file's tests, run alone in a fresh interpreter, never import moto (nor need AWS)."""
    root = Path(__file__).resolve().parents[2]
    script = ("import sys, pytest\n"
              f"rc = pytest.main(['-q', '-p', 'no:cacheprovider', '-k', 'not without_moto', {__file__!r}])\n"
              "moto = sorted(m for m in sys.modules if m == 'moto' or m.startswith('moto.'))\n"
              "print('moto modules:', moto)\n"
              "sys.exit(rc or (3 if moto else 0))\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "moto modules: []" in done.stdout
