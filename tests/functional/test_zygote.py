"""Participants forked from the zygote (fed/zygote.py) behave as `fed-participant` processes: their arguments,
output and exit status, a session of their own, a signal's end; a refusal to fork a process with threads, and
spawned commands when the zygote cannot fork."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from fed import zygote as zygote_module
from fed.demo.processes import Participants, participant_environment
from fed.zygote import Forked, Zygote
from store.connection import Connection

pytestmark = pytest.mark.skipif(not zygote_module.supported(), reason="forking participants needs Linux")


@pytest.fixture(scope="module")
def zygote(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Zygote]:
    z = Zygote(participant_environment(), tmp_path_factory.mktemp("zygote") / "zygote.log")
    z.start()
    yield z
    z.stop()


def test_a_forked_participant_runs_the_cli_with_its_arguments_and_its_log(zygote: Zygote, tmp_path: Path) -> None:
    log = tmp_path / "help.log"
    child = zygote.fork(["start", "--help"], participant_environment(), log)
    assert child.wait(60) == 0
    assert "Join a run and train until it is finished" in log.read_text()
    assert zygote._ready is not None and zygote._ready["threads"] == 1
    assert "torch" in zygote._ready["ready"]
    assert zygote._ready["frozen"] > 100_000  # torch's objects, out of the children's collections (no copy of them)


def test_its_exit_status_and_its_error_are_its_own(zygote: Zygote, tmp_path: Path) -> None:
    log = tmp_path / "bad.log"
    child = zygote.fork(["start", "--id", "p1", "--connection", str(tmp_path / "none.json")],
                        participant_environment(), log)
    assert child.wait(60) == 1
    assert "none.json not found" in log.read_text()


def test_a_signal_ends_it_and_the_zygote_reports_how(zygote: Zygote, tmp_path: Path) -> None:
    connection = tmp_path / "connection.json"
    Connection("r", "b", "t", endpoint="http://127.0.0.1:9").save(connection)  # nothing listens: it retries
    child = zygote.fork(["start", "--connection", str(connection), "--id", "p1", "--state-dir",
                         str(tmp_path / "state")], participant_environment(), tmp_path / "p1.log")
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(1.0)
    assert child.poll() is None
    assert os.getsid(child.pid) == child.pid  # a session of its own: Ctrl-C reaches the demo only
    child.kill()
    assert child.wait(30) == -signal.SIGKILL


def test_it_refuses_to_fork_a_process_with_threads(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(zygote_module, "threads", lambda: 2)
    reply = zygote_module._fork({"argv": [], "env": {}, "log": str(tmp_path / "x.log")}, ())
    assert "threads" in reply["error"]


def test_participants_are_spawned_as_commands_when_the_zygote_fails(monkeypatch: pytest.MonkeyPatch,
                                                                    tmp_path: Path) -> None:
    procs = Participants(tmp_path / "connection.json", tmp_path, forked=True, extra_args=["--help"])

    def refuse(*_args: object) -> Forked:
        raise zygote_module.ZygoteError("refused for the test")

    assert procs.zygote is not None
    monkeypatch.setattr(procs.zygote, "fork", refuse)
    try:
        procs.spawn(["p1"])
        process = procs.procs["p1"].process
        assert isinstance(process, subprocess.Popen)
        assert process.wait(60) == 0 and procs.zygote is None
    finally:
        procs.stop()


def test_the_zygote_refuses_where_there_is_no_fork(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(sys, "platform", "darwin")
    with pytest.raises(zygote_module.ZygoteError):
        Zygote({}, tmp_path / "z.log").start()
