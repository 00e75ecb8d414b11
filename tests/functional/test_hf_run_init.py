"""`fed run init --from DIR`: a run file starting a run from a Hugging Face model, its digests read from the model."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fed.cli import app
from participant.tasks import hf_tiny
from participant.tasks.hf import model_digests
from shared.config import Adapter, parse_config


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # (not pre-trained: only its files and digests matter here)
    return hf_tiny.build(tmp_path_factory.mktemp("models") / "tiny", pretrain_steps=0)


def test_the_run_file_names_the_model_by_digest_and_is_a_valid_run(model: Path, tmp_path: Path) -> None:
    # Given a Hugging Face model directory
    out = tmp_path / "run.toml"

    # When a run is started from it with adapters
    result = CliRunner().invoke(app, ["run", "init", "--from", str(model), "--adapter", "lora", "--run-id",
                                      "tiny-lora", "--out", str(out)])

    # Then the run file is a valid run of the Hugging Face task naming the model's own digests and its base's
    assert result.exit_code == 0, result.output
    config = parse_config(tomllib.loads(out.read_text()), str(out))
    digests = model_digests(str(model))
    assert config.run_id == "tiny-lora" and config.task == "participant.tasks.hf:task"
    assert config.hf.model == str(model) and config.hf.adapter is Adapter.LORA
    assert (config.hf.config_digest, config.hf.tokenizer_digest) == (digests["config"], digests["tokenizer"])
    assert config.hf.base_digest and config.dataset_size > 0 and config.initial_model_schema
    # and an existing file is not overwritten
    again = CliRunner().invoke(app, ["run", "init", "--from", str(model), "--out", str(out)])
    assert again.exit_code == 2 and "exists" in again.output


def test_a_directory_without_a_model_is_refused_with_the_reason(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["run", "init", "--from", str(tmp_path)])
    assert result.exit_code == 1 and "cannot start a run from" in result.output
    bad = CliRunner().invoke(app, ["run", "init", "--from", str(tmp_path), "--adapter", "qlora"])
    assert bad.exit_code == 2 and "none or lora" in bad.output
