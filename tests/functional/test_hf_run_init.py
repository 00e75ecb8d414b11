"""`fed run init --from DIR`: a run file starting a run from a Hugging Face model, its digests read from the model."""

from __future__ import annotations

import tomllib
from collections.abc import Callable
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fed.cli import app
from participant.task import load_task
from participant.tasks import digits_meta, hf, hf_tiny
from participant.tasks.hf import model_digests
from participant.tensors import save_model
from shared import keys, wire
from shared.config import Adapter, parse_config
from shared.digest import digest_file
from shared.state import Phase
from tests.functional.conftest import Harness


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


def test_the_run_file_pins_the_initial_model_a_participant_builds_and_an_offer_of_other_weights_is_refused(
        model: Path, tmp_path: Path, harness_factory: Callable[..., Harness], monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a run file written from a Hugging Face model (adapters on the frozen model)
    monkeypatch.delenv(hf.MODEL_ENV, raising=False)
    out = tmp_path / "run.toml"
    result = CliRunner().invoke(app, ["run", "init", "--from", str(model), "--adapter", "lora", "--run-id",
                                      "tiny-pin", "--out", str(out)])
    assert result.exit_code == 0, result.output
    config = parse_config(tomllib.loads(out.read_text()), str(out))
    # Then it pins the initial model by the digest of the one a participant builds from the model's files
    built = save_model(load_task(config.task, config).build_model(config.seed), tmp_path / "init.safetensors")
    honest = built.read_bytes()
    assert config.initial_model_digest == digest_file(built)
    # When the run starts, and the first offer ingested is an adversary's of the same tensors with other weights
    settings = {name: getattr(config, name) for name in ("run_id", "task", "hf", "dataset_size", "seed",
                                                          "initial_model_schema", "initial_model_digest")}
    h = harness_factory(**settings, min_clients=3, min_per_round=3, max_update_bytes=64 << 20)
    h.scheduled_tick()
    for pid in ("adversary", "alice", "bob"):
        h.join_alive(pid)
    tensors, _ = wire.decode(honest)
    other = {name: (arr + 1).astype(arr.dtype) for name, arr in tensors.items()}
    offer = h.send(keys.init_key(config.run_id, "adversary"), wire.encode(other))
    # Then it is refused, naming the digest the run pins; the run waits for the pinned model
    assert offer["accepted"] is False, offer
    assert f"initial_model_digest {config.initial_model_digest[:16]}" in offer["reason"]
    assert h.state().phase is Phase.WAITING
    # and starts from alice's offer of it
    assert h.send(keys.init_key(config.run_id, "alice"), honest)["accepted"] is True
    state = h.state()
    assert state.phase is Phase.TRAIN and state.model_source == "alice"
    assert state.global_digest == config.initial_model_digest


def test_a_built_in_tasks_run_file_pins_the_model_its_participants_build(tmp_path: Path) -> None:
    # When a run file is written for the digits task, at seed 7
    out = tmp_path / "digits.toml"
    result = CliRunner().invoke(app, ["run", "init", "--task", "digits", "--seed", "7", "--run-id", "digits-7",
                                      "--out", str(out)])
    # Then it pins the digest of the model the task builds from seed 7 (as each participant builds it)
    assert result.exit_code == 0, result.output
    config = parse_config(tomllib.loads(out.read_text()), str(out))
    assert (config.task, config.seed) == (digits_meta.TASK, 7)
    assert config.initial_model_schema == digits_meta.MODEL_SCHEMA
    built = save_model(load_task(config.task, config).build_model(7), tmp_path / "init.safetensors")
    assert config.initial_model_digest == digest_file(built)
    # and neither a task nor a model, or both, is refused with the reason
    neither = CliRunner().invoke(app, ["run", "init"])
    assert neither.exit_code == 2 and "--from DIR" in neither.output
    unknown = CliRunner().invoke(app, ["run", "init", "--task", "nonsense"])
    assert unknown.exit_code == 1 and "give one of digits" in unknown.output and "module:object" in unknown.output
