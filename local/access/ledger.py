"""Every judged AWS request of a test session, written where the session's report (`local.access.report`) finds it.

Each process that judges requests (the local server, or a test process with in-process moto) keeps its own files
in the ledger directory (FED_ACCESS_LEDGER): `denied-<pid>-<n>.jsonl`, one line per denied call, written at once so
a test can fail on it before it ends; and `calls-<pid>-<n>.json`, the counts of every call by (test, principal,
role, action, outcome, code path), rewritten whole now and then and when the process stops. Nothing is ever shared
between processes, so no file needs a lock.
"""

from __future__ import annotations

import atexit
import itertools
import json
import os
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

ENV_LEDGER = "FED_ACCESS_LEDGER"
FLUSH_SECONDS = 2.0
_files = itertools.count()

ALLOWED = "allowed"
DENIED = "denied"
UNJUDGED = "unjudged"  # no principal of the system: a test's own look at the stack, or the stand-ins for AWS itself
MISSING_AS_403 = "missing-key-403"  # a read of a missing key answered 403, as S3 answers a caller without ListBucket


@dataclass(frozen=True)
class CallKey:
    test: str
    principal: str  # function:tick, participant:alice, operator; "" when unjudged
    role: str  # function:tick, participant, operator
    action: str  # s3:GetObject; for an unjudged call the operation (s3 GetObject)
    outcome: str
    caller: str  # the code path that made it


@dataclass(frozen=True)
class Denial:
    test: str
    principal: str
    role: str
    operation: str
    action: str
    resource: str
    why: str
    caller: str
    at: float


class Ledger:
    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        token = f"{os.getpid()}-{next(_files)}"
        self.calls_path = directory / f"calls-{token}.json"
        self.denied_path = directory / f"denied-{token}.jsonl"
        self._counts: Counter[CallKey] = Counter()
        self._lock = threading.Lock()
        self._flushing = threading.Lock()
        self._dirty = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._flusher, name="access-ledger", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    @classmethod
    def from_env(cls) -> Ledger | None:
        directory = os.environ.get(ENV_LEDGER)
        return cls(Path(directory)) if directory else None

    def count(self, key: CallKey) -> None:
        with self._lock:
            self._counts[key] += 1
            self._dirty = True

    def deny(self, denial: Denial) -> None:
        line = json.dumps(asdict(denial)) + "\n"
        with self._lock, self.denied_path.open("a") as out:
            out.write(line)

    def flush(self) -> None:
        with self._flushing:  # one writer at a time: a file is replaced whole, never left half-written
            with self._lock:
                if not self._dirty:
                    return
                rows = [{**asdict(k), "count": n} for k, n in self._counts.items()]
                self._dirty = False
            partial = self.calls_path.with_suffix(".partial")
            partial.write_text(json.dumps(rows))
            partial.replace(self.calls_path)

    def _flusher(self) -> None:
        while not self._stop.wait(FLUSH_SECONDS):
            self.flush()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()
        self.flush()


def read_calls(directory: Path) -> Iterator[tuple[CallKey, int]]:
    for path in sorted(directory.glob("calls-*.json")):
        for row in json.loads(path.read_text()):
            count = row.pop("count")
            yield CallKey(**row), count


def read_denials(directory: Path, since: float = 0.0) -> list[Denial]:
    found = []
    for path in sorted(directory.glob("denied-*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                denial = Denial(**json.loads(line))
                if denial.at >= since:
                    found.append(denial)
    return found


def now() -> float:
    return time.time()
