"""The whole system on one machine: the local stack, real participant processes training digits with torch."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fed.cli import app
from fed.status import collect
from shared import keys
from shared.state import MemberStatus, Phase
from shared.wire import digest
from store.blobs import Bucket, s3_client
from tests.e2e.harness import Run, e2e_config

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


def test_a_run_with_three_participants_finishes(local_run: Callable[..., Run]) -> None:
    # Given the local stack and three participant processes
    config = e2e_config(total_rounds=3)
    run = local_run(config)
    names = ["p1", "p2", "p3"]

    # When they join and train
    run.start_participants(names)
    run.wait_for(lambda: run.store.read_state().phase is Phase.FINISHED, 90, "the run to finish")

    # Then every round was aggregated from all three updates, and the state points to the last global model
    state = run.store.read_state()
    rounds = sorted(run.store.rounds(), key=lambda r: r.round)
    assert state.aggregated == 3 and [r.round for r in rounds] == [0, 1, 2]
    assert all(r.aggregated and r.counted == ("p1", "p2", "p3") and not r.refused for r in rounds)
    assert all(r.loss is not None and r.loss > 0 for r in rounds)
    assert rounds[-1].loss < rounds[0].loss
    c = run.stack.connection
    final_key = keys.global_key(config.run_id, state.round, state.global_digest)
    final = Bucket(c.bucket, s3_client(c.endpoint, c.region)).get(final_key)
    assert digest(final.data) == state.global_digest == rounds[-1].global_digest
    # and every participant noticed the end and exited cleanly
    assert run.procs.wait_exit(30), "participants still running after the run finished"
    assert [p.process.returncode for p in run.procs.procs.values()] == [0, 0, 0]


def test_a_participant_killed_mid_round_is_dropped_and_the_run_finishes(local_run: Callable[..., Run]) -> None:
    # Given three participants in a run that can go on with two (an epoch starts once two are in: the third may
    # come in only at the next one, hence two epochs)
    config = e2e_config(min_clients=2, min_per_round=2, min_updates=2, total_rounds=8, rounds_per_epoch=4)
    run = local_run(config)
    # (p3 trains at a tenth of the speed, so the kill below mostly lands before its update)
    run.start_participants(["p1", "p2", "p3"], extra={"p3": ["--throttle", "0.1"]})
    run.wait_for(lambda: len(run.store.read_state().members) == 3, 60, "all three to be admitted")

    # When p3 is killed (SIGKILL) as soon as a round of the last epoch after its first one selects it (it has
    # trained in a round by then), and before the last round: every member trains every round, so a round
    # after the kill selects p3 even where its update of the kill's round came first, and cannot close until the
    # coordinator drops it (the run could otherwise end before p3 fell silent)
    first, last = config.rounds_per_epoch + 1, config.total_rounds - 2

    def p3_training() -> bool:
        s = run.store.read_state()
        return s.phase is Phase.TRAIN and first <= s.round <= last and "p3" in s.selected
    run.wait_for(p3_training, 60, "a round selecting p3")
    killed_in = run.store.read_state().round
    run.procs.kill("p3")

    # Then the coordinator drops it (silent, or missed the deadline) and the run still finishes
    run.wait_for(lambda: run.store.read_state().phase is Phase.FINISHED, 90, "the run to finish without p3")
    state = run.store.read_state()
    assert state.aggregated == config.total_rounds
    assert state.members["p3"].status is MemberStatus.DROPPED
    reason = state.members["p3"].reason
    assert "silent" in reason or "missed the deadline" in reason, reason
    rounds = sorted(run.store.rounds(), key=lambda r: r.round)
    dropped_in = [r for r in rounds if "p3" in r.dropped]
    assert dropped_in and dropped_in[0].round >= killed_in
    assert dropped_in[0].dropped["p3"] == reason
    assert all("p3" not in r.counted for r in rounds if r.round > dropped_in[0].round)
    assert all(r.aggregated for r in rounds)  # two updates were still enough for every round
    # and `fed status` shows it dropped, with the reason
    lines = {p.pid: p for p in collect(run.stack.connection).participants}
    assert (lines["p3"].state, lines["p3"].reason) == ("dropped", reason)
    assert lines["p1"].state == lines["p2"].state == "finished"
    # and the survivors finish normally
    assert run.procs.wait_exit(30)
    assert run.procs.procs["p1"].process.returncode == 0 and run.procs.procs["p2"].process.returncode == 0


def test_fed_demo_writes_the_report(tmp_path: Path) -> None:
    # Given `fed demo` with two participants and two rounds
    report = tmp_path / "demo.json"
    args = ["demo", "--participants", "2", "--rounds", "2", "--report", str(report), "--workdir",
            str(tmp_path / "work"), "--timeout", "120"]

    # When it runs
    result = CliRunner().invoke(app, args)

    # Then it exits 0 with the per-round table printed and the report written
    assert result.exit_code == 0, result.output
    assert "test acc" in result.output and "finished" in result.output
    body = json.loads(report.read_text())
    assert set(body) >= {"config", "rounds", "final_accuracy", "wall_seconds"}
    assert body["config"]["total_rounds"] == 2 and body["config"]["min_clients"] == 2
    assert [r["round"] for r in body["rounds"]] == [0, 1]
    for row in body["rounds"]:
        assert set(row) >= {"round", "participants", "accepted", "refused", "loss", "accuracy", "seconds"}
        # (the witnesses may leave out an update that makes the aggregate worse: seen once, p2's in round 1)
        assert row["participants"] == 2 and row["accepted"] >= 1 and row["refused"] == 0
        assert 0.0 < row["accuracy"] <= 1.0 and row["seconds"] > 0
    assert sum(r["accepted"] for r in body["rounds"]) >= 3  # at most one left out
    assert body["final_accuracy"] == body["rounds"][-1]["accuracy"]
    assert body["final_accuracy"] > 0.5  # two rounds of digits from scratch
    assert body["wall_seconds"] > 0
