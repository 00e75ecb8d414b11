"""Two ticks racing over a round that closes at its deadline while a late update is being recorded.

Tick A loads its snapshot before the late update is recorded, tick B after; both close the round and
write the next round's global model to the same key before committing. B commits first; A's write lands
after B's commit and replaces the committed model with A's (a different set of updates, or the carried
model), then A loses its commit. The run then points to a digest the bucket no longer holds: invariant 2
breaks, `fed verify` reports it, and participants cannot fetch the model (its digest never matches).
Global models are now content-addressed (`shared.keys.global_key`), so A's write can only add an orphan.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

import coordinator.tick as coordinator
from coordinator.aggregation import UNLEASED_INPUTS
from coordinator.service import run_tick
from coordinator.tick import TickResult
from coordinator.verify import verify_run
from shared import keys
from shared.wire import digest
from tests.functional.conftest import MODEL


def scaled(x: float) -> dict[str, np.ndarray]:
    return {k: (v * 0 + x).astype(np.float32) for k, v in MODEL.items()}


def race(harness: Any, late: str) -> TickResult:
    """Tick A (deadline passed) holds before writing; `late`'s update is ingested (tick B closes the round
    with it and commits); then A writes and commits. Returns A's result."""
    deps = harness.deps
    after_deadline = harness.state().deadline + 1
    a_waiting, b_done = threading.Event(), threading.Event()
    original = coordinator.carry_out_before_commit
    a_thread: list[threading.Thread] = []
    results: list[TickResult] = []

    def held(deps: Any, decision: Any, **lease: Any) -> Any:
        if threading.current_thread() is a_thread[0] and not b_done.is_set():
            a_waiting.set()
            assert b_done.wait(20)
        return original(deps, decision, **lease)

    coordinator.carry_out_before_commit = held
    try:
        a = threading.Thread(target=lambda: results.append(run_tick(deps, after_deadline)))
        a_thread.append(a)
        a.start()
        assert a_waiting.wait(20)
        harness.upload(late, scaled(3))  # ingest records it, and its own tick (B) closes the round and commits
        b_done.set()
        a.join(30)
    finally:
        coordinator.carry_out_before_commit = original
    return results[0]


def test_the_committed_global_survives_a_racing_tick_with_an_older_snapshot(harness_factory) -> None:  # type: ignore[no-untyped-def]
    # Given a round of three whose deadline passed with two updates in
    harness = harness_factory(liveness_timeout=3600, min_clients=3, min_per_round=3)
    harness.start(["alice", "bob", "carol"])
    harness.upload("alice", scaled(1))
    harness.upload("bob", scaled(2))

    # When a tick that saw two updates races the tick of carol's late update
    race(harness, "carol")

    # Then the bucket still holds the global model the run committed
    state = harness.state()
    key = keys.global_key(harness.config.run_id, 1, state.global_digest)
    stored = harness.s3.get_object(Bucket=harness.res.bucket, Key=key)
    assert digest(stored["Body"].read()) == state.global_digest
    assert all(check.ok for check in verify_run(harness.deps))


def test_the_committed_global_survives_a_racing_tick_that_carries_the_model_over(harness_factory) -> None:  # type: ignore[no-untyped-def]
    # Given a round that needs three updates, whose deadline passed with two in
    harness = harness_factory(liveness_timeout=3600, min_clients=3, min_per_round=3, min_updates=3)
    harness.start(["alice", "bob", "carol"])
    harness.upload("alice", scaled(1))
    harness.upload("bob", scaled(2))

    # When a tick that saw two (and so carries the model over) races the tick that aggregates all three
    race(harness, "carol")

    # Then the bucket still holds the global model the run committed
    state = harness.state()
    key = keys.global_key(harness.config.run_id, 1, state.global_digest)
    stored = harness.s3.get_object(Bucket=harness.res.bucket, Key=key)
    assert state.aggregated == 1
    assert digest(stored["Body"].read()) == state.global_digest


def test_an_update_that_cannot_be_read_back_is_left_out_and_the_round_goes_on(harness_factory) -> None:  # type: ignore[no-untyped-def]
    # Given a round of three in which alice's recorded update version is gone from the bucket by the time
    # the round closes (a crafted key, a lifecycle rule, an operator's mistake: every read of it fails)
    harness = harness_factory(liveness_timeout=3600, min_clients=3, min_per_round=3)
    harness.start(["alice", "bob", "carol"])
    harness.upload("alice", scaled(1), samples=10)
    harness.upload("bob", scaled(2), samples=10)
    recorded = harness.deps.store.update_record(0, "alice")
    assert recorded is not None and recorded.accepted
    harness.s3.delete_object(Bucket=harness.res.bucket, Key=keys.update_key(harness.config.run_id, 0, "alice"),
                             VersionId=recorded.version_id)
    # When the last update closes the round
    harness.upload("carol", scaled(4), samples=10)
    # Then the round is aggregated from the two readable updates, and alice's is refused with its reason
    state = harness.state()
    assert state.round == 1 and state.aggregated == 1
    (summary,) = harness.deps.store.rounds()
    assert summary.counted == ("bob", "carol")
    assert "unreadable as recorded" in summary.refused["alice"] and "not in the bucket" in summary.refused["alice"]
    np.testing.assert_allclose(harness.global_model(1)["dense.bias"], 3.0)
    # And the run is not wedged: anyone can still recompute the new global model from the bucket
    assert all(check.ok for check in verify_run(harness.deps))


def test_a_tick_that_decided_before_the_round_was_committed_does_not_aggregate_it_again(harness_factory) -> None:  # type: ignore[no-untyped-def]
    # Given a round of enough updates to be aggregated under its lease, whose deadline passed with all but one in
    pids = [f"p{i:02d}" for i in range(UNLEASED_INPUTS + 2)]  # (the racing tick sees more than UNLEASED_INPUTS)
    harness = harness_factory(liveness_timeout=3600, min_clients=len(pids), min_per_round=len(pids),
                              fraction_per_round=1.0)
    harness.start(pids)
    for i, pid in enumerate(pids[:-1]):
        harness.upload(pid, scaled(i))

    # When a tick that saw them (and would close the round at its deadline) waits while the last update's tick
    # aggregates the round and commits, and only then claims the round (the lease is free again)
    late = race(harness, pids[-1])

    # Then it finds the round committed and leaves it alone: one global model written, not two
    assert not late.committed and any("committed by another invocation" in n for n in late.notes), late
    state = harness.state()
    assert state.round == 1 and state.aggregated == 1
    listed = harness.s3.list_objects_v2(Bucket=harness.res.bucket,
                                        Prefix=keys.global_prefix(harness.config.run_id, 1))["Contents"]
    assert [o["Key"] for o in listed] == [keys.global_key(harness.config.run_id, 1, state.global_digest)]
