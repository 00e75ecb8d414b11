"""The credential endpoint's service: a host redeems its invite once, then renews by signed requests; each accepted
request is answered with STS credentials for the participant role, tagged with the host's id.

Every request is first counted against the limit over all hosts, so that whatever arrives, at most that many a
minute cost more than one counter write; each one past it records its refusal (`store.hosts`). The rules are
`shared.hosts`'; the answers are (HTTP status, JSON body), the body `{"error": reason}` for a refusal.
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
    REDEEM_PATH,
    RENEW_PATH,
    REPLAYED,
    UNKNOWN_HOST,
    HostLimits,
    credential_answer,
    error_body,
    redeem_refusal,
    renew_refusal,
    secret_hash,
)
from shared.keys import KeyError_, validate_participant_id
from shared.messages import MessageError, RedeemRequest, RenewRequest, parse_message
from shared.naming import PARTICIPANT_TAG
from shared.table_keys import ALL_HOSTS
from store.hosts import HostStore

# (host id, lifetime in seconds) -> the four fields of `shared.messages.IssuedCredentials`
Issuer = Callable[[str, int], dict[str, str]]
Answer = tuple[int, dict[str, Any]]
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
    if not deps.store.count_request(ALL_HOSTS, now, limits.all_hosts_per_minute):
        return 429, error_body("too many requests to the credential endpoint; try again in a minute")
    if len(body) > limits.max_body_bytes:
        return _refused(deps, 413, UNKNOWN_HOST, f"the body is larger than {limits.max_body_bytes} bytes", now)
    if method != "POST":
        return _refused(deps, 405, UNKNOWN_HOST, "only POST is answered", now)
    route = ROUTES.get(path)
    if route is None:
        return _refused(deps, 404, UNKNOWN_HOST, f"no such path: POST {REDEEM_PATH} or {RENEW_PATH}", now)
    try:
        request = parse_message(route, body)
    except MessageError as exc:
        return _refused(deps, 400, claimed_host(body), str(exc), now)
    if not deps.store.count_request(request.host, now, limits.per_host_per_minute):
        return 429, error_body(f"too many requests for host {request.host}; try again in a minute")
    if isinstance(request, RedeemRequest):
        return _redeem(deps, request, now)
    return _renew(deps, request, now)


def _redeem(deps: CredentialDeps, request: RedeemRequest, now: float) -> Answer:
    reason = redeem_refusal(deps.store.get(request.host), request, now)
    if reason is None and not deps.store.redeem(request.host, secret_hash(request.secret), request.public_key, now):
        # another redemption (or a new invite) came first: say what it left
        reason = redeem_refusal(deps.store.get(request.host), request, now) or "invite already redeemed"
    if reason is not None:
        return _refused(deps, 403, request.host, reason, now)
    return _credentials(deps, request.host, now)


def _renew(deps: CredentialDeps, request: RenewRequest, now: float) -> Answer:
    reason = renew_refusal(deps.store.get(request.host), request, now, deps.limits)
    if reason is None and not deps.store.use_nonce(request.host, request.nonce, now, deps.limits.nonce_seconds):
        reason = REPLAYED
    if reason is not None:
        return _refused(deps, 403, request.host, reason, now)
    return _credentials(deps, request.host, now)


def _credentials(deps: CredentialDeps, host: str, now: float) -> Answer:
    issued = deps.issue(host, deps.limits.credential_seconds)
    deps.store.note_credentials(host, now)
    return 200, credential_answer(issued, deps.connection)


def _refused(deps: CredentialDeps, status: int, host: str, reason: str, now: float) -> Answer:
    deps.store.record_refusal(host, reason, now)
    return status, error_body(reason)


def claimed_host(body: bytes) -> str:
    """The valid host id a malformed request names, so its refusal is recorded under it; UNKNOWN_HOST if none."""
    try:
        host = json.loads(body).get("host")
        return validate_participant_id(host)
    except (ValueError, AttributeError, RecursionError, KeyError_):
        return UNKNOWN_HOST


def session_name(host: str) -> str:
    """STS wants 2-64 characters; a participant id has 1-63 of [A-Za-z0-9_-]. A one-character id gets an "=", which no
    id holds, so the session's name still says which host it is (`host_of_session`)."""
    return host if len(host) >= 2 else f"{host}="


def host_of_session(name: str) -> str:
    return name.removesuffix("=")


def sts_issuer(role_arn: str, endpoint: str | None, region: str) -> Issuer:
    """Sessions of the participant role `role_arn`, tagged `participant=<host>` (what every participant policy
    reads). botocore's own check of the parameters is off: it refuses lifetimes under 900 s, which STS refuses
    too, but the local stack and the tests ask moto for less."""
    sts = boto3.client("sts", endpoint_url=endpoint, region_name=region,
                       config=Config(parameter_validation=False, retries={"max_attempts": 4, "mode": "standard"}))

    def issue(host: str, seconds: int) -> dict[str, str]:
        issued = sts.assume_role(RoleArn=role_arn, RoleSessionName=session_name(host), DurationSeconds=seconds,
                                 Tags=[{"Key": PARTICIPANT_TAG, "Value": host}])["Credentials"]
        expiration: datetime = issued["Expiration"]
        return {"AccessKeyId": issued["AccessKeyId"], "SecretAccessKey": issued["SecretAccessKey"],
                "SessionToken": issued["SessionToken"],
                "Expiration": expiration.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")}

    return issue
