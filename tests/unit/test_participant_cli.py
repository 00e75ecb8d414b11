"""`fed-participant`: help, usage errors and the connection checks, without starting a daemon."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from participant.cli import app, default_participant_id, use_local_credentials
from shared.keys import validate_participant_id

runner = CliRunner()


@pytest.fixture(autouse=True)
def restore_participant_logging() -> Iterator[None]:
    """`start` configures the participant logger for CliRunner's streams, which close after the call."""
    logger = logging.getLogger("participant")
    saved = (list(logger.handlers), logger.level, logger.propagate)
    yield
    logger.handlers[:], logger.level, logger.propagate = saved[0], saved[1], saved[2]


def test_top_level_help_names_the_start_command() -> None:
    result = runner.invoke(app, ["--help"], env={"COLUMNS": "120"})
    assert result.exit_code == 0
    assert "start" in result.output and "Join a run and train until it is finished" in result.output


def test_start_help_explains_every_flag_with_examples() -> None:
    result = runner.invoke(app, ["start", "--help"], env={"COLUMNS": "160"})
    assert result.exit_code == 0
    for flag in ("--id", "--connection", "--stack", "--region", "--run", "--task", "--state-dir", "--device",
                 "--threads", "--max-rounds", "--poll-max", "--log-level"):
        assert flag in result.output, flag
    assert "Examples" in result.output and "fed-participant start --id alice" in result.output
    assert "Exit status" in result.output


def test_an_invalid_id_is_a_usage_error() -> None:
    result = runner.invoke(app, ["start", "--id", "../etc"])
    assert result.exit_code == 2
    assert "invalid participant id" in result.output


def test_a_missing_connection_file_says_how_to_get_one(tmp_path: Path) -> None:
    result = runner.invoke(app, ["start", "--id", "alice", "--connection", str(tmp_path / "nope.json")])
    assert result.exit_code == 1
    assert "fed local" in result.output


def test_run_must_match_the_connection(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    conn = tmp_path / "local.json"
    conn.write_text(json.dumps({"run_id": "local", "bucket": "fed-local", "table": "fed-local-state",
                                "endpoint": "http://127.0.0.1:1", "region": "us-east-1"}))
    result = runner.invoke(app, ["start", "--id", "alice", "--connection", str(conn), "--run", "other"])
    assert result.exit_code == 1
    assert "--run other" in result.output and "'local'" in result.output


def test_loopback_endpoints_get_throwaway_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAREALKEY")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "real-secret")
    monkeypatch.setenv("AWS_PROFILE", "prod")
    monkeypatch.setenv("AWS_SESSION_TOKEN", "token")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "false")  # so that monkeypatch restores all of these
    assert not use_local_credentials(None)  # AWS: the standard chain, untouched
    assert not use_local_credentials("https://s3.example.com")
    assert os.environ["AWS_ACCESS_KEY_ID"] == "AKIAREALKEY"
    assert use_local_credentials("http://127.0.0.1:4566")
    assert os.environ["AWS_ACCESS_KEY_ID"] == "local" and "AWS_PROFILE" not in os.environ
    assert "AWS_SESSION_TOKEN" not in os.environ


def test_the_default_id_is_a_valid_one() -> None:
    assert validate_participant_id(default_participant_id())
