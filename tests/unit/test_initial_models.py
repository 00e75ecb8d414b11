"""The coordinator's table of the built-in tasks' initial-model schemas is the one their meta modules compute, and a
run file that pins nothing takes its task's."""

from __future__ import annotations

from typing import Any

import pytest

from participant.tasks import digits_meta, flower_digits_meta, lm_meta
from shared.config import RunConfig
from shared.initial_models import TASK_MODEL_SCHEMAS, task_model_schema


def test_the_table_holds_each_built_in_tasks_schema_as_its_meta_module_computes_it() -> None:
    assert TASK_MODEL_SCHEMAS == {meta.TASK: meta.MODEL_SCHEMA for meta in (digits_meta, flower_digits_meta, lm_meta)}


@pytest.mark.parametrize("meta", [digits_meta, flower_digits_meta, lm_meta], ids=lambda m: m.__name__)
def test_a_run_that_pins_nothing_takes_its_tasks_schema(meta: Any) -> None:
    task = meta.TASK
    assert RunConfig(run_id="run", task=task).initial_model_schema == meta.MODEL_SCHEMA
    assert RunConfig(run_id="run", task=task, initial_model_schema="").initial_model_schema == task_model_schema(task)


def test_a_pin_written_in_the_run_file_is_kept_and_an_unknown_task_gets_none() -> None:
    pinned = "ab" * 32
    assert RunConfig(run_id="run", initial_model_schema=pinned).initial_model_schema == pinned
    by_digest = RunConfig(run_id="run", initial_model_digest=pinned)
    assert by_digest.initial_model_digest == pinned and by_digest.initial_model_schema == ""
    assert RunConfig(run_id="run", task="my_tasks:task").initial_model_schema == ""
    # (the parsed config, written out and read again, is the same run)
    config = RunConfig(run_id="run")
    assert RunConfig.model_validate_json(config.model_dump_json()) == config
