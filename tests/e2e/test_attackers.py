"""Two attacker identities against the protocol's own numbers, end to end (issue 31): real participant processes on
the local stack, each attacker with its own registered identity and only the rights the participant role gives.

Both attackers sort before every honest id and run `participant.tasks.hostile`: they offer a 3 x 3 initial model,
claim `train_seconds = 1e-6` for every update (a self-reported speed that once bought 8 x the median share), and
upload their honest change sign-flipped and scaled 5x. Whenever one holds a witness seat a script signing with its
key uploads a proof first: one attesting nobody, then one with every bit set. Throughput sizing is on.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from pathlib import Path

import pytest

from shared.config import RunConfig
from shared.state import MemberStatus, Phase
from tests.e2e.attackers import ScriptedWitness
from tests.e2e.harness import Run, e2e_config

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]

HOSTILE = "participant.tasks.hostile:task"
ATTACKERS = ["a1", "a2"]  # sort first: the first offer by id once became round 0's global
HONEST = ["p1", "p2", "p3"]
ROUNDS = 8


def config(run_id: str) -> RunConfig:
    return e2e_config(run_id=run_id, min_clients=3, min_per_round=3, min_updates=2, total_rounds=ROUNDS,
                      witness_nodes=3, round_witness_time=8, max_round_train_time=30, liveness_timeout=10,
                      learning_rate=0.1, local_epochs=2, batch_size=32)


def final_accuracy(run: Run) -> float:
    state = run.state()
    return run.accuracy(state.round, state.global_digest)


def test_two_attacker_identities_neither_steer_nor_wedge_the_run(local_run: Callable[..., Run],
                                                                  tmp_path: Path) -> None:
    # Given the run of the three honest participants alone, for reference
    clean = local_run(config("e2e-clean"))
    clean.start_participants(HONEST)
    clean.wait_for(lambda: clean.state().phase is Phase.FINISHED, 300, "the clean run to finish")
    reference = final_accuracy(clean)
    clean.procs.stop()
    clean.stack.stop()

    # When the same run has the two attackers as members too
    run = local_run(config("e2e-attacked"))
    run.start_participants([*ATTACKERS, *HONEST], tasks={a: HOSTILE for a in ATTACKERS})
    keys = {a: tmp_path / "participants" / a / "signing-key.pem" for a in ATTACKERS}
    with ScriptedWitness(run, "a1", keys["a1"]) as w1, ScriptedWitness(run, "a2", keys["a2"], ("overfull",)) as w2:
        run.wait_for(lambda: run.state().phase is Phase.FINISHED, 600, "the attacked run to finish")
    state = run.state()
    rounds = sorted(run.store.rounds(), key=lambda r: r.round)
    refusals = run.store.refusals()
    print(f"proofs sent: a1 {w1.sent}, a2 {w2.sent}")
    for r in rounds:
        print(f"round {r.round} epoch {r.epoch}: aggregated {r.aggregated}, counted {r.counted}, shares {r.shares}, "
              f"witnesses {r.witnesses}, dropped {dict(r.dropped)}")

    # Then the run finished, trained from an honest initial model: no 3 x 3 offer was ever taken (one that arrived
    # before the model was adopted was refused with its reason; one after it, moot)
    assert state.aggregated == ROUNDS
    assert state.model_source in HONEST
    participants = run.store.participants()
    assert all(participants[a].init_digest == "" for a in ATTACKERS)
    print("refused offers:", [(r.pid, r.reason[:80]) for r in refusals if "initial model refused" in r.reason])
    # And every honest member stayed: none was ever dropped
    assert all(state.members[p].status is MemberStatus.ACTIVE for p in HONEST), state.members
    assert not any(set(r.dropped) & set(HONEST) for r in rounds), [(r.round, r.dropped) for r in rounds]
    # And no update of an attacker was ever aggregated, and no claimed speed bought more than a fair share: an
    # attacker's share of a round is at most max_share_ratio x the median
    assert all(not set(r.counted) & set(ATTACKERS) for r in rounds)
    for r in rounds:
        if len(r.shares) >= 3:
            median = statistics.median(r.shares.values())
            assert all(r.shares.get(a, 0) <= 2 * median for a in ATTACKERS), (r.round, r.shares)
    # And the witness seats they held cost at most one round: each bad proof dropped its sender and barred it
    sent = {**{r: "a1" for r in w1.sent}, **{r: "a2" for r in w2.sent}}
    assert sent, "no attacker was ever an elected witness"
    assert sum(1 for r in rounds if not r.aggregated) <= 1, [(r.round, r.aggregated) for r in rounds]
    assert {a for a in ATTACKERS if a in sent.values()} <= {
        pid for r in rounds for pid, why in r.dropped.items() if "witness proof" in why}
    # And the final model is within two points of the run without the attackers (9 of the 450 test examples)
    final = final_accuracy(run)
    print(f"final test accuracy {final:.4f} with the attackers, {reference:.4f} without")
    assert final >= reference - 0.02, (final, reference)
    # And `fed verify` recomputes every aggregated round
    code, out = run.fed("verify")
    assert code == 0, out
