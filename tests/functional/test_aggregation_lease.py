"""A round of many updates is aggregated by one invocation at a time, however small the model: a second tick
meanwhile (the schedule's, an update's) would read every update again (`coordinator.aggregation`)."""

from __future__ import annotations

import numpy as np

from coordinator.aggregation import LEASE_SLACK_SECONDS, UNLEASED_INPUTS, lease_seconds
from tests.functional.conftest import MODEL, Harness, assert_round_left_to_lease_holder

PIDS = [f"p{i:02d}" for i in range(UNLEASED_INPUTS + 1)]


def test_a_small_model_with_many_updates_is_aggregated_under_the_rounds_lease(harness_factory) -> None:  # type: ignore[no-untyped-def]
    h: Harness = harness_factory(min_clients=len(PIDS), min_per_round=len(PIDS), min_updates=len(PIDS),
                                 fraction_per_round=1.0, liveness_timeout=3600)
    h.start(PIDS)

    def close_round() -> None:
        for i, pid in enumerate(PIDS):
            assert h.upload(pid, {k: v + i for k, v in MODEL.items()}, samples=10)["accepted"]

    # Given another invocation holding the round's lease, the round waits for it, then is aggregated
    assert_round_left_to_lease_holder(h, close_round)
    # as the mean of the updates
    mean = np.mean(np.arange(len(PIDS)))
    for name, want in MODEL.items():
        np.testing.assert_allclose(h.global_model(1)[name], want + mean, rtol=1e-6)


def test_the_lease_lasts_for_the_requests_of_every_input_as_well_as_their_bytes() -> None:
    # a thousand small updates are a thousand ranged GETs: the lease outlasts them (sized by bytes alone it expired
    # mid-aggregation at 1,000 participants, and a second tick read half the updates again)
    assert lease_seconds(600, 1000) >= LEASE_SLACK_SECONDS + 1000 * 0.05
    assert lease_seconds(10**9, 4) >= LEASE_SLACK_SECONDS + 5 * 10**9 / 200e6
