"""`fed verify`'s core: every global model recomputed from the bucket matches its recorded digest."""

from __future__ import annotations

import numpy as np
import pytest

from coordinator.verify import verify_run
from shared import keys, wire
from shared.config import Strategy
from tests.functional.conftest import MODEL, Harness


def model(k: float) -> dict[str, np.ndarray]:
    return {name: (arr + k).astype(arr.dtype) for name, arr in MODEL.items()}


def test_verify_matches_then_finds_a_tampered_global(harness: Harness) -> None:
    harness.start(["alice", "bob"])
    for r in range(2):
        harness.upload("alice", model(1 + r), samples=7)
        harness.upload("bob", model(5 + r), samples=3)
    checks = verify_run(harness.deps)
    assert [c.round for c in checks] == [0, 1] and all(c.ok for c in checks), checks
    # When someone overwrites a global model in the bucket
    harness.s3.put_object(Bucket=harness.res.bucket, Key=harness.global_key(2),
                          Body=wire.encode(model(0)))
    checks = verify_run(harness.deps)
    assert checks[0].ok and not checks[1].ok
    assert checks[1].stored != checks[1].expected == checks[1].recomputed


def test_an_update_overwritten_after_acceptance_cannot_change_the_recomputation(harness: Harness) -> None:
    harness.start(["alice", "bob"])
    harness.upload("alice", model(1))
    harness.upload("bob", model(2))
    # the bucket is versioned: verification reads the accepted version, not the newest object
    harness.s3.put_object(Bucket=harness.res.bucket, Key=keys.update_key(harness.config.run_id, 0, "alice"),
                          Body=wire.encode(model(50)))
    assert all(c.ok for c in verify_run(harness.deps))


@pytest.mark.parametrize("strategy", list(Strategy))
def test_every_strategy_passes_verify_through_the_handlers(harness_factory, strategy: Strategy) -> None:  # type: ignore[no-untyped-def]
    # Given a run of three rounds with the strategy, three participants, updates around the global model
    h: Harness = harness_factory(strategy=strategy, min_clients=3, min_per_round=3, total_rounds=3,
                                 norm_outlier_factor=0)
    h.start(["alice", "bob", "carol"])
    rng = np.random.default_rng(0)
    # When every round's updates arrive through the ingest handler (which ticks the rounds closed)
    for round_no in range(3):
        base = h.global_model(round_no)
        for pid in ("alice", "bob", "carol"):
            update = {k: (v + rng.normal(0, 0.1, v.shape)).astype(np.float32) for k, v in base.items()}
            assert h.upload(pid, update, samples=10)["accepted"]
    # Then every round was aggregated and anyone recomputes each global from the bucket
    assert h.state().aggregated == 3
    checks = verify_run(h.deps)
    assert [(c.round, c.ok) for c in checks] == [(0, True), (1, True), (2, True)], checks


def test_a_krum_run_leaves_the_far_off_update_out_and_passes_verify(harness_factory) -> None:  # type: ignore[no-untyped-def]
    # Given a Krum run of five participants, one Byzantine at most (f = 1: rounds of 2f + 3 = 5 updates), one far off
    pids = ["alice", "bob", "carol", "dave", "mallory"]
    h: Harness = harness_factory(strategy=Strategy("krum"), krum_byzantine=1, min_clients=5, min_per_round=5,
                                 min_updates=5, total_rounds=2, norm_outlier_factor=0)
    h.start(pids)
    rng = np.random.default_rng(1)
    for round_no in range(2):
        base = h.global_model(round_no)
        sent = {pid: {k: (v + rng.normal(0, 0.1, v.shape) + (40.0 if pid == "mallory" else 0.0)).astype(np.float32)
                      for k, v in base.items()} for pid in pids}
        for pid, update in sent.items():
            assert h.upload(pid, update, samples=10)["accepted"]
        # Then the round's global is the mean of the four honest updates (m = n - f = 4), mallory's left out
        honest = [sent[p] for p in pids if p != "mallory"]
        out = h.global_model(round_no + 1)
        for k in out:
            np.testing.assert_allclose(out[k], np.mean([u[k] for u in honest], axis=0), rtol=1e-6, atol=1e-6)
    # And anyone recomputes each round's selection and global from the bucket
    checks = verify_run(h.deps)
    assert [(c.round, c.ok) for c in checks] == [(0, True), (1, True)], checks
