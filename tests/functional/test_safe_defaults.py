"""Safe defaults: a claimed sample count is bounded even when the coordinator does not know the data set's
size, and a run that loses its table mid-epoch can be restored from a checkpoint written every few rounds."""

from __future__ import annotations

import boto3
import numpy as np

from coordinator.operations import restore
from local.resources import create_resources
from shared.config import RunConfig
from shared.state import Phase
from tests.functional.conftest import MODEL


def model(k: float) -> dict[str, np.ndarray]:
    return {name: (arr * 0 + k).astype(arr.dtype) for name, arr in MODEL.items()}


def test_a_huge_sample_claim_cannot_own_fedavg_with_the_default_config(harness_factory) -> None:  # type: ignore[no-untyped-def]
    # Given the defaults of a run whose data set size the coordinator does not know (as in runs/example.toml)
    harness = harness_factory(dataset_size=0, min_clients=3, min_per_round=3)
    assert harness.config.max_sample_ratio == RunConfig.model_fields["max_sample_ratio"].default > 0
    harness.start(["alice", "bob", "mallory"])
    # When two honest members claim what they trained and one claims 10^30 samples
    harness.upload("alice", model(1), samples=450)
    harness.upload("bob", model(3), samples=449)
    harness.upload("mallory", model(5), samples=10**30)
    # Then the claim is refused with its reason, and the global model is the honest members' FedAvg
    state = harness.state()
    assert state.round == 1 and state.aggregated == 1
    (summary,) = harness.deps.store.rounds()
    assert summary.counted == ("alice", "bob")
    assert "claims 1000000000000000000000000000000 samples" in summary.refused["mallory"]
    np.testing.assert_allclose(harness.global_model(1)["dense.bias"], (450 * 1 + 449 * 3) / 899, rtol=1e-6)


def test_a_run_that_loses_its_table_mid_epoch_restores_from_the_periodic_checkpoint(harness_factory) -> None:  # type: ignore[no-untyped-def]
    # Given one long epoch (the default) checkpointed every 2 aggregated rounds
    h = harness_factory(total_rounds=10, checkpoint_every=2)
    h.start(["alice", "bob"])
    for k in range(3):
        h.upload("alice", model(k))
        h.upload("bob", model(k + 1))
    before = h.state()
    assert before.aggregated == 3 and before.epoch == 1 and before.phase is Phase.TRAIN
    at_round_2 = h.global_digest(2)
    # When the table is lost in the middle of the epoch
    boto3.client("dynamodb", region_name="us-east-1").delete_table(TableName=h.res.table)
    create_resources(h.config.run_id)
    # And the participants come back, joining and offering a model, before the operator restores it
    h.join("alice")
    h.join("bob")
    h.offer("alice")
    h.scheduled_tick()
    # Then the coordinator does not start the run over (which would overwrite its checkpoints)
    assert h.state().version == 0
    # And the run comes back at the last checkpoint (round 2), not from scratch
    restored = restore(h.deps)
    assert (restored.round, restored.aggregated, restored.global_digest) == (2, 2, at_round_2)
    h.join("alice")
    h.join("bob")
    assert h.state().phase is Phase.TRAIN and h.state().round == 2
