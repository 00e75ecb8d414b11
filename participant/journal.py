"""The participant's memory across its own restarts: a small JSON file in its state directory.

It records which rounds' updates were uploaded (never redone after a restart), which round was
being trained (retrained, deterministically, if the process died mid-round), and which witness proofs
and health reports were sent (each is sent once per round; the coordinator refuses a second). `joined_at` ties the
file to one incarnation of the run: a run recreated under the same id (a restarted local stack) has
a new join time, and the old progress is discarded instead of skipping rounds that never happened.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SCHEMA = 1
FILE_NAME = "progress.json"


@dataclass
class Journal:
    run_id: str
    participant: str
    joined_at: float | None = None
    uploaded: dict[int, dict[str, Any]] = field(default_factory=dict)  # round -> {digest, samples, at, ...}
    training: dict[str, Any] | None = None  # {round, digest, started} while a round is being trained
    outcomes: dict[int, str] = field(default_factory=dict)  # round -> "accepted" or the refusal reason
    witnessed: dict[int, dict[str, Any]] = field(default_factory=dict)  # round -> {complete, attested, at}
    health_reported: dict[int, list[str]] = field(default_factory=dict)  # round -> the members it named

    @property
    def uploaded_rounds(self) -> frozenset[int]:
        return frozenset(self.uploaded)

    def to_json(self) -> str:
        body = asdict(self)
        body["schema"] = SCHEMA
        body["uploaded"] = {str(k): v for k, v in sorted(self.uploaded.items())}
        body["outcomes"] = {str(k): v for k, v in sorted(self.outcomes.items())}
        body["witnessed"] = {str(k): v for k, v in sorted(self.witnessed.items())}
        body["health_reported"] = {str(k): v for k, v in sorted(self.health_reported.items())}
        return json.dumps(body, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Journal:
        body = json.loads(text)
        if body.get("schema") != SCHEMA:
            raise ValueError(f"unknown progress file schema {body.get('schema')!r}")
        return cls(
            run_id=body["run_id"],
            participant=body["participant"],
            joined_at=body.get("joined_at"),
            uploaded={int(k): v for k, v in body.get("uploaded", {}).items()},
            training=body.get("training"),
            outcomes={int(k): v for k, v in body.get("outcomes", {}).items()},
            witnessed={int(k): v for k, v in body.get("witnessed", {}).items()},
            health_reported={int(k): list(v) for k, v in body.get("health_reported", {}).items()},
        )


class JournalFile:
    """Load and atomically save the journal (write a temporary file, fsync, rename)."""

    def __init__(self, directory: Path, run_id: str, participant: str) -> None:
        self.path = Path(directory) / FILE_NAME
        self.run_id, self.participant = run_id, participant

    def load(self) -> tuple[Journal, str]:
        """The stored journal, or a fresh one; the second item says why a stored one was not used."""
        fresh = Journal(self.run_id, self.participant)
        try:
            journal = Journal.from_json(self.path.read_text())
        except FileNotFoundError:
            return fresh, ""
        except (ValueError, KeyError, TypeError) as exc:
            return fresh, f"unreadable progress file {self.path} ({exc}); starting afresh"
        if (journal.run_id, journal.participant) != (self.run_id, self.participant):
            return fresh, (
                f"progress file {self.path} belongs to {journal.participant}@{journal.run_id}; starting afresh"
            )
        return journal, ""

    def save(self, journal: Journal) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".progress-", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as fh:
                fh.write(journal.to_json())
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


class JournalKeeper:
    """The journal in use and the file it is saved to: one object the daemon's duties share, so that a journal
    replaced (`restart`, when the run was recreated) is the one every duty writes to. Without a file (the load
    test's simulated participants) it lives in memory only."""

    def __init__(self, journal: Journal, file: JournalFile | None = None) -> None:
        self.journal, self.file = journal, file

    @property
    def name(self) -> str:
        return str(self.file.path) if self.file is not None else "the journal (kept in memory)"

    def save(self) -> None:
        if self.file is not None:
            self.file.save(self.journal)

    def restart(self) -> None:
        """Forget every round: a fresh journal for the same run and participant."""
        self.journal = Journal(self.journal.run_id, self.journal.participant)

    def adopt(self, joined_at: float) -> float | None:
        """Tie the journal to the incarnation of the run we joined at `joined_at` (as the coordinator recorded it).
        A journal of an earlier incarnation (the run recreated under the same id) is restarted: returns that
        incarnation's join time, else None."""
        earlier = self.journal.joined_at
        if earlier is not None and abs(earlier - joined_at) <= 1e-3:
            return None  # written in this incarnation
        if earlier is not None:
            self.restart()
        self.journal.joined_at = joined_at
        self.save()
        return earlier

    def start_training(self, round_no: int, global_digest: str) -> dict[str, Any] | None:
        """Note that `round_no` is being trained (retrained after a restart); return the previous note."""
        previous = self.journal.training
        self.journal.training = {"round": round_no, "digest": global_digest, "started": time.time()}
        self.save()
        return previous

    def stop_training(self) -> None:
        self.journal.training = None
        self.save()

    def uploaded(self, round_no: int, entry: dict[str, Any]) -> None:
        """Our update of `round_no` is in the bucket: never train that round again."""
        self.journal.uploaded[round_no] = entry
        self.journal.training = None
        self.save()
