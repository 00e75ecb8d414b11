"""Epochs, checkpoints, late joiners and the operator's pause, resume and restore, end to end."""

from __future__ import annotations

import json
from collections.abc import Callable

import boto3
import pytest

from local.resources import create_resources
from shared import keys
from shared.state import Phase
from tests.e2e.harness import Run, e2e_config

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]


def latest_checkpoint(run: Run) -> dict[str, object] | None:
    from store.blobs import NotFound

    try:
        pointer = json.loads(run.bucket.get(keys.latest_checkpoint_key(run.config.run_id)).data)
        return json.loads(run.bucket.get(str(pointer["state_key"])).data)
    except NotFound:
        return None


def test_two_epochs_write_a_checkpoint_and_admit_a_late_joiner_at_the_second(local_run: Callable[..., Run]) -> None:
    # Given a run of two epochs of two rounds, with witnesses, started by three participants
    # (a long cooldown: on a loaded machine p4 may take a while to start, and must join before epoch 2 does)
    config = e2e_config(total_rounds=4, rounds_per_epoch=2, cooldown_time=15, witness_nodes=2, witness_tolerance=0.5,
                        round_witness_time=4, max_round_train_time=30, liveness_timeout=15)
    run = local_run(config)
    run.start_participants(["p1", "p2", "p3"])

    # When p4 starts once the first epoch has begun
    run.wait_for(lambda: run.state().epoch == 1, 60, "the first epoch to start")
    run.spawn("p4")

    # Then it is recorded as a participant while epoch 1 goes on, without being admitted to it
    run.wait_for(lambda: run.store.participant("p4") is not None, 60, "p4's join to be recorded")
    joined_at = float(run.store.participant("p4").joined_at)
    # And the end of epoch 1 writes a checkpoint: its round, the global model it points to, and the state
    run.wait_for(lambda: latest_checkpoint(run) is not None, 60, "the first checkpoint")
    checkpoint = latest_checkpoint(run)
    assert checkpoint is not None and checkpoint["epoch"] == 1 and checkpoint["round"] == 2
    saved = run.bucket.get(str(checkpoint["global_key"])).data
    assert saved == run.bucket.get(keys.global_key(config.run_id, 2, str(checkpoint["global_digest"]))).data
    # And epoch 2 admits p4, which trains its rounds, and the run finishes
    run.wait_for(lambda: run.state().phase is Phase.FINISHED, 120, "the run to finish")
    rounds = sorted(run.store.rounds(), key=lambda r: r.round)
    assert [(r.round, r.epoch) for r in rounds] == [(0, 1), (1, 1), (2, 2), (3, 2)]
    assert all(r.aggregated for r in rounds)
    assert joined_at >= rounds[0].started - 1, "p4 joined after epoch 1 began (event times have 1 s resolution)"
    assert all("p4" not in r.selected for r in rounds[:2])
    assert all("p4" in r.counted for r in rounds[2:])
    assert run.procs.wait_exit(30) and all(p.process.returncode == 0 for p in run.procs.procs.values())


def test_pause_resume_and_restore_after_the_table_is_lost(local_run: Callable[..., Run]) -> None:
    # Given a run whose every round is an epoch (a checkpoint after each), with witnesses, and three participants
    config = e2e_config(total_rounds=4, rounds_per_epoch=1, cooldown_time=1, witness_nodes=2, witness_tolerance=0.5,
                        round_witness_time=4, max_round_train_time=30, liveness_timeout=15)
    run = local_run(config)
    names = ["p1", "p2", "p3"]
    run.start_participants(names)
    run.wait_for(lambda: run.state().aggregated >= 1, 90, "the first round")

    # When the operator pauses the run
    code, out = run.fed("run", "pause")
    assert code == 0 and "paused" in out, out
    paused = run.state()
    assert paused.phase is Phase.PAUSED

    # Then the participants stay up, waiting, and nothing is trained
    def all_waiting() -> bool:
        infos = [run.store.participant(p).info for p in names]
        return all(str(i.get("activity", "")).startswith("waiting: not a member") for i in infos)

    run.wait_for(all_waiting, 30, "every participant to wait while paused")
    assert run.state().phase is Phase.PAUSED and run.state().aggregated == paused.aggregated

    # When the operator resumes it, training goes on in a new epoch
    code, out = run.fed("run", "resume")
    assert code == 0 and "resumed" in out, out
    run.wait_for(lambda: run.state().aggregated > paused.aggregated, 60, "a round after the pause")
    assert run.state().epoch > paused.epoch

    # When the table is lost (deleted and created empty) and the operator restores the latest checkpoint
    c = run.stack.connection
    boto3.client("dynamodb", endpoint_url=c.endpoint, region_name=c.region).delete_table(TableName=c.table)
    create_resources(config.run_id, c.endpoint, c.region)
    checkpoint = latest_checkpoint(run)
    assert checkpoint is not None
    code, out = run.fed("run", "restore", "--force")  # scheduled ticks may have recorded a fresh state since
    assert code == 0 and f"round {checkpoint['round']}," in out, out

    # Then the participants, still running, join again and carry the run on to the end
    run.wait_for(lambda: run.state().phase is Phase.FINISHED, 120, "the restored run to finish")
    state = run.state()
    assert state.aggregated == config.total_rounds
    rounds = sorted(run.store.rounds(), key=lambda r: r.round)  # only those since the restore are in the new table
    assert rounds[0].round == checkpoint["round"] and all(r.aggregated for r in rounds)
    assert all(set(r.counted) == set(names) for r in rounds)
    code, out = run.fed("verify")
    assert code == 0, out
    assert run.procs.wait_exit(30) and all(p.process.returncode == 0 for p in run.procs.procs.values())
