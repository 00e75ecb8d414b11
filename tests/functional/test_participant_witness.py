"""Participant daemons (threads, in-process moto) doing witness duty and sending health reports."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from participant.journal import JournalFile
from shared.state import MemberStatus, Phase, RunState
from shared.witness import Proof
from tests.functional.conftest import Harness
from tests.functional.test_participant_daemon import Participant, run  # noqa: F401 (the `run` fixture)

POISONED = "participant.tasks.poisoned:task"


def test_witnesses_refuse_a_poisoned_update_and_a_health_report_drops_it(
    run: Callable[..., Harness], tmp_path: Path  # noqa: F811
) -> None:
    # Given four participants, three elected witnesses per round, and carol uploading poisoned updates. Equal
    # shares: sized by throughput on a busy machine carol once measured slow and trained 52 of 1437 samples, and
    # behind a share that small a flip is refused in about 3 rounds of 4 (weighed as the median update:
    # test_witness_poisoning.py, benchmarks/witness_errors.py --victim-share), while this test asserts she is never
    # counted. The first epoch starts once all four have joined (a tick that saw three once started it with three)
    harness = run(start_with=4, total_rounds=3, min_clients=3, min_per_round=3, min_updates=2, witness_nodes=3,
                  round_witness_time=60, witness_tolerance=0.3, work_sizing="equal")
    names = ["alice", "bob", "carol", "dave"]
    people = {pid: Participant(harness, pid, tmp_path / pid, task=POISONED if pid == "carol" else None)
              for pid in names}

    # When the run goes to the end
    for p in people.values():
        assert p.wait().finished

    # Then carol's update was never aggregated: no witness attested it
    state = harness.state()
    assert state.phase is Phase.FINISHED and state.aggregated == 3
    rounds = sorted(harness.deps.store.rounds(), key=lambda s: s.round)
    assert all("carol" not in s.counted for s in rounds)
    first = rounds[0]
    assert first.aggregated and first.proofs == 3 and first.health["carol"] == 0
    assert all(first.health[p] == 3 for p in ("alice", "bob", "dave"))
    # And a member's health report dropped her after her second unattested round (health_strikes = 2), the
    # coordinator's witness records agreeing; after the first nobody reported her
    carol = state.members["carol"]
    assert carol.reason == "health check: round 1 attested by 0 of 2 witnesses needed, 2 witnessed rounds in a row"
    assert carol.status is MemberStatus.DROPPED and any("carol" in s.dropped for s in rounds)
    assert not harness.deps.store.health_reports(0)
    reports = harness.deps.store.health_reports(1)
    assert reports and all(named == ("carol",) for named in reports.values())
    # And each proof was sent once per round by each elected witness, with its evaluations and throughput
    proofs = harness.deps.store.proofs(0)
    assert set(proofs) == set(first.witnesses)
    for pid, proof in proofs.items():
        assert isinstance(proof, Proof) and proof.complete and proof.throughput > 0
        assert set(proof.evaluations) >= {"global", "alice", "bob", "carol", "dave"}
        journal, _ = JournalFile(tmp_path / pid, harness.config.run_id, pid).load()
        assert journal.witnessed[0]["complete"] and "carol" not in journal.witnessed[0]["attested"]
        assert not (tmp_path / pid / "witness" / "000000").exists()  # verified bytes removed after the proof


def test_a_stalled_participant_is_dropped_by_health_reports_after_incomplete_proofs(
    run: Callable[..., Harness], tmp_path: Path  # noqa: F811
) -> None:
    # Given four participants, three witnesses, and dave whose training blocks from his second round on
    harness = run(start_with=4, total_rounds=3, min_clients=3, min_per_round=3, min_updates=2, witness_nodes=3,
                  max_round_train_time=3, round_witness_time=3, witness_tolerance=0.5,
                  health_strikes=1)
    people = {pid: Participant(harness, pid, tmp_path / pid,
                               task="participant.tasks.stalled:task" if pid == "dave" else None)
              for pid in ("alice", "bob", "carol", "dave")}

    # When the others finish the run
    for pid in ("alice", "bob", "carol"):
        assert people[pid].wait().finished

    # Then the round dave stalled in was closed at its deadline, witnessed with incomplete proofs of the others'
    # updates, aggregated from them, and dave dropped by a health report
    state = harness.state()
    assert state.aggregated == 3
    dave = state.members["dave"]
    assert dave.status is MemberStatus.DROPPED and dave.reason.startswith("health check: round 1"), dave.reason
    stalled = next(s for s in harness.deps.store.rounds() if s.round == 1)
    assert stalled.aggregated and set(stalled.counted) == {"alice", "bob", "carol"} and stalled.health["dave"] == 0
    proofs = harness.deps.store.proofs(1)
    assert proofs and not any(p.complete for p in proofs.values())
    assert all(p.attests(pid, harness.deps.store.update_record(1, pid).digest)
               for p in proofs.values() for pid in ("alice", "bob", "carol"))
    # And dave, stuck in training, stops cleanly when asked
    people["dave"].stop.set()
    assert people["dave"].wait().reason == "stopped"


def test_a_proof_is_sent_once_across_restarts_and_again_for_a_restored_run(harness: Harness, tmp_path: Path) -> None:
    import time

    from participant.decide import SendProof
    from shared import keys
    from tests.functional.test_participant_daemon import versions

    # Given a witness of round 0 holding the round's global model
    daemon, state, _ = witness_of_round_zero(harness, tmp_path)
    key = keys.witness_key(harness.config.run_id, 0, "alice")

    # When it sends its proof, and (its journal lost) is asked to again
    daemon._send_proof(SendProof(0, complete=False), state)
    assert daemon.journal.witnessed[0]["complete"] is False
    proof = Proof.from_json(harness.s3.get_object(Bucket=harness.res.bucket, Key=key)["Body"].read())
    assert (proof.round, proof.witness, proof.position, proof.complete) == (0, "alice", 1, False)
    daemon.journal.witnessed.clear()
    daemon._send_proof(SendProof(0, complete=False), state)
    # Then the proof in the bucket stands for it: one upload, and the journal says it was sent
    assert versions(harness, key) == 1 and 0 in daemon.journal.witnessed

    # But in a new incarnation of the run (restored after its table was lost: joined again since), it is sent anew
    daemon.journal.witnessed.clear()
    daemon.me.joined_at = time.time() + 2
    daemon._send_proof(SendProof(0, complete=False), state)
    assert versions(harness, key) == 2


def test_a_squatted_proof_or_update_key_does_not_stop_a_participant(harness: Harness, tmp_path: Path) -> None:
    from participant.decide import SendProof
    from shared import keys
    from shared.signing import verify
    from tests.functional.test_participant_daemon import versions

    # Given a witness of round 0, and someone else's objects already at its proof key and at its update key (locally,
    # nothing stops another writer there): one unsigned, one signed by another participant
    daemon, state, held = witness_of_round_zero(harness, tmp_path)
    proof_key = keys.witness_key(harness.config.run_id, 0, "alice")
    update_key = keys.update_key(harness.config.run_id, 0, "alice")
    harness.put(proof_key, b'{"schema": 1}', signed_by=None)
    harness.put(update_key, held, signed_by="mallory")

    # Then neither counts as its own: its update is not taken as uploaded, and its proof is sent over the squatter's
    assert not daemon.remote.update_stored(0, daemon.me.joined_at)
    daemon._send_proof(SendProof(0, complete=False), state)
    assert versions(harness, proof_key) == 2
    sent = harness.s3.get_object(Bucket=harness.res.bucket, Key=proof_key)
    body = sent["Body"].read()
    verify(daemon.signer.public_key, proof_key, body, sent["Metadata"])
    assert Proof.from_json(body).witness == "alice"
    # And an object it did upload itself still counts (a restart does not send it twice)
    daemon.remote.upload(update_key, held, "the update")
    assert daemon.remote.update_stored(0, daemon.me.joined_at)


def witness_of_round_zero(harness: Harness, tmp_path: Path) -> tuple[Any, RunState, bytes]:
    """A daemon ("alice") elected witness of round 0, holding the round's global model: (daemon, state, model)."""
    import threading
    import time

    import torch

    from participant.daemon import Daemon, Options
    from participant.tasks.digits import task
    from participant.tensors import model_bytes
    from participant.ui import Reporter
    from shared.wire import digest
    from store.connection import Connection

    conn = Connection(run_id=harness.config.run_id, bucket=harness.res.bucket, table=harness.res.table)
    daemon = Daemon(conn, Options(pid="alice", state_dir=tmp_path / "alice"), threading.Event(), Reporter(bars=False))
    daemon.config, daemon.task, daemon.device = harness.config, task, torch.device("cpu")
    held = model_bytes(task.build_model(0))
    daemon.me.held_model = held
    daemon.me.held, daemon.me.joined_at = digest(held), time.time() - 60
    state = RunState(harness.config.run_id, phase=Phase.WITNESS, round=0, selected=("alice", "bob"),
                     witnesses=("bob", "alice"), global_digest=daemon.me.held)
    return daemon, state, held
