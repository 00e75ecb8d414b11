"""What `StateStore` hands back about the records ingest writes: plain frozen data, no pynamodb.

The coordinator's own view of these records (what a tick reads) is `shared.state.ParticipantView` and
`UpdateView`; these carry every stored field, for ingest's checks, `fed status`, `fed verify` and tests.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from shared.state import ParticipantView


@dataclass(frozen=True)
class ParticipantRecord:
    """A participant as ingest registered it."""

    pid: str
    joined_at: float
    last_seen: float
    ready_epoch: int = 0
    init_digest: str = ""
    init_version: str = ""  # the S3 version of its offer ingest checked
    public_key: str = ""
    info: Mapping[str, Any] = field(default_factory=dict)  # participant-supplied, displayed and never trusted
    last_sent: float = 0.0  # `sent_at` of the last join request or heartbeat accepted
    heard_at: float = 0.0  # last signed message accepted after the join that registered it; 0: none yet
    # Made eligible by the heartbeat its join request found, by the join function, which never ticks: the next
    # heartbeat ingested ticks for it (`coordinator.intake`)
    unticked: bool = False
    samples: int = 0  # local data mode: its own data's sample count, registered at join (never changed); 0: none
    progress: tuple[int, int, int] = (-1, 0, 0)  # (round, done, total) of its latest heartbeat; round -1: none
    progress_at: float = 0.0  # when that progress last moved (ingest's clock)
    rate: float = 0.0  # samples per second it measured in its last round (as its heartbeat said)

    def view(self) -> ParticipantView:
        """What a tick needs of this record."""
        r, done, total = self.progress
        return ParticipantView(self.pid, self.joined_at, self.last_seen, self.ready_epoch, self.init_digest,
                               heard_at=self.heard_at, samples=self.samples, progress_round=r, progress_done=done,
                               progress_total=total, progress_at=self.progress_at, rate=self.rate,
                               init_version=self.init_version)


@dataclass(frozen=True)
class UpdateRecord:
    """What ingest learned about one uploaded update."""

    round: int
    pid: str
    key: str
    accepted: bool
    reason: str = ""
    samples: int = 0
    digest: str = ""
    size: int = 0
    etag: str = ""
    version_id: str = ""
    norm: float = -1.0
    received_at: float = 0.0
    data_offset: int = -1  # where its data section starts (the aggregation reads it without a look first)
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class ProofRecord:
    """A witness's proof for a round, as uploaded and validated."""

    round: int
    pid: str
    etag: str
    body: str  # the proof's JSON
    received_at: float


@dataclass(frozen=True)
class RefusalRecord:
    """An object refused before it could be tied to a round slot."""

    key: str
    etag: str  # "<etag>:<version id>" of the refused object
    reason: str
    at: float
    pid: str = ""
