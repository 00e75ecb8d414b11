"""What a Hugging Face update names of the model it was trained from (`fed.model`), and how ingest's admission rules
judge it against the run's `[run.hf]` digests: the wire format, `HfOptions.identity`, `model_mismatch` and
`check_update_meta`. No AWS, no torch."""

from __future__ import annotations

import json
from typing import Any

import pytest

from shared.admission import check_update_meta, model_mismatch
from shared.config import Adapter, HfOptions, RunConfig
from shared.state import Member, Phase, RunState
from shared.wire import MAX_METRICS_BYTES, UpdateMeta, WireError

RUN = "hf-run"
PIDS = ("alice", "bob")
CONFIG, TOKENIZER, BASE = "c" * 64, "7" * 64, "b" * 64
OTHER = "0123456789ab" + "f" * 52
NAMED = {"config": CONFIG, "tokenizer": TOKENIZER, "base": BASE}


def meta(model: dict[str, str] | None = None, **changes: Any) -> UpdateMeta:
    base: dict[str, Any] = dict(run_id=RUN, round=2, participant="bob", samples=10, metrics={"loss": 1.5},
                                model=dict(NAMED) if model is None else model)
    base.update(changes)
    return UpdateMeta(**base)


def hf(**changes: Any) -> HfOptions:
    base: dict[str, Any] = dict(config_digest=CONFIG, tokenizer_digest=TOKENIZER, base_digest=BASE,
                                adapter=Adapter.LORA)
    base.update(changes)
    return HfOptions(**base)


def run_config(options: HfOptions) -> RunConfig:
    return RunConfig(run_id=RUN, task="participant.tasks.hf:task", hf=options)


def state() -> RunState:
    return RunState(RUN, phase=Phase.TRAIN, epoch=1, round=2, members={p: Member() for p in PIDS}, selected=PIDS)


def metadata_with(model: str) -> dict[str, str]:
    return meta(model={}).to_metadata() | {"fed.model": model}


# --- the wire format ------------------------------------------------------------------------------------


def test_the_model_an_update_names_survives_the_metadata_round_trip() -> None:
    # Given an update naming its config, tokenizer and base digests
    sent = meta()
    # When it is written as safetensors metadata and read back
    md = sent.to_metadata()
    # Then fed.model holds them as JSON, and parsing gives the same update back
    assert json.loads(md["fed.model"]) == NAMED
    assert UpdateMeta.from_metadata(md) == sent


def test_an_update_naming_no_model_writes_no_fed_model_and_reads_back_as_naming_none() -> None:
    # Given an update of a task that names no model (every task but the Hugging Face one)
    sent = meta(model={})
    # When it round-trips through the metadata
    md = sent.to_metadata()
    # Then no fed.model is written (such files are byte-for-byte what they were before), and none is read back
    assert "fed.model" not in md
    assert UpdateMeta.from_metadata(md).model == {}


@pytest.mark.parametrize(
    "raw, words",
    [
        ("{not json", "fed.model is not JSON"),
        ("", "fed.model is not JSON"),
        ('["config", "tokenizer"]', "fed.model must map names to digests"),
        ('"' + CONFIG + '"', "fed.model must map names to digests"),
        ('{"config": 7}', "fed.model must map names to digests"),
        ('{"config": {"nested": "x"}}', "fed.model must map names to digests"),
        ('{"config": null}', "fed.model must map names to digests"),
        (json.dumps({"config": "x" * MAX_METRICS_BYTES}), f"fed.model exceeds {MAX_METRICS_BYTES} bytes"),
    ],
)
def test_malformed_fed_model_is_a_wire_error(raw: str, words: str) -> None:
    # Given update metadata whose fed.model is not a small JSON object of strings
    md = metadata_with(raw)
    # When it is parsed, then it is refused, the reason saying what is wrong with it
    with pytest.raises(WireError, match=words):
        UpdateMeta.from_metadata(md)


def test_a_fed_model_just_under_the_limit_is_read() -> None:
    # Given a fed.model of exactly the largest size allowed
    filler = "x" * (MAX_METRICS_BYTES - len(json.dumps({"config": ""})))
    raw = json.dumps({"config": filler})
    assert len(raw) == MAX_METRICS_BYTES
    # When it is parsed, then it is kept as named
    assert UpdateMeta.from_metadata(metadata_with(raw)).model == {"config": filler}


# --- the run's identity ---------------------------------------------------------------------------------


def test_a_full_fine_tuning_run_identifies_its_model_by_config_and_tokenizer_only() -> None:
    # Given a run without adapters, even one that recorded a base digest
    options = hf(adapter=Adapter.NONE)
    # Then updates must name its config and tokenizer; the base is not part of it (the update is the whole model)
    assert options.identity() == {"config": CONFIG, "tokenizer": TOKENIZER}


def test_an_adapter_run_identifies_its_model_by_its_base_too() -> None:
    assert hf().identity() == NAMED


@pytest.mark.parametrize(
    "changes, expected",
    [
        ({"config_digest": ""}, {"tokenizer": TOKENIZER, "base": BASE}),
        ({"tokenizer_digest": ""}, {"config": CONFIG, "base": BASE}),
        ({"base_digest": ""}, {"config": CONFIG, "tokenizer": TOKENIZER}),
        ({"config_digest": "", "tokenizer_digest": "", "base_digest": ""}, {}),
    ],
)
def test_digests_the_run_did_not_record_are_not_checked(changes: dict[str, str], expected: dict[str, str]) -> None:
    assert hf(**changes).identity() == expected


def test_the_default_run_records_no_model() -> None:
    assert HfOptions().identity() == {}
    assert RunConfig(run_id=RUN).hf.identity() == {}


@pytest.mark.parametrize("bad", ["A" * 64, "c" * 63, "c" * 65, "not-a-digest"])
def test_a_recorded_digest_must_be_64_lower_case_hex(bad: str) -> None:
    with pytest.raises(ValueError):
        hf(tokenizer_digest=bad)


# --- model_mismatch -------------------------------------------------------------------------------------


def test_an_update_naming_every_recorded_digest_matches() -> None:
    assert model_mismatch(NAMED, NAMED) == ""
    assert model_mismatch(NAMED, {"tokenizer": TOKENIZER}) == ""  # parts the run did not record are not compared
    assert model_mismatch({}, {}) == ""  # a run recording nothing takes any update
    assert model_mismatch({"extra": "x"} | NAMED, NAMED) == ""  # names beyond the run's are not judged


@pytest.mark.parametrize("part", ["config", "tokenizer", "base"])
def test_an_update_naming_another_digest_is_refused_naming_the_part(part: str) -> None:
    # Given an update naming another digest for one part of the run's model
    named = NAMED | {part: OTHER}
    # When it is judged, then the reason names the part, its digest and the run's (each cut to 12 hex)
    assert model_mismatch(named, NAMED) == (
        f"trained from another model: its {part} digest is {OTHER[:12]}, the run's is {NAMED[part][:12]}")


@pytest.mark.parametrize("part", ["config", "tokenizer", "base"])
def test_an_update_leaving_out_a_recorded_part_is_refused_naming_it(part: str) -> None:
    named = {k: v for k, v in NAMED.items() if k != part}
    assert model_mismatch(named, NAMED) == (
        f"trained from another model: its {part} digest is none, the run's is {NAMED[part][:12]}")


def test_an_update_naming_no_model_is_refused_by_a_run_that_recorded_one() -> None:
    # Given an update that names nothing (e.g. from a host running another task) in a run that recorded digests
    reason = model_mismatch({}, NAMED)
    # Then it is refused, naming the first recorded part it lacks
    assert reason == f"trained from another model: its config digest is none, the run's is {CONFIG[:12]}"


def test_an_update_naming_an_empty_digest_is_refused() -> None:
    assert "its tokenizer digest is none" in model_mismatch(NAMED | {"tokenizer": ""}, NAMED)


# --- check_update_meta ----------------------------------------------------------------------------------


def test_an_update_of_the_runs_model_passes_the_metadata_checks() -> None:
    check_update_meta(meta(), run_config(hf()), state(), "bob", 2)
    # (a full fine-tuning run does not compare the base, so an adapter's base named or not makes no difference)
    check_update_meta(meta(model={"config": CONFIG, "tokenizer": TOKENIZER}), run_config(hf(adapter=Adapter.NONE)),
                      state(), "bob", 2)


@pytest.mark.parametrize(
    "model, words",
    [
        (NAMED | {"tokenizer": OTHER}, f"its tokenizer digest is {OTHER[:12]}, the run's is {TOKENIZER[:12]}"),
        (NAMED | {"config": OTHER}, f"its config digest is {OTHER[:12]}, the run's is {CONFIG[:12]}"),
        (NAMED | {"base": OTHER}, f"its base digest is {OTHER[:12]}, the run's is {BASE[:12]}"),
        ({}, f"its config digest is none, the run's is {CONFIG[:12]}"),
    ],
)
def test_an_update_of_another_model_fails_the_metadata_checks(model: dict[str, str], words: str) -> None:
    # Given a run that recorded its model's digests, when an update names others, then it is a WireError (the
    # refusal reason ingest records)
    with pytest.raises(WireError, match=words):
        check_update_meta(meta(model=model), run_config(hf()), state(), "bob", 2)


def test_a_run_recording_no_model_takes_updates_naming_any() -> None:
    check_update_meta(meta(model={"tokenizer": OTHER}), run_config(HfOptions()), state(), "bob", 2)
    check_update_meta(meta(model={}), RunConfig(run_id=RUN), state(), "bob", 2)
