"""The S3 key layout: the only module that knows where objects live in the run's bucket.

    runs/<run>/join/<participant>              join request (JSON)
    runs/<run>/init/<participant>              initial-model offer (safetensors), used if the run has none
    runs/<run>/heartbeat/<participant>         liveness and readiness (JSON)
    runs/<run>/rounds/<round>/global/<digest>  global model that round <round> trains from, by its SHA-256
    runs/<run>/rounds/<round>/optimizer/<digest>  server optimizer state that produced round <round>'s global:
                                               its index and piece files, each named by its digest
    runs/<run>/rounds/<round>/staging/<job>/<first>  a shard worker's outcome for the shard starting at piece <first>
    runs/<run>/rounds/<round>/delta/<digest>   the compressed change from the previous global to round <round>'s:
                                               its index (named by that global's digest) and piece files (by theirs)
    runs/<run>/rounds/<round>/<participant>    participant's trained model for round <round>
    runs/<run>/rounds/<round>/witness/<participant>   a witness's proof for round <round> (JSON)
    runs/<run>/rounds/<round>/health/<participant>    a health report about round <round> (JSON)
    runs/<run>/checkpoints/<round>/global      the global model a checkpoint keeps (the one round <round> trains from)
    runs/<run>/checkpoints/<round>/state.json  the run's state with it (every few rounds, and at each epoch's end)
    runs/<run>/checkpoints/<round>/optimizer/<digest>  the server optimizer state kept with it (index, pieces)
    runs/<run>/checkpoints/latest.json         which checkpoint is the latest
    runs/<run>/roster/<digest>                 the per-member part of the run state (members, selection, plan,
                                               speeds, health), by its digest, named by the state item
    runs/<run>/manifest.json                   tensor names, shapes and dtypes of the model
    runs/<run>/config.json                     the run configuration, published by the first tick

Rounds are zero-padded so keys sort in round order. Participant ids are validated before they become
part of any key: no path characters, no reserved names. Parsing is strict and total: ASCII only, every
part matched whole, and a key is accepted only if formatting what was parsed gives the key back
(`format_key(parse_key(k)) == k`), so the coordinator never records a key it would read back as another.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from enum import StrEnum

# Matched with `fullmatch` (never `match` with `$`, which tolerates a trailing newline), ASCII classes only.
PARTICIPANT_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,62}", re.ASCII)
RUN_ID_PATTERN = re.compile(r"[a-z0-9][a-z0-9-]{1,38}[a-z0-9]", re.ASCII)
RESERVED_IDS = frozenset({
    "global", "manifest", "config", "witness", "health", "state", "checkpoint", "checkpoints", "staging",
    "optimizer", "delta",
})
ROUND_DIGITS = 6
DIGEST_PATTERN = re.compile(r"[0-9a-f]{64}", re.ASCII)
MAX_KEY_LENGTH = 1024  # S3's own limit, in bytes of UTF-8; ours are ASCII


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
    STAGING = "staging"  # a global model being written in parts by the shard workers, before it has a digest
    OPTIMIZER = "optimizer"  # a server optimizer state's index or piece file, by its digest
    DELTA = "delta"  # a download delta's index (by the digest of the global it rebuilds) or piece file (by its own)
    ROSTER = "roster"  # the per-member part of a committed run state, by its digest (`store.rosters`)


def validate_participant_id(pid: str) -> str:
    """Return pid if it may be used in keys, else raise with the reason."""
    if not isinstance(pid, str) or not PARTICIPANT_ID_PATTERN.fullmatch(pid):
        raise KeyError_(
            f"invalid participant id {_shown(str(pid))}: use 1-63 characters of letters, digits, '_' and '-', "
            "starting with a letter or digit"
        )
    if pid.lower() in RESERVED_IDS:
        raise KeyError_(f"invalid participant id {_shown(pid)}: the name is reserved")
    return pid


def run_prefix(run_id: str) -> str:
    return f"runs/{run_id}/"


def join_prefix(run_id: str) -> str:
    return f"{run_prefix(run_id)}join/"


def join_key(run_id: str, pid: str) -> str:
    return f"{join_prefix(run_id)}{validate_participant_id(pid)}"


def init_key(run_id: str, pid: str) -> str:
    return f"{run_prefix(run_id)}init/{validate_participant_id(pid)}"


def heartbeat_prefix(run_id: str) -> str:
    return f"{run_prefix(run_id)}heartbeat/"


def heartbeat_key(run_id: str, pid: str) -> str:
    return f"{heartbeat_prefix(run_id)}{validate_participant_id(pid)}"


def rounds_prefix(run_id: str) -> str:
    return f"{run_prefix(run_id)}rounds/"


def round_prefix(run_id: str, round_no: int) -> str:
    if round_no < 0:
        raise KeyError_(f"round must be >= 0, got {round_no}")
    return f"{rounds_prefix(run_id)}{round_no:0{ROUND_DIGITS}d}/"


def global_key(run_id: str, round_no: int, digest: str) -> str:
    """Content-addressed: a key never holds two different models, so a racing tick that writes before its
    (failing) commit can leave an orphan but never replace the model the run committed to."""
    if not DIGEST_PATTERN.fullmatch(digest):
        raise KeyError_(f"global model digest must be 64 hex characters, got {digest!r}")
    return f"{global_prefix(run_id, round_no)}{digest}"


def global_prefix(run_id: str, round_no: int) -> str:
    return f"{round_prefix(run_id, round_no)}global/"


def staging_key(run_id: str, round_no: int, job: str) -> str:
    """Where the aggregation job `job` (64 hex digits naming its inputs) writes the global model of `round_no`
    part by part; it is copied to its content address (`global_key`) once its digest is known."""
    if not DIGEST_PATTERN.fullmatch(job):
        raise KeyError_(f"aggregation job id must be 64 hex characters, got {job!r}")
    return f"{round_prefix(run_id, round_no)}staging/{job}"


def shard_result_key(run_id: str, round_no: int, job: str, first: int) -> str:
    """Where the shard worker fed by the shard queue leaves its outcome for the shard of aggregation job `job`
    that starts at piece `first` (JSON), for the tick waiting on the job."""
    if not 0 <= first < 10**ROUND_DIGITS:
        raise KeyError_(f"a shard's first piece must be 0 to {10**ROUND_DIGITS - 1}, got {first}")
    return f"{staging_key(run_id, round_no, job)}/{first:0{ROUND_DIGITS}d}"


def optimizer_key(run_id: str, round_no: int, digest: str) -> str:
    """Content-addressed like the global model: the index of the server optimizer state that made round
    `round_no`'s global model, or one of its piece files (`shared.server_opt`)."""
    if not DIGEST_PATTERN.fullmatch(digest):
        raise KeyError_(f"optimizer state digest must be 64 hex characters, got {digest!r}")
    return f"{round_prefix(run_id, round_no)}optimizer/{digest}"


def delta_key(run_id: str, round_no: int, digest: str) -> str:
    """The download delta to round `round_no`'s global model (`shared.delta`): its index, at the digest of the
    global it rebuilds, or one of its piece files, at the piece file's own digest."""
    if not DIGEST_PATTERN.fullmatch(digest):
        raise KeyError_(f"delta file digest must be 64 hex characters, got {digest!r}")
    return f"{round_prefix(run_id, round_no)}delta/{digest}"


def update_key(run_id: str, round_no: int, pid: str) -> str:
    return f"{round_prefix(run_id, round_no)}{validate_participant_id(pid)}"


def witness_key(run_id: str, round_no: int, pid: str) -> str:
    return f"{round_prefix(run_id, round_no)}witness/{validate_participant_id(pid)}"


def health_key(run_id: str, round_no: int, pid: str) -> str:
    return f"{round_prefix(run_id, round_no)}health/{validate_participant_id(pid)}"


def checkpoints_prefix(run_id: str) -> str:
    return f"{run_prefix(run_id)}checkpoints/"


def checkpoint_prefix(run_id: str, round_no: int) -> str:
    """A checkpoint is named by the round whose global model it keeps: two never share a key."""
    return f"{checkpoints_prefix(run_id)}{round_no:0{ROUND_DIGITS}d}/"


def checkpoint_global_key(run_id: str, round_no: int) -> str:
    return f"{checkpoint_prefix(run_id, round_no)}global"


def checkpoint_state_key(run_id: str, round_no: int) -> str:
    return f"{checkpoint_prefix(run_id, round_no)}state.json"


def checkpoint_optimizer_key(run_id: str, round_no: int, digest: str) -> str:
    if not DIGEST_PATTERN.fullmatch(digest):
        raise KeyError_(f"optimizer state digest must be 64 hex characters, got {digest!r}")
    return f"{checkpoint_prefix(run_id, round_no)}optimizer/{digest}"


def latest_checkpoint_key(run_id: str) -> str:
    return f"{checkpoints_prefix(run_id)}latest.json"


def roster_prefix(run_id: str) -> str:
    return f"{run_prefix(run_id)}roster/"


def roster_key(run_id: str, digest: str) -> str:
    """Content-addressed: the per-member part of a run state (`store.rosters`); the state item names it."""
    if not DIGEST_PATTERN.fullmatch(digest):
        raise KeyError_(f"roster digest must be 64 hex characters, got {digest!r}")
    return f"{roster_prefix(run_id)}{digest}"


def manifest_key(run_id: str) -> str:
    return f"{run_prefix(run_id)}manifest.json"


def config_key(run_id: str) -> str:
    return f"{run_prefix(run_id)}config.json"


# Who writes what: participants upload these kinds, each key ending in the uploader's id; the coordinator writes
# every other kind, at the keys `coordinator_key_patterns` covers.
UPLOADED_KINDS = frozenset({ObjectKind.JOIN, ObjectKind.INIT, ObjectKind.HEARTBEAT, ObjectKind.UPDATE,
                            ObjectKind.WITNESS, ObjectKind.HEALTH})
COORDINATOR_ROUND_FOLDERS = ("global", "optimizer", "delta", "staging")  # rounds/<round>/<folder>/...


def coordinator_key_patterns(run_id: str) -> tuple[str, ...]:
    """Every key the coordinator writes, as patterns in which `*` stands for any text, '/' included (as in
    EventBridge's and IAM's wildcards): global models, server optimizer state, download deltas, staged aggregates
    and the shard outcomes beside them, in any round; rosters; checkpoints; manifest; config.

    No uploaded key of the layout matches one: those are join/, init/ and heartbeat/<id>, and rounds/<round>/<id>,
    rounds/<round>/witness/<id>, rounds/<round>/health/<id>, and an id holds no '/' and is never one of the round
    folders' names (`RESERVED_IDS`)."""
    any_round = f"{rounds_prefix(run_id)}*/"
    return (*(f"{any_round}{folder}/*" for folder in COORDINATOR_ROUND_FOLDERS),
            f"{roster_prefix(run_id)}*", f"{checkpoints_prefix(run_id)}*", manifest_key(run_id), config_key(run_id))


# What the participant role's session tag (its id) may hold, as its trust and policy conditions admit it
# (`infra.participants`): 1-63 characters, none of these, not a reserved name (in any case).
_NOT_IN_TAG_IDS = frozenset("/.:=+@ ")
_TAG_ID_MAX = 63


def uploader(run_id: str, key: str) -> str | None:
    """Whose upload a key can be, read from the key alone as the participant role grants writes
    (`infra.layout.participant_writes`): join/<id>, init/<id>, heartbeat/<id>, and anything below rounds/ that ends
    in /<id> (IAM's `*` spans '/', so at any depth), <id> being a value the session tag may hold. A key need not
    parse (`parse_key`) to have an uploader: junk at depth under a participant's keys is that participant's. None
    for a key no participant session can write: outside the run, or the coordinator's (`coordinator_key_patterns`).
    """
    prefix = run_prefix(run_id)
    if not key.startswith(prefix):
        return None
    rest = key[len(prefix):]
    folder, _, tail = rest.partition("/")
    if folder in ("join", "init", "heartbeat"):
        pid = tail
    elif folder == "rounds" and "/" in tail:
        if any(fnmatch.fnmatchcase(key, pattern) for pattern in coordinator_key_patterns(run_id)):
            return None
        pid = tail.rsplit("/", 1)[1]
    else:
        return None
    if not 0 < len(pid) <= _TAG_ID_MAX or not _NOT_IN_TAG_IDS.isdisjoint(pid) or pid.lower() in RESERVED_IDS:
        return None
    return pid


@dataclass(frozen=True)
class ParsedKey:
    kind: ObjectKind
    run_id: str
    participant: str | None = None
    round: int | None = None
    digest: str | None = None  # a global model's or optimizer file's content address; a staging object's job id
    name: str | None = None  # a checkpoint's file ("global", "state.json", "latest.json", "optimizer"); a shard's first
    # piece (staging/<job>/<first>)


_ROUND_RE = re.compile(rf"[0-9]{{{ROUND_DIGITS}}}", re.ASCII)
_CHECKPOINT_FILES = ("global", "state.json")


def _round_of(key: str, text: str) -> int:
    if not _ROUND_RE.fullmatch(text):
        raise KeyError_(f"key {_shown(key)}: round {_shown(text)} is not {ROUND_DIGITS} digits")
    return int(text)


def _shown(text: str, limit: int = 120) -> str:
    """A key as it may appear in a recorded reason: bounded, and quoted so control characters show."""
    return repr(text[:limit]) + ("…" if len(text) > limit else "")


def format_key(p: ParsedKey) -> str:
    """The key a parsed key stands for (the inverse of `parse_key`)."""
    r, pid = p.round, p.participant
    match p.kind:
        case ObjectKind.MANIFEST:
            return manifest_key(p.run_id)
        case ObjectKind.CONFIG:
            return config_key(p.run_id)
        case ObjectKind.JOIN if pid is not None:
            return join_key(p.run_id, pid)
        case ObjectKind.INIT if pid is not None:
            return init_key(p.run_id, pid)
        case ObjectKind.HEARTBEAT if pid is not None:
            return heartbeat_key(p.run_id, pid)
        case ObjectKind.ROSTER if p.digest is not None:
            return roster_key(p.run_id, p.digest)
        case ObjectKind.GLOBAL if r is not None:
            return global_key(p.run_id, r, p.digest) if p.digest is not None else f"{global_prefix(p.run_id, r)[:-1]}"
        case ObjectKind.STAGING if r is not None and p.digest is not None and p.name is not None:
            return shard_result_key(p.run_id, r, p.digest, int(p.name))
        case ObjectKind.STAGING if r is not None and p.digest is not None:
            return staging_key(p.run_id, r, p.digest)
        case ObjectKind.OPTIMIZER if r is not None and p.digest is not None:
            return optimizer_key(p.run_id, r, p.digest)
        case ObjectKind.DELTA if r is not None and p.digest is not None:
            return delta_key(p.run_id, r, p.digest)
        case ObjectKind.UPDATE if r is not None and pid is not None:
            return update_key(p.run_id, r, pid)
        case ObjectKind.WITNESS if r is not None and pid is not None:
            return witness_key(p.run_id, r, pid)
        case ObjectKind.HEALTH if r is not None and pid is not None:
            return health_key(p.run_id, r, pid)
        case ObjectKind.CHECKPOINT if r is None and p.name == "latest.json":
            return latest_checkpoint_key(p.run_id)
        case ObjectKind.CHECKPOINT if r is not None and p.name == "optimizer" and p.digest is not None:
            return checkpoint_optimizer_key(p.run_id, r, p.digest)
        case ObjectKind.CHECKPOINT if r is not None and p.name in _CHECKPOINT_FILES:
            return f"{checkpoint_prefix(p.run_id, r)}{p.name}"
    raise KeyError_(f"not a complete key: {p}")


def parse_key(key: str) -> ParsedKey:
    """Classify a key of the layout; raise KeyError_ with the reason for anything else.

    Total and strict: any text either parses to the one `ParsedKey` that formats back to exactly `key`,
    or is refused with a bounded reason.
    """
    if not isinstance(key, str) or not key.isascii() or len(key) > MAX_KEY_LENGTH:
        raise KeyError_(f"key {_shown(str(key))} is not an ASCII key of at most {MAX_KEY_LENGTH} characters")
    if not key.isprintable():
        raise KeyError_(f"key {_shown(key)} holds control characters")
    parsed = _parse_parts(key)
    if format_key(parsed) != key:  # defence in depth: what we would read back is what was written
        raise KeyError_(f"key {_shown(key)} is not in the layout's canonical form")
    return parsed


_BY_DIGEST = {  # rounds/<round>/<part>/<64 hex digits>
    "global": (ObjectKind.GLOBAL, "a global model's name (its digest)"),
    "staging": (ObjectKind.STAGING, "an aggregation job's name"),
    "delta": (ObjectKind.DELTA, "a download delta file's name (a digest)"),
}


def _parse_parts(key: str) -> ParsedKey:
    parts = key.split("/")
    if len(parts) < 3 or parts[0] != "runs" or not RUN_ID_PATTERN.fullmatch(parts[1]):
        raise KeyError_(f"key {_shown(key)} is outside the run layout")
    run_id, rest = parts[1], parts[2:]
    if rest == ["manifest.json"]:
        return ParsedKey(ObjectKind.MANIFEST, run_id)
    if rest == ["config.json"]:
        return ParsedKey(ObjectKind.CONFIG, run_id)
    simple = {"join": ObjectKind.JOIN, "init": ObjectKind.INIT, "heartbeat": ObjectKind.HEARTBEAT}
    if len(rest) == 2 and rest[0] in simple:
        return ParsedKey(simple[rest[0]], run_id, participant=validate_participant_id(rest[1]))
    if len(rest) == 2 and rest[0] == "roster":
        if not DIGEST_PATTERN.fullmatch(rest[1]):
            raise KeyError_(f"key {_shown(key)}: a roster's name must be its 64-hex-digit digest")
        return ParsedKey(ObjectKind.ROSTER, run_id, digest=rest[1])
    if rest == ["checkpoints", "latest.json"]:
        return ParsedKey(ObjectKind.CHECKPOINT, run_id, name="latest.json")
    if len(rest) == 3 and rest[0] == "checkpoints" and rest[2] in _CHECKPOINT_FILES:
        return ParsedKey(ObjectKind.CHECKPOINT, run_id, round=_round_of(key, rest[1]), name=rest[2])
    if len(rest) == 4 and rest[0] in ("rounds", "checkpoints") and rest[2] == "optimizer":
        if not DIGEST_PATTERN.fullmatch(rest[3]):
            raise KeyError_(f"key {_shown(key)}: an optimizer state file's name must be its 64-hex-digit digest")
        round_no = _round_of(key, rest[1])
        if rest[0] == "checkpoints":
            return ParsedKey(ObjectKind.CHECKPOINT, run_id, round=round_no, digest=rest[3], name="optimizer")
        return ParsedKey(ObjectKind.OPTIMIZER, run_id, round=round_no, digest=rest[3])
    if len(rest) == 4 and rest[0] == "rounds" and rest[2] in _BY_DIGEST:
        kind, what = _BY_DIGEST[rest[2]]
        if not DIGEST_PATTERN.fullmatch(rest[3]):
            raise KeyError_(f"key {_shown(key)}: {what} must be 64 hex digits")
        return ParsedKey(kind, run_id, round=_round_of(key, rest[1]), digest=rest[3])
    if len(rest) == 5 and rest[0] == "rounds" and rest[2] == "staging":
        if not DIGEST_PATTERN.fullmatch(rest[3]) or not _ROUND_RE.fullmatch(rest[4]):
            raise KeyError_(f"key {_shown(key)}: a shard outcome is staging/<64 hex digits>/<6 digits>")
        return ParsedKey(ObjectKind.STAGING, run_id, round=_round_of(key, rest[1]), digest=rest[3], name=rest[4])
    if len(rest) == 4 and rest[0] == "rounds" and rest[2] in ("witness", "health"):
        kind = ObjectKind.WITNESS if rest[2] == "witness" else ObjectKind.HEALTH
        return ParsedKey(kind, run_id, participant=validate_participant_id(rest[3]), round=_round_of(key, rest[1]))
    if len(rest) == 3 and rest[0] == "rounds":
        round_no = _round_of(key, rest[1])
        if rest[2] == "global":
            return ParsedKey(ObjectKind.GLOBAL, run_id, round=round_no)
        return ParsedKey(ObjectKind.UPDATE, run_id, participant=validate_participant_id(rest[2]), round=round_no)
    raise KeyError_(f"key {_shown(key)} is outside the run layout")
