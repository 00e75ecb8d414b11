"""Operator actions: pause, resume, and restoring a run from its checkpoint after its table is lost."""

from __future__ import annotations

import boto3
import numpy as np
import pytest

from coordinator.operations import OperationError, restore, set_paused
from local.resources import create_resources
from shared.naming import tick_rule_name
from shared.state import Phase
from tests.functional.conftest import MODEL, Harness


def model(k: float) -> dict[str, np.ndarray]:
    return {name: (arr + k).astype(arr.dtype) for name, arr in MODEL.items()}


def test_pause_and_resume(harness: Harness) -> None:
    harness.start(["alice", "bob"])
    harness.upload("alice", model(1))
    # When the operator pauses mid-round
    result = set_paused(harness.deps, True)
    # Then the run is paused, the open round closed unaggregated, and uploads are refused
    assert result.state.phase is Phase.PAUSED
    assert harness.deps.store.rounds()[0].aggregated is False
    refused = harness.upload("bob", model(2), round_no=0)
    assert refused["accepted"] is False
    # And the paused run switched its tick schedule off (an idle run is billed nothing)
    events = boto3.client("events", region_name="us-east-1")
    rule = tick_rule_name(harness.config.run_id)
    assert events.describe_rule(Name=rule)["State"] == "DISABLED"
    # When the operator resumes, the live participants start a new epoch at the next round, the schedule on again
    result = set_paused(harness.deps, False)
    assert result.state.phase is Phase.TRAIN and result.state.round == 1 and result.state.epoch == 2
    assert events.describe_rule(Name=rule)["State"] == "ENABLED"
    harness.upload("alice", model(1))
    harness.upload("bob", model(3))
    assert harness.state().aggregated == 1


def test_restore_from_the_latest_checkpoint_after_the_table_is_lost(harness_factory) -> None:  # type: ignore[no-untyped-def]
    h = harness_factory(rounds_per_epoch=1, total_rounds=3, cooldown_time=0)
    h.start(["alice", "bob"])
    h.upload("alice", model(1))
    h.upload("bob", model(2))
    before = h.state()
    assert before.aggregated == 1 and before.epoch == 2  # cooldown passed at once: the second epoch began
    with pytest.raises(OperationError, match="--force"):
        restore(h.deps)
    # When the table is lost
    boto3.client("dynamodb", region_name="us-east-1").delete_table(TableName=h.res.table)
    create_resources(h.config.run_id)
    assert h.state().version == 0
    # Then restore rebuilds the run from the checkpoint, and participants rejoining carry it on
    restored = restore(h.deps)
    assert (restored.round, restored.aggregated, restored.global_digest) == (1, 1, before.global_digest)
    state = h.state()
    assert state.phase is Phase.WAITING and state.round == 1 and state.global_digest == before.global_digest
    h.join_alive("alice")
    h.join_alive("bob")
    assert h.state().phase is Phase.TRAIN and h.state().round == 1
    h.upload("alice", model(1))
    h.upload("bob", model(2))
    assert h.state().aggregated == 2
