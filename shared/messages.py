"""The control messages participants upload, one pydantic schema each: the only place their shape is defined.

    JoinRequest    runs/<run>/join/<participant>                     who joins, with the key it signs with
    Heartbeat      runs/<run>/heartbeat/<participant>                liveness and readiness
    HealthReport   runs/<run>/rounds/<round>/health/<participant>    members a participant reports unhealthy
    ProofEnvelope  runs/<run>/rounds/<round>/witness/<participant>   a witness proof's JSON (shared.witness.Proof)

and the one the coordinator sends them:

    StateChange    the run's state topic -> each participant's queue    a committed state item, pushed

and the credential endpoint's (a function URL; shared.hosts has its rules):

    RedeemRequest     POST /redeem    an invite's secret, with the public key the host binds to its id
    RenewRequest      POST /renew     a timestamp and nonce signed with that key
    CredentialAnswer  either's 200    STS credentials for the participant role, and where the run lives

Every model is strict (no coercion: "3" is not an integer), forbids unknown fields, is frozen and bounds
every string, list and mapping, so a hostile upload costs a bounded amount of work and storage. Ingest
parses each body with `parse_message`, whose `MessageError` names the offending field(s) and never echoes
more than a few hundred characters of the input. Senders build the model and upload
`model.model_dump(mode="json")` (the `schema` version is filled in by default).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Final, Literal, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PlainValidator,
    SerializerFunctionWrapHandler,
    ValidationError,
    model_serializer,
    model_validator,
)
from pydantic import StringConstraints as Text
from pydantic_core import ErrorDetails

from shared.keys import validate_participant_id

SCHEMA_VERSION: Final = 1  # join requests, heartbeats and health reports; absent means 1
PROOF_SCHEMA: Final = 1  # witness proofs carry it explicitly
MAX_CONTROL_BYTES = 64 * 1024  # join requests, heartbeats and health reports are small JSON documents
MAX_PROOF_BYTES = 256 * 1024  # an uploaded proof; recorded whole in one DynamoDB item (400 KB at most)
MAX_PROOF_RECORD_BYTES = 300 * 1024  # the proof as recorded (shared.witness.Proof.to_json), which can be longer
MAX_BLOOM_BITS = 1 << 20
MAX_HASHES = 32
MAX_HEALTH_IDS = 1000  # participant ids one health report may name
MAX_EVALUATIONS = 10_000  # entries of a proof's evaluations
MAX_RUN_ID = 64  # longer than any valid run id (3-40 characters): a mismatch is refused by its own reason
MAX_PUBLIC_KEY = 128  # a base64 Ed25519 public key is 44 characters
MAX_PARTICIPANT_ID = 63
MAX_INFO_ITEMS = 64  # `info` is displayed, never trusted; admission.bounded_info keeps 20 items of 40/200 chars
MAX_INFO_KEY = 64
MAX_INFO_TEXT = 1024
MAX_INFO_NUMBER = 1e15  # fits a DynamoDB number
MAX_COUNTER = 10**9  # rounds, epochs and witness positions
MAX_ERROR_CHARS = 300  # a MessageError's text at most (it is recorded and logged)
_MAX_FIELD_CHARS = 60  # one field path in an error (field names and mapping keys come from the input)
_MAX_PROBLEMS = 3

M = TypeVar("M", bound="Message")


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a message: the field's path ("" for the document itself) and why."""

    field: str
    kind: str  # pydantic's error type: "missing", "extra_forbidden", "int_type", "json_invalid", ...
    text: str

    def describe(self) -> str:
        if not self.field:
            return self.text
        return f"field '{self.field}': {self.text}"


class MessageError(ValueError):
    """A control message that does not fit its schema; the text names the offending field(s)."""

    def __init__(self, problems: Sequence[Problem]) -> None:
        self.problems = tuple(problems)
        super().__init__(describe(self.problems))

    @property
    def fields(self) -> tuple[str, ...]:
        return tuple(p.field for p in self.problems)


def describe(problems: Sequence[Problem]) -> str:
    """A bounded, one-line account of `problems`."""
    shown = "; ".join(p.describe() for p in problems[:_MAX_PROBLEMS])
    if len(problems) > _MAX_PROBLEMS:
        shown += f"; and {len(problems) - _MAX_PROBLEMS} more"
    return shown if len(shown) <= MAX_ERROR_CHARS else shown[: MAX_ERROR_CHARS - 1] + "…"


def _printable(text: str, limit: int) -> str:
    clean = "".join(c if c.isprintable() else "?" for c in text[: limit + 1])
    return clean if len(clean) <= limit else clean[: limit - 1] + "…"


def _field_path(loc: tuple[int | str, ...]) -> str:
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part == "[key]":
            path += "[key]"
        else:
            path += f".{part}" if path else str(part)
    return _printable(path, _MAX_FIELD_CHARS)


def _problem(error: ErrorDetails) -> Problem:
    kind, loc = error["type"], tuple(error["loc"])
    if not loc and kind == "json_invalid":
        return Problem("", kind, "not a JSON document")
    if not loc and kind == "model_type":
        return Problem("", kind, "not a JSON object")
    text = error["msg"]
    if kind == "value_error" and "error" in error.get("ctx", {}):
        text = str(error.get("ctx", {})["error"])  # our own validators' words, without "Value error, "
    return Problem(_field_path(loc), kind, _printable(text, MAX_ERROR_CHARS))


def parse_message(model: type[M], data: bytes | str) -> M:
    """Validate a JSON document against `model`; raise MessageError naming the offending field(s)."""
    try:
        return model.model_validate_json(data)
    except ValidationError as exc:
        errors = exc.errors(include_url=False, include_input=False)
        raise MessageError([_problem(e) for e in errors]) from None


# --- field types -------------------------------------------------------------------------------------


def _info_value(value: Any) -> str | int | float | bool | None:
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int | float):
        if not (math.isfinite(value) and abs(value) <= MAX_INFO_NUMBER):
            raise ValueError(f"info numbers must be finite and at most {MAX_INFO_NUMBER:g} in size")
        return value
    if isinstance(value, str):
        if len(value) > MAX_INFO_TEXT:
            raise ValueError(f"info text must be at most {MAX_INFO_TEXT} characters")
        return str(value)  # a str subclass (torch.__version__ is one) is kept as plain text
    raise ValueError("info values must be strings, numbers, booleans or null (info is flat)")


ParticipantId = Annotated[
    str, Text(min_length=1, max_length=MAX_PARTICIPANT_ID), AfterValidator(validate_participant_id)
]
RunId = Annotated[str, Text(max_length=MAX_RUN_ID)]
InfoKey = Annotated[str, Text(max_length=MAX_INFO_KEY)]
InfoValue = Annotated[str | int | float | bool | None, PlainValidator(_info_value)]
Info = Annotated[dict[InfoKey, InfoValue], Field(max_length=MAX_INFO_ITEMS)]
Counter = Annotated[int, Field(ge=0, le=MAX_COUNTER)]
# When the sender made the message (its clock, Unix seconds). Join requests and heartbeats sit at one key per
# participant, so a signed copy could be uploaded again: ingest accepts one only if it was sent after the last
# one it accepted from that participant and within `max_clock_skew` of its arrival (`admission.staleness`).
SentAt = Annotated[float, Field(gt=0, lt=1e11, allow_inf_nan=False)]


class Message(BaseModel):
    """Strict, closed, immutable and bounded; serialized with `model_dump(mode="json")`."""

    model_config = ConfigDict(
        strict=True, extra="forbid", frozen=True, allow_inf_nan=False, serialize_by_alias=True,  # pydantic>=2.11
    )


# --- the messages -------------------------------------------------------------------------------------


class JoinRequest(Message):
    """Signed with the key it registers: proof that the joiner holds it."""

    schema_version: Literal[1] = Field(SCHEMA_VERSION, alias="schema")
    run_id: RunId
    participant: ParticipantId
    public_key: Annotated[str, Text(min_length=1, max_length=MAX_PUBLIC_KEY)]
    sent_at: SentAt
    info: Info = Field(default_factory=dict)
    # Local data mode: how many samples the participant's own data holds (registered once; an update may claim
    # at most this many). Absent in assigned mode.
    samples: Annotated[int, Field(ge=1, le=MAX_COUNTER)] | None = None

    @model_serializer(mode="wrap")
    def _omit_absent_samples(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        body: dict[str, Any] = handler(self)
        if body.get("samples") is None:  # assigned mode: the join reads exactly as it did before local mode
            body.pop("samples", None)
        return body


class Progress(Message):
    """How far a participant's training of a round has got: `done` of `total` units (batches)."""

    round: Counter
    done: Counter
    total: Annotated[int, Field(ge=1, le=MAX_COUNTER)]

    @model_validator(mode="after")
    def _done_within_total(self) -> Progress:
        if self.done > self.total:
            raise ValueError("done cannot exceed total")
        return self


MAX_RATE = 1e9  # samples per second


class Heartbeat(Message):
    """Liveness, and the epoch whose model the participant holds (`ready_epoch`; absent: no news); its training
    progress in the round it trains or trained last (`progress`), and the training throughput it measured in its
    last round, in samples per second (`samples_per_second`). Both are shown by `fed status`; progress also tells
    a stuck participant from a slow one (docs/protocol.md)."""

    schema_version: Literal[1] = Field(SCHEMA_VERSION, alias="schema")
    participant: ParticipantId
    sent_at: SentAt
    ready_epoch: Counter | None = None
    info: Info = Field(default_factory=dict)
    progress: Progress | None = None
    samples_per_second: Annotated[float, Field(ge=0, le=MAX_RATE)] | None = None

    @model_serializer(mode="wrap")
    def _omit_absent(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        body: dict[str, Any] = handler(self)
        for name in ("progress", "samples_per_second"):  # a heartbeat without them reads as it did before
            if body.get(name) is None:
                body.pop(name, None)
        return body


class HealthReport(Message):
    """Members attested by fewer than a quorum of a round's witnesses, as one member saw the scores."""

    schema_version: Literal[1] = Field(SCHEMA_VERSION, alias="schema")
    unhealthy: tuple[ParticipantId, ...] = Field(max_length=MAX_HEALTH_IDS)


MAX_STATE_CHANGE_BYTES = 16 * 1024  # the state item's body is a few hundred bytes whatever the membership
# SNS publishes and SQS receives are billed one request per 64 KiB of payload: a state change carries its roster
# (`store.push`) only while the whole message stays within one
BILLED_CHUNK_BYTES = 64 * 1024


class StateChange(Message):
    """A commit that changed the run's phase, round, epoch or model, as published to the run's state topic: the
    state item's body exactly as stored (its roster named by digest, `store.rosters`) and its version. A
    participant takes it as a read of the state item that it did not have to make. Publishing is best effort:
    a participant that hears nothing for long reads the item itself (participant.protocol)."""

    schema_version: Literal[1] = Field(SCHEMA_VERSION, alias="schema")
    run_id: RunId
    version: Annotated[int, Field(ge=1, le=10**15)]
    state: dict[str, Any]


class BloomEnvelope(Message):
    """A bloom filter as a proof carries it (shared.witness.BloomFilter)."""

    bits: int = Field(ge=8, le=MAX_BLOOM_BITS)
    hashes: int = Field(ge=1, le=MAX_HASHES)
    hex: str = Field(max_length=2 * ((MAX_BLOOM_BITS + 7) // 8))

    @model_validator(mode="after")
    def _data_fits(self) -> BloomEnvelope:
        if len(self.hex) != 2 * ((self.bits + 7) // 8):
            raise ValueError("bloom filter data does not match its size")
        try:
            bytes.fromhex(self.hex)
        except ValueError:
            raise ValueError("bloom filter data is not hex") from None
        return self


class ProofEnvelope(Message):
    """A witness proof's JSON (shared.witness.Proof.to_json writes it, Proof.from_json reads it through this)."""

    schema_version: Literal[1] = Field(alias="schema")  # required: proofs always carried it
    run_id: RunId
    round: Counter
    witness: ParticipantId
    position: Counter
    participants: BloomEnvelope
    digests: BloomEnvelope
    complete: bool
    loss: float = 0.0
    throughput: float = 0.0
    evaluations: Annotated[
        dict[Annotated[str, Text(max_length=MAX_PARTICIPANT_ID)], float], Field(max_length=MAX_EVALUATIONS)
    ] = Field(default_factory=dict)


# --- the coordinator's own messages: a tick hands an aggregation shard to a shard worker -----------------


class ShardInput(Message):
    participant: str = Field(max_length=MAX_PARTICIPANT_ID)
    samples: int = Field(gt=0)
    digest: str = Field(pattern=r"^[0-9a-f]{64}$")
    version_id: str = Field(max_length=1024)
    norm: float = -1.0
    data_offset: int = Field(-1, ge=-1)


class ShardTask(Message):
    """Pieces [first, stop) of the global model of round `round + 1`, to be written as parts of the multipart
    upload `upload_id` at `staging` (`coordinator.aggregation`). The base model is named by its authenticated
    version (the tick read it back by digest), so the worker need not hash it again."""

    round: int = Field(ge=0, le=MAX_COUNTER)
    base_digest: str = Field(pattern=r"^[0-9a-f]{64}$")
    base_version: str = Field(max_length=1024)
    base_size: int = Field(gt=0)
    inputs: list[ShardInput] = Field(min_length=1)
    staging: str = Field(max_length=1024)
    upload_id: str = Field(max_length=4096)
    first: int = Field(ge=0)
    stop: int = Field(gt=0)
    optimizer_digest: str = Field("", pattern=r"^([0-9a-f]{64})?$")  # the server optimizer state it starts from


class PieceDone(Message):
    index: int = Field(ge=0)
    etag: str = Field(max_length=256)
    hash: str = Field(pattern=r"^[0-9a-f]{64}$")
    state: str = Field("", pattern=r"^([0-9a-f]{64})?$")  # the digest of the piece's optimizer state file, if any
    delta: str = Field("", pattern=r"^([0-9a-f]{64})?$")  # the digest of the piece's download delta file, if any


class ShardDone(Message):
    pieces: list[PieceDone]


# --- what a shard worker hands back: its outcome, bound to the task it answers -----------------------------

SHARD_OUTCOME_SCHEMA: Final = 2  # (1: an unbound outcome, trusted by its upload id alone)
MAX_OUTCOME_TEXT = 2000  # a failure's or an unreadable input's account, as the worker wrote it


def shard_task_digest(task: ShardTask) -> str:
    """SHA-256 of the task's canonical JSON: every input (participant, samples, recorded digest and version, norm,
    data offset), the base model's digest, version and size, the staging key (which names the job), the upload,
    the pieces [first, stop) and the optimizer state it starts from. An outcome names it, so an outcome answers
    exactly one task: one written for another job, another upload or another piece range names another digest."""
    canonical = json.dumps(task.model_dump(mode="json"), sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


class ShardCorrupt(Message):
    """An input the worker could not read as the task records it, named as the task names it (participant,
    recorded digest and version); no participant for the base model or the optimizer state."""

    participant: str = Field("", max_length=MAX_PARTICIPANT_ID)
    digest: str = Field("", pattern=r"^([0-9a-f]{64})?$")
    version_id: str = Field("", max_length=1024)
    missing: bool = False  # the read found no such version (rather than one it could not read)
    message: str = Field(max_length=MAX_OUTCOME_TEXT)


class ShardOutcome(Message):
    """What a shard worker leaves at `keys.shard_result_key` (or returns to a local worker pool), for the task whose
    digest is `task` (`shard_task_digest`): exactly one of the pieces it wrote, an input it could not read, or why it
    failed. `upload_id` repeats the task's (an outcome of an earlier attempt at the same job is told apart by it
    without hashing anything)."""

    schema_version: Literal[2] = Field(SHARD_OUTCOME_SCHEMA, alias="schema")
    task: str = Field(pattern=r"^[0-9a-f]{64}$")
    upload_id: str = Field(max_length=4096)
    done: ShardDone | None = None
    corrupt: ShardCorrupt | None = None
    failed: str = Field("", max_length=MAX_OUTCOME_TEXT)

    @model_validator(mode="after")
    def _exactly_one(self) -> ShardOutcome:
        if (self.done is not None) + (self.corrupt is not None) + bool(self.failed) != 1:
            raise ValueError("a shard outcome is exactly one of done, corrupt and failed")
        return self


# --- the credential endpoint's requests and answer (shared.hosts: the invite, the renewal's signed message) -------

SECRET_PATTERN: Final = r"^[A-Za-z0-9_-]{43}$"  # base64url, unpadded, of 32 random bytes
NONCE_PATTERN: Final = r"^[0-9a-f]{32}$"
MAX_SIGNATURE = 128  # a base64 Ed25519 signature is 88 characters
MAX_NAME = 2048  # an ARN, a URL or a resource name in the answer's connection


def _base64_of(size: int, what: str) -> Any:
    def check(text: str) -> str:
        try:
            raw = base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError):
            raise ValueError(f"{what} is not base64") from None
        if len(raw) != size:
            raise ValueError(f"{what} must be {size} bytes, not {len(raw)}")
        return text

    return AfterValidator(check)


Ed25519Key = Annotated[str, Text(min_length=1, max_length=MAX_PUBLIC_KEY), _base64_of(32, "an Ed25519 public key")]
Ed25519Signature = Annotated[str, Text(min_length=1, max_length=MAX_SIGNATURE), _base64_of(64, "an Ed25519 signature")]
Name = Annotated[str, Text(max_length=MAX_NAME)]


class RedeemRequest(Message):
    """A host's first request: the invite's one-time secret, and the raw public keys it binds to its id: the host
    key its renewals are signed with, and the key its uploads are signed with (so that both die together)."""

    host: ParticipantId
    secret: str = Field(pattern=SECRET_PATTERN)
    public_key: Ed25519Key
    upload_key: Ed25519Key


class RenewRequest(Message):
    """Every later request: signed with the bound key over `shared.hosts.renewal_message`; the time bounds how long a
    copy could be replayed, the nonce refuses the replay within that time."""

    host: ParticipantId
    issued_at: SentAt
    nonce: str = Field(pattern=NONCE_PATTERN)
    signature: Ed25519Signature


class IssuedCredentials(Message):
    """STS credentials as botocore's refreshable credentials read them (`Expiration`: ISO 8601 UTC, "Z")."""

    AccessKeyId: str = Field(min_length=16, max_length=128)
    SecretAccessKey: str = Field(min_length=1, max_length=256)
    SessionToken: str = Field(min_length=1, max_length=4096)
    Expiration: str = Field(pattern=r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z$")


class RunConnection(Message):
    """Where the run lives: `store.connection.Connection`'s fields but the tick function (an operator's)."""

    run_id: RunId
    bucket: Name
    table: Name
    region: Annotated[str, Text(min_length=1, max_length=64)]
    participant_role: Name
    state_topic: Name = ""
    endpoint: Name | None = None  # None on AWS; the local stack's endpoint locally


class CredentialAnswer(Message):
    """The credential endpoint's 200 answer to a redemption or a renewal: all a host needs to take part."""

    credentials: IssuedCredentials
    connection: RunConnection
