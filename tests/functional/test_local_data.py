"""Local data mode through the real ingest path: each participant registers its own data's sample count
when it joins, and no update may claim more."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from shared import keys
from tests.functional.conftest import MODEL, Harness


def model(x: float) -> dict[str, np.ndarray]:
    return {k: np.full_like(v, x) for k, v in MODEL.items()}


def join_with(h: Harness, pid: str, samples: int | None) -> dict[str, Any]:
    body = json.loads(h.join_bytes(pid))
    if samples is not None:
        body["samples"] = samples
    return h.send(keys.join_key(h.config.run_id, pid), json.dumps(body).encode())


@pytest.fixture
def local(harness_factory) -> Harness:  # type: ignore[no-untyped-def]
    h: Harness = harness_factory(data_mode="local", dataset_size=0, max_sample_ratio=0)
    h.scheduled_tick()
    for pid, samples in (("alice", 300), ("bob", 100)):
        assert join_with(h, pid, samples)["accepted"]
        h.heartbeat(pid)
    h.offer("alice")
    return h


def test_the_join_registers_the_sample_count_and_updates_are_weighted_by_their_claims(local: Harness) -> None:
    assert local.deps.store.participant("alice").samples == 300  # type: ignore[union-attr]
    assert local.upload("alice", model(1), samples=300)["accepted"]
    assert local.upload("bob", model(5), samples=100)["accepted"]
    assert local.state().round == 1
    # weighted by their claims, alice's three times bob's counted at max_share_ratio (2) x the smaller of the two
    np.testing.assert_allclose(local.global_model(1)["dense.bias"], (200 * 1 + 100 * 5) / 300)


def test_an_update_claiming_more_than_its_registered_samples_is_refused_with_the_reason(local: Harness) -> None:
    result = local.upload("bob", model(5), samples=101)
    assert result["accepted"] is False
    assert "claims 101 samples, more than the 100 its join registered" in result["reason"]
    assert local.deps.store.update_record(0, "bob").reason == result["reason"]  # type: ignore[union-attr]
    # and the run goes on with the honest update
    assert local.upload("alice", model(1), samples=300)["accepted"]


def test_a_join_without_a_sample_count_is_refused_naming_the_field(harness_factory) -> None:  # type: ignore[no-untyped-def]
    h: Harness = harness_factory(data_mode="local", dataset_size=0)
    h.scheduled_tick()
    result = join_with(h, "carol", None)
    assert result["accepted"] is False and "'samples'" in result["reason"]
    assert h.deps.store.participant("carol") is None
    assert [r.reason for r in h.deps.store.refusals()] == [result["reason"]]


def test_a_rejoin_cannot_raise_the_registered_count(local: Harness) -> None:
    join_with(local, "bob", 10**6)
    assert local.deps.store.participant("bob").samples == 100  # type: ignore[union-attr]
    assert local.upload("bob", model(5), samples=1000)["accepted"] is False
