"""Server optimizers through the handlers: their state in the bucket beside the global model, recomputed by
`fed verify`, surviving a crash before the commit and a `fed run restore`."""

from __future__ import annotations

import json
from typing import Any

import boto3
import numpy as np
import pytest

from coordinator.service import run_tick
from coordinator.verify import verify_run
from local.resources import create_resources
from shared import keys, wire
from shared.config import ServerOptimizer
from shared.state import Phase
from store.table import StateStore
from store.trace import acting_as, function
from tests.functional.conftest import Harness
from tests.functional.test_fed_operate import connection_file, fed

PIDS = ["alice", "bob", "carol"]
OPTIMIZERS = [o for o in ServerOptimizer if o is not ServerOptimizer.NONE]


def train_round(h: Harness, round_no: int, rng: np.random.Generator, pids: list[str] = PIDS) -> None:
    base = h.global_model(round_no)
    for pid in pids:
        update = {k: (v + rng.normal(0, 0.1, v.shape)).astype(np.float32) for k, v in base.items()}
        assert h.upload(pid, update, samples=10)["accepted"]


def state_index(h: Harness, round_no: int, digest: str) -> dict[str, Any]:
    body = h.s3.get_object(Bucket=h.res.bucket, Key=keys.optimizer_key(h.config.run_id, round_no, digest))["Body"]
    return dict(json.loads(body.read()))


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_every_optimizer_passes_verify_through_the_handlers(harness_factory, optimizer: ServerOptimizer) -> None:  # type: ignore[no-untyped-def]
    h: Harness = harness_factory(server_optimizer=optimizer, min_clients=3, min_per_round=3, total_rounds=3,
                                 norm_outlier_factor=0)
    h.start(PIDS)
    rng = np.random.default_rng(0)
    for round_no in range(3):
        train_round(h, round_no, rng)
    state = h.state()
    assert state.aggregated == 3 and state.optimizer_digest
    summaries = sorted(h.deps.store.rounds(), key=lambda s: s.round)
    assert [bool(s.optimizer_digest) for s in summaries] == [True, True, True]
    assert len({s.optimizer_digest for s in summaries}) == 3  # the state moves every round
    index = state_index(h, 3, state.optimizer_digest)
    assert (index["optimizer"], index["round"], index["global"]) == (optimizer.value, 3, state.global_digest)
    checks = verify_run(h.deps)
    assert [(c.round, c.ok) for c in checks] == [(0, True), (1, True), (2, True)], checks
    assert [c.optimizer_recomputed for c in checks] == [s.optimizer_digest for s in summaries]


def test_the_optimizer_changes_the_global_model(harness_factory) -> None:  # type: ignore[no-untyped-def]
    # the same updates make a different global under FedAvgM's momentum than under plain FedAvg (from round 1)
    globals_ = {}
    for optimizer in (ServerOptimizer.NONE, ServerOptimizer.FEDAVGM):
        h: Harness = harness_factory(run_id=f"opt-{optimizer.value}", server_optimizer=optimizer, min_clients=3,
                                     min_per_round=3, norm_outlier_factor=0)
        h.start(PIDS)
        rng = np.random.default_rng(1)
        for round_no in range(2):
            train_round(h, round_no, rng)
        globals_[optimizer] = [h.global_model(r) for r in (1, 2)]
    # FedAvgM with lr 1 and no momentum yet is FedAvg in round 0 (x - (x - a) = a, to float32 rounding) ...
    plain, momentum = globals_[ServerOptimizer.NONE], globals_[ServerOptimizer.FEDAVGM]
    for name in plain[0]:
        np.testing.assert_allclose(momentum[0][name], plain[0][name], rtol=1e-6, atol=1e-6)
    # ... and round 1 adds 0.9 x round 0's step: well away from FedAvg's
    assert max(float(np.abs(momentum[1][n] - plain[1][n]).max()) for n in plain[1]) > 0.01


def test_verify_catches_a_tampered_optimizer_state(harness_factory, tmp_path) -> None:  # type: ignore[no-untyped-def]
    h: Harness = harness_factory(server_optimizer="fedadam", min_clients=3, min_per_round=3, norm_outlier_factor=0)
    h.start(PIDS)
    rng = np.random.default_rng(2)
    for round_no in range(2):
        train_round(h, round_no, rng)
    first = sorted(h.deps.store.rounds(), key=lambda s: s.round)[0].optimizer_digest
    piece = state_index(h, 1, first)["pieces"][0]
    # When someone overwrites a piece of round 1's optimizer state
    forged = wire.encode({"m": np.ones(5, np.float32), "v": np.ones(5, np.float32)})
    h.s3.put_object(Bucket=h.res.bucket, Key=keys.optimizer_key(h.config.run_id, 1, piece), Body=forged)
    checks = verify_run(h.deps)
    # Then verify names the round whose stored state differs; the next round still recomputes from the
    # authenticated version (the bucket is versioned), so its own check passes
    assert not checks[0].ok and checks[0].optimizer_stored != checks[0].optimizer_expected
    assert checks[0].optimizer_recomputed == checks[0].optimizer_expected
    assert checks[1].ok, checks[1]
    code, out = fed("verify", "--connection", str(connection_file(h, tmp_path)))
    assert code == 1 and "stored optimizer state differs from recorded" in out


def test_a_crash_between_writing_the_state_and_committing_loses_nothing(
    harness_factory, monkeypatch: pytest.MonkeyPatch  # type: ignore[no-untyped-def]
) -> None:
    h: Harness = harness_factory(server_optimizer="diloco", min_clients=3, min_per_round=3, norm_outlier_factor=0)
    h.start(PIDS)
    rng = np.random.default_rng(3)
    train_round(h, 0, rng)
    before = h.state()
    # Given the coordinator dies after writing round 1's global model and optimizer state, before its commit
    original = StateStore.commit
    crashed: list[int] = []

    def crash_once(self: StateStore, state: Any, *args: Any, **kwargs: Any) -> int:
        if state.aggregated == 2 and not crashed:
            crashed.append(state.round)
            raise RuntimeError("simulated crash before the commit")
        return original(self, state, *args, **kwargs)

    monkeypatch.setattr(StateStore, "commit", crash_once)
    with pytest.raises(RuntimeError, match="simulated crash"):
        train_round(h, 1, rng)
    assert crashed and h.state().aggregated == 1 and h.state().optimizer_digest == before.optimizer_digest
    # When the next tick runs
    result = run_tick(h.deps)
    # Then it aggregates the round from the state the committed run points to, and every digest checks out
    assert result.committed and result.state.aggregated == 2 and result.state.optimizer_digest
    assert result.state.optimizer_digest != before.optimizer_digest
    assert all(c.ok for c in verify_run(h.deps)), verify_run(h.deps)


def test_the_state_survives_a_restore(harness_factory, tmp_path) -> None:  # type: ignore[no-untyped-def]
    h: Harness = harness_factory(server_optimizer="fedyogi", min_clients=3, min_per_round=3, rounds_per_epoch=2,
                                 total_rounds=4, cooldown_time=600, norm_outlier_factor=0)
    h.start(PIDS)
    rng = np.random.default_rng(4)
    for round_no in range(2):
        train_round(h, round_no, rng)
    before = h.state()
    assert before.phase is Phase.COOLDOWN and before.optimizer_digest
    checkpoint = json.loads(h.s3.get_object(
        Bucket=h.res.bucket, Key=keys.checkpoint_state_key(h.config.run_id, 2))["Body"].read())
    assert checkpoint["optimizer_digest"] == before.optimizer_digest
    # When the table is lost and the round's objects are gone (expired), and the run is restored
    boto3.client("dynamodb", region_name="us-east-1").delete_table(TableName=h.res.table)
    create_resources(h.config.run_id)
    for file in [before.optimizer_digest, *state_index(h, 2, before.optimizer_digest)["pieces"]]:
        key = keys.optimizer_key(h.config.run_id, 2, file)
        for v in h.s3.list_object_versions(Bucket=h.res.bucket, Prefix=key).get("Versions", []):
            h.s3.delete_object(Bucket=h.res.bucket, Key=key, VersionId=v["VersionId"])
    code, out = fed("run", "restore", "--connection", str(connection_file(h, tmp_path)))
    assert code == 0, out
    # Then the run goes on from the checkpoint's model *and* optimizer state
    restored = h.state()
    assert (restored.round, restored.global_digest, restored.optimizer_digest) == (
        2, before.global_digest, before.optimizer_digest)
    for pid in PIDS:  # the participants' records went with the table: they join again
        h.join_alive(pid)
    h.scheduled_tick()
    assert h.state().phase is Phase.TRAIN, h.state()
    train_round(h, 2, rng)
    after = h.state()
    assert after.aggregated == 3 and after.optimizer_digest not in ("", before.optimizer_digest)
    assert all(c.ok for c in verify_run(h.deps)), verify_run(h.deps)


def test_a_run_over_pieces_goes_on_when_the_counted_set_changes_size(harness_factory) -> None:  # type: ignore[no-untyped-def]
    # Given a FedAdam run of a model over two 8 MiB pieces (the global's header lists the round's inputs, so its
    # length, and every piece boundary, moves with how many were counted)
    h: Harness = harness_factory(server_optimizer=ServerOptimizer.FEDADAM, min_clients=2, min_per_round=2,
                                 min_updates=1, total_rounds=3, norm_outlier_factor=0, max_update_bytes=64 << 20)
    big = {"w": np.linspace(-1, 1, (8 << 20) // 4 + 300_000, dtype=np.float32),
           "b": np.zeros(10, np.float32)}
    h.scheduled_tick()
    for pid in PIDS:
        h.join_alive(pid)
    h.offer(PIDS[0], big)
    rng = np.random.default_rng(1)
    # When round 0 counts three updates
    train_round(h, 0, rng)
    assert h.state().aggregated == 1
    # and round 1 two: bob's update is refused (another shape)
    base = h.global_model(1)
    assert h.upload("alice", {k: (v + 0.01).astype(np.float32) for k, v in base.items()}, samples=10)["accepted"]
    assert h.upload("bob", {"w": base["w"][:-1], "b": base["b"]}, samples=10)["accepted"] is False
    assert h.upload("carol", {k: (v - 0.01).astype(np.float32) for k, v in base.items()}, samples=10)["accepted"]
    assert h.state().aggregated == 2, h.deps.store.rounds()
    # and round 2 one: carol drops out (the round closes at its deadline with alice's update alone)
    base = h.global_model(2)
    assert h.upload("alice", {k: (v + 0.02).astype(np.float32) for k, v in base.items()}, samples=10)["accepted"]
    with acting_as(function("tick")):
        run_tick(h.deps, now=h.state().deadline + 1)
    # Then every round aggregated, the state carried across the moving piece boundaries, and `fed verify` recomputes
    # every global model and optimizer state
    state = h.state()
    assert state.aggregated == 3 and state.phase is Phase.FINISHED
    counted = [len(s.counted) for s in sorted(h.deps.store.rounds(), key=lambda s: s.round)]
    assert counted == [3, 2, 1]
    checks = verify_run(h.deps)
    assert [(c.round, c.ok) for c in checks] == [(0, True), (1, True), (2, True)], checks
