"""`fed hosts invite|list|revoke|reinstate`: hosts that join with an invite line alone, their revocation, and
their return as a new generation.

An invite carries the run's credential endpoint and a one-time secret; only the secret's hash is stored
(`store.hosts`). Revoking a host refuses its renewals at the endpoint and its uploads at ingest at once, and also
denies its sessions already issued: the participant role's inline policy `REVOKED_HOSTS_POLICY` denies everything
to sessions tagged (`shared.hosts.HOST_TAG`) with a revoked generation of a host. IAM evaluates that policy on every
request, so a session issued before the revocation stops working within seconds; `aws:TokenIssueTime` could not do
this per host (it would cut every host's sessions). A revoked id stays revoked: `reinstate` starts its next
generation, whose sessions carry another tag, so the old generation's stay denied.

The policy lists the generations revoked within the last `shared.hosts.DENY_SECONDS` (the longest session and a clock
allowance: older ones' sessions have all expired), read from the revocation records in the table, never from the
hosts' current status. Its room is the role's 10,240 characters of inline policy less the role's own policy, so the
bound is on revocations per session lifetime, not per run; past it the revocation's IAM step is refused, saying when
room frees up (its endpoint and ingest refusals hold regardless). The local stack writes and applies the same policy
(`local.access.control`).
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import asdict, dataclass
from typing import Any

import boto3
from botocore.exceptions import ClientError

from shared.hosts import (
    DENY_SECONDS,
    MAX_ROLE_POLICY_CHARS,
    UNKNOWN_HOST,
    HostRecord,
    HostRefusal,
    HostStatus,
    Invite,
    Revocation,
    denied,
    deny_policy,
    format_invite,
    new_secret,
    policy_chars,
    room_frees_at,
    secret_hash,
)
from shared.keys import validate_participant_id
from shared.naming import PARTICIPANT_POLICY, REVOKED_HOSTS_POLICY
from store.connection import Connection
from store.hosts import HostStore
from store.table import StateStore

DURATION = re.compile(r"(\d+)([smhd])")
UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
MAX_INVITE_SECONDS = 30 * 86400


class HostsError(RuntimeError):
    """Something the operator must fix first; the message says what."""


def duration_seconds(text: str) -> int:
    """'90s', '15m', '24h', '7d' as seconds (at most 30 days)."""
    match = DURATION.fullmatch(text.strip())
    if not match or int(match.group(1)) <= 0:
        raise HostsError(f"{text!r} is not a duration: a whole number and s, m, h or d, e.g. 24h")
    seconds = int(match.group(1)) * UNIT_SECONDS[match.group(2)]
    if seconds > MAX_INVITE_SECONDS:
        raise HostsError(f"{text!r} is longer than 30 days: hand out invites closer to when they are used")
    return seconds


def hosts_of(conn: Connection) -> HostStore:
    return HostStore(conn.table, conn.run_id, conn.endpoint, conn.region)


def invite(conn: Connection, host: str, expires_in: int, now: float | None = None) -> str:
    """A new invite line for `host`; its secret's hash is recorded, replacing an earlier invite not yet redeemed
    (the same generation). A revoked host comes back only by `reinstate`."""
    _check_endpoint(conn)
    validate_participant_id(host)
    now = time.time() if now is None else now
    secret = new_secret()
    store = hosts_of(conn)
    if store.invite(host, secret_hash(secret), now + expires_in, now):
        return format_invite(Invite(conn.credential_endpoint, host, secret, int(now + expires_in)))
    record = store.get(host)
    refused = record.status if record is not None else None
    if refused is HostStatus.ACTIVE:
        raise HostsError(f"host {host!r} is active (it redeemed an invite): revoke it first, or invite another id")
    if refused is HostStatus.REVOKED:
        raise HostsError(f"host {host!r} is revoked, and stays revoked: `fed hosts reinstate {host}` starts its next "
                         "generation (new keys; the revoked machine's sessions, keys and uploads stay refused)")
    raise HostsError(f"host {host!r} changed while inviting it: try again")


def _check_endpoint(conn: Connection) -> None:
    if not conn.credential_endpoint:
        raise HostsError("this run has no credential endpoint: redeploy the stack (or restart `fed local`) with "
                         "this version")


@dataclass(frozen=True)
class HostLine:
    """A host as `fed hosts list` shows it."""

    host: str
    status: str
    invited_at: float
    invite_expires: float
    redeemed_at: float
    last_credentials_at: float
    last_seen: float  # its last upload the coordinator accepted (0: none)
    revoked_at: float
    revoke_reason: str
    refusals: int  # the endpoint's refusals of requests naming it, kept a week after the latest of each kind
    last_refusal: str  # the latest one's reason
    generation: int = 0  # `fed hosts reinstate` starts the next (0: the row of requests naming no invited host)


def listing(conn: Connection) -> list[HostLine]:
    """Every host, with the endpoint's refusals of it: the refusals are kept one record per host and kind, so this
    reads O(hosts) items whatever a flood sent."""
    store = hosts_of(conn)
    refusals: dict[str, list[HostRefusal]] = {}
    for f in store.refusals():  # the latest last
        refusals.setdefault(f.host, []).append(f)
    seen = {pid: p.last_seen for pid, p in StateStore.of(conn).participant_records().items()}
    lines = []
    for r in sorted(store.list(), key=lambda r: r.host):
        mine = refusals.get(r.host, [])
        lines.append(HostLine(r.host, _status(r), r.invited_at, r.invite_expires, r.redeemed_at,
                              r.last_credentials_at, seen.get(r.host, 0.0), r.revoked_at, r.revoke_reason,
                              sum(f.count for f in mine), mine[-1].reason if mine else "", r.generation))
    if strangers := refusals.get(UNKNOWN_HOST):  # requests naming no invited host: one row, however many
        lines.append(HostLine(UNKNOWN_HOST, NOT_INVITED, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, "",
                              sum(f.count for f in strangers), strangers[-1].reason))
    return lines


NOT_INVITED = "not invited"  # the status of the row of requests that named no invited host


def _status(record: HostRecord) -> str:
    if record.status is HostStatus.INVITED and record.invite_expires <= time.time():
        return "expired"
    return record.status.value


def as_json(lines: list[HostLine]) -> str:
    return json.dumps([asdict(line) for line in lines], indent=1)


def revoke(conn: Connection, host: str, reason: str, iam: Any = None, now: float | None = None) -> list[str]:
    """Revoke `host`'s current generation: its renewals and uploads are refused from now on, and its sessions are
    denied (`deny_sessions`). What was done, one line each."""
    now = time.time() if now is None else now
    store = hosts_of(conn)
    record = store.revoke(host, reason, now)
    if record is None:
        raise HostsError(f"no host {host!r} in run {conn.run_id} (`fed hosts list` shows them)")
    done = f"host {host} (generation {record.generation}) revoked: its renewals and its uploads are refused ({reason})"
    lines = [done]
    if conn.participant_role:
        try:
            deny_sessions(_iam(conn, iam), conn.participant_role, store.revocations(now), now)
        except (ClientError, HostsError) as exc:
            raise HostsError(f"{done}; but its sessions already issued could not be denied: {exc}") from None
        lines.append(f"its sessions already issued are denied (policy {REVOKED_HOSTS_POLICY} on the participant role)")
    return lines


def reinstate(conn: Connection, host: str, expires_in: int, iam: Any = None, now: float | None = None) -> str:
    """Bring revoked `host` back as its next generation: a new invite line, under which the host makes new keys.
    Its earlier generations' keys, sessions and uploads stay refused (the deny policy is rewritten, as it stands)."""
    _check_endpoint(conn)
    validate_participant_id(host)
    now = time.time() if now is None else now
    secret = new_secret()
    store = hosts_of(conn)
    record = store.reinstate(host, secret_hash(secret), now + expires_in, now)
    if record is None:
        found = store.get(host)
        if found is None:
            raise HostsError(f"no host {host!r} in run {conn.run_id} (`fed hosts invite {host}` invites it)")
        raise HostsError(f"host {host!r} is {found.status.value}, not revoked: only a revoked host is reinstated "
                         f"(`fed hosts invite {host}` renews an invite not yet redeemed)")
    if conn.participant_role:
        try:  # the revoked generations as they stand: what aged out is dropped, nothing of this host is
            deny_sessions(_iam(conn, iam), conn.participant_role, store.revocations(now), now)
        except (ClientError, HostsError) as exc:
            raise HostsError(f"host {host} reinstated as generation {record.generation}, but the deny policy could "
                             f"not be rewritten: {exc}") from None
    return format_invite(Invite(conn.credential_endpoint, host, secret, int(now + expires_in)))


def _iam(conn: Connection, iam: Any) -> Any:
    return iam or boto3.client("iam", endpoint_url=conn.endpoint, region_name=conn.region)


def deny_sessions(iam: Any, role_arn: str, revocations: list[Revocation], now: float) -> str:
    """Write the participant role's inline policy denying every action to the sessions of the generations revoked
    less than DENY_SECONDS before `now`, and return it. HostsError, writing nothing, where it would not fit beside
    the role's own policy (IAM counts a role's inline policies together), saying when room frees up."""
    tags = denied(revocations, now)
    if not tags:
        return ""  # every revoked generation's sessions have expired: the policy written last denies only those
    role = role_arn.rsplit("/", 1)[-1]
    document = deny_policy(tags)
    room = MAX_ROLE_POLICY_CHARS - _own_policy_chars(iam, role)
    if len(document) > room:
        frees = room_frees_at(revocations, now, room)
        when = (f"in {frees - now:.0f} s, at {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(frees))}"
                if frees is not None else "never: the role's own policy leaves no room")
        raise HostsError(
            f"the deny policy of the {len(tags)} generations revoked in the last {DENY_SECONDS} s would be "
            f"{len(document)} characters, over the {room} the participant role has left (IAM: {MAX_ROLE_POLICY_CHARS} "
            f"for its inline policies together); room frees up {when}, when the oldest revocations' sessions have "
            "expired. Until then their sessions end within credential_minutes")
    iam.put_role_policy(RoleName=role, PolicyName=REVOKED_HOSTS_POLICY, PolicyDocument=document)
    return document


def _own_policy_chars(iam: Any, role: str) -> int:
    """The size of the role's own inline policy (the template's, `PARTICIPANT_POLICY`), as IAM counts it."""
    try:
        document = iam.get_role_policy(RoleName=role, PolicyName=PARTICIPANT_POLICY)["PolicyDocument"]
    except ClientError as exc:
        if exc.response["Error"]["Code"] == "NoSuchEntity":
            return 0
        raise
    return policy_chars(document if isinstance(document, str) else json.dumps(document))
