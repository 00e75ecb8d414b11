"""`fed run pause|resume|restore` and `fed verify` against a run on in-process moto."""

from __future__ import annotations

import json
from pathlib import Path

import boto3
import numpy as np
from typer.testing import CliRunner

from fed.cli import app
from local.resources import create_resources
from shared import wire
from shared.state import Phase
from store.connection import Connection
from tests.functional.conftest import MODEL, Harness


def model(k: float) -> dict[str, np.ndarray]:
    return {name: (arr + k).astype(arr.dtype) for name, arr in MODEL.items()}


def connection_file(h: Harness, tmp_path: Path) -> Path:
    path = tmp_path / "connection.json"
    Connection(run_id=h.config.run_id, bucket=h.res.bucket, table=h.res.table).save(path)
    return path


def fed(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args))
    return result.exit_code, result.output


def test_pause_and_resume_through_the_cli(harness: Harness, tmp_path: Path) -> None:
    harness.start(["alice", "bob"])
    conn = str(connection_file(harness, tmp_path))
    # When the operator pauses mid-round (a connection naming no tick function to invoke: as a deployed stack
    # without that output)
    code, out = fed("run", "pause", "--connection", conn)
    # Then the request is recorded, and the coordinator's next tick, not the operator, carries it out
    assert code == 0, out
    assert "pause requested" in out and harness.state().pause_requested
    harness.scheduled_tick()
    assert harness.state().phase is Phase.PAUSED
    # And resume starts a new epoch with the live participants
    code, out = fed("run", "resume", harness.config.run_id, "--connection", conn)
    assert code == 0, out
    assert "resume requested" in out
    harness.scheduled_tick()
    assert harness.state().phase is Phase.TRAIN and harness.state().epoch == 2
    # A run id other than the connection's is refused before anything is done
    code, out = fed("run", "pause", "other-run", "--connection", conn)
    assert code == 2 and "is for run" in out and harness.state().phase is Phase.TRAIN


def test_restore_needs_a_checkpoint_then_force_when_the_run_has_state(harness_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    h = harness_factory(rounds_per_epoch=1, total_rounds=3, cooldown_time=600)
    h.start(["alice", "bob"])
    conn = str(connection_file(h, tmp_path))
    code, out = fed("run", "restore", "--connection", conn, "--force")
    assert code == 1 and "no checkpoint" in out
    h.upload("alice", model(1))
    h.upload("bob", model(2))
    before = h.state()
    assert before.phase is Phase.COOLDOWN and before.aggregated == 1
    code, out = fed("run", "restore", "--connection", conn)
    assert code == 1 and "--force" in out
    # When the table is lost and recreated, restore rebuilds the state from the checkpoint
    boto3.client("dynamodb", region_name="us-east-1").delete_table(TableName=h.res.table)
    create_resources(h.config.run_id)
    code, out = fed("run", "restore", "--connection", conn)
    assert code == 0, out
    assert "restored" in out and "round 1" in out
    state = h.state()
    assert (state.phase, state.round, state.global_digest) == (Phase.WAITING, 1, before.global_digest)


def test_verify_prints_each_round_and_fails_on_a_mismatch(harness: Harness, tmp_path: Path) -> None:
    harness.start(["alice", "bob"])
    for r in range(2):
        harness.upload("alice", model(1 + r))
        harness.upload("bob", model(2 + r))
    conn = str(connection_file(harness, tmp_path))
    code, out = fed("verify", "--connection", conn)
    assert code == 0, out
    assert "2 of 2 round(s) match" in out
    code, out = fed("verify", "--connection", conn, "--json")
    body = json.loads(out)
    assert code == 0 and body["ok"] and [r["round"] for r in body["rounds"]] == [0, 1]
    assert all(r["recorded"] == r["recomputed"] == r["stored"] and len(r["stored"]) == 64 for r in body["rounds"])
    # When round 1's aggregate in the bucket is replaced by other bytes
    harness.s3.put_object(Bucket=harness.res.bucket, Key=harness.global_key(2),
                          Body=wire.encode(model(9)))
    code, out = fed("verify", "--connection", conn)
    # Then verify says which round and exits 1
    assert code == 1 and "MISMATCH" in out and "stored object differs" in out and "1 of 2" in out


def test_restore_retries_when_a_tick_commits_between_its_read_and_its_write(
    harness: Harness, tmp_path: Path, monkeypatch  # type: ignore[no-untyped-def]
) -> None:
    import coordinator.operations as operations
    from coordinator.operations import Restored
    from store.table import Conflict

    calls: list[bool] = []

    def racing(deps, force):  # type: ignore[no-untyped-def]
        calls.append(force)
        if len(calls) == 1:
            raise Conflict("state changed since version 3")
        return Restored(2, 4, 4, "e" * 64)

    monkeypatch.setattr(operations, "restore", racing)
    harness.scheduled_tick()  # publishes the config
    code, out = fed("run", "restore", "--connection", str(connection_file(harness, tmp_path)), "--force")
    assert code == 0 and calls == [True, True] and "round 4" in out, out


def test_status_plot_writes_the_curves_of_every_finished_round(harness: Harness, tmp_path: Path) -> None:
    import matplotlib.image

    harness.start(["alice", "bob"])
    conn = str(connection_file(harness, tmp_path))
    png = tmp_path / "curves.png"
    # Before any round has finished there is nothing to draw: the status is shown, the plot is explained
    code, out = fed("status", "--connection", conn, "--plot", str(png))
    assert code == 0 and "no finished rounds to plot yet" in out and not png.exists()
    # After two aggregated rounds
    for r in range(2):
        harness.upload("alice", model(1 + r))
        harness.upload("bob", model(2 + r))
    code, out = fed("status", "--connection", conn, "--plot", str(png))
    # Then the PNG is written: three stacked panels (loss, accuracy, seconds) at 700 x 800 pixels
    assert code == 0, out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert matplotlib.image.imread(png).shape[:2] == (800, 700)


def test_verify_says_clearly_which_rounds_expired_and_checks_them_against_their_checkpoint(
    harness_factory, tmp_path: Path  # type: ignore[no-untyped-def]
) -> None:
    # Given three aggregated rounds, a checkpoint every 2, and round 0's objects expired from the bucket
    h = harness_factory(total_rounds=5, checkpoint_every=2)
    h.start(["alice", "bob"])
    for r in range(3):
        h.upload("alice", model(1 + r))
        h.upload("bob", model(2 + r))
    s3 = boto3.client("s3", region_name="us-east-1")
    prefix = f"runs/{h.config.run_id}/rounds/000000/"
    for v in s3.list_object_versions(Bucket=h.res.bucket, Prefix=prefix).get("Versions", []):
        s3.delete_object(Bucket=h.res.bucket, Key=v["Key"], VersionId=v["VersionId"])
    conn = str(connection_file(h, tmp_path))
    # When the run is verified
    code, out = fed("verify", "--connection", conn, "--json")
    body = json.loads(out[out.index("{"):])
    # Then round 0 is reported as expired (not a mismatch), the others match, and the exit status is 0
    rounds = {r["round"]: r for r in body["rounds"]}
    assert code == 0 and body["ok"], out
    assert rounds[0]["expired"] and rounds[0]["passes"] and "round_objects_expire_days" in rounds[0]["problem"]
    assert rounds[1]["ok"] and rounds[2]["ok"]
    # And round 1's global model, kept by the checkpoint at round 2, is still checked against its record
    code, out = fed("verify", "--connection", conn)
    assert code == 0 and "expired" in out and "2 of 3 round(s) match" in out
    for v in s3.list_object_versions(Bucket=h.res.bucket, Prefix=f"runs/{h.config.run_id}/rounds/000001/").get(
            "Versions", []):
        s3.delete_object(Bucket=h.res.bucket, Key=v["Key"], VersionId=v["VersionId"])
    out = fed("verify", "--connection", conn, "--json")[1]
    body = json.loads(out[out.index("{"):])
    assert {r["round"]: r for r in body["rounds"]}[1]["problem"].endswith("its checkpoint matches")
