"""Witnesses under attack (issue 14): proofs that claim more than they could know, proofs too long to record,
witnesses that withhold attestations, and rounds closed on partial proofs."""

from __future__ import annotations

import json
import time

import pytest

from coordinator.service import run_tick
from shared import keys
from shared.config import RunConfig
from shared.state import MemberStatus, Phase
from shared.witness import MAX_PROOF_BYTES, Proof
from tests.functional.conftest import Harness
from tests.functional.test_witnesses import PIDS, model, recorded_digests, send_proof

DEFAULT_WITNESS_TIME = RunConfig.model_fields["round_witness_time"].default


def witnessed_round(harness_factory, witnesses: int) -> Harness:  # type: ignore[no-untyped-def]
    """Four members, `witnesses` witnesses a round, the default witness deadline; every update is in."""
    h: Harness = harness_factory(min_clients=3, min_per_round=3, min_updates=2, witness_nodes=witnesses,
                                 round_witness_time=DEFAULT_WITNESS_TIME, health_strikes=1)
    h.start(PIDS)  # (one strike drops: what is tested here is whether a round's records are evidence at all)
    for i, pid in enumerate(PIDS):
        h.upload(pid, model(1.0 + i))
    return h


@pytest.fixture
def attacked(harness_factory) -> Harness:  # type: ignore[no-untyped-def]
    """Three witnesses a round (quorum 2)."""
    return witnessed_round(harness_factory, 3)


def test_an_over_full_filter_is_refused_with_its_reason(attacked: Harness) -> None:
    h = attacked
    w = h.state().witnesses[0]
    full = {"participants": {"bits": 64, "hashes": 8, "hex": "ff" * 8},
            "digests": {"bits": 64, "hashes": 8, "hex": "ff" * 8}}
    result = send_proof(h, w, {}, full)
    assert result["accepted"] is False and "bits set" in str(result["reason"])
    assert any("bits set" in r.reason for r in h.deps.store.refusals())
    # A small filter half set: few bits, yet it would attest a large share of what its witness never saw
    sparse = {"participants": {"bits": 8, "hashes": 1, "hex": "0f"}, "digests": {"bits": 8, "hashes": 1, "hex": "0f"}}
    result = send_proof(h, h.state().witnesses[1], {}, sparse)
    assert result["accepted"] is False and "never saw" in str(result["reason"])
    assert h.state().round == 0


def test_an_honest_filter_is_not_an_overclaim(attacked: Harness) -> None:
    h = attacked
    digests = recorded_digests(h)
    for w in h.state().witnesses[:2]:
        assert send_proof(h, w, digests)["accepted"]
    assert h.state().round == 1


def test_a_proof_that_grows_past_the_item_limit_when_recorded_is_refused_and_recorded(attacked: Harness) -> None:
    h = attacked
    s = h.state()
    w = s.witnesses[0]
    # Non-ASCII evaluation keys: 4 bytes each as uploaded, 12 as `\\ud83d\\ude00` once the proof is written out
    evaluations = {"\U0001f600" * 59 + f"{i:04d}": 0.5 for i in range(950)}
    proof = json.loads(Proof.build(
        h.config.run_id, s.round, w, s.witnesses.index(w), {}, len(s.selected), complete=True).to_json())
    proof["evaluations"] = evaluations
    body = json.dumps(proof, ensure_ascii=False).encode()
    assert len(body) <= MAX_PROOF_BYTES
    result = h.send(keys.witness_key(h.config.run_id, s.round, w), body)
    assert result["accepted"] is False and "record limit" in str(result["reason"])
    assert any("record limit" in r.reason for r in h.deps.store.refusals())
    # the run goes on: the two other witnesses decide the round
    for other in s.witnesses[1:]:
        assert send_proof(h, other, recorded_digests(h))["accepted"]
    assert h.state().round == 1


def test_a_partial_disagreeing_set_of_proofs_does_not_close_the_round(attacked: Harness) -> None:
    h = attacked
    honest, attacker, late = h.state().witnesses
    assert send_proof(h, attacker, {})["accepted"]  # early and empty
    assert send_proof(h, honest, recorded_digests(h))["accepted"]
    s = h.state()
    assert s.round == 0 and s.phase is Phase.WITNESS  # a quorum is in, but it disagrees: wait for the third
    assert send_proof(h, late, recorded_digests(h))["accepted"]
    s = h.state()
    assert s.round == 1 and s.aggregated == 1
    summary = h.deps.store.rounds()[0]
    assert set(summary.counted) == set(PIDS)
    assert attacker in summary.suspects and "refused the update" in summary.suspects[attacker]


def test_agreeing_proofs_attesting_everything_close_the_round_at_once(attacked: Harness) -> None:
    h = attacked
    first, second, _ = h.state().witnesses
    for w in (first, second):
        assert send_proof(h, w, recorded_digests(h))["accepted"]
    assert h.state().round == 1


def test_two_empty_proofs_of_three_cost_no_round_and_drop_their_witnesses(attacked: Harness) -> None:
    # Given a round whose witnesses are two attackers sending empty proofs and one honest witness (issue 31: this
    # left the round unaggregated, and the attackers could do it again the next time they held the seats)
    h = attacked
    honest, *attackers = h.state().witnesses
    for w in attackers:
        assert send_proof(h, w, {})["accepted"]
    assert send_proof(h, honest, recorded_digests(h))["accepted"]
    # Then the empty proofs are refused against the records: their witnesses are dropped, with why, and the seats
    # they held go to the round's other member (the only one left), drawn from the round's seed
    s = h.state()
    assert s.round == 0 and s.phase is Phase.WITNESS
    for w in attackers:
        assert s.members[w].status is MemberStatus.DROPPED and "attests none" in s.members[w].reason, s.members[w]
        assert s.witness_strikes[w] == 1
    (other,) = set(PIDS) - {honest, *attackers}
    assert s.witnesses == (honest, other) and set(s.unseated) == set(attackers)
    # And when the new witness attests, the round aggregates: no round lost
    assert send_proof(h, other, recorded_digests(h))["accepted"]
    s = h.state()
    assert s.round == 1 and s.aggregated == 1
    summary = h.deps.store.rounds()[0]
    assert summary.aggregated and set(summary.dropped) == set(attackers), summary
    assert {honest, other} <= set(summary.counted)
    # And a participant whose proofs were refused holds no witness seat again, though the next epoch (two members
    # were too few to go on) admits it again as a trainer
    assert s.epoch == 2 and set(attackers) <= set(s.members) and not set(attackers) & set(s.witnesses), s


def test_an_over_full_proof_costs_no_round_and_drops_its_witness(attacked: Harness) -> None:
    h = attacked
    first, second, third = h.state().witnesses
    full = {"participants": {"bits": 64, "hashes": 8, "hex": "ff" * 8},
            "digests": {"bits": 64, "hashes": 8, "hex": "ff" * 8}}
    assert send_proof(h, first, {}, full)["accepted"] is False
    assert send_proof(h, second, recorded_digests(h))["accepted"]
    s = h.state()
    assert s.members[first].status is MemberStatus.DROPPED and "bits set" in s.members[first].reason
    (other,) = set(PIDS) - {first, second, third}
    assert s.witnesses == (other, second, third) and s.round == 0
    assert send_proof(h, third, recorded_digests(h))["accepted"]
    assert h.state().aggregated == 1


def test_one_empty_proof_of_two_drops_its_witness_and_nobody_else(harness_factory) -> None:  # type: ignore[no-untyped-def]
    h = witnessed_round(harness_factory, 2)
    honest, attacker = h.state().witnesses
    assert send_proof(h, attacker, {})["accepted"]
    assert send_proof(h, honest, recorded_digests(h))["accepted"]
    s = h.state()
    assert s.round == 0 and s.members[attacker].status is MemberStatus.DROPPED
    (replacement,) = [w for w in s.witnesses if w != honest]
    assert send_proof(h, replacement, recorded_digests(h))["accepted"]
    assert h.state().round == 1 and h.state().aggregated == 1
    for pid in PIDS:  # every member names every other: the round's records drop nobody honest on that
        h.send(keys.health_key(h.config.run_id, 0, pid), json.dumps({"unhealthy": PIDS}).encode())
    assert {p for p, m in h.state().members.items() if m.status is MemberStatus.ACTIVE} == set(PIDS) - {attacker}


def test_a_unanimous_refusal_still_drops_the_refused(attacked: Harness) -> None:
    h = attacked
    honest = {p: d for p, d in recorded_digests(h).items() if p != "dave"}
    first, second, third = h.state().witnesses
    for w in (first, second):
        send_proof(h, w, honest)
    assert h.state().round == 0  # a refusal waits for every witness: then it is evidence
    send_proof(h, third, honest)
    assert h.state().health == {**{p: 3 for p in honest}, "dave": 0}
    h.send(keys.health_key(h.config.run_id, 0, "alice"), json.dumps({"unhealthy": ["dave"]}).encode())
    assert h.state().members["dave"].status is MemberStatus.DROPPED


def test_missing_proofs_wait_for_the_witness_deadline(attacked: Harness) -> None:
    h = attacked
    honest, attacker, _ = h.state().witnesses
    send_proof(h, attacker, {})
    send_proof(h, honest, recorded_digests(h))
    assert h.state().round == 0
    # At the deadline the empty proof is judged against the honest one: its witness is replaced, the round goes on
    run_tick(h.deps, time.time() + DEFAULT_WITNESS_TIME + 1)
    s = h.state()
    assert s.round == 0 and attacker not in s.witnesses and honest in s.witnesses
    # and when no other proof comes before the new deadline, the round closes unaggregated, nobody else dropped
    run_tick(h.deps, time.time() + 2 * DEFAULT_WITNESS_TIME + 2)
    s = h.state()
    assert s.round == 1 and s.aggregated == 0
    assert set(h.deps.store.rounds()[0].dropped) == {attacker}


def test_honest_filters_of_any_round_size_are_never_an_overclaim() -> None:
    from shared.witness import overclaim

    for selected in (1, 2, 3, 5, 8, 20, 100, 1000):
        for recorded in sorted({1, selected // 2 or 1, selected}):
            attested = {f"p{i}": f"{i:064x}" for i in range(recorded)}
            proof = Proof.build("run", 0, "w", 0, attested, selected, complete=True)
            assert overclaim(proof, recorded) == "", (selected, recorded)
