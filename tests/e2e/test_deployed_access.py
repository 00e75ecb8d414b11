"""Participants whose every request is judged as AWS judges the participant role (`local.access`): a run starts,
witnesses, survives a participant restarted mid-round, and finishes, with no call refused (tests/conftest.py fails
the test on any) — with witnessing off and on, and with int8 downloads (a delta index that may be missing)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from local.access import ENFORCE, shared_ledger
from local.access.ledger import MISSING_AS_403, read_calls
from shared.state import MemberStatus, Phase
from tests.conftest import ledger_dir
from tests.e2e.harness import Run, e2e_config

CASES = {
    "no-witnesses": {},
    "witnesses": {"witness_nodes": 2, "witness_tolerance": 0.5, "round_witness_time": 4},
    "int8-downloads": {"download_encoding": "int8"},
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_run_judged_as_aws_judges_it_starts_witnesses_survives_a_restart_and_finishes(
    local_run: Callable[..., Run], request: pytest.FixtureRequest, case: str
) -> None:
    overrides: dict[str, Any] = CASES[case]
    # Given a run on the local stack whose calls are refused as IAM would refuse them (the participants hold the
    # participant role's rights only: their own keys, no listing of the bucket)
    config = e2e_config(total_rounds=4, min_clients=3, min_per_round=3, min_updates=2, liveness_timeout=30,
                        max_round_train_time=30, **overrides)
    run = local_run(config)
    assert run.stack.access is not None and run.stack.access.mode == ENFORCE, run.stack.access
    # (p2 trains at a twentieth of the speed: the round it is stopped in is mostly one it is still training)
    slow = {"p2": ["--throttle", "0.05"]}
    run.start_participants(["p1", "p2", "p3"], extra=slow)

    # When p2 is killed (SIGKILL) while a round after the first is open, and restarted (it resumes the round: trains
    # it again, or finds its upload of it landed and reads it back by version)
    def open_round() -> bool:
        s = run.state()
        return s.phase is Phase.TRAIN and 1 <= s.round < config.total_rounds - 1 and "p2" in s.selected

    run.wait_for(open_round, 90, "a round after the first")
    restarted_in = run.state().round
    run.procs.kill("p2")
    run.procs.spawn(["p2"], slow)

    # Then the run finishes with every round aggregated, p2 still a member that trained after its restart
    run.wait_for(lambda: run.state().phase is Phase.FINISHED, 180, "the run to finish")
    state = run.state()
    assert state.aggregated == config.total_rounds
    assert state.members["p2"].status is not MemberStatus.DROPPED, state.members["p2"]
    trained = [r.round for r in run.store.rounds() if "p2" in r.counted]
    assert any(r >= restarted_in for r in trained), (restarted_in, trained)
    if config.witness_nodes:
        assert all(r.witnesses and r.proofs for r in run.store.rounds() if r.aggregated), "every round witnessed"
    assert run.procs.wait_exit(30), "participants still running after the run finished"
    # And the participants' reads of their own missing keys were answered 403, as S3 answers a caller that may not
    # list the bucket, and read as "not there"
    ledger = shared_ledger()
    assert ledger is not None
    ledger.flush()
    answered_403 = sum(n for key, n in read_calls(ledger_dir())
                       if key.test == request.node.nodeid and key.outcome == MISSING_AS_403
                       and key.role == "participant")
    assert answered_403 > 0
