"""`fed-participant start --gpus 2` and `torchrun --nproc-per-node 2 ... fed-participant start`: a participant that
is a node of two ranks (gloo on this CPU) takes part in a run, uploading one update a round; one of its ranks killed
is a crash of the participant, which resumes when started again (by hand, or by torchrun's agent)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from fed.demo.processes import ParticipantProcess, await_joins, participant_command, participant_environment
from shared.state import Phase
from tests.e2e.harness import Run, e2e_config

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def _followers(parent: int) -> list[int]:
    """The pids of the node ranks `parent` started (`python -m participant.node ... --parent PID`)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"participant.node" in argv and str(parent).encode() in argv:
            found.append(int(entry.name))
    return found


def test_a_node_of_two_ranks_trains_and_a_killed_rank_is_a_participant_crash(local_run: Callable[..., Run]) -> None:
    # Given a run of three participants, p1 a node of two ranks training at half speed (its rounds last long enough
    # for a kill to land mid-round)
    config = e2e_config(total_rounds=5, max_round_train_time=60, liveness_timeout=20)
    run = local_run(config)
    run.start_participants(["p1", "p2", "p3"], extra={"p1": ["--gpus", "2", "--throttle", "0.5"]})
    p1 = run.procs.procs["p1"].process.pid
    run.wait_for(lambda: bool(_followers(p1)), 120, "p1's second rank to start")
    first = _followers(p1)

    # When its second rank is SIGKILLed once the run is in its second round
    run.wait_for(lambda: run.store.read_state().aggregated >= 1, 120, "the first round")
    os.kill(first[0], signal.SIGKILL)

    # Then p1 stops as a crashed participant would (exit 1, naming the lost rank), leaving no rank behind
    p1_process = run.procs.procs["p1"].process
    run.procs.procs["p1"].killed = True  # (its exit 1 is expected: not a failure of the run's processes)
    assert p1_process.wait(60) == 1
    assert "the node lost a rank" in run.procs.procs["p1"].log.read_text()
    assert _followers(p1) == []
    # and started again, it resumes (its journal and id) while the others went on, and the run finishes
    run.procs.spawn(["p1"], {"p1": ["--gpus", "2"]})
    run.wait_for(lambda: run.store.read_state().phase is Phase.FINISHED, 240, "the run to finish")
    rounds = sorted(run.store.rounds(), key=lambda r: r.round)
    assert [r.round for r in rounds] == [0, 1, 2, 3, 4]
    assert all(r.aggregated for r in rounds) and "p1" in rounds[0].counted
    assert run.procs.wait_exit(60)
    assert [run.procs.procs[n].process.returncode for n in ("p1", "p2", "p3")] == [0, 0, 0]


def _torchrun_ranks(agent: int) -> dict[int, int]:
    """{rank: pid} of the workers torchrun's agent `agent` started (their environment's RANK)."""
    ranks = {}
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == agent:
                env = dict(v.split(b"=", 1) for v in (entry / "environ").read_bytes().split(b"\0") if b"=" in v)
                ranks[int(env[b"RANK"])] = int(entry.name)
        except (OSError, KeyError, ValueError):
            continue
    return ranks


def test_a_node_torchrun_started_trains_and_its_agent_restarts_it_after_a_lost_rank(
        local_run: Callable[..., Run]) -> None:
    # Given a run of two participants, p1 a node of two ranks that torchrun starts (each rank runs
    # `fed-participant start`; rank 1 only follows), allowed one restart
    config = e2e_config(min_clients=2, min_per_round=2, total_rounds=4, max_round_train_time=60, liveness_timeout=20)
    run = local_run(config)
    log = run.workdir / "logs" / "p1.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    args = ["start", "--connection", str(run.connection_file), "--id", "p1", "--state-dir",
            str(run.workdir / "participants" / "p1"), "--threads", "1", "--poll-max", "0.5", "--throttle", "0.5"]
    with log.open("ab") as out:
        agent = subprocess.Popen([str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc-per-node",
                                  "2", "--max-restarts", "1", "--no-python", *participant_command(), *args],
                                 stdout=out, stderr=subprocess.STDOUT, env=participant_environment())
    run.procs.procs["p1"] = ParticipantProcess("p1", agent, log)
    run.procs.spawn(["p2"])
    await_joins(run.stack, ["p1", "p2"], run.procs, timeout=120)
    run.stack.release_events()

    # When, once the first round is aggregated, rank 1 is SIGKILLed
    run.wait_for(lambda: run.store.read_state().aggregated >= 1, 120, "the first round")
    ranks = _torchrun_ranks(agent.pid)
    assert sorted(ranks) == [0, 1]
    os.kill(ranks[1], signal.SIGKILL)

    # Then torchrun's agent restarts the node (new processes, the same participant resuming from its journal), and
    # the run finishes with p1's updates counted after the restart too
    run.wait_for(lambda: _torchrun_ranks(agent.pid).get(1) not in (None, ranks[1]), 120, "the node's restart")
    run.wait_for(lambda: run.store.read_state().phase is Phase.FINISHED, 240, "the run to finish")
    rounds = sorted(run.store.rounds(), key=lambda r: r.round)
    assert [r.round for r in rounds] == [0, 1, 2, 3]
    assert all(r.aggregated for r in rounds) and "p1" in rounds[0].counted and "p1" in rounds[-1].counted
    assert run.procs.wait_exit(60)
    assert agent.returncode == 0 and run.procs.procs["p2"].process.returncode == 0
    # and only rank 0 spoke to the coordinator: one join per start of the node, the lost rank named
    text = log.read_text()
    assert text.count("join request sent") == 2 and text.count("node of 2 ranks (gloo, torchrun) up") == 2
    # (rank 0 names it when the loss breaks a collective it is in; when rank 0 is between collectives, torchrun's
    # agent sees the dead worker first, names it and stops rank 0: which comes first is a race, both name the rank)
    assert "the node lost a rank" in text or "failed (exitcode: -9) local_rank: 1" in text
