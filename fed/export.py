"""`fed export`: a run's global model out of its bucket, as the safetensors file the coordinator wrote, or (a run of
the Hugging Face task) as a model directory `from_pretrained` loads.

The global model of round R lives at its content address `rounds/<R>/global/<sha256>`; the digest comes from the
run's records (the state for the latest, the round summary of R - 1 for an earlier one), and the file written is
checked against it before it is moved into place, so a partial or altered download never lands at the path asked for.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from participant.tasks import hf_meta
from shared import keys
from shared.config import RunConfig
from shared.digest import digest_file
from store.blobs import Bucket, NotFound, s3_client
from store.connection import Connection
from store.table import StateStore


class ExportError(RuntimeError):
    """What cannot be exported, and why."""


@dataclass(frozen=True)
class Exported:
    round: int
    key: str
    digest: str
    size: int
    path: Path


def global_of(conn: Connection, round_no: int | None) -> tuple[int, str]:
    """(round, digest) of round `round_no`'s global model; None: the latest."""
    store = StateStore.of(conn)
    state = store.read_state()
    if not state.global_digest:
        raise ExportError(f"run {conn.run_id} has no global model yet (phase {state.phase.value})")
    if round_no is None or round_no == state.round:
        return state.round, state.global_digest
    if round_no > state.round or round_no < 1:
        raise ExportError(f"round {round_no} has no global model: the run's latest is round {state.round} "
                          "(round 0's is the initial model, which `fed export` does not serve)")
    made = {r.round + 1: r.global_digest for r in store.rounds() if r.aggregated and r.global_digest}
    if round_no not in made:
        raise ExportError(f"round {round_no - 1} was not aggregated, so round {round_no} has no global model of "
                          "its own; `fed status` lists the rounds")
    return round_no, made[round_no]


def export_global(conn: Connection, round_no: int | None, out: Path) -> Exported:
    """Write the global model to `out`, its digest checked first (on a mismatch nothing is written)."""
    round_no, digest = global_of(conn, round_no)
    key = keys.global_key(conn.run_id, round_no, digest)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(prefix=f".{out.name}.", dir=out.parent)
    os.close(fd)
    try:
        s3_client(conn.endpoint, conn.region).download_file(conn.bucket, key, partial)
        got = digest_file(Path(partial))
        if got != digest:
            raise ExportError(f"{key} holds a file whose digest is {got}, not {digest}: not written")
        os.replace(partial, out)
    finally:
        Path(partial).unlink(missing_ok=True)
    return Exported(round_no, key, digest, out.stat().st_size, out)


def run_config(conn: Connection) -> RunConfig:
    """The configuration the run published in its bucket (its first tick writes it)."""
    try:
        blob = Bucket(conn.bucket, s3_client(conn.endpoint, conn.region)).get(keys.config_key(conn.run_id))
    except NotFound:
        raise ExportError(f"run {conn.run_id} has not published its configuration yet") from None
    return RunConfig.model_validate_json(blob.data)


def export_hf_dir(conn: Connection, round_no: int | None, out: Path, merged: bool = True,
                  model: str | None = None) -> tuple[Exported, list[str]]:
    """Write the global model as a Hugging Face model directory at `out` (which must not hold files yet): built in
    a directory beside it and moved into place whole, so a failure leaves nothing at `out`. `model`: this machine's
    copy of the run's model, when `[run.hf] model` names another path (its digests must be the run's)."""
    config = run_config(conn)
    if not hf_meta.is_hf(config.task):
        raise ExportError(f"run {conn.run_id} trains {config.task}, not a Hugging Face model: export "
                          "--format safetensors")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"{out} exists and is not an empty directory: choose a new one")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        done = export_global(conn, round_no, staging / "global.safetensors")
        from participant.task import TaskError
        from participant.tasks.hf import export_hf

        model_dir = staging / "model"
        try:
            files = export_hf(config, done.path, model_dir, merged=merged, source=model)
        except TaskError as exc:
            raise ExportError(str(exc)) from None
        if out.exists():
            out.rmdir()
        os.replace(model_dir, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return done, files
