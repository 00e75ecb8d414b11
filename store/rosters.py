"""The per-member part of the run state, kept beside the state item rather than in it.

Everything of the state that grows with the membership (members, selection, counted updates, exclusions,
witnesses, health scores, speeds, the round's plan) is one JSON document in the run's bucket at its content
address (`keys.roster_key`); the state item names it by digest. So the item that every participant polls is
the same few hundred bytes whatever the number of members (DynamoDB's 400 KB item limit no longer caps the
run), and the roster is read again only when a commit changed it — a few times a round, not every poll.

Writes come before the state item's conditional commit and are idempotent (same content, same key): a commit
that loses its race leaves at most an object nobody names. Reads check the bytes against the digest the
committed state names (`Bucket.read_verified`), reading first the version the state item records (`VERSIONS`),
so nothing written over a roster, however often, is taken for the coordinator's or keeps it from being read.
"""

from __future__ import annotations

import json
from typing import Any

from shared import keys
from shared.digest import digest
from shared.state import RunState
from store.blobs import Bucket
from store.records import ROSTER, ROSTER_FIELDS, VERSIONS, joined_body, state_from_body

MAX_ROSTER_BYTES = 64 * 1024 * 1024  # ~300,000 members: far beyond what one run admits
OPTIONAL_FIELDS = {"counted_last", "strikes"}  # absent from the rosters of runs started before they existed
EMPTY = ""  # the digest a state item names when every roster field is empty (a new run): no object at all


def encoded(roster: dict[str, Any]) -> bytes:
    """The canonical bytes of a roster (one document, one digest)."""
    return json.dumps(roster, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


class Rosters:
    """Reads and writes one run's rosters, remembering the last one seen (a warm function or a participant
    polling the state reads a roster once per change, not once per read of the state)."""

    def __init__(self, bucket: Bucket, run_id: str) -> None:
        self.bucket, self.run_id = bucket, run_id
        self._last: tuple[str, dict[str, Any], bytes] = (EMPTY, {}, b"")  # digest, roster, canonical bytes
        self.writes = 0  # rosters stored

    def write(self, roster: dict[str, Any]) -> str:
        """Store `roster` (unless it is empty or the one last seen); its digest, for the state item."""
        if not any(roster.values()):
            return EMPTY
        data = encoded(roster)
        name = digest(data)
        if name != self._last[0]:
            self.bucket.put(keys.roster_key(self.run_id, name), data)
            self.writes += 1
            self._last = (name, roster, data)
        return name

    def read(self, name: str, delivered: bytes = b"", version_id: str = "") -> dict[str, Any]:
        """The roster a state item names ({} for EMPTY): the one last seen, the `delivered` bytes if they are that
        roster's (a push carries them: `store.push`), else read from the bucket (`version_id`: the version the
        item records, "": not recorded)."""
        if name == EMPTY:
            return {}
        if name != self._last[0] and not (delivered and self._take(name, delivered)):
            key = keys.roster_key(self.run_id, name)
            self._adopt(name, self.bucket.get_verified(key, name, MAX_ROSTER_BYTES, version_id))
        return self._last[1]

    def held(self, name: str) -> bytes:
        """The canonical bytes of roster `name` if it is the one last seen (b"" otherwise, and for EMPTY)."""
        return self._last[2] if name == self._last[0] and name != EMPTY else b""

    def _take(self, name: str, data: bytes) -> bool:
        """Adopt `data` as roster `name` if it is: its digest and its fields (False: read it from the bucket)."""
        if len(data) > MAX_ROSTER_BYTES or digest(data) != name:
            return False
        try:
            self._adopt(name, data)
        except ValueError:
            return False
        return True

    def _adopt(self, name: str, data: bytes) -> None:
        roster = json.loads(data)
        if not isinstance(roster, dict) or set(roster) | OPTIONAL_FIELDS != set(ROSTER_FIELDS):
            raise ValueError(f"roster {name[:12]} does not hold the fields {', '.join(ROSTER_FIELDS)}")
        self._last = (name, roster, data)


def state_of_item(body: dict[str, Any], version: int, rosters: Rosters, roster: bytes = b"") -> RunState:
    """The whole run state of a state item's body: the item's fields and the roster it names (`roster`: the bytes a
    push delivered with the body, used if they are that roster's)."""
    recorded = body.get(VERSIONS) or {}
    return state_from_body(joined_body(body, rosters.read(body[ROSTER], roster, str(recorded.get(ROSTER, "")))),
                           version)
