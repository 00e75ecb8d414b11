"""`fed demo`'s evaluation of each round's global model, in a process of its own.

The demo process runs the local stack's dispatcher and the coordinator's functions. Evaluating there meant
importing torch into it (seconds of CPU during the participants' admission, holding its interpreter lock against
the ingests and ticks: the last join to round 0 took 0.85-1.3 s with it) and running the task's evaluation between
the functions' work every round. Instead, a helper process evaluates: forked from the demo's zygote, where torch
and the tasks are already imported, or spawned (`python -m fed.evaluation`) where there is none.

The demo listens on a Unix socket and the helper connects to it; then JSON lines, one reply per request:

    request  {"round": r, "digest": "<sha256 of the global model>"}
    reply    {"metrics": {"test_accuracy": ..., ...}}   or   {"error": "why"}

The helper reads the global model from the run's bucket itself (the connection file names it), checks its digest
and evaluates it with the task on its held-out set. It exits when the demo closes the socket.
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from shared import keys
from shared.config import RunConfig
from shared.wire import digest
from store.blobs import Bucket, s3_client
from store.connection import Connection

START_TIMEOUT = 120.0  # the helper connects once it runs (a spawned one imports torch first: seconds)
EVALUATE_TIMEOUT = 300.0  # its first reply waits for the task's model and held-out set to load


class EvaluationFailed(RuntimeError):
    """The helper could not evaluate (its reason), or is gone."""


class Process(Protocol):
    """What the demo's process handles offer (`subprocess.Popen`, `fed.zygote.Forked`)."""

    def poll(self) -> int | None: ...

    def kill(self) -> None: ...

    def wait(self, timeout: float | None = None) -> int: ...


# --- the demo's side -------------------------------------------------------------------------------------


class Evaluator:
    """Asks the helper to evaluate global models; `start(argv, log)` starts the helper (`main` with `argv`)."""

    def __init__(self, config: RunConfig, connection_file: Path, log: Path,
                 start: Callable[[list[str], Path], Process]) -> None:
        self.config, self.log = config, log
        self._dir = Path(tempfile.mkdtemp(prefix="fed-eval-"))  # (a Unix socket's path must be short)
        path = self._dir / "socket"
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(str(path))
        self._listener.listen(1)
        self._lock = threading.Lock()
        self._channel: Any = None  # the connection's file (reads and writes)
        self.process = start(["--socket", str(path), "--connection", str(connection_file),
                              "--config-json", config.model_dump_json()], log)

    def evaluate(self, round_no: int, model_digest: str) -> dict[str, float]:
        """The task's evaluation of the global model of round `round_no` (the one with this digest)."""
        with self._lock:
            channel = self._connected()
            try:
                channel.write(json.dumps({"round": round_no, "digest": model_digest}).encode() + b"\n")
                channel.flush()
                line = channel.readline()
            except OSError as exc:
                raise EvaluationFailed(f"the evaluator did not answer ({exc}); see {self.log}") from exc
        if not line:
            raise EvaluationFailed(f"the evaluator exited; see {self.log}")
        reply = json.loads(line)
        if "error" in reply:
            raise EvaluationFailed(str(reply["error"]))
        return {k: float(v) for k, v in reply["metrics"].items()}

    def _connected(self) -> Any:
        if self._channel is None:
            self._listener.settimeout(START_TIMEOUT)
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                raise EvaluationFailed(f"the evaluator did not start within {START_TIMEOUT:.0f}s; see "
                                       f"{self.log}") from None
            conn.settimeout(EVALUATE_TIMEOUT)
            self._channel = conn.makefile("rwb")
        return self._channel

    def stop(self) -> None:
        """Close the socket (the helper exits at its end) and wait for the helper."""
        if self._channel is not None:
            self._channel.close()
        self._listener.close()
        try:
            self.process.wait(10)
        except Exception:  # (Popen and Forked raise TimeoutExpired)
            self.process.kill()
        shutil.rmtree(self._dir, ignore_errors=True)


# --- the helper's side ------------------------------------------------------------------------------------


class _Model:
    """The task's model and held-out set, loaded once; `error` if they could not be."""

    def __init__(self, config: RunConfig) -> None:
        self.error: BaseException | None = None
        try:
            import torch

            from participant.task import load_task

            torch.set_num_threads(1)  # the participants need the cores more than the evaluator
            self.torch = torch
            self.task = load_task(config.task, config)
            self.model = self.task.build_model(config.seed)
            self.task.evaluate(self.model, torch.device("cpu"))  # load the held-out set now, not at the first round
        except BaseException as exc:  # reported with every request
            self.error = exc

    def evaluate(self, data: bytes) -> dict[str, float]:
        from participant.tensors import load_into

        load_into(self.model, data)
        return {k: float(v) for k, v in self.task.evaluate(self.model, self.torch.device("cpu")).items()}


def _answer(request: dict[str, Any], model: _Model, run_id: str, bucket: Bucket, task: str) -> dict[str, Any]:
    if model.error is not None:
        return {"error": f"cannot evaluate with task {task!r}: {model.error}"}
    round_no, model_digest = int(request["round"]), str(request["digest"])
    data = bucket.get(keys.global_key(run_id, round_no, model_digest)).data
    if digest(data) != model_digest:
        return {"error": f"the global model of round {round_no} does not match the digest the run recorded"}
    return {"metrics": model.evaluate(data)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fed.evaluation",
                                     description="fed demo's evaluator (started by the demo; see the module's doc)")
    parser.add_argument("--socket", required=True, help="the demo's Unix socket to connect to")
    parser.add_argument("--connection", type=Path, required=True, help="the run's connection file")
    parser.add_argument("--config-json", required=True, help="the run's configuration (JSON)")
    args = parser.parse_args(argv)
    config = RunConfig.model_validate_json(args.config_json)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(args.socket)
    channel = sock.makefile("rwb")
    model = _Model(config)
    run: tuple[str, Bucket] | None = None
    for line in channel:
        request = json.loads(line)
        try:
            if run is None:  # (the connection file is written once the stack is up: read at the first request)
                conn = Connection.load(args.connection)
                run = (conn.run_id, Bucket(conn.bucket, s3_client(conn.endpoint, conn.region)))
            reply = _answer(request, model, *run, config.task)
        except Exception as exc:  # the demo reports it and stops
            reply = {"error": f"evaluating round {request.get('round')}: {type(exc).__name__}: {exc}"}
        channel.write(json.dumps(reply).encode() + b"\n")
        channel.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
