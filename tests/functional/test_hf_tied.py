"""A Hugging Face model whose input embedding and output head are one weight (tied, as in most small LMs): the
weight travels once, stays tied through a round's load, training and save, and exports as a model that
`from_pretrained` loads with the same logits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from participant.task import load_task
from participant.tasks import hf_tiny
from participant.tasks.hf import export_hf
from participant.tensors import load_into, save_model
from shared.config import HfOptions, RunConfig

pytestmark = pytest.mark.timeout(300)

TIED = ("model.embed_tokens.weight", "lm_head.weight")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[bool, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {tied: hf_tiny.build(root / str(tied), pretrain_steps=0, tied=tied) for tied in (False, True)}


def _task(model_dir: Path) -> Any:
    config = RunConfig(run_id="tied", task="participant.tasks.hf:task", batch_size=8, learning_rate=1e-2,
                       hf=HfOptions(model=str(model_dir)))
    return config, load_task(config.task, config)


def test_a_tied_weight_is_in_the_state_once_and_stays_tied_through_a_round(models: dict[bool, Path],
                                                                          tmp_path: Path) -> None:
    # Given the same tiny Llama with its embedding and head separate, and tied
    _, untied = _task(models[False])
    config, tied = _task(models[True])
    separate, shared = untied.build_model(0).state_dict(), tied.build_model(0).state_dict()

    # Then the tied model's state has the weight once, under the embedding's name: its file is smaller by the head
    assert set(separate) - set(shared) == {TIED[1]} and TIED[0] in shared
    head = separate[TIED[1]].nbytes
    sizes = [save_model(task.build_model(0), tmp_path / f"{name}.safetensors").stat().st_size
             for name, task in (("untied", untied), ("tied", tied))]
    assert sizes[0] - sizes[1] == pytest.approx(head, abs=512)

    # When a round loads the global model, trains and saves, and the next loads that update
    start = save_model(tied.build_model(0), tmp_path / "global.safetensors")
    model = load_into(tied.build_model(0), start)
    tied.train(model, list(range(32)), config, torch.device("cpu"), None, seed=1)
    after = load_into(tied.build_model(0), save_model(model, tmp_path / "update.safetensors"))

    # Then the weight moved, and it is still one weight, the same in both places
    assert after.lm_head.weight is after.model.embed_tokens.weight
    assert not torch.equal(after.lm_head.weight, load_into(tied.build_model(0), start).lm_head.weight)
    torch.testing.assert_close(after.lm_head.weight, model.lm_head.weight)
    # and loading a state dict by name (as a node's rank 0 does after FSDP) fills the head from the embedding
    fresh = tied.build_model(0)
    fresh.load_state_dict(model.state_dict())
    assert torch.equal(fresh.lm_head.weight, model.lm_head.weight)


def test_a_tied_model_exports_as_one_from_pretrained_loads_with_its_logits(models: dict[bool, Path],
                                                                          tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    # Given a trained global model of the tied Llama, as the coordinator would hold it
    config, tied = _task(models[True])
    model = tied.build_model(0)
    tied.train(model, list(range(32)), config, torch.device("cpu"), None, seed=1)
    held = save_model(model, tmp_path / "global.safetensors")

    # When it is exported as a Hugging Face directory and loaded back
    export_hf(config, held, tmp_path / "out")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", local_files_only=True)

    # Then it is tied, and its logits are the global model's
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    tokens = torch.arange(1, 33).reshape(2, 16)
    with torch.no_grad():
        want = load_into(tied.build_model(0), held).eval()(input_ids=tokens).logits
        torch.testing.assert_close(loaded.eval()(input_ids=tokens).logits, want, atol=1e-4, rtol=1e-4)
