"""A Hugging Face run refuses updates trained from another model, with the reason recorded, and goes on.

The run records its model by digest (`[run.hf]`: config, tokenizer and, with adapters, the frozen base); every update
names what it was trained from (`fed.model`), and ingest refuses one naming anything else; an adapter update of
another shape (another LoRA rank) is refused by the manifest check. The last tests load the task itself on a tiny
model (`participant.tasks.hf_tiny`): a host holding another model refuses to start.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from coordinator.service import run_tick
from participant.task import TaskError, load_task
from participant.tasks import hf
from shared import keys, wire
from shared.config import Adapter, HfOptions, RunConfig
from shared.state import Phase
from tests.functional.conftest import Harness

CONFIG, TOKENIZER, BASE = "c" * 64, "7" * 64, "b" * 64
OTHER = "0123456789ab" + "e" * 52
NAMED = {"config": CONFIG, "tokenizer": TOKENIZER, "base": BASE}
RANK, WIDTH = 8, 64
PREFIX = "base_model.model.model.layers.0.self_attn"
LORA_A, LORA_B = f"{PREFIX}.q_proj.lora_A.weight", f"{PREFIX}.q_proj.lora_B.weight"


def adapters(rank: int = RANK, k: float = 0.0) -> dict[str, np.ndarray]:
    """LoRA adapter weights as PEFT names them: A of (rank, width), B of (width, rank)."""
    return {LORA_A: np.full((rank, WIDTH), 0.01 + k, np.float32), LORA_B: np.full((WIDTH, rank), k, np.float32)}


@pytest.fixture
def hf_run(harness_factory) -> Harness:  # type: ignore[no-untyped-def]
    """An adapter run of the Hugging Face task, its model recorded by digest, training round 0 from `adapters()`."""
    harness: Harness = harness_factory(
        task=hf.TASK, max_update_bytes=64 * 1024,
        hf=HfOptions(config_digest=CONFIG, tokenizer_digest=TOKENIZER, base_digest=BASE, adapter=Adapter.LORA))
    harness.scheduled_tick()
    for pid in ("alice", "bob"):
        harness.join_alive(pid)
    harness.offer("alice", adapters())
    assert harness.state().phase is Phase.TRAIN and harness.state().round == 0
    return harness


def upload(h: Harness, pid: str, arrays: dict[str, np.ndarray], model: dict[str, str]) -> dict[str, Any]:
    """`pid`'s update for the current round, naming `model` as what it was trained from (`fed.model`)."""
    s = h.state()
    meta = wire.UpdateMeta(h.config.run_id, s.round, pid, 10, {"loss": 1.0}, model)
    return h.send(keys.update_key(h.config.run_id, s.round, pid), wire.encode(arrays, meta.to_metadata()))


def recorded_reasons(h: Harness, round_no: int = 0) -> list[str]:
    """Every refusal reason the run recorded (where `fed status` reads them): update records and refusals."""
    reasons = [u.reason for u in h.deps.store.updates(round_no).values() if not u.accepted]
    return reasons + [r.reason for r in h.deps.store.refusals()]


def assert_the_run_goes_on(h: Harness) -> None:
    """Bob's update of the run's model is accepted in the same round, and the round is aggregated from it alone."""
    assert h.state().phase is Phase.TRAIN and h.state().round == 0
    result = upload(h, "bob", adapters(k=1.0), NAMED)
    assert result["accepted"] is True, result
    if h.state().round == 0:  # the refused update may not count towards closing the round: the deadline closes it
        run_tick(h.deps, time.time() + h.config.max_round_train_time + 1)
    state = h.state()
    assert state.round == 1 and state.aggregated == 1
    assert h.deps.store.rounds()[0].counted == ("bob",)
    np.testing.assert_allclose(h.global_model(1)[LORA_B], np.ones((WIDTH, RANK)))  # bob's weights, nobody else's


# (name, the update alice sends, words its recorded reason must contain)
HOSTILE: dict[str, tuple[dict[str, np.ndarray], dict[str, str], str]] = {
    "another tokenizer": (
        adapters(k=5.0), NAMED | {"tokenizer": OTHER},
        f"trained from another model: its tokenizer digest is {OTHER[:12]}, the run's is {TOKENIZER[:12]}"),
    "adapters of another base": (
        adapters(k=5.0), NAMED | {"base": OTHER},
        f"trained from another model: its base digest is {OTHER[:12]}, the run's is {BASE[:12]}"),
    "another config": (
        adapters(k=5.0), NAMED | {"config": OTHER},
        f"trained from another model: its config digest is {OTHER[:12]}, the run's is {CONFIG[:12]}"),
    "naming no model": (
        adapters(k=5.0), {}, f"trained from another model: its config digest is none, the run's is {CONFIG[:12]}"),
    "adapters of another rank": (
        adapters(rank=4, k=5.0), NAMED, f"wrong shape for {LORA_A}: [4, 64], expected [8, 64]"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_an_update_of_another_model_is_refused_with_its_reason_and_the_run_goes_on(hf_run: Harness,
                                                                                   case: str) -> None:
    # Given an adapter run training round 0, its config, tokenizer and base recorded by digest
    arrays, model, words = HOSTILE[case]
    # When alice uploads adapters trained from something else (or of another shape), signed with her own key
    result = upload(hf_run, "alice", arrays, model)
    # Then it is refused, the reason naming what differs, recorded where `fed status` reads it
    assert result["accepted"] is False, result
    assert words in result["reason"], result
    assert any(words in r for r in recorded_reasons(hf_run)), recorded_reasons(hf_run)
    # And the run goes on: bob's update of the run's model in the same round is accepted and aggregated alone
    assert_the_run_goes_on(hf_run)


def test_updates_of_the_runs_model_are_accepted_and_aggregated(hf_run: Harness) -> None:
    # Given an adapter run training round 0
    # When both participants upload adapters of the run's rank naming the run's config, tokenizer and base
    first = upload(hf_run, "alice", adapters(k=3.0), NAMED)
    second = upload(hf_run, "bob", adapters(k=1.0), NAMED)
    # Then both are accepted, nothing is refused, and the round is aggregated from both (equal samples: the mean)
    assert first["accepted"] is True and second["accepted"] is True, (first, second)
    assert recorded_reasons(hf_run) == []
    state = hf_run.state()
    assert state.round == 1 and state.aggregated == 1
    assert sorted(hf_run.deps.store.rounds()[0].counted) == ["alice", "bob"]
    np.testing.assert_allclose(hf_run.global_model(1)[LORA_B], np.full((WIDTH, RANK), 2.0))


def test_a_full_fine_tuning_run_does_not_judge_the_base(harness_factory) -> None:  # type: ignore[no-untyped-def]
    # Given a run without adapters that recorded config and tokenizer (and, unused, a base digest)
    h: Harness = harness_factory(task=hf.TASK, hf=HfOptions(config_digest=CONFIG, tokenizer_digest=TOKENIZER,
                                                            base_digest=BASE))
    h.start(["alice", "bob"])
    whole = {name: (arr + 1).astype(arr.dtype) for name, arr in h.global_model(0).items()}
    # When alice's update names the run's config and tokenizer but another base, and bob's another tokenizer
    alice = upload(h, "alice", whole, {"config": CONFIG, "tokenizer": TOKENIZER, "base": OTHER})
    bob = upload(h, "bob", whole, {"config": CONFIG, "tokenizer": OTHER})
    # Then alice's is accepted (a whole model has no base apart from itself) and bob's refused, naming the tokenizer
    assert alice["accepted"] is True, alice
    assert bob["accepted"] is False and "its tokenizer digest is" in bob["reason"], bob


# --- the task on a real (tiny) model ------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama model directory (config, tokenizer, weights), built offline once for this module. Its weights are
    the seeded draw without pre-training (which costs most of a build, and nothing here trains)."""
    from participant.tasks import hf_tiny

    return hf_tiny.build(tmp_path_factory.mktemp("hf") / "m", pretrain_steps=0)


@pytest.fixture(scope="module")
def tiny_digests(tiny_model: Path) -> dict[str, str]:
    """The tiny model's identity as a run records it: config, tokenizer and its weights' digest (the base)."""
    named = hf.model_digests(str(tiny_model))
    return named | {"base": hf.weights_digest(hf.load_model(str(tiny_model)).state_dict())}


@pytest.fixture(autouse=True)
def _no_model_override(monkeypatch: pytest.MonkeyPatch) -> None:
    """This host holds the run's model where `[run.hf] model` says (no FED_HF_MODEL from the environment)."""
    monkeypatch.delenv(hf.MODEL_ENV, raising=False)


def hf_config(model: Path, digests: dict[str, str], **changes: Any) -> RunConfig:
    options: dict[str, Any] = dict(model=str(model), config_digest=digests["config"],
                                   tokenizer_digest=digests["tokenizer"], sequence_length=32, eval_sequences=4)
    options.update(changes)
    return RunConfig(run_id="hf-task-run", task=hf.TASK, hf=HfOptions(**options))


def test_a_host_holding_another_tokenizer_refuses_to_start(tiny_model: Path, tiny_digests: dict[str, str]) -> None:
    # Given a run that recorded a tokenizer digest other than the one of this host's copy of the model
    config = hf_config(tiny_model, tiny_digests, tokenizer_digest=OTHER)
    # When the participant loads the run's task, then it refuses, naming the tokenizer and both digests
    with pytest.raises(TaskError, match="tokenizer digest") as raised:
        load_task(hf.TASK, config)
    assert tiny_digests["tokenizer"][:12] in str(raised.value) and OTHER[:12] in str(raised.value)
    assert hf.MODEL_ENV in str(raised.value)  # and says how to point it at the run's model


def test_a_host_holding_the_runs_model_loads_the_task(tiny_model: Path, tiny_digests: dict[str, str]) -> None:
    # Given a run that recorded this model's config and tokenizer digests
    config = hf_config(tiny_model, tiny_digests)
    # When the participant loads the run's task, then it loads, naming the run's digests in every update
    task = load_task(hf.TASK, config)
    assert isinstance(task, hf.HfTask) and task.train_size > 0
    assert task.identity == {"config": tiny_digests["config"], "tokenizer": tiny_digests["tokenizer"]}


def test_an_adapter_host_holding_another_base_refuses_to_start(tiny_model: Path,
                                                               tiny_digests: dict[str, str]) -> None:
    # Given an adapter run whose recorded base is not this host's weights (the same config and tokenizer)
    config = hf_config(tiny_model, tiny_digests, adapter=Adapter.LORA, base_digest=OTHER)
    # When the participant loads the run's task, then it refuses, naming the base
    with pytest.raises(TaskError, match="base digest"):
        load_task(hf.TASK, config)


def test_an_adapter_task_trains_and_uploads_the_adapters_alone(tiny_model: Path,
                                                                tiny_digests: dict[str, str]) -> None:
    # Given an adapter run recording this model's config, tokenizer and base
    config = hf_config(tiny_model, tiny_digests, adapter=Adapter.LORA, base_digest=tiny_digests["base"])
    task = load_task(hf.TASK, config)
    assert isinstance(task, hf.HfTask)
    assert task.identity == tiny_digests  # what every update names
    # When it builds the model
    model = task.build_model(config.seed)
    # Then its state dict (the initial global model, every update) holds the LoRA adapters and nothing of the base
    state = model.state_dict()
    assert state and all(".lora_A." in name or ".lora_B." in name for name in state), sorted(state)[:5]
    assert {name for name in state if ".lora_A." in name} and {name for name in state if ".lora_B." in name}
    rank = config.hf.lora_rank
    assert all(t.shape[0] == rank for name, t in state.items() if ".lora_A." in name)
    assert all(t.shape[1] == rank for name, t in state.items() if ".lora_B." in name)
    # And the trainable weights are the adapters alone: the base is frozen
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in name for name in trainable)
