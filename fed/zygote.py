"""Participant processes forked from one process that imported torch and the built-in tasks once.

`fed demo` starts N `fed-participant start` processes at once, and each imports torch and the task before
it can ask to join: seconds of CPU each, so four of them on a 2-core machine took
~9 s before the last one joined (`make bench-rounds`). The zygote imports those once, then forks a
participant per request: each child runs `participant.cli.app` with the arguments, environment and log
file a `fed-participant` process would have had, and starts in a fraction of a second.

Protocol, JSON lines: the parent writes requests `{"argv": [...], "env": {...}, "log": path, "entry": ""}` to the
zygote's stdin (`entry`, "module:function": a helper such as the demo's evaluator, `fed.evaluation:main`, runs
instead of the participant); the zygote answers each with `{"started": pid}` (or `{"error": why}`), and writes
`{"exited": pid, "code": rc}` when a child ends (rc as subprocess gives it: negative for a signal). Its first line
is `{"ready": ...}`, once the imports are done.

Fork safety: the zygote runs no torch operation (torch starts its thread pools on the first one), and forks only
while it has exactly one thread (/proc/self/task), else it refuses and the caller spawns a process as before. Each
child gets SIGTERM when the zygote dies (PR_SET_PDEATHSIG), and the zygote gets it when its parent dies: no
participant outlives the demo. Linux only.

    python -m fed.zygote   # (started by `Zygote.start`)
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

# What a participant imports before its join request, heaviest first (each one missing is skipped, so a participant
# without one still gets the rest preloaded). torch's symbolic shapes (with sympy, 0.4 s): building a model on the
# meta device, as the digits tasks do, imports them at `to_empty`. Not scikit-learn: the digits tasks read its
# bundled CSV without importing it (participant.tasks.digits_data): about 1 s less CPU here (3.4 -> 2.4 s measured)
PRELOAD = (
    "torch", "torch.fx.experimental.symbolic_shapes", "participant.cli", "participant.daemon", "participant.training",
    "participant.tasks.digits", "participant.tasks.flower_digits", "participant.tasks.lm", "numpy.random",
)
# And, for participants whose task steps with torch.optim (whose first optimizer imports torch's compiler stack:
# ~1.3 s of CPU), that stack too; the digits tasks step without it (`participant.sgd`), and their zygote skips it
OPTIMIZERS = ("torch._dynamo", "torch.optim")
READY_TIMEOUT = 120.0  # the imports, on a loaded machine
PR_SET_PDEATHSIG = 1


def supported() -> bool:
    return sys.platform.startswith("linux") and hasattr(os, "fork")


def die_with_parent() -> None:
    """In a child: get SIGTERM when the parent dies (Linux only; a no-op elsewhere)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


# --- the parent's side ----------------------------------------------------------------------------------


class Forked:
    """A participant forked by the zygote, with the part of `subprocess.Popen`'s interface the demo uses (it is
    the zygote's child, not ours: its exit status comes from the zygote)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._exited = threading.Event()

    def _ended(self, code: int) -> None:
        self.returncode = code
        self._exited.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired(f"participant {self.pid}", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:  # gone; its exit is on its way from the zygote
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ZygoteError(RuntimeError):
    """The zygote could not start or fork (the caller spawns processes instead)."""


class Zygote:
    """The zygote process, and the participants it forked."""

    def __init__(self, env: dict[str, str], log: Path, optimizers: bool = True) -> None:
        """`optimizers`: also preload torch.optim's compiler stack (`OPTIMIZERS`), for tasks that step with it."""
        self.env, self.log, self.optimizers = env, log, optimizers
        self.process: subprocess.Popen[bytes] | None = None
        self._children: dict[int, Forked] = {}
        self._replies: list[dict[str, Any]] = []
        self._lock = threading.Condition()
        self._request = threading.Lock()  # one fork request and its reply at a time
        self._ready: dict[str, Any] | None = None
        self._closed = False

    def start(self) -> None:
        """Start the zygote; its imports run in the background (`fork` waits for them)."""
        if not supported():
            raise ZygoteError("forking participants needs Linux")
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as err:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "fed.zygote", *(OPTIMIZERS if self.optimizers else ())],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                env=self.env, start_new_session=True, preexec_fn=die_with_parent,  # noqa: PLW1509
            )
        threading.Thread(target=self._read, name="zygote-reader", daemon=True).start()

    def fork(self, argv: list[str], env: dict[str, str], log: Path, entry: str = "") -> Forked:
        """A `fed-participant <argv>` process (with `entry`, "module:function", that function called with `argv`
        instead: it returns the exit status), its output appended to `log`. Raises ZygoteError."""
        assert self.process is not None and self.process.stdin is not None, "start() first"
        self._await(lambda: self._ready is not None, READY_TIMEOUT, "to import torch and the tasks")
        request = json.dumps({"argv": argv, "env": env, "log": str(log), "entry": entry}) + "\n"
        with self._request:
            try:
                self.process.stdin.write(request.encode())
                self.process.stdin.flush()
            except (BrokenPipeError, ValueError) as exc:
                raise ZygoteError(f"the zygote is gone ({exc}); see {self.log}") from exc
            self._await(lambda: bool(self._replies), 30.0, "to fork")
            with self._lock:
                reply = self._replies.pop(0)
        if "error" in reply:
            raise ZygoteError(str(reply["error"]))
        return self._children[int(reply["started"])]

    def stop(self) -> None:
        """Close the zygote (its children get SIGTERM if still running: stop them first)."""
        if self.process is None:
            return
        if self.process.stdin is not None:
            try:
                self.process.stdin.close()
            except OSError:
                pass
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def _await(self, condition: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        with self._lock:
            while not condition():
                left = deadline - time.monotonic()
                if self._closed:
                    raise ZygoteError(f"the zygote exited; see {self.log}")
                if left <= 0:
                    raise ZygoteError(f"the zygote took over {timeout:.0f}s {what}; see {self.log}")
                self._lock.wait(left)

    def _read(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        for line in self.process.stdout:
            message = json.loads(line)
            with self._lock:
                if "ready" in message:
                    self._ready = message
                elif "started" in message:
                    self._children[int(message["started"])] = Forked(int(message["started"]))
                    self._replies.append(message)
                elif "error" in message:
                    self._replies.append(message)
                elif "exited" in message:
                    self._children[int(message["exited"])]._ended(int(message["code"]))
                self._lock.notify_all()
        with self._lock:  # the zygote is gone, and with it (PR_SET_PDEATHSIG) its children
            self._closed = True
            for child in self._children.values():
                if child.returncode is None:
                    child._ended(-signal.SIGTERM)
            self._lock.notify_all()


# --- the zygote's side ----------------------------------------------------------------------------------


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


def serve(extra: Sequence[str] = ()) -> None:
    """Import PRELOAD (and `extra`), then fork a participant per request until stdin closes.

    The imports' objects are moved out of the garbage collector's reach (`gc.freeze`) before any fork: a child's
    first full collection would otherwise walk every object torch and the tasks made, writing to each one's header,
    and so copy nearly every page it shares with the zygote. Measured (`fed demo --task flower`, two runs of each):
    a forked participant's store and clients built in 0.26-0.31 s instead of 0.72-0.78 s. The collector also stays
    off during the imports, which make objects and free none."""
    stdin = sys.stdin.fileno()
    began = time.perf_counter()
    loaded = []
    gc.disable()
    for name in (*PRELOAD[:1], *extra, *PRELOAD[1:]):  # (heaviest first)
        try:
            importlib.import_module(name)
            loaded.append(name)
        except ImportError as exc:
            print(f"zygote: not preloaded: {name} ({exc})", file=sys.stderr)
    gc.freeze()
    gc.enable()

    def say(message: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(message) + "\n")
        sys.stdout.flush()

    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # (only to wake the select below)
    say({"ready": loaded, "seconds": round(time.perf_counter() - began, 2), "threads": threads(),
         "frozen": gc.get_freeze_count()})
    pending = b""
    while True:
        readable, _, _ = select.select([stdin, wake_r], [], [])
        if wake_r in readable:
            os.read(wake_r, 4096)
        _reap(say)
        if stdin not in readable:
            continue
        data = os.read(stdin, 65536)
        if not data:
            return  # the parent closed us
        pending += data
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            say(_fork(json.loads(line), (wake_r, wake_w, stdin)))


def _reap(say: Callable[[dict[str, Any]], None]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        say({"exited": pid, "code": code})


def _fork(request: dict[str, Any], private: tuple[int, ...]) -> dict[str, Any]:
    if threads() != 1:
        return {"error": f"the zygote has {threads()} threads: forking it is not safe"}
    try:
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    except OSError as exc:
        return {"error": f"cannot open {request['log']}: {exc}"}
    pid = os.fork()
    if pid == 0:  # the participant
        code = 1
        try:
            code = _child(request["argv"], request["env"], log, private, request.get("entry", ""))
        finally:
            os._exit(code)
    os.close(log)
    return {"started": pid}


def _child(argv: list[str], env: dict[str, str], log: int, private: tuple[int, ...], entry: str) -> int:
    """In the forked child: become `fed-participant <argv>`, or run `entry` with `argv` (its own session, output
    and environment)."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for fd in private:
        os.close(fd)
    os.setsid()  # Ctrl-C reaches the demo, which stops the participants in order
    die_with_parent()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(devnull)
    os.close(log)
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    sys.stderr.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    os.environ.clear()
    os.environ.update(env)
    sys.argv = ["fed-participant", *argv]
    code = 1
    try:
        if entry:
            module, function = entry.split(":")
            code = int(getattr(importlib.import_module(module), function)(argv))
        else:
            from participant.cli import app

            app(args=argv, prog_name="fed-participant")
            code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - the process's last word, as an uncaught exception would print it
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    return code


if __name__ == "__main__":
    serve(sys.argv[1:])
    # Nothing to flush or keep: leave without the interpreter's teardown of everything torch made (0.27 s of every
    # demo's end, measured with `make bench-rounds`)
    sys.stdout.flush()
    os._exit(0)
