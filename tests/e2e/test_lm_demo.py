"""`fed demo --task lm`: the local stack and real participant processes training the byte-level transformer."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fed.cli import app
from participant.tasks import lm_meta

# Two rounds of two participants: one pass over the corpus a round, about 20 s a round on an idle 2-core machine
# (up to a minute under load), so this is a slow test (`make test-slow`).
pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]


def test_fed_demo_task_lm_lowers_the_held_out_loss(tmp_path: Path) -> None:
    # Given `fed demo --task lm` with two participants and two rounds
    report, plot = tmp_path / "lm.json", tmp_path / "lm.png"
    args = ["demo", "--task", "lm", "--participants", "2", "--rounds", "2", "--report", str(report), "--plot",
            str(plot), "--workdir", str(tmp_path / "work"), "--timeout", "480"]

    # When it runs
    result = CliRunner().invoke(app, args)

    # Then it exits 0, printing each round's held-out loss and perplexity
    assert result.exit_code == 0, result.output
    assert "test loss" in result.output and "perplexity" in result.output and "finished" in result.output
    body = json.loads(report.read_text())
    assert body["config"]["task"] == lm_meta.TASK and body["config"]["dataset_size"] == lm_meta.TRAIN_SIZE
    rounds = body["rounds"]
    assert [r["round"] for r in rounds] == [0, 1]
    for row in rounds:
        assert row["aggregated"] and row["accepted"] == 2 and row["refused"] == 0
        assert row["test_perplexity"] == pytest.approx(math.exp(row["test_loss"]))
    # and the held-out loss fell from the untrained model's ln(256) = 5.55, and again from the first round to the last
    assert rounds[0]["test_loss"] < 4.0
    assert rounds[-1]["test_loss"] < rounds[0]["test_loss"]
    assert body["final_test_loss"] == rounds[-1]["test_loss"]
    assert plot.stat().st_size > 0
