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
