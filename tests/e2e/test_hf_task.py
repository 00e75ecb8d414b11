"""The Hugging Face task end to end: `fed demo --task hf` with full fine-tuning and with LoRA adapters, and a run's
global model exported with `fed export --format hf` and loaded back by `from_pretrained`."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from fed.cli import app
from fed.demo.hf import hf_settings
from participant.tasks import hf_tiny
from participant.tasks.hf import TASK
from shared.config import RunConfig
from shared.state import Phase
from tests.e2e.harness import Run, e2e_config

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo's tiny Llama (byte-level BPE on Python's help text, 2 layers of width 64), built offline."""
    return hf_tiny.build(tmp_path_factory.mktemp("models") / "tiny-llama")


def _demo(tmp_path: Path, tiny: Path, *more: str) -> dict[str, Any]:
    report = tmp_path / "report.json"
    args = ["demo", "--task", "hf", "--model", str(tiny), "--participants", "3", "--rounds", "3", "--report",
            str(report), "--plot", str(tmp_path / "report.png"), "--workdir", str(tmp_path / "work"), *more]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "perplexity" in result.output and "finished" in result.output
    assert (tmp_path / "report.png").stat().st_size > 0
    body: dict[str, Any] = json.loads(report.read_text())
    return body


def test_demo_fine_tunes_and_lora_moves_twenty_times_fewer_bytes(tmp_path: Path, tiny: Path) -> None:
    # Given the tiny Llama, fine-tuned by three participants for three rounds, once whole and once with adapters
    full = _demo(tmp_path / "full", tiny)
    lora = _demo(tmp_path / "lora", tiny, "--adapter", "lora")

    for body in (full, lora):
        rows = body["rounds"]
        # Then every round aggregated all three updates, and its held-out loss fell round over round
        assert [r["round"] for r in rows] == [0, 1, 2]
        assert all(r["aggregated"] and r["accepted"] == 3 and r["refused"] == 0 for r in rows)
        losses = [r["test_loss"] for r in rows]
        assert losses == sorted(losses, reverse=True) and len(set(losses)) == 3, losses
        assert all(r["test_perplexity"] == pytest.approx(math.exp(r["test_loss"])) for r in rows)
    # and the adapters' updates are at least 20x smaller than the whole model's, round by round
    for whole, adapters in zip(full["rounds"], lora["rounds"], strict=True):
        assert adapters["upload_bytes"] > 0 and whole["upload_bytes"] >= 20 * adapters["upload_bytes"]
    assert lora["config"]["hf"]["base_digest"] and lora["config"]["hf"]["adapter"] == "lora"


def _finished_run(local_run: Callable[[RunConfig], Run], tiny: Path, adapter: str) -> Run:
    settings = hf_settings(str(tiny), adapter)
    config = e2e_config(task=TASK, min_clients=2, min_per_round=2, min_updates=2, total_rounds=1, batch_size=16,
                        learning_rate=2e-2 if adapter == "lora" else 3e-3, max_round_train_time=120,
                        liveness_timeout=30, **settings)
    run = local_run(config)
    run.start_participants(["p1", "p2"])
    run.wait_for(lambda: run.store.read_state().phase is Phase.FINISHED, 240, "the run to finish")
    return run


def _logits(model: Any, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=tokens).logits.float()


def _held_logits(run: Run, tmp_path: Path, tokens: torch.Tensor) -> torch.Tensor:
    """The logits of the run's latest global model, as the coordinator holds it, loaded into the task's model."""
    from participant.task import load_task
    from participant.tensors import load_into

    raw = tmp_path / "global.safetensors"
    status, output = run.fed("export", str(raw))
    assert status == 0, output
    task = load_task(TASK, run.config)
    return _logits(load_into(task.build_model(run.config.seed), raw), tokens)


@pytest.mark.parametrize("adapter", ["none", "lora"])
def test_export_hf_loads_with_from_pretrained_and_gives_the_global_models_logits(
        local_run: Callable[[RunConfig], Run], tmp_path: Path, tiny: Path, adapter: str) -> None:
    from transformers import AutoModelForCausalLM

    # Given a finished run of the tiny Llama (whole, or LoRA adapters)
    run = _finished_run(local_run, tiny, adapter)
    tokens = torch.randint(0, 1000, (2, 48), generator=torch.Generator().manual_seed(0))
    held = _held_logits(run, tmp_path, tokens)

    # When its latest global model is exported as a Hugging Face directory (for LoRA: merged into the base)
    status, output = run.fed("export", "--format", "hf", str(tmp_path / "merged"))
    assert status == 0, output

    # Then from_pretrained loads it, and its logits are the global model's
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", local_files_only=True)
    assert (tmp_path / "merged" / "tokenizer.json").is_file()
    torch.testing.assert_close(_logits(exported, tokens), held, atol=1e-4, rtol=1e-4)
    if adapter == "lora":
        from peft import PeftModel

        # and the adapters alone, loaded by PEFT onto the base, give them too
        status, output = run.fed("export", "--format", "hf", "--adapter-only", str(tmp_path / "adapter"))
        assert status == 0, output
        assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
        base = AutoModelForCausalLM.from_pretrained(tiny, local_files_only=True)
        with_adapter = PeftModel.from_pretrained(base, tmp_path / "adapter")
        torch.testing.assert_close(_logits(with_adapter, tokens), held, atol=1e-4, rtol=1e-4)
    # and a directory that holds files already is refused, nothing written into it
    status, output = run.fed("export", "--format", "hf", str(tmp_path / "merged"))
    assert status == 1 and "not an empty directory" in output
