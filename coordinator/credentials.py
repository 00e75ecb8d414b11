"""The credential endpoint's service: a host redeems its invite once, then renews by signed requests; each accepted
request is answered with STS credentials for the participant role, tagged with the host's id.

A request is verified first, then counted. One that proves its sender (the invite's secret, or a renewal signed by
the host's bound key, in time and with a fresh nonce) spends its host's budget and the one of all hosts
(`HostLimits`); every other one (malformed, no invite, a wrong secret or signature, stale or replayed) spends only
the unverified budget, so that no flood of them, at any rate, refuses a host that proves itself. Past its budget an
unverified request is answered 429 and only counted; within it, its refusal is kept in the one record of its host
and kind (`store.hosts`), under UNKNOWN_HOST where the id it names is not invited. No id, secret or signature that
does not match is told apart in the answer (NOT_ACCEPTED): the record keeps the reason for the operator.

The rules are `shared.hosts`'; the answers are (HTTP status, JSON body), the body `shared.hosts.error_body` for a
refusal, `temporary` where the host should try again with backoff.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import boto3
from botocore.config import Config

from shared.hosts import (
    NOT_ACCEPTED,
    REDEEM_PATH,
    RENEW_PATH,
    REPLAYED,
    UNKNOWN_HOST,
    HostLimits,
    HostRecord,
    RefusalKind,
    credential_answer,
    error_body,
    redeem_refusal,
    redeem_verified,
    renew_refusal,
    renew_verified,
    secret_hash,
    session_tag,
    skew_refusal,
    status_refusal,
)
from shared.keys import KeyError_, validate_participant_id
from shared.messages import MessageError, RedeemRequest, RenewRequest, parse_message
from shared.naming import HOST_TAG, PARTICIPANT_TAG
from shared.table_keys import ALL_HOSTS, UNVERIFIED
from store.hosts import HostStore

# (host id, its generation, lifetime in seconds) -> the four fields of `shared.messages.IssuedCredentials`
Issuer = Callable[[str, int, int], dict[str, str]]
Answer = tuple[int, dict[str, Any]]
MAX_SESSION_NAME = 64  # STS's RoleSessionName
ROUTES: dict[str, type[RedeemRequest] | type[RenewRequest]] = {REDEEM_PATH: RedeemRequest, RENEW_PATH: RenewRequest}


@dataclass(frozen=True)
class CredentialDeps:
    """What the endpoint works with: the host records, its limits, where the run lives (the answer's `connection`:
    `shared.messages.RunConnection`'s fields) and what issues a host's session."""

    store: HostStore
    limits: HostLimits
    connection: dict[str, Any]
    issue: Issuer


def build_credential_deps(run_id: str, bucket: str, table: str, endpoint: str | None, region: str, state_topic: str,
                          participant_role: str, limits: HostLimits) -> CredentialDeps:
    """The endpoint's `CredentialDeps` from the names its function is given (`functions.settings`)."""
    connection = {"run_id": run_id, "bucket": bucket, "table": table, "region": region,
                  "participant_role": participant_role, "state_topic": state_topic, "endpoint": endpoint}
    return CredentialDeps(HostStore(table, run_id, endpoint, region), limits, connection,
                          sts_issuer(participant_role, endpoint, region))


def answer(deps: CredentialDeps, method: str, path: str, body: bytes, now: float) -> Answer:
    """The answer to one request to the endpoint."""
    limits = deps.limits
    if len(body) > limits.max_body_bytes:
        return _malformed(deps, 413, f"the body is larger than {limits.max_body_bytes} bytes", now)
    if method != "POST":
        return _malformed(deps, 405, "only POST is answered", now)
    route = ROUTES.get(path)
    if route is None:
        return _malformed(deps, 404, f"no such path: POST {REDEEM_PATH} or {RENEW_PATH}", now)
    try:
        request = parse_message(route, body)
    except MessageError as exc:
        return _malformed(deps, 400, str(exc), now, claimed_host(body))
    record = deps.store.get(request.host)
    if isinstance(request, RedeemRequest):
        return _redeem(deps, record, request, now)
    return _renew(deps, record, request, now)


def _redeem(deps: CredentialDeps, record: HostRecord | None, request: RedeemRequest, now: float) -> Answer:
    if not redeem_verified(record, request):
        return _unverified(deps, record, redeem_refusal(record, request, now) or "wrong secret", now)
    spent = _spend(deps, request.host, now)
    if spent is not None:
        return spent
    reason = redeem_refusal(record, request, now)
    if reason is None and not deps.store.redeem(request.host, secret_hash(request.secret), request.public_key,
                                                   request.upload_key, now):
        # another redemption (or a new invite) came first: say what it left
        reason = redeem_refusal(deps.store.get(request.host), request, now) or "invite already redeemed"
    if reason is not None:
        return _refused(deps, request.host, reason, now)
    assert record is not None  # (verified)
    return _credentials(deps, request.host, record.generation, now)


def _renew(deps: CredentialDeps, record: HostRecord | None, request: RenewRequest, now: float) -> Answer:
    if not renew_verified(record, request):
        why = renew_refusal(record, request, now, deps.limits) or "signature does not match the host's key"
        return _unverified(deps, record, why, now)
    # Signed, but a copy of an old renewal is signed too: out of its time window or with its nonce used, it spends
    # no host's budget. The host's own retry after a lost answer lands here as well, so it is told to try again.
    stale = skew_refusal(request, now, deps.limits)
    if stale is None and not deps.store.use_nonce(request.host, request.nonce, now, deps.limits.nonce_seconds):
        stale = REPLAYED
    if stale is not None:
        return _not_proven(deps, 403, request.host, RefusalKind.STALE, stale, error_body(stale, temporary=True), now)
    spent = _spend(deps, request.host, now)
    if spent is not None:
        return spent
    assert record is not None  # (verified: its key, in its time window; the signature is not checked again)
    reason = status_refusal(record)
    if reason is not None:
        return _refused(deps, request.host, reason, now)
    return _credentials(deps, request.host, record.generation, now)


def _spend(deps: CredentialDeps, host: str, now: float) -> Answer | None:
    """Count a verified request against its host's budget, then all hosts': the 429 past either, else None."""
    limits = deps.limits
    if not deps.store.count_request(host, now, limits.per_host_per_minute):
        return 429, error_body(f"too many requests for host {host}; try again in a minute", temporary=True)
    if not deps.store.count_request(ALL_HOSTS, now, limits.all_hosts_per_minute):
        return 429, error_body("too many requests to the credential endpoint; try again in a minute", temporary=True)
    return None


def _credentials(deps: CredentialDeps, host: str, generation: int, now: float) -> Answer:
    issued = deps.issue(host, generation, deps.limits.credential_seconds)
    deps.store.note_credentials(host, now)
    return 200, credential_answer(issued, deps.connection)


def _refused(deps: CredentialDeps, host: str, reason: str, now: float) -> Answer:
    """A verified request refused for good (revoked, expired, already redeemed): the host is told why."""
    deps.store.record_refusal(host, RefusalKind.REFUSED, reason, now)
    return 403, error_body(reason)


def _unverified(deps: CredentialDeps, record: HostRecord | None, reason: str, now: float) -> Answer:
    """An id with no invite, or a secret or signature that does not match: one answer for all (NOT_ACCEPTED), the
    reason recorded under the host if it is invited, under UNKNOWN_HOST if not (so that the records stay O(hosts))."""
    host = record.host if record is not None else UNKNOWN_HOST
    return _not_proven(deps, 403, host, RefusalKind.UNVERIFIED, reason, error_body(NOT_ACCEPTED), now)


def _malformed(deps: CredentialDeps, status: int, reason: str, now: float, claimed: str = UNKNOWN_HOST) -> Answer:
    """Not a request at all; recorded under UNKNOWN_HOST (no record was read to know the id it names is invited)."""
    noted = reason if claimed == UNKNOWN_HOST else f"{reason} (naming host {claimed})"
    return _not_proven(deps, status, UNKNOWN_HOST, RefusalKind.MALFORMED, noted, error_body(reason), now)


def _not_proven(deps: CredentialDeps, status: int, host: str, kind: RefusalKind, reason: str,
                body: dict[str, Any], now: float) -> Answer:
    """A request that proves nothing spends the unverified budget alone; past it, it is answered 429 and only counted
    (in the budget's counter), so a flood costs one counter write a request beyond reading and checking it."""
    if not deps.store.count_request(UNVERIFIED, now, deps.limits.unverified_per_minute):
        return 429, error_body("too many unverified requests to the credential endpoint; try again in a minute",
                               temporary=True)
    deps.store.record_refusal(host, kind, reason, now)
    return status, body


def claimed_host(body: bytes) -> str:
    """The valid host id a malformed request names, for its refusal's reason; UNKNOWN_HOST if none."""
    try:
        host = json.loads(body).get("host")
        return validate_participant_id(host)
    except (ValueError, AttributeError, RecursionError, KeyError_):
        return UNKNOWN_HOST


def session_name(host: str, generation: int) -> str:
    """The session's `shared.hosts.session_tag` where it fits STS's 64 characters (a participant id has 1-63), so that
    the name says which host and generation it is (`host_of_session`, `tag_of_session`); else the id alone."""
    tag = session_tag(host, generation)
    return tag if len(tag) <= MAX_SESSION_NAME else host


def host_of_session(name: str) -> str:
    return name.split(".", 1)[0]


def tag_of_session(name: str) -> str | None:
    """The session's HOST_TAG value as its name says it, or None where the name is the id alone."""
    return name if "." in name else None


def sts_issuer(role_arn: str, endpoint: str | None, region: str) -> Issuer:
    """Sessions of the participant role `role_arn`, tagged `participant=<host>` (what every participant policy
    reads) and `HOST_TAG=<host>.<generation>` (what the deny on revoked generations reads, `fed.hosts`).
    botocore's own check of the parameters is off: it refuses lifetimes under 900 s, which STS refuses
    too, but the local stack and the tests ask moto for less."""
    sts = boto3.client("sts", endpoint_url=endpoint, region_name=region,
                       config=Config(parameter_validation=False, retries={"max_attempts": 4, "mode": "standard"}))

    def issue(host: str, generation: int, seconds: int) -> dict[str, str]:
        tags = [{"Key": PARTICIPANT_TAG, "Value": host}, {"Key": HOST_TAG, "Value": session_tag(host, generation)}]
        issued = sts.assume_role(RoleArn=role_arn, RoleSessionName=session_name(host, generation),
                                 DurationSeconds=seconds, Tags=tags)["Credentials"]
        expiration: datetime = issued["Expiration"]
        return {"AccessKeyId": issued["AccessKeyId"], "SecretAccessKey": issued["SecretAccessKey"],
                "SessionToken": issued["SessionToken"],
                "Expiration": expiration.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")}

    return issue
