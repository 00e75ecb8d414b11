"""Participant daemons (threads, in-process moto) training a run whose updates and downloads are int8-compressed
deltas, with witnesses: every update is accepted and attested, the model learns as with weights, `fed verify`
recomputes every global, and the bytes sent and received are about a quarter of the weights'."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from coordinator.verify import verify_run
from shared import keys, wire
from shared.state import Phase
from tests.functional.conftest import Harness
from tests.functional.test_participant_daemon import Participant, run  # noqa: F401 (the `run` fixture)


def test_int8_updates_and_downloads_with_witnesses_train_the_run_and_verify(  # noqa: F811
    run: Callable[..., Harness], tmp_path: Path  # noqa: F811
) -> None:
    # Given a run of int8-compressed updates and downloads, three participants and two witnesses a round (equal
    # shares, so that the seeded training does the same each run: sized by throughput on a busy machine, one round
    # once gave bob 577 samples whose honest update overfit — the aggregate's loss 0.33 with it, 0.16 without —
    # and both witnesses rightly refused it, so the round was retried)
    harness = run(total_rounds=3, min_clients=3, min_per_round=3, min_updates=3, witness_nodes=2,
                  round_witness_time=60, witness_tolerance=0.3, update_encoding="int8", quant_block=64,
                  download_encoding="int8", work_sizing="equal")
    names = ["alice", "bob", "carol"]
    people = {pid: Participant(harness, pid, tmp_path / pid) for pid in names}
    # When the run goes to the end
    outcomes = {pid: p.wait() for pid, p in people.items()}
    # Then every update was accepted, attested and counted, and the model learned
    state = harness.state()
    assert state.phase is Phase.FINISHED and state.aggregated == 3
    rounds = sorted(harness.deps.store.rounds(), key=lambda s: s.round)
    assert [s.counted for s in rounds] == [tuple(names)] * 3
    assert all(o.finished and o.final["test_accuracy"] > 0.85 for o in outcomes.values()), outcomes
    # And each update on the wire is int8 codes with their scales: about a quarter of the weights' bytes
    run_id = harness.config.run_id
    weights = harness.s3.head_object(Bucket=harness.res.bucket, Key=harness.global_key(1))["ContentLength"]
    for rec in harness.deps.store.all_updates():
        assert rec.accepted, rec.reason
        body = harness.s3.get_object(Bucket=harness.res.bucket, Key=keys.update_key(run_id, rec.round, rec.pid),
                                     VersionId=rec.version_id)["Body"].read()
        header = wire.parse_header(body)
        assert header.metadata["fed.encoding"] == "int8" and header.metadata["fed.block"] == "64"
        assert {s.dtype for s in header.tensors.values()} == {"I8", "F32"}
        assert rec.size < 0.35 * weights, (rec.size, weights)
    # And each participant keeps what quantization lost for its next round
    assert all((tmp_path / pid / "residual.safetensors").exists() for pid in names)
    # And each downloaded the first global model whole, then rebuilt rounds 1-3's from their int8 deltas (codes
    # are a quarter of the weights' bytes; on a 19 KB model the header each delta carries weighs too)
    for round_no in (1, 2, 3):
        assert harness.s3.head_object(Bucket=harness.res.bucket,
                                      Key=keys.delta_key(run_id, round_no, harness.global_digest(round_no)))
    for pid, person in people.items():
        assert weights < person.daemon.training.downloaded < weights * (1 + 3 * 0.5), pid
    # And anyone recomputes every global model from the bucket
    checks = verify_run(harness.deps)
    assert [(c.round, c.ok) for c in checks] == [(0, True), (1, True), (2, True)], checks
