"""The Hugging Face task's own data in local data mode: a host's files, or a part of the run's text (`iid:I/N`)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from participant.tasks.hf_data import TextError
from tests.functional.conftest import hf_local_task as _task


def test_iid_parts_of_the_runs_text_are_disjoint_and_cover_it(hf_model: Path) -> None:
    # Given three hosts, each holding part I of 3 of the run's training text
    parts = []
    for i in range(3):
        task = _task(hf_model)
        indices = task.local_data(f"iid:{i}/3")
        assert list(indices) == list(range(task.train_size))
        parts.append(task._own)
    # Then together they are the run's training sequences, each once
    whole = _task(hf_model)._shared[0]
    joined = np.concatenate(parts)
    assert len(joined) == len(whole)
    assert sorted(map(bytes, joined)) == sorted(map(bytes, whole))
    # and a label skew is refused: text has no labels
    with pytest.raises(ValueError, match="no labels"):
        _task(hf_model).local_data("dirichlet:0.5:0/3")


def test_a_hosts_json_lines_are_its_training_set_and_a_bad_line_is_named(hf_model: Path, tmp_path: Path) -> None:
    # Given a host's own JSON-lines file
    own = tmp_path / "mine.jsonl"
    own.write_text("\n".join(json.dumps({"body": f"def f{i}(x):\n    return x * {i}\n" * 20}) for i in range(30)))

    # When the task loads it as local data (field "body")
    task = _task(hf_model, text_field="body")
    indices = task.local_data(str(own))

    # Then its sequences are what this host trains
    assert len(indices) == task.train_size > 10
    # and a line that is not JSON is refused, naming the file and line
    own.write_text('{"body": "fine"}\nnot json\n')
    with pytest.raises(TextError, match=r"mine.jsonl:2: not JSON"):
        _task(hf_model, text_field="body").local_data(str(own))
