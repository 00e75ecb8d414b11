"""`fed-participant start --gpus 2`: a participant that is a node of two ranks (gloo on this CPU) takes part in a run,
uploading one update a round; one of its ranks killed is a crash of the participant, which resumes when started
again."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path

import pytest

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
