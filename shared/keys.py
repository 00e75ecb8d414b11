"""The S3 key layout: the only module that knows where objects live in the run's bucket.

    runs/<run>/join/<participant>              join request (JSON)
    runs/<run>/init/<participant>              initial-model offer (safetensors), used if the run has none
    runs/<run>/heartbeat/<participant>         liveness and readiness (JSON)
    runs/<run>/rounds/<round>/global/<digest>  global model that round <round> trains from, by its SHA-256
    runs/<run>/rounds/<round>/<participant>    participant's trained model for round <round>
    runs/<run>/rounds/<round>/witness/<participant>   a witness's proof for round <round> (JSON)
    runs/<run>/rounds/<round>/health/<participant>    a health report about round <round> (JSON)
    runs/<run>/checkpoints/<epoch>/global      the global model at the end of an epoch
    runs/<run>/checkpoints/<epoch>/state.json  the run's state at the end of that epoch
    runs/<run>/checkpoints/latest.json         which checkpoint is the latest
    runs/<run>/manifest.json                   tensor names, shapes and dtypes of the model
    runs/<run>/config.json                     the run configuration, published by the first tick

Rounds are zero-padded so keys sort in round order. Participant ids are validated before they become
part of any key: no path characters, no reserved names.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum

PARTICIPANT_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$")
RESERVED_IDS = frozenset({"global", "manifest", "config", "witness", "health", "state", "checkpoint", "checkpoints"})
ROUND_DIGITS = 6
DIGEST_PATTERN = re.compile(r"^[0-9a-f]{64}$")


class KeyError_(ValueError):
    """A key or participant id that does not fit the layout."""


class ObjectKind(StrEnum):
    JOIN = "join"
    INIT = "init"
    HEARTBEAT = "heartbeat"
    GLOBAL = "global"
    UPDATE = "update"
    MANIFEST = "manifest"
    CONFIG = "config"
    WITNESS = "witness"
    HEALTH = "health"
    CHECKPOINT = "checkpoint"


def validate_participant_id(pid: str) -> str:
    """Return pid if it may be used in keys, else raise with the reason."""
    if not isinstance(pid, str) or not PARTICIPANT_ID_PATTERN.match(pid):
        raise KeyError_(
            f"invalid participant id {pid!r}: use 1-63 characters of letters, digits, '_' and '-', "
            "starting with a letter or digit"
        )
    if pid.lower() in RESERVED_IDS:
        raise KeyError_(f"invalid participant id {pid!r}: the name is reserved")
    return pid


def run_prefix(run_id: str) -> str:
    return f"runs/{run_id}/"


def join_key(run_id: str, pid: str) -> str:
    return f"{run_prefix(run_id)}join/{validate_participant_id(pid)}"


def init_key(run_id: str, pid: str) -> str:
    return f"{run_prefix(run_id)}init/{validate_participant_id(pid)}"


def heartbeat_key(run_id: str, pid: str) -> str:
    return f"{run_prefix(run_id)}heartbeat/{validate_participant_id(pid)}"


def round_prefix(run_id: str, round_no: int) -> str:
    if round_no < 0:
        raise KeyError_(f"round must be >= 0, got {round_no}")
    return f"{run_prefix(run_id)}rounds/{round_no:0{ROUND_DIGITS}d}/"


def global_key(run_id: str, round_no: int, digest: str) -> str:
    """Content-addressed: a key never holds two different models, so a racing tick that writes before its
    (failing) commit can leave an orphan but never replace the model the run committed to."""
    if not DIGEST_PATTERN.match(digest):
        raise KeyError_(f"global model digest must be 64 hex characters, got {digest!r}")
    return f"{global_prefix(run_id, round_no)}{digest}"


def global_prefix(run_id: str, round_no: int) -> str:
    return f"{round_prefix(run_id, round_no)}global/"


def update_key(run_id: str, round_no: int, pid: str) -> str:
    return f"{round_prefix(run_id, round_no)}{validate_participant_id(pid)}"


def witness_key(run_id: str, round_no: int, pid: str) -> str:
    return f"{round_prefix(run_id, round_no)}witness/{validate_participant_id(pid)}"


def health_key(run_id: str, round_no: int, pid: str) -> str:
    return f"{round_prefix(run_id, round_no)}health/{validate_participant_id(pid)}"


def checkpoint_prefix(run_id: str, epoch: int) -> str:
    return f"{run_prefix(run_id)}checkpoints/{epoch:0{ROUND_DIGITS}d}/"


def checkpoint_global_key(run_id: str, epoch: int) -> str:
    return f"{checkpoint_prefix(run_id, epoch)}global"


def checkpoint_state_key(run_id: str, epoch: int) -> str:
    return f"{checkpoint_prefix(run_id, epoch)}state.json"


def latest_checkpoint_key(run_id: str) -> str:
    return f"{run_prefix(run_id)}checkpoints/latest.json"


def manifest_key(run_id: str) -> str:
    return f"{run_prefix(run_id)}manifest.json"


def config_key(run_id: str) -> str:
    return f"{run_prefix(run_id)}config.json"


@dataclass(frozen=True)
class ParsedKey:
    kind: ObjectKind
    run_id: str
    participant: str | None = None
    round: int | None = None


_ROUND_RE = re.compile(rf"^\d{{{ROUND_DIGITS}}}$")


def _round_of(key: str, text: str) -> int:
    if not _ROUND_RE.match(text):
        raise KeyError_(f"key {key!r}: round {text!r} is not {ROUND_DIGITS} digits")
    return int(text)


def parse_key(key: str) -> ParsedKey:
    """Classify a key of the layout; raise KeyError_ with the reason for anything else."""
    parts = key.split("/")
    if len(parts) < 3 or parts[0] != "runs" or not parts[1]:
        raise KeyError_(f"key {key!r} is outside the run layout")
    run_id, rest = parts[1], parts[2:]
    if rest == ["manifest.json"]:
        return ParsedKey(ObjectKind.MANIFEST, run_id)
    if rest == ["config.json"]:
        return ParsedKey(ObjectKind.CONFIG, run_id)
    simple = {"join": ObjectKind.JOIN, "init": ObjectKind.INIT, "heartbeat": ObjectKind.HEARTBEAT}
    if len(rest) == 2 and rest[0] in simple:
        return ParsedKey(simple[rest[0]], run_id, participant=validate_participant_id(rest[1]))
    if rest[0] == "checkpoints" and len(rest) in (2, 3):
        return ParsedKey(ObjectKind.CHECKPOINT, run_id)
    if len(rest) == 4 and rest[0] == "rounds" and rest[2] == "global":
        return ParsedKey(ObjectKind.GLOBAL, run_id, round=_round_of(key, rest[1]))
    if len(rest) == 4 and rest[0] == "rounds" and rest[2] in ("witness", "health"):
        kind = ObjectKind.WITNESS if rest[2] == "witness" else ObjectKind.HEALTH
        return ParsedKey(kind, run_id, participant=validate_participant_id(rest[3]), round=_round_of(key, rest[1]))
    if len(rest) == 3 and rest[0] == "rounds":
        round_no = _round_of(key, rest[1])
        if rest[2] == "global":
            return ParsedKey(ObjectKind.GLOBAL, run_id, round=round_no)
        return ParsedKey(ObjectKind.UPDATE, run_id, participant=validate_participant_id(rest[2]), round=round_no)
    raise KeyError_(f"key {key!r} is outside the run layout")
