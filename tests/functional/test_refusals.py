"""Every kind of bad update is refused with its reason recorded, and the run goes on."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from coordinator.service import run_tick
from shared import keys, wire
from shared.state import Phase
from tests.functional.conftest import MODEL, Harness


def good(k: float = 1.0) -> dict[str, np.ndarray]:
    return {name: (arr + k).astype(arr.dtype) for name, arr in MODEL.items()}


def with_tensor(name: str, value: np.ndarray) -> dict[str, np.ndarray]:
    arrays = good()
    arrays[name] = value
    return arrays


def nan_model() -> dict[str, np.ndarray]:
    arrays = good()
    arrays["dense.bias"][1] = np.nan
    return arrays


def inf_model() -> dict[str, np.ndarray]:
    arrays = good()
    arrays["dense.weight"][0, 0] = np.inf
    return arrays


def padded(h: Harness, pid: str) -> bytes:
    meta = wire.UpdateMeta(h.config.run_id, 0, pid, 10, {}).to_metadata()
    return wire.encode(good(), {**meta, "padding": "x" * h.config.max_update_bytes})


# name -> (how to upload it, words the recorded reason must contain)
BAD: dict[str, tuple[Callable[[Harness, str], Any], str]] = {
    "wrong shape": (lambda h, p: h.upload(p, with_tensor("dense.bias", np.zeros(5, np.float32))), "wrong shape"),
    "wrong dtype": (lambda h, p: h.upload(p, with_tensor("dense.bias", np.zeros(4, np.float64))), "wrong dtype"),
    "NaN": (lambda h, p: h.upload(p, nan_model()), "non-finite"),
    "Inf": (lambda h, p: h.upload(p, inf_model()), "non-finite"),
    "over the size limit": (lambda h, p: h.send(keys.update_key(h.config.run_id, 0, p), padded(h, p)), "size limit"),
    "not a safetensors file": (
        lambda h, p: h.send(keys.update_key(h.config.run_id, h.state().round, p), b"\x80\x04K\x01." * 10),
        "safetensors",
    ),
    "wrong round": (lambda h, p: h.upload(p, good(), round_no=h.state().round + 3), "wrong round"),
    "missing tensor": (lambda h, p: h.upload(p, {"dense.weight": good()["dense.weight"]}), "missing tensors"),
    "too many samples": (lambda h, p: h.upload(p, good(), samples=10_000), "more than the"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_update_is_refused_with_its_reason_and_the_run_goes_on(harness: Harness, case: str) -> None:
    # Given a round in training
    harness.start(["alice", "bob"])
    upload, words = BAD[case]
    # When alice uploads something bad
    result = upload(harness, "alice")
    # Then it is refused, with the reason recorded where `fed status` reads it
    assert result["accepted"] is False, result
    assert words in result["reason"]
    recorded = [u.reason for u in harness.deps.store.updates(0).values() if not u.accepted]
    recorded += [r.reason for r in harness.deps.store.refusals()]
    assert any(words in r for r in recorded), recorded
    # And the run is unaffected: it still finishes its round with the good update
    assert harness.state().phase is Phase.TRAIN
    if case == "wrong round":  # the slot is still free: alice can send her real update
        harness.upload("alice", good())
    harness.upload("bob", good(2.0))
    if harness.state().round == 0:  # alice's slot was used by the refused update: the deadline closes the round
        run_tick(harness.deps, time.time() + harness.config.max_round_train_time + 1)
    state = harness.state()
    assert state.round == 1 and state.aggregated == 1


def test_unselected_participant_is_refused(harness_factory) -> None:  # type: ignore[no-untyped-def]
    harness = harness_factory(min_clients=3, min_per_round=1, fraction_per_round=0.3)
    state = harness.start(["alice", "bob", "carol"])
    (chosen,) = state.selected
    outsider = next(p for p in ("alice", "bob", "carol") if p != chosen)
    result = harness.upload(outsider, good(), samples=5)
    assert result["accepted"] is False and "not selected" in result["reason"]
    harness.upload(chosen, good())
    assert harness.state().aggregated == 1
    assert harness.deps.store.rounds()[0].counted == (chosen,)


def test_duplicate_update_is_refused_and_the_first_is_kept(harness: Harness) -> None:
    harness.start(["alice", "bob", "carol"])
    first = harness.upload("alice", good(1.0))
    second = harness.upload("alice", good(9.0))
    assert first["accepted"] and second["accepted"] is False
    assert "duplicate" in second["reason"]
    assert harness.deps.store.refusals()[0].reason.startswith("duplicate")
    harness.upload("bob", good(1.0))
    harness.upload("carol", good(1.0))
    np.testing.assert_allclose(harness.global_model(1)["dense.bias"], np.ones(4))  # the 9.0 never counted


def test_join_for_another_run_is_refused(harness: Harness) -> None:
    harness.scheduled_tick()
    result = harness.join("mallory", run_id="other-run")
    assert result["accepted"] is False and "other-run" in result["reason"]
    assert "mallory" not in harness.deps.store.participants()


@pytest.mark.parametrize("key", ["runs/func-run/rounds/12/alice", "runs/func-run/join/../x", "elsewhere/x",
                                 "runs/func-run/join/a%2Fb", "runs/func-run/join/" + "p" * 80])
def test_keys_outside_the_layout_are_refused(harness: Harness, key: str) -> None:
    harness.scheduled_tick()
    result = harness.send(key, json.dumps({"run_id": "func-run"}).encode())
    assert result["accepted"] is False
    assert harness.deps.store.refusals()[0].key == key


def test_malformed_metadata_is_refused(harness: Harness) -> None:
    harness.start(["alice", "bob"])
    data = wire.encode(good(), {"fed.schema": "1", "fed.run": "func-run", "fed.round": "zero"})
    result = harness.send(keys.update_key("func-run", 0, "alice"), data)
    assert result["accepted"] is False and "malformed metadata" in result["reason"]
