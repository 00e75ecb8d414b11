"""A flood of uploads from one participant while a run of three honest ones trains: 5,000 objects within seconds.

The attack this guards against: every object a participant writes under its own keys (at any depth, and re-writes of
its own keys) is an ingest invocation that reads the object, records a refusal and may tick; one session could use up
the account's concurrency and the table, delaying honest uploads until members were dropped and rounds lost. Now each
participant has an upload budget (`upload_budget` objects a minute, `coordinator.intake.budget`): past it an object
costs one conditional write, is counted as dropped, and is neither read, recorded nor ticked on.

Three honest participants (`SimParticipant`, heartbeating every `heartbeat_interval`, "training" for a fixed time
each round) run five rounds. When round 1 starts, a registered participant that is no member ("flooder", joined
after the epoch started) writes 5,000 objects from eight threads: junk below rounds/ at depths of one to four
folders ending in its id, re-writes of its own update key, and bogus heartbeats, all signed with its key. The server
and the functions (the dispatcher) run in processes of their own, as in the join-flood test.

Asserted: every round is aggregated and counts all three honest participants, none of them is ever dropped (the
flood's events queue ahead of the honest ones: the run finishes before ingest has taken them all, the ticks catching
up with the members' news); of the flood's objects ingest took, at most `upload_budget` a minute were recorded and
the rest dropped and counted on one item. Printed: the round times, the flood's span, what
was recorded and dropped, and the wall time.
"""

from __future__ import annotations

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
from shared.config import UPLOAD_WINDOW_SECONDS, RunConfig
from shared.messages import Heartbeat, JoinRequest
from shared.signing import Signer
from shared.state import MemberStatus, Phase
from shared.table_keys import UPLOAD_COUNT_PREFIX
from store.connection import Connection
from store.table import StateStore
from tests.e2e.load_support import SimParticipant, StackProcess, honest_fleet, stack_process

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(420)]

HONEST = [f"honest{i}" for i in range(3)]
FLOODER = "flooder"
OBJECTS = 5000
BUDGET = 100  # upload_budget: an honest participant here sends about 35 objects a minute (heartbeats every 3 s)
FLOOD_ROUND = 1
TRAIN_SECONDS = 3.0
RUN_TIMEOUT = 300.0


def flood_config() -> RunConfig:
    return RunConfig(
        run_id="upflood", min_clients=len(HONEST), fraction_per_round=1.0, min_per_round=len(HONEST),
        min_updates=len(HONEST), total_rounds=5, warmup_time=10, max_round_train_time=60, round_witness_time=0,
        cooldown_time=0, liveness_timeout=30, heartbeat_interval=3, dataset_size=1000, upload_budget=BUDGET,
        task="tests.e2e.load_support:tiny_model",  # what SimParticipant offers and trains (no built-in task's model)
    )


@pytest.fixture()
def stack(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[StackProcess]:
    with stack_process(flood_config(), tmp_path / "stack.log", monkeypatch) as server:
        yield server


class Flooder:
    """One registered participant writing as many objects as it can under its own keys, signed with its key."""

    def __init__(self, conn: Connection, threads: int = 8) -> None:
        self.conn, self.threads, self.run = conn, threads, conn.run_id
        self.s3 = boto3.client("s3", endpoint_url=conn.endpoint, region_name=conn.region,
                               config=Config(max_pool_connections=threads * 2, retries={"max_attempts": 8}))
        self.signer = Signer.generate()
        self.span = (0.0, 0.0)
        self.errors: list[BaseException] = []

    def put(self, key: str, body: bytes) -> None:
        try:
            self.s3.put_object(Bucket=self.conn.bucket, Key=key, Body=body, Metadata=self.signer.metadata(key, body))
        except BaseException as exc:  # reported by the test
            self.errors.append(exc)

    def join(self) -> None:
        request = JoinRequest(run_id=self.run, participant=FLOODER, public_key=self.signer.public_key,
                              sent_at=time.time(), info={"host": "flood"})
        self.put(keys.join_key(self.run, FLOODER), request.model_dump_json().encode())

    def _object(self, i: int, round_no: int) -> None:
        kind = i % 3
        if kind == 0:  # junk at depth, under rounds/ and ending in its id (the role grants rounds/*/<own id>)
            key = keys.run_prefix(self.run) + f"rounds/{round_no:06d}/{'deep/' * (i % 4)}{i}/{FLOODER}"
            self.put(key, b"junk %d" % i)
        elif kind == 1:  # its own update key, written again and again
            self.put(keys.update_key(self.run, round_no, FLOODER), b"not a model %d" % i)
        else:  # heartbeats, bogus and well-formed
            beat = Heartbeat(participant=FLOODER, sent_at=time.time()).model_dump_json().encode()
            self.put(keys.heartbeat_key(self.run, FLOODER), beat if i % 2 else b"{bogus")

    def flood(self, n: int, round_no: int) -> None:
        began = time.time()
        with ThreadPoolExecutor(self.threads) as pool:
            list(pool.map(lambda i: self._object(i, round_no), range(n)))
        self.span = (began, time.time())


def flooder_counts(store: StateStore) -> tuple[dict[int, int], int]:
    """The flooder's uploads counted within its budget, by window, and those dropped."""
    u = store.m.upload_count
    counted = {int(i.sk.split("#")[1]): int(i.n) for i in u.query(store.pk, u.sk.startswith(UPLOAD_COUNT_PREFIX))
               if i.sk.endswith(f"#{FLOODER}")}
    dropped = store.dropped_uploads().get(FLOODER)
    return counted, dropped.dropped if dropped else 0


def diagnose(store: StateStore, sims: list[SimParticipant]) -> str:
    s = store.read_state()
    return (f"phase {s.phase}, epoch {s.epoch}, round {s.round}, members {sorted(s.members)}; flooder "
            f"{flooder_counts(store)}; errors {[repr(x.error) for x in sims if x.error]}")


def test_a_flood_of_uploads_from_one_participant_is_dropped_and_counted_and_the_run_goes_on(
    stack: StackProcess, tmp_path: Path
) -> None:
    config = flood_config()
    conn = stack.connection
    store = store_for(conn)
    _, honest, dispatcher = honest_fleet(stack, config, HONEST, TRAIN_SECONDS, RUN_TIMEOUT,
                                   tmp_path / "dispatcher.log")
    flooder = Flooder(conn)
    began, began_at = time.monotonic(), time.time()
    try:
        # Given three honest participants training
        threads = [threading.Thread(target=s.run, args=(i * 0.2,), name=s.pid, daemon=True)
                   for i, s in enumerate(honest)]
        for t in threads:
            t.start()

        # When, as round 1 starts, a registered participant (no member) writes 5,000 objects under its own keys
        def round_started(r: int) -> bool:
            s = store.read_state()
            return (s.phase is Phase.TRAIN and s.round >= r) or s.round > r or s.phase is Phase.FINISHED
        assert wait_until(lambda: round_started(FLOOD_ROUND), 120, 0.1), diagnose(store, honest)
        flooder.join()
        assert wait_until(lambda: FLOODER in store.participants(), 30, 0.2), diagnose(store, honest)
        flooder.flood(OBJECTS, FLOOD_ROUND)

        # Then the honest participants finish the run
        for t in threads:
            t.join(max(1.0, began + RUN_TIMEOUT + 30 - time.monotonic()))
        ended_at = time.time()
    finally:
        stats = dispatcher.stop()
    wall = time.monotonic() - began

    state = store.read_state()
    rounds = sorted(store.rounds(), key=lambda r: r.round)
    counted, dropped = flooder_counts(store)
    recorded = ([r for r in store.refusals() if keys.uploader(conn.run_id, r.key) == FLOODER]
                + [u for u in store.all_updates() if u.pid == FLOODER])
    windows = range(int(flooder.span[0] // UPLOAD_WINDOW_SECONDS) - 1, int(time.time() // UPLOAD_WINDOW_SECONDS) + 1)
    ingested = sum(counted.values()) + dropped
    print(f"\nupload flood: {OBJECTS} objects uploaded {flooder.span[0] - began_at:.1f}-"
          f"{flooder.span[1] - began_at:.1f}s; when the run finished ({ended_at - began_at:.1f}s) ingest had taken "
          f"{ingested} of them (the rest were still queued): counted within the budget by window {counted}, dropped "
          f"{dropped}, recorded {len(recorded)}; wall time {wall:.0f}s")
    print("rounds (start-end): " + ", ".join(
        f"{r.round}: {r.started - began_at:.1f}-{r.ended - began_at:.1f}s ({r.seconds:.1f}s)" for r in rounds))
    print(f"dispatcher: {stats}")

    errors = [f"{s.pid}: {type(s.error).__name__}: {s.error}" for s in honest if s.error is not None]
    assert not errors and not flooder.errors, (errors, flooder.errors[:3])
    assert flooder.span[1] <= rounds[-1].ended, "the flood must go in while the rounds run"
    # Then every round was aggregated with all three honest participants, and none of them was ever dropped
    assert [r.round for r in rounds] == list(range(config.total_rounds)), "a round was lost"
    for r in rounds:
        assert r.aggregated and set(HONEST) <= set(r.counted), (r.round, r.counted)
        assert not set(r.dropped) & set(HONEST), (r.round, r.dropped)
    assert state.phase is Phase.FINISHED and state.aggregated == config.total_rounds
    assert all(state.members[p].status is MemberStatus.ACTIVE for p in HONEST)
    # And of the flood, at most upload_budget objects a minute were counted within the budget (and so at most that
    # many recorded); every other one ingest took was dropped and counted on the flooder's one dropped item
    assert set(counted) <= set(windows) and all(n <= BUDGET for n in counted.values()), (counted, windows)
    assert sum(counted.values()) <= BUDGET * len(counted) < ingested <= OBJECTS + 1
    assert dropped == ingested - sum(counted.values()) > 0
    assert len(recorded) <= sum(counted.values())
