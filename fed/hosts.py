"""`fed hosts invite|list|revoke`: hosts that join with an invite line alone, and their revocation.

An invite carries the run's credential endpoint and a one-time secret; only the secret's hash is stored
(`store.hosts`). Revoking a host refuses its renewals at the endpoint and its uploads at ingest at once, and on
AWS also denies its sessions already issued: the participant role's inline policy `REVOKED_HOSTS_POLICY` denies
everything to sessions tagged with a revoked id. IAM evaluates that policy on every request, so a session issued
before the revocation stops working within seconds; `aws:TokenIssueTime` could not do this per host (it would cut
every host's sessions).
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import asdict, dataclass
from typing import Any

import boto3
from botocore.exceptions import ClientError

from shared.hosts import HostRecord, HostRefusal, HostStatus, Invite, format_invite, new_secret, secret_hash
from shared.keys import validate_participant_id
from shared.naming import PARTICIPANT_TAG, REVOKED_HOSTS_POLICY
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
    """A new invite line for `host`; its secret's hash is recorded, replacing an earlier invite not yet redeemed."""
    if not conn.credential_endpoint:
        raise HostsError("this run has no credential endpoint: redeploy the stack (or restart `fed local`) with "
                         "this version")
    validate_participant_id(host)
    now = time.time() if now is None else now
    secret = new_secret()
    if not hosts_of(conn).invite(host, secret_hash(secret), now + expires_in, now):
        raise HostsError(f"host {host!r} is active (it redeemed an invite): revoke it first, or invite another id")
    return format_invite(Invite(conn.credential_endpoint, host, secret, int(now + expires_in)))


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
                              sum(f.count for f in mine), mine[-1].reason if mine else ""))
    return lines


def _status(record: HostRecord) -> str:
    if record.status is HostStatus.INVITED and record.invite_expires <= time.time():
        return "expired"
    return record.status.value


def as_json(lines: list[HostLine]) -> str:
    return json.dumps([asdict(line) for line in lines], indent=1)


def revoke(conn: Connection, host: str, reason: str, iam: Any = None, now: float | None = None) -> list[str]:
    """Revoke `host`: its renewals and uploads are refused from now on, and on AWS its sessions are denied
    (`deny_sessions`). What was done, one line each."""
    now = time.time() if now is None else now
    if not hosts_of(conn).revoke(host, reason, now):
        raise HostsError(f"no host {host!r} in run {conn.run_id} (`fed hosts list` shows them)")
    done = [f"host {host} revoked: its renewals and its uploads are refused ({reason})"]
    if conn.endpoint is None and conn.participant_role:
        revoked = [r.host for r in hosts_of(conn).list() if r.status is HostStatus.REVOKED]
        try:
            deny_sessions(iam or boto3.client("iam", region_name=conn.region), conn.participant_role, revoked)
        except ClientError as exc:
            raise HostsError(
                f"{done[0]}; but its sessions already issued could not be denied ({exc}). They end within "
                "credential_minutes. The role's inline policies are limited to 10,240 characters in all: with that "
                "many revoked hosts, start the run's next stack instead") from None
        done.append(f"its sessions already issued are denied (policy {REVOKED_HOSTS_POLICY} on the participant role)")
    return done


def deny_sessions(iam: Any, role_arn: str, hosts: list[str]) -> None:
    """The participant role's inline policy denying every action to sessions tagged with one of `hosts`."""
    document = {"Version": "2012-10-17", "Statement": [{
        "Sid": "RevokedHosts", "Effect": "Deny", "Action": "*", "Resource": "*",
        "Condition": {"StringEquals": {f"aws:PrincipalTag/{PARTICIPANT_TAG}": sorted(set(hosts))}},
    }]}
    iam.put_role_policy(RoleName=role_arn.rsplit("/", 1)[-1], PolicyName=REVOKED_HOSTS_POLICY,
                        PolicyDocument=json.dumps(document))
