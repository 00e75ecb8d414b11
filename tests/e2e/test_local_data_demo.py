"""`fed demo --split`: participant processes each train on their own part of the digits training set."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fed.cli import app
from participant.splits import partition
from participant.tasks import digits_meta
from participant.tasks.digits import task as digits

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def test_fed_demo_split_dirichlet_trains_each_participant_on_its_own_part(tmp_path: Path) -> None:
    # Given `fed demo --split dirichlet:0.5` with three participants and three rounds
    report, work = tmp_path / "report.json", tmp_path / "work"
    args = ["demo", "--split", "dirichlet:0.5", "--participants", "3", "--rounds", "3", "--report", str(report),
            "--workdir", str(work), "--timeout", "240"]

    # When it runs
    result = CliRunner().invoke(app, args)

    # Then the run is in local data mode and every round aggregates all three updates
    assert result.exit_code == 0, result.output
    body = json.loads(report.read_text())
    assert body["config"]["data_mode"] == "local" and body["split"] == "dirichlet:0.5"
    assert [(r["aggregated"], r["accepted"], r["refused"]) for r in body["rounds"]] == [(True, 3, 0)] * 3
    # and each participant trained exactly its own part every round (computed here independently of the task)
    labels = digits._data[1].numpy()
    parts = partition(labels, 3, 0.5, seed=digits_meta.SPLIT_SEED)
    for i in range(3):
        log = (work / "logs" / f"p{i + 1}.log").read_text()
        sent = [int(n) for n in re.findall(r"update uploaded \(\d+ bytes, (\d+) samples", log)]
        assert sent == [len(parts[i])] * 3, (i, sent)
    assert body["final_accuracy"] > 0.5
