"""The hostile-input catalog: each case is refused with a specific recorded reason, the coordinator keeps
working, and the run finishes with the right model (the global equals FedAvg of the honest updates).

Cases already covered elsewhere: wrong shape or dtype, missing tensors, NaN/Inf, over the size limit,
inflated sample counts, malformed metadata, wrong round, unselected, duplicate (test_refusals.py);
path characters and keys outside the layout (test_refusals.py, tests/unit/test_core.py); spoofed
witness proofs (test_witnesses.py).
"""

from __future__ import annotations

import io
import json
import pickle
import struct
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest

from coordinator.service import run_tick
from functions.observability import logger
from shared import keys, wire
from shared.state import Phase
from tests.functional.conftest import MODEL, Harness

PIDS = ["alice", "bob", "carol", "dave"]
N_JOINS = 2000


def model(k: float) -> dict[str, np.ndarray]:
    return {name: (arr + k).astype(arr.dtype) for name, arr in MODEL.items()}


def meta(h: Harness, pid: str, samples: int = 10, round_no: int = 0) -> dict[str, str]:
    return wire.UpdateMeta(h.config.run_id, round_no, pid, samples, {"loss": 1.0}).to_metadata()


def raw_update(h: Harness, pid: str, data: bytes) -> dict[str, Any]:
    return h.send(keys.update_key(h.config.run_id, h.state().round, pid), data)


def truncated(h: Harness, pid: str) -> bytes:
    return wire.encode(model(1), meta(h, pid))[:-10]


def huge_claim(h: Harness, pid: str) -> bytes:
    header = json.dumps({"dense.weight": {"dtype": "F32", "shape": [100000, 100000], "data_offsets": [0, 4 * 10**10]},
                         "dense.bias": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
    return struct.pack("<Q", len(header)) + header + b"\x00" * 16


def lengths_disagree(h: Harness, pid: str) -> bytes:
    return wire.encode(model(1), meta(h, pid)) + b"\x00" * 8


def pickled(h: Harness, pid: str) -> bytes:
    return pickle.dumps({k: v.tolist() for k, v in model(1).items()})


def torch_saved(h: Harness, pid: str) -> bytes:
    torch = pytest.importorskip("torch")
    buf = io.BytesIO()
    torch.save({k: torch.from_numpy(v) for k, v in model(1).items()}, buf)
    return buf.getvalue()


def npz(h: Harness, pid: str) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **model(1))
    return buf.getvalue()


def extra_tensor(h: Harness, pid: str) -> bytes:
    return wire.encode({**model(1), "backdoor": np.ones(3, np.float32)}, meta(h, pid))


def zero_samples(h: Harness, pid: str) -> bytes:
    return wire.encode(model(1), meta(h, pid, samples=0))


def negative_samples(h: Harness, pid: str) -> bytes:
    return wire.encode(model(1), meta(h, pid, samples=-5))


def metadata_for_another(h: Harness, pid: str) -> bytes:
    return wire.encode(model(1), meta(h, "bob" if pid != "bob" else "alice"))


CASES: dict[str, tuple[Callable[[Harness, str], bytes], str]] = {
    "truncated file": (truncated, "truncated"),
    "header claiming huge tensors": (huge_claim, "outside the"),
    "header and data lengths disagreeing": (lengths_disagree, "disagree"),
    "a pickle": (pickled, "safetensors"),
    "a torch.save file": (torch_saved, "safetensors"),
    "an .npz": (npz, "safetensors"),
    "extra tensors": (extra_tensor, "unexpected tensors"),
    "zero samples": (zero_samples, "must be positive"),
    "negative samples": (negative_samples, "must be positive"),
    "metadata naming another participant": (metadata_for_another, "another run, round or participant"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_hostile_update_is_refused_and_the_run_finishes_with_the_right_model(harness: Harness, case: str) -> None:
    make, words = CASES[case]
    harness.start(["alice", "bob"])
    result = raw_update(harness, "alice", make(harness, "alice"))
    assert result["accepted"] is False and words in result["reason"], result
    harness.upload("bob", model(3), samples=10)
    run_tick(harness.deps, time.time() + harness.config.max_round_train_time + 1)
    state = harness.state()
    assert state.aggregated == 1
    summary = harness.deps.store.rounds()[0]
    assert summary.counted == ("bob",) and words in summary.refused["alice"]
    np.testing.assert_array_equal(harness.global_model(1)["dense.bias"], model(3)["dense.bias"])


def test_a_norm_far_beyond_the_rounds_others_is_left_out(harness_factory) -> None:  # type: ignore[no-untyped-def]
    h = harness_factory(min_clients=4, min_per_round=4)
    h.start(PIDS)
    for i, pid in enumerate(PIDS):
        h.upload(pid, model(1000.0 if pid == "dave" else 0.1 * (i + 1)), samples=10)
    summary = h.deps.store.rounds()[0]
    assert summary.counted == ("alice", "bob", "carol")
    assert "median" in summary.refused["dave"]
    expected = np.mean([model(0.1 * (i + 1))["dense.bias"] for i in range(3)], axis=0)
    np.testing.assert_allclose(h.global_model(1)["dense.bias"], expected, rtol=1e-6)


def test_future_round_and_finished_run(harness_factory) -> None:  # type: ignore[no-untyped-def]
    h = harness_factory(total_rounds=1)
    h.start(["alice", "bob"])
    future = h.upload("alice", model(1), round_no=1)
    assert future["accepted"] is False and "wrong round" in future["reason"]
    h.upload("alice", model(1))
    h.upload("bob", model(2))
    assert h.state().phase is Phase.FINISHED
    late = h.upload("alice", model(1), round_no=1)
    assert late["accepted"] is False and "finished" in late["reason"]


def test_unknown_participant_is_refused(harness: Harness) -> None:
    harness.start(["alice", "bob"])
    result = harness.upload("mallory", model(1), samples=5)
    assert result["accepted"] is False and "not a member" in result["reason"]
    heartbeat = harness.send(keys.heartbeat_key(harness.config.run_id, "ghost"), harness.heartbeat_bytes("ghost"))
    assert heartbeat["accepted"] is False and "never joined" in heartbeat["reason"]


@contextmanager
def quiet_functions() -> Iterator[None]:
    """The functions' logger at WARNING for the duration of a `with` block."""
    level = logger.log_level
    logger.setLevel("WARNING")
    try:
        yield
    finally:
        logger.setLevel(level)


@pytest.mark.slow
@pytest.mark.timeout(1500)  # about 5 minutes on a quiet 2-core machine; well over 10 on a loaded one
def test_thousands_of_fake_joins_cost_a_bounded_table(harness_factory) -> None:  # type: ignore[no-untyped-def]
    h = harness_factory(max_participants=50)
    h.scheduled_tick()
    accepted = refused = 0
    with quiet_functions():  # 2,000 "ingested" log lines would bury the rest of the CI log
        for i in range(N_JOINS):
            result = h.join(f"fake{i:05d}")
            accepted += bool(result["accepted"])
            refused += not result["accepted"]
    assert accepted == 50 and refused == N_JOINS - 50
    assert len(h.deps.store.participants()) == 50
    assert h.deps.store.refusals()[0].reason.startswith("the run is full")
    # the state item holds members only: nobody was admitted without a model, and its size did not grow
    assert h.state().members == {}
