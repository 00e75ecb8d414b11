"""A flood of join requests while a round runs: 300 distinct signed identities join within seconds.

The attack this guards against: hundreds of identities joining at once delayed heartbeat processing until
honest members were dropped as silent, a round was lost, and the next epoch admitted hundreds of the flood's
identities. Now join requests go down their own lane (their own rule and queue, one dispatcher worker
locally, a bounded concurrency on AWS) and an epoch admits at most `max_admissions_per_epoch` new
participants, each only once heard from after its join.

Five honest participants (`SimParticipant`: the daemon's protocol without torch, heartbeating every
`heartbeat_interval` as the daemon does, "training" for a fixed time each round) run two epochs. Rounds 0 and
1 run undisturbed; when round 2 starts, 300 identities send a join request each within seconds
(`shared.messages.JoinRequest`, signed with its own `shared.signing.Signer`). Once the first epoch's rounds
are over, each flood identity also sends a signed heartbeat: the most it can do to be admitted to the next
epoch. (A burst of 300 heartbeats goes down the main lane, the lane of updates: sent during a round, it delays
that round on this stack, whose moto server and functions share two cores; on AWS each is an invocation of
its own. It is sent after the rounds here so that the round times measure the join flood.) The server and the
functions (the dispatcher) run in processes of their own, as in the load test.

Asserted: rounds 2 and 3 (during the join flood) take at most twice as long as rounds 0 and 1; no round is
lost, no honest member is dropped and every round counts all five; the next epoch admits exactly
`max_admissions_per_epoch` flood identities although more had proved liveness by then, the earliest joined.
Printed: the round times, the join lane's progress and the admissions.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import boto3
import pytest
from botocore.config import Config

from fed.localrun import store_for, wait_until
from shared import keys
from shared.config import RunConfig
from shared.messages import Heartbeat, JoinRequest
from shared.signing import Signer
from shared.state import MemberStatus, Phase
from store.connection import Connection
from store.table import StateStore
from tests.e2e.load_support import SimParticipant, StackProcess, honest_fleet, stack_process

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(420)]

HONEST = [f"honest{i}" for i in range(5)]
FLOOD = 300
ADMISSIONS = 20  # max_admissions_per_epoch
FLOOD_ROUND = 2  # the flood starts when this round starts
TRAIN_SECONDS = 3.0
RUN_TIMEOUT = 240.0


def flood_config() -> RunConfig:
    """Two epochs: rounds 0-3, a cooldown (the join lane registers more of the flood meanwhile), round 4. Members
    heartbeat every 3 s and are dropped after 30 s of silence: the attack delayed heartbeats longer than that.
    Every member is selected each round; flood identities admitted to the second epoch never upload, so round 4
    closes at its deadline, dropping them."""
    return RunConfig(
        run_id="flood", min_clients=len(HONEST), fraction_per_round=1.0, min_per_round=len(HONEST),
        min_updates=len(HONEST), total_rounds=5, rounds_per_epoch=4, warmup_time=10, max_round_train_time=15,
        round_witness_time=0, cooldown_time=15, liveness_timeout=30, heartbeat_interval=3, dataset_size=1000,
        max_participants=2 * FLOOD, max_admissions_per_epoch=ADMISSIONS,
        task="tests.e2e.load_support:tiny_model",  # what SimParticipant offers and trains (no built-in task's)
    )


@pytest.fixture()
def stack(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[StackProcess]:
    with stack_process(flood_config(), tmp_path / "stack.log", monkeypatch) as server:
        yield server


class Flood:
    """Identities with a signing key each: a burst of signed join requests, later a burst of signed heartbeats."""

    def __init__(self, conn: Connection, n: int, threads: int = 8) -> None:
        self.conn, self.threads = conn, threads
        self.s3 = boto3.client("s3", endpoint_url=conn.endpoint, region_name=conn.region,
                               config=Config(max_pool_connections=threads * 2, retries={"max_attempts": 8}))
        self.signers = {f"flood{i:03d}": Signer.generate() for i in range(n)}
        self.spans: dict[str, tuple[float, float]] = {}  # "joins" / "heartbeats" -> (first, last upload)
        self.errors: list[BaseException] = []

    def _put(self, pid: str, key: str, body: bytes) -> None:
        try:
            self.s3.put_object(Bucket=self.conn.bucket, Key=key, Body=body,
                               Metadata=self.signers[pid].metadata(key, body))
        except BaseException as exc:  # reported by the test
            self.errors.append(exc)

    def _join(self, pid: str) -> None:
        request = JoinRequest(run_id=self.conn.run_id, participant=pid, public_key=self.signers[pid].public_key,
                              sent_at=time.time(), info={"host": "flood"})
        self._put(pid, keys.join_key(self.conn.run_id, pid), request.model_dump_json().encode())

    def _beat(self, pid: str) -> None:
        beat = Heartbeat(participant=pid, sent_at=time.time())
        self._put(pid, keys.heartbeat_key(self.conn.run_id, pid), beat.model_dump_json().encode())

    def burst(self, what: str) -> None:
        """Every identity sends its join request ("joins") or a heartbeat ("heartbeats"), from a few threads."""
        began = time.time()
        with ThreadPoolExecutor(self.threads) as pool:
            list(pool.map(self._join if what == "joins" else self._beat, self.signers))
        self.spans[what] = (began, time.time())


def diagnose(store: StateStore, sims: list[SimParticipant]) -> str:
    s = store.read_state()
    seen = {p: (round(v.last_seen, 1), v.proven) for p, v in store.participants().items() if not p.startswith("flood")}
    return (f"phase {s.phase}, epoch {s.epoch}, round {s.round}, members {sorted(s.members)}; honest records "
            f"{seen}; errors {[repr(x.error) for x in sims if x.error]}; sent {[dict(x.actions) for x in sims]}")


def test_a_flood_of_signed_joins_neither_slows_rounds_nor_drops_members_nor_buys_admission(
    stack: StackProcess, tmp_path: Path
) -> None:
    config = flood_config()
    conn = stack.connection
    store = store_for(conn)
    counter, honest, dispatcher = honest_fleet(stack, config, HONEST, TRAIN_SECONDS, RUN_TIMEOUT,
                                               tmp_path / "dispatcher.log")
    flood = Flood(conn, FLOOD)  # (the keys are made before the clock starts)
    progress: dict[str, object] = {}
    began, began_at = time.monotonic(), time.time()
    try:
        # Given five honest participants training the first epoch
        threads = [threading.Thread(target=s.run, args=(i * 0.2,), name=s.pid, daemon=True)
                   for i, s in enumerate(honest)]
        for t in threads:
            t.start()

        # When 300 identities send signed join requests within seconds, as round 2 starts
        def round_started(r: int) -> bool:
            s = store.read_state()
            return (s.phase is Phase.TRAIN and s.round >= r) or s.round > r or s.phase is Phase.FINISHED
        assert wait_until(lambda: round_started(FLOOD_ROUND), 120, 0.1), diagnose(store, honest)
        flood.burst("joins")

        # and, once the first epoch's rounds are over, each of them a signed heartbeat: the most they can do to be
        # admitted to the next epoch (heard from since joining)
        def first_epoch_over() -> bool:
            s = store.read_state()
            return s.phase is Phase.COOLDOWN or s.epoch >= 2
        assert wait_until(first_epoch_over, 150, 0.1), diagnose(store, honest)
        progress["flood registered when the first epoch's rounds ended"] = sum(
            1 for p in store.participants() if p.startswith("flood"))
        flood.burst("heartbeats")

        # (the second epoch starts once the cooldown is over)
        assert wait_until(lambda: store.read_state().epoch >= 2, 150, 0.2), diagnose(store, honest)
        second = store.read_state()
        participants = store.participants()
        progress["flood registered at the second epoch"] = sum(1 for p in participants if p.startswith("flood"))
        proven = sorted((v.joined_at, p) for p, v in participants.items()  # as the epoch started
                        if p.startswith("flood") and v.proven and v.heard_at <= second.epoch_started)
        progress["flood heard from since joining by then"] = len(proven)

        # And the honest participants finish the run (round 4 closes at its deadline, without the flood's updates)
        for t in threads:
            t.join(max(1.0, began + RUN_TIMEOUT + 30 - time.monotonic()))
    finally:
        stats = dispatcher.stop()
    wall = time.monotonic() - began

    state = store.read_state()
    rounds = sorted(store.rounds(), key=lambda r: r.round)
    seconds = {r.round: r.seconds for r in rounds}
    before = [seconds[r] for r in range(FLOOD_ROUND)]
    during = [seconds[r] for r in range(FLOOD_ROUND, config.rounds_per_epoch)]
    admitted_flood = sorted(p for p in second.members if p.startswith("flood"))
    joins, beats = (tuple(round(t - began_at, 1) for t in flood.spans[k]) for k in ("joins", "heartbeats"))
    print(f"\njoin flood: {FLOOD} signed join requests uploaded {joins[0]}-{joins[1]}s, heartbeats {beats[0]}-"
          f"{beats[1]}s; rounds (start-end): " + ", ".join(
              f"{r.round}: {r.started - began_at:.1f}-{r.ended - began_at:.1f}s" for r in rounds)
          + f"; wall time {wall:.0f}s")
    print("round times (s): " + ", ".join(f"{r}: {s:.2f}" for r, s in seconds.items())
          + f"; before the flood mean {statistics.mean(before):.2f}, during max {max(during):.2f}")
    print(f"second epoch: {len(second.members)} members, {len(admitted_flood)} of them flood identities "
          f"(max_admissions_per_epoch {ADMISSIONS}); {progress}")
    print(f"dispatcher: {stats}")
    for r in rounds:
        ups = sorted(round(u.received_at - r.started, 1) for u in store.all_updates() if u.round == r.round)
        refused = sorted({u.reason for u in store.all_updates() if u.round == r.round and not u.accepted})
        print(f"  round {r.round} (epoch {r.epoch}): {len(r.counted)} counted, uploads arrived at {ups} s, "
              f"dropped {sorted(r.dropped)}" + (f", refused: {refused}" if refused else ""))

    # Then the flood went in while rounds 2 and 3 ran
    errors = [f"{s.pid}: {type(s.error).__name__}: {s.error}" for s in honest if s.error is not None]
    assert not errors and not flood.errors, (errors, flood.errors[:3])
    assert flood.spans["joins"][1] <= rounds[FLOOD_ROUND].ended, "the flood must go in while round 2 runs"
    assert progress["flood registered when the first epoch's rounds ended"] < FLOOD, "the join lane had a backlog"
    # And those rounds took at most twice as long as the ones before
    assert max(during) <= 2 * statistics.mean(before), (before, during)
    # And no honest member was dropped, and every round counted all five
    assert [r.round for r in rounds] == list(range(config.total_rounds)), "a round was lost"
    for r in rounds:
        assert not set(r.dropped) & set(HONEST), (r.round, r.dropped)
        assert set(HONEST) <= set(r.counted), (r.round, r.counted)
        assert r.aggregated
    assert all(state.members[p].status is MemberStatus.ACTIVE for p in HONEST)
    # And the second epoch admitted every honest member and exactly max_admissions_per_epoch flood identities,
    # although more had proved liveness by then: the earliest joined
    assert set(HONEST) <= set(second.members)
    assert len(proven) > ADMISSIONS, progress
    assert len(admitted_flood) == ADMISSIONS and set(admitted_flood) <= {p for _, p in proven}
    joined = dict((p, t) for t, p in proven)
    left_out = [joined[p] for p in joined if p not in admitted_flood]
    assert max(joined[p] for p in admitted_flood) <= min(left_out), "not the earliest joined"
    # And the run finished, the admitted flood identities dropped for never uploading
    assert state.phase is Phase.FINISHED and state.aggregated == config.total_rounds
    assert all(state.members[p].status is MemberStatus.DROPPED for p in admitted_flood)
    assert stats.get("joins_delivered", 0) >= FLOOD * 0.5
