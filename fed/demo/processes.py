"""The demo's participant processes: `fed-participant start` per participant, forked from a zygote with torch
imported (fed/zygote.py) or spawned, each with its own state directory and log; waiting for them to join, noticing
one that failed, killing one on purpose and stopping them all."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from fed.demo.errors import DemoFailed
from fed.zygote import Forked, Zygote, ZygoteError, die_with_parent
from fed.zygote import supported as zygote_supported
from local.stack import LocalStack, client_environment
from shared import keys
from store.blobs import Bucket, s3_client

JOIN_TIMEOUT = 120.0  # participants import torch first: seconds on a loaded 2-core machine
POLL_MAX = 0.5  # participants re-read the state at least this often: rounds follow each other quickly


def participant_environment() -> dict[str, str]:
    """What a participant process gets: this process's environment, for the local endpoint."""
    return {
        # pyarrow (which pandas imports where installed, and the datasets extra brings) starts jemalloc's background
        # thread at import: a zygote that imported it could then not fork safely (fed/zygote.py)
        "JE_ARROW_MALLOC_CONF": "background_thread:false",
        **os.environ,
        **client_environment(),
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",  # N processes share the cores: one thread each trains fastest
        "MKL_NUM_THREADS": "1",
    }


def participant_command() -> list[str]:
    """`fed-participant` from this environment (beside this interpreter), else on PATH."""
    beside = Path(sys.executable).with_name("fed-participant")
    if beside.exists():
        return [str(beside)]
    found = shutil.which("fed-participant")
    if found:
        return [found]
    return [sys.executable, "-c", "from participant.cli import app; app()"]


@dataclass
class ParticipantProcess:
    name: str
    process: subprocess.Popen[bytes] | Forked
    log: Path
    killed: bool = False


@dataclass
class Participants:
    """N `fed-participant start` processes, each with its own state directory and log file; with `forked`, forked
    from a zygote that imported torch and the tasks once (fed/zygote.py: seconds sooner to join on a small machine),
    else each spawned as the command."""

    connection_file: Path
    workdir: Path
    extra_args: list[str] = field(default_factory=list)
    procs: dict[str, ParticipantProcess] = field(default_factory=dict)
    forked: bool = False
    torch_optimizers: bool = True  # whether the task steps with torch.optim (the zygote then preloads it)
    zygote: Zygote | None = None

    def __post_init__(self) -> None:
        if self.forked and zygote_supported():
            self.zygote = Zygote(participant_environment(), self.workdir / "logs" / "zygote.log",
                                 optimizers=self.torch_optimizers)
            self.zygote.start()  # (its imports overlap whatever the caller does until the first spawn)

    def spawn(self, names: list[str], extra: dict[str, list[str]] | None = None,
              invites: dict[str, str] | None = None) -> None:
        """Start a process per name; `extra` adds arguments for some of them (e.g. another --task); one with an
        invite line in `invites` joins with it alone (`fed-participant start --invite`), as a host outside AWS."""
        env = participant_environment()
        logs = self.workdir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        for name in names:
            log = logs / f"{name}.log"
            state_dir = self.workdir / "participants" / name
            joins = (["--invite", invites[name]] if invites and name in invites else
                     ["--connection", str(self.connection_file), "--id", name])
            args = ["start", *joins, "--state-dir", str(state_dir), "--threads", "1", "--poll-max", str(POLL_MAX),
                    *self.extra_args, *(extra or {}).get(name, [])]
            log.write_bytes(b"")
            self.procs[name] = ParticipantProcess(name, self._start(args, env, log), log)

    def start_helper(self, module: str, args: list[str], log: Path) -> subprocess.Popen[bytes] | Forked:
        """`python -m <module> <args>` (its `main(args)`), forked from the zygote if there is one: a helper of the
        demo's that needs torch, such as the evaluator (fed/evaluation.py)."""
        log.parent.mkdir(parents=True, exist_ok=True)
        return self._start(args, participant_environment(), log, module)

    def _start(self, args: list[str], env: dict[str, str], log: Path,
               helper: str = "") -> subprocess.Popen[bytes] | Forked:
        if self.zygote is not None:
            try:
                return self.zygote.fork(args, env, log, f"{helper}:main" if helper else "")
            except ZygoteError as exc:
                logging.getLogger(__name__).warning("spawning participants instead of forking them: %s", exc)
                self.zygote.stop()
                self.zygote = None
        command = [sys.executable, "-m", helper] if helper else participant_command()
        with log.open("ab") as out:
            return subprocess.Popen(
                [*command, *args], stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=env, start_new_session=True,  # Ctrl-C reaches the demo, which stops them in order
                preexec_fn=die_with_parent if sys.platform.startswith("linux") else None,  # noqa: PLW1509
            )

    def kill(self, name: str) -> None:
        """SIGKILL: no goodbye, no flush; the coordinator must notice on its own."""
        p = self.procs[name]
        p.killed = True
        p.process.send_signal(signal.SIGKILL)
        p.process.wait()

    def failed(self) -> list[ParticipantProcess]:
        """Processes that exited with an error (a killed one does not count)."""
        return [p for p in self.procs.values()
                if not p.killed and p.process.poll() is not None and p.process.returncode != 0]

    def running(self) -> list[ParticipantProcess]:
        return [p for p in self.procs.values() if p.process.poll() is None]

    def wait_exit(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while self.running() and time.monotonic() < deadline:
            time.sleep(0.2)
        return not self.running()

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM every live process, then SIGKILL what is left after `grace` seconds; then the zygote."""
        for p in self.running():
            p.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for p in self.procs.values():
            try:
                p.process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.process.kill()
                p.process.wait()
        if self.zygote is not None:
            self.zygote.stop()

    def tail(self, name: str, lines: int = 15) -> str:
        try:
            text = self.procs[name].log.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


def await_joins(stack: LocalStack, names: list[str], procs: Participants, timeout: float = JOIN_TIMEOUT,
                heard: bool = True) -> None:
    """Wait until every participant's join request (and, with `heard`, a heartbeat after it) is in the bucket
    (delivery is held back meanwhile, so the first epoch admits them all: an epoch admits only those heard from
    since joining); raise DemoFailed if one dies first or they take longer than `timeout`. `heard=False` where the
    participants cannot heartbeat yet (no tick has published the run's configuration while everything is held)."""
    assert stack.resources is not None
    bucket = Bucket(stack.resources.bucket, s3_client(stack.endpoint, stack.resources.region))
    run_id = stack.config.run_id
    deadline = time.monotonic() + timeout
    while True:
        check_processes(procs)
        joined = {k.rsplit("/", 1)[-1] for k in bucket.keys(keys.join_prefix(run_id))}
        if heard:
            joined &= {k.rsplit("/", 1)[-1] for k in bucket.keys(keys.heartbeat_prefix(run_id))}
        if joined >= set(names):
            return
        if time.monotonic() > deadline:
            missing = ", ".join(sorted(set(names) - joined))
            raise DemoFailed(f"participants {missing} did not ask to join within {timeout:.0f}s")
        time.sleep(0.2)


def check_processes(procs: Participants) -> None:
    """DemoFailed, with the end of its log, if a participant process exited with an error."""
    failed = procs.failed()
    if failed:
        p = failed[0]
        raise DemoFailed(
            f"participant {p.name} exited with status {p.process.returncode}; the end of {p.log}:\n{procs.tail(p.name)}"
        )
