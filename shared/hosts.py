"""Hosts outside AWS: the invite an operator hands over, the renewal a host signs, and the rules the credential
endpoint applies to both (pure: `store.hosts` keeps the records, `coordinator.credentials` answers the requests).

A host is a participant (its id is a participant id) that has no AWS identity of its own. It redeems an invite
once, binding the public half of a key pair it has just made (its host key) and the public key it signs its
uploads with; after that it renews by requests signed with the host key. Each answer is STS credentials for the
participant role tagged with its id, so every participant policy applies to it unchanged, and with its generation
(`session_tag`).

Generations: a revoked id stays revoked. `fed hosts reinstate` starts the id's next generation (a new invite); every
key, session and upload of an earlier generation stays refused: keys by the host record (`retired_keys`, and ingest's
`upload_refusal`), sessions by the participant role's deny on `HOST_TAG` (`deny_policy`).

    fed-invite-v1.<base64url, unpadded, of {"endpoint": ..., "host": ..., "secret": ..., "expires": ...}>

Only the secret's SHA-256 is stored, and no error here or at the endpoint repeats a secret.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Final

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from shared.keys import KeyError_, validate_participant_id
from shared.messages import NONCE_PATTERN, SECRET_PATTERN, CredentialAnswer, RedeemRequest, RenewRequest
from shared.naming import HOST_TAG

INVITE_PREFIX: Final = "fed-invite-v1."
REDEEM_PATH: Final = "/redeem"  # the endpoint's two paths (POST), after the invite's endpoint URL
RENEW_PATH: Final = "/renew"
INVITE_FIELDS: Final = ("endpoint", "host", "secret", "expires")  # in the order an invite is written
MAX_INVITE_CHARS: Final = 4096
MAX_ENDPOINT_CHARS: Final = 2048
SECRET_BYTES: Final = 32
NONCE_BYTES: Final = 16
MAX_SESSION_SECONDS: Final = 3600  # the longest session the endpoint issues (role chaining caps STS at one hour)
CLOCK_ALLOWANCE_SECONDS: Final = 300  # how far AWS's clock and the revoking operator's may disagree
# How long a revoked generation stays in the deny policy: every session issued before its revocation has expired by then
DENY_SECONDS: Final = MAX_SESSION_SECONDS + CLOCK_ALLOWANCE_SECONDS
MAX_ROLE_POLICY_CHARS: Final = 10240  # IAM: a role's inline policies together, whitespace not counted
# The most the participant role's own inline policy may take (tests/infrastructure checks the template's): the deny
# policy has the rest, whatever the number of revocations in DENY_SECONDS (`fed.hosts.deny_sessions` measures both).
PARTICIPANT_POLICY_BUDGET: Final = 6000
RATE_WINDOW_SECONDS: Final = 60  # the rate limits count requests per minute
REFUSAL_SECONDS: Final = 7 * 24 * 3600  # how long a refusal's record is kept
UNKNOWN_HOST: Final = "?"  # what a refusal records when the request names no valid host id
_SECRET = re.compile(SECRET_PATTERN)
_NONCE = re.compile(NONCE_PATTERN)
_BASE64URL = re.compile(r"[A-Za-z0-9_-]+")


class HostStatus(StrEnum):
    INVITED = "invited"  # an invite is out; nothing is bound yet
    ACTIVE = "active"  # redeemed: its public key is bound, it renews
    REVOKED = "revoked"  # refused from then on


@dataclass(frozen=True)
class HostLimits:
    """What the credential endpoint allows (its function's environment sets the first three)."""

    credential_seconds: int = 3600  # a session's lifetime (900-3600 on AWS; less locally)
    per_host_per_minute: int = 12  # verified requests (a matching secret or signature) of one host
    all_hosts_per_minute: int = 120  # verified requests of all hosts together
    # Requests that prove nothing (malformed, an id with no invite, a wrong secret or signature, a stale or replayed
    # renewal): a budget of their own, so that no flood of them spends the two above; past it they are answered 429
    # and only counted.
    unverified_per_minute: int = 60
    max_skew_seconds: float = 300.0  # how far a renewal's `issued_at` may be from the endpoint's clock
    max_body_bytes: int = 4096

    @property
    def nonce_seconds(self) -> int:
        """How long a used nonce is kept: past the whole window in which its renewal's time is accepted."""
        return int(2 * self.max_skew_seconds) + RATE_WINDOW_SECONDS


@dataclass(frozen=True)
class HostRecord:
    """A host as stored (`store.hosts`); times are epoch seconds, 0 for "not yet"."""

    host: str
    status: HostStatus
    secret_hash: str = field(repr=False)
    invite_expires: float
    invited_at: float
    public_key: str = ""  # the host key, bound at redemption: renewals are signed with it
    redeemed_at: float = 0.0
    last_credentials_at: float = 0.0
    revoked_at: float = 0.0
    revoke_reason: str = ""
    generation: int = 1  # 1 from the first invite; each `fed hosts reinstate` starts the next
    upload_key: str = ""  # the upload-signing key, bound at redemption with the host key
    registered_key: str = ""  # the upload key ingest registered for this generation's join ("" until then)
    retired_keys: tuple[str, ...] = ()  # the host and upload keys of earlier generations: never bound again


@dataclass(frozen=True)
class Revocation:
    """One generation of a host, revoked at `at` (epoch seconds): its sessions are denied until `at + DENY_SECONDS`."""

    host: str
    generation: int
    at: float


class RefusalKind(StrEnum):
    """What the endpoint keeps refusals by: one record per host and kind, however many arrive."""

    MALFORMED = "malformed"  # not a request: size, method, path or body
    UNVERIFIED = "unverified"  # no invite for the id, or the secret or signature does not match
    STALE = "stale"  # signed, but its time is out of the window or its nonce was used (a replay, or a retry)
    REFUSED = "refused"  # verified, and refused for good: revoked, invite expired or already redeemed


@dataclass(frozen=True)
class HostRefusal:
    """The refusals of one kind of requests naming `host` (UNKNOWN_HOST for those naming no invited host): how
    many, the latest (`reason`, `at`) and the first, kept a week after the latest."""

    host: str
    reason: str
    at: float
    kind: RefusalKind = RefusalKind.REFUSED
    count: int = 1
    first_reason: str = ""
    first_at: float = 0.0


# --- the invite -------------------------------------------------------------------------------------------


class InviteError(ValueError):
    """An invite line that is not one; the text says what is wrong and never repeats the secret."""


@dataclass(frozen=True)
class Invite:
    endpoint: str  # the credential endpoint's URL
    host: str
    secret: str = field(repr=False)
    expires: int  # epoch seconds


def new_secret() -> str:
    """An invite's one-time secret: base64url, unpadded, of 32 random bytes."""
    return base64.urlsafe_b64encode(secrets.token_bytes(SECRET_BYTES)).rstrip(b"=").decode()


def secret_hash(secret: str) -> str:
    """What is stored of a secret: the SHA-256 (hex) of its text."""
    return hashlib.sha256(secret.encode()).hexdigest()


def format_invite(invite: Invite) -> str:
    body = json.dumps({name: getattr(invite, name) for name in INVITE_FIELDS}, separators=(",", ":"))
    return INVITE_PREFIX + base64.urlsafe_b64encode(body.encode()).rstrip(b"=").decode()


def parse_invite(line: str) -> Invite:
    """The invite a line carries (surrounding whitespace ignored); InviteError naming what is wrong."""
    text = line.strip()
    if not text.startswith(INVITE_PREFIX):
        raise InviteError(f"not an invite: an invite line starts with {INVITE_PREFIX!r}")
    if len(text) > MAX_INVITE_CHARS:
        raise InviteError(f"the invite is longer than {MAX_INVITE_CHARS} characters")
    payload = text[len(INVITE_PREFIX):]
    if not _BASE64URL.fullmatch(payload):
        raise InviteError("the invite is damaged: after its prefix it must be unpadded base64url")
    try:
        fields = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    except (binascii.Error, ValueError):
        raise InviteError("the invite is damaged: it does not decode to a JSON document") from None
    invite = _invite_of(fields)
    if format_invite(invite) != text:
        raise InviteError("the invite is damaged: it is not written as `fed hosts invite` writes invites")
    return invite


def _invite_of(fields: Any) -> Invite:
    if not isinstance(fields, dict):
        raise InviteError("the invite is damaged: it does not decode to a JSON object")
    missing = [name for name in INVITE_FIELDS if name not in fields]
    unknown = sorted(name[:40] for name in fields if name not in INVITE_FIELDS)
    if missing or unknown:
        raise InviteError("the invite is damaged: " + "; ".join(
            ([f"it lacks {', '.join(missing)}"] if missing else []) + ([f"unknown {unknown}"] if unknown else [])))
    endpoint, host, secret, expires = (fields[name] for name in INVITE_FIELDS)
    if not (isinstance(endpoint, str) and re.fullmatch(r"https?://[!-~]+", endpoint)
            and len(endpoint) <= MAX_ENDPOINT_CHARS):
        raise InviteError("the invite's endpoint is not an http(s) URL")
    try:
        validate_participant_id(host)
    except KeyError_ as exc:
        raise InviteError(f"the invite's host: {exc}") from None
    if not (isinstance(secret, str) and _SECRET.fullmatch(secret)):
        raise InviteError(f"the invite's secret is not the base64url of {SECRET_BYTES} bytes")
    if not (type(expires) is int and expires > 0):
        raise InviteError("the invite's expiry is not a positive whole number of epoch seconds")
    return Invite(endpoint, host, secret, expires)


# --- the renewal --------------------------------------------------------------------------------------------


def new_nonce() -> str:
    return secrets.token_hex(NONCE_BYTES)


def renewal_message(host: str, issued_at: float, nonce: str) -> bytes:
    """What a renewal's signature covers (both sides build it here): the host, the time as its float's repr
    (what JSON carries back to the same float) and the nonce."""
    return f"fed-renew:v1\n{host}\n{issued_at!r}\n{nonce}".encode()


def public_key_of(private_key: Ed25519PrivateKey) -> str:
    """The base64 of the raw public key, as a redemption binds it."""
    raw = private_key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return base64.b64encode(raw).decode()


def sign_renewal(signer_private_key: Ed25519PrivateKey, host: str, now: float) -> RenewRequest:
    issued_at, nonce = float(now), new_nonce()
    signature = signer_private_key.sign(renewal_message(host, issued_at, nonce))
    return RenewRequest(host=host, issued_at=issued_at, nonce=nonce, signature=base64.b64encode(signature).decode())


def verify_renewal(public_key: str, request: RenewRequest) -> bool:
    """Whether `request` is signed by the private half of `public_key` (base64 of the raw key)."""
    try:
        key = Ed25519PublicKey.from_public_bytes(base64.b64decode(public_key, validate=True))
        key.verify(base64.b64decode(request.signature, validate=True),
                   renewal_message(request.host, request.issued_at, request.nonce))
    except (InvalidSignature, ValueError):
        return False
    return True


# --- the endpoint's rules ---------------------------------------------------------------------------------


def redeem_refusal(record: HostRecord | None, request: RedeemRequest, now: float) -> str | None:
    """Why a redemption is refused, or None. The secret is checked first, so that only its holder learns what
    became of the invite."""
    if record is None:
        return "no invite for this host"
    if not secret_matches(record, request.secret):
        return "wrong secret"
    if record.status is HostStatus.REVOKED:
        return "host is revoked"
    if record.status is HostStatus.ACTIVE:
        return "invite already redeemed"
    if now >= record.invite_expires:
        return "invite expired"
    if request.public_key == request.upload_key:
        return "the host key and the upload key must differ"
    if {request.public_key, request.upload_key} & set(record.retired_keys):
        return "a key of an earlier generation of this host: make new keys"
    return None


def renew_refusal(record: HostRecord | None, request: RenewRequest, now: float, limits: HostLimits) -> str | None:
    """Why a renewal is refused, or None; its nonce is checked after (`store.hosts.HostStore.use_nonce`), so that
    no unsigned request uses one up. The revocation's reason is told only to the holder of the key."""
    if record is None:
        return "unknown host"
    if not record.public_key:
        return "host is revoked" if record.status is HostStatus.REVOKED else "host has not redeemed its invite"
    stale = skew_refusal(request, now, limits)
    if stale is not None:
        return stale
    if not verify_renewal(record.public_key, request):
        return "signature does not match the host's registered key"
    return status_refusal(record)


def status_refusal(record: HostRecord) -> str | None:
    """Why a host that proved itself is refused all the same (revoked, not active), or None."""
    if record.status is HostStatus.REVOKED:
        return "host is revoked" + (f": {record.revoke_reason}" if record.revoke_reason else "")
    if record.status is not HostStatus.ACTIVE:
        return f"host is {record.status.value}"
    return None


REPLAYED = "nonce already used (a replayed renewal)"
# The one answer to a request whose id, secret or signature does not match, so that it tells no stranger which ids
# are invited (the refusal's record keeps the reason for the operator).
NOT_ACCEPTED = "not accepted: no invited host holds this secret or key"


def secret_matches(record: HostRecord, secret: str) -> bool:
    return bool(record.secret_hash) and hmac.compare_digest(secret_hash(secret), record.secret_hash)


def redeem_verified(record: HostRecord | None, request: RedeemRequest) -> bool:
    """Whether a redemption proves its sender holds the host's invite secret (what it may then spend is counted)."""
    return record is not None and secret_matches(record, request.secret)


def renew_verified(record: HostRecord | None, request: RenewRequest) -> bool:
    """Whether a renewal is signed by the host's bound key (whatever else is wrong with it)."""
    return record is not None and bool(record.public_key) and verify_renewal(record.public_key, request)


def skew_refusal(request: RenewRequest, now: float, limits: HostLimits) -> str | None:
    """Why a renewal's time is out of the window it is accepted in, or None."""
    skew = now - request.issued_at
    if abs(skew) <= limits.max_skew_seconds:
        return None
    return (f"issued_at is {abs(skew):.0f} s {'behind' if skew > 0 else 'ahead of'} the endpoint's clock "
            f"(at most {limits.max_skew_seconds:.0f} s)")


def upload_refusal(record: HostRecord | None, join: bool) -> str | None:
    """Why ingest refuses an upload from the id of `record` (None: no invited host has that id), or None. Only the
    current generation's, once redeemed: before its join is registered only the join itself (which `coordinator.
    intake.join` checks against `record.upload_key`), since the participant record may still hold an earlier
    generation's key."""
    if record is None:
        return None
    if record.status is HostStatus.REVOKED:
        return "from a revoked host: " + (record.revoke_reason or "revoked")
    if record.status is not HostStatus.ACTIVE:
        return f"from host {record.host}, whose generation {record.generation} has not redeemed its invite"
    if join or record.registered_key == record.upload_key or (record.generation == 1 and not record.registered_key):
        return None
    return (f"from host {record.host} before the join of its generation {record.generation} was registered "
            "(an earlier generation's key is refused)")


# --- the deny on revoked generations' sessions ---------------------------------------------------------------


def session_tag(host: str, generation: int) -> str:
    """The value of a host session's `HOST_TAG`: ids are [A-Za-z0-9_-], so the "." is unambiguous."""
    return f"{host}.{generation}"


def denied(revocations: list[Revocation], now: float) -> list[str]:
    """The session tags to deny at `now`: of every generation revoked less than DENY_SECONDS ago (older ones'
    sessions have all expired), sorted."""
    return sorted({session_tag(r.host, r.generation) for r in revocations if now - r.at < DENY_SECONDS})


def deny_policy(tags: list[str]) -> str:
    """The participant role's inline policy denying everything to sessions tagged with one of `tags`, as IAM counts
    it: JSON without whitespace."""
    document = {"Version": "2012-10-17", "Statement": [{
        "Sid": "RevokedHosts", "Effect": "Deny", "Action": "*", "Resource": "*",
        "Condition": {"StringEquals": {f"aws:PrincipalTag/{HOST_TAG}": tags}},
    }]}
    return json.dumps(document, separators=(",", ":"))


def policy_chars(document: Mapping[str, Any] | str) -> int:
    """A policy's size as IAM counts it (no whitespace outside strings)."""
    text = document if isinstance(document, str) else json.dumps(document, separators=(",", ":"))
    return len(json.dumps(json.loads(text), separators=(",", ":")))


def room_frees_at(revocations: list[Revocation], now: float, room: int) -> float | None:
    """When the deny policy of the generations revoked by `now` fits in `room` characters: `now` if it does, else
    the first time enough of them have aged out (None if not even then: a policy of no tag does not fit)."""
    live = sorted((r for r in revocations if now - r.at < DENY_SECONDS), key=lambda r: r.at)
    for i in range(len(live) + 1):
        at = now if i == 0 else live[i - 1].at + DENY_SECONDS
        if len(deny_policy(denied(live[i:], at))) <= room:
            return at
    return None


# --- the answers --------------------------------------------------------------------------------------------


def credential_answer(credentials: Mapping[str, Any], connection: Mapping[str, Any]) -> dict[str, Any]:
    """The 200 answer's body, checked against `CredentialAnswer` (a missing or extra field is a bug here)."""
    answer = CredentialAnswer.model_validate({"credentials": dict(credentials), "connection": dict(connection)})
    return answer.model_dump(mode="json")


def error_body(reason: str, temporary: bool = False) -> dict[str, Any]:
    """A refusal's body: `temporary` tells the host that the same request may be accepted later (a rate limit, a
    clock out of the window, a replayed nonce), so it tries again with backoff; a definite one stops it."""
    return {"error": reason, "temporary": temporary}
