"""The credential endpoint on in-process moto, through `functions.credentials.handler` with function URL events: a
host redeems its invite and renews; every hostile request is refused with its reason recorded, no flood of requests
that prove nothing refuses a host that proves itself, and a flood costs a bounded number of items."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Any

import boto3
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

import coordinator.credentials
from functions import credentials
from functions.settings import credential_deps_from_env
from local.context import LocalContext
from local.resources import create_resources
from shared.hosts import (
    NOT_ACCEPTED,
    REPLAYED,
    UNKNOWN_HOST,
    HostLimits,
    HostStatus,
    RefusalKind,
    new_secret,
    public_key_of,
    secret_hash,
    sign_renewal,
)
from shared.naming import (
    ENV_ALL_HOSTS_RATE,
    ENV_BUCKET,
    ENV_CREDENTIAL_SECONDS,
    ENV_HOST_RATE,
    ENV_PARTICIPANT_ROLE,
    ENV_RUN_ID,
    ENV_STATE_TOPIC,
    ENV_TABLE,
)
from shared.table_keys import ALL_HOSTS, UNVERIFIED
from store.hosts import HostStore
from store.trace import OPERATOR, acting_as, function

RUN = "hosts-run"
ROLE = "arn:aws:iam::123456789012:role/fed-hosts-run-participant"
T0 = 1_800_000_000.0  # a minute's first second: the rate windows are whole minutes
SECONDS = 120  # the sessions' lifetime (shorter than AWS allows; moto takes it)


@dataclass
class Endpoint:
    store: HostStore
    table: str
    now: float = T0
    assumed: list[dict[str, Any]] = field(default_factory=list)  # what each sts:AssumeRole asked for

    def call(self, path: str, body: bytes | str | dict[str, Any], method: str = "POST",
             b64: bool = False) -> tuple[int, dict[str, Any]]:
        raw = json.dumps(body).encode() if isinstance(body, dict) else body
        raw = raw if isinstance(raw, bytes) else raw.encode()
        with acting_as(function("credentials")):
            result = credentials.handler(url_event(path, raw, method, b64), LocalContext())
        assert result["headers"]["content-type"] == "application/json"
        return int(result["statusCode"]), json.loads(result["body"])

    def invite(self, host: str, expires_in: float = 3600) -> str:
        secret = new_secret()
        with acting_as(OPERATOR):
            assert self.store.invite(host, secret_hash(secret), self.now + expires_in, self.now)
        return secret

    def redeemed(self, host: str) -> Ed25519PrivateKey:
        key = Ed25519PrivateKey.generate()
        status, body = self.redeem(host, self.invite(host), key)
        assert status == 200, body
        return key

    def redeem(self, host: str, secret: str, key: Ed25519PrivateKey | None = None) -> tuple[int, dict[str, Any]]:
        key = key or Ed25519PrivateKey.generate()
        return self.call("/redeem", {"host": host, "secret": secret, "public_key": public_key_of(key),
                                     "upload_key": public_key_of(Ed25519PrivateKey.generate())}, b64=True)

    def renew(self, host: str, key: Ed25519PrivateKey, issued_at: float | None = None) -> tuple[int, dict[str, Any]]:
        signed = sign_renewal(key, host, self.now if issued_at is None else issued_at)
        return self.call("/renew", signed.model_dump(mode="json"))

    def reasons(self, host: str | None = None) -> list[str]:
        return [r.reason for r in self.store.refusals(host)]

    def items(self) -> int:
        ddb = boto3.client("dynamodb", region_name="us-east-1")
        return int(ddb.scan(TableName=self.table, Select="COUNT")["Count"])


def url_event(path: str, body: bytes, method: str, b64: bool) -> dict[str, Any]:
    """A Lambda function URL event (payload format 2.0), as AWS delivers a host's request."""
    return {
        "version": "2.0", "routeKey": "$default", "rawPath": path, "rawQueryString": "",
        "headers": {"content-type": "application/json", "host": "abc123.lambda-url.us-east-1.on.aws",
                    "user-agent": "fed-participant"},
        "requestContext": {
            "accountId": "anonymous", "apiId": "abc123", "domainName": "abc123.lambda-url.us-east-1.on.aws",
            "domainPrefix": "abc123", "requestId": "c0ffee", "routeKey": "$default", "stage": "$default",
            "time": "15/Jan/2027:08:00:00 +0000", "timeEpoch": int(T0 * 1000),
            "http": {"method": method, "path": path, "protocol": "HTTP/1.1", "sourceIp": "203.0.113.7",
                     "userAgent": "fed-participant"},
        },
        "body": base64.b64encode(body).decode() if b64 else body.decode(errors="replace"),
        "isBase64Encoded": b64,
    }


@pytest.fixture
def endpoint(aws: None, atomic_dynamodb: None, monkeypatch: pytest.MonkeyPatch) -> Iterator[Endpoint]:
    res = create_resources(RUN)
    for name, value in {ENV_RUN_ID: RUN, ENV_BUCKET: res.bucket, ENV_TABLE: res.table,
                        ENV_STATE_TOPIC: res.state_topic, ENV_PARTICIPANT_ROLE: ROLE,
                        ENV_CREDENTIAL_SECONDS: str(SECONDS), "AWS_REGION": "us-east-1"}.items():
        monkeypatch.setenv(name, value)
    ep = Endpoint(HostStore(res.table, RUN), res.table)
    real_client = boto3.client

    def client(*args: Any, **kwargs: Any) -> Any:  # records what the issuer asks STS for
        made = real_client(*args, **kwargs)
        made.meta.events.register("provide-client-params.sts.AssumeRole",
                                  lambda params, **_: ep.assumed.append(dict(params)))
        return made

    monkeypatch.setattr(coordinator.credentials, "boto3", SimpleNamespace(client=client))
    monkeypatch.setattr(credentials, "clock", lambda: ep.now)
    yield ep


# --- the host's path -------------------------------------------------------------------------------------


def test_a_host_redeems_its_invite_then_renews_for_sessions_tagged_with_its_id(endpoint: Endpoint) -> None:
    key = Ed25519PrivateKey.generate()
    status, body = endpoint.redeem("alice", endpoint.invite("alice"), key)
    assert status == 200, body
    assert set(body) == {"credentials", "connection"}
    assert set(body["credentials"]) == {"AccessKeyId", "SecretAccessKey", "SessionToken", "Expiration"}
    assert body["credentials"]["Expiration"].endswith("Z")
    deps = credential_deps_from_env()
    assert body["connection"] == {"run_id": RUN, "bucket": deps.connection["bucket"], "table": endpoint.table,
                                  "region": "us-east-1", "participant_role": ROLE,
                                  "state_topic": deps.connection["state_topic"], "endpoint": None}
    record = endpoint.store.get("alice")
    assert record is not None and record.status is HostStatus.ACTIVE
    assert record.public_key == public_key_of(key) and record.redeemed_at == record.last_credentials_at == T0

    endpoint.now += 100
    status, renewed = endpoint.renew("alice", key)
    assert status == 200, renewed
    assert renewed["credentials"]["AccessKeyId"] != body["credentials"]["AccessKeyId"]
    record = endpoint.store.get("alice")
    assert record is not None and record.last_credentials_at == T0 + 100
    # tagged with its id (what every participant policy reads) and its generation (what the deny on revoked ones reads)
    assert endpoint.assumed == [{"RoleArn": ROLE, "RoleSessionName": "alice.1", "DurationSeconds": SECONDS,
                                 "Tags": [{"Key": "participant", "Value": "alice"},
                                          {"Key": "fed-host", "Value": "alice.1"}]}] * 2
    session = boto3.client("sts", region_name="us-east-1", aws_access_key_id=renewed["credentials"]["AccessKeyId"],
                           aws_secret_access_key=renewed["credentials"]["SecretAccessKey"],
                           aws_session_token=renewed["credentials"]["SessionToken"])
    assert session.get_caller_identity()["Arn"].endswith(":assumed-role/fed-hosts-run-participant/alice.1")
    assert endpoint.reasons() == []


# --- hostile requests, each refused with its reason recorded ----------------------------------------------


def refused(reason: str, temporary: bool = False) -> dict[str, Any]:
    return {"error": reason, "temporary": temporary}


UNVERIFIED_ANSWER = (403, refused(NOT_ACCEPTED))


def test_an_invite_redeemed_twice(endpoint: Endpoint) -> None:
    secret = endpoint.invite("alice")
    assert endpoint.redeem("alice", secret)[0] == 200
    assert endpoint.redeem("alice", secret) == (403, refused("invite already redeemed"))
    assert endpoint.reasons("alice") == ["invite already redeemed"]


def test_an_expired_invite(endpoint: Endpoint) -> None:
    secret = endpoint.invite("alice", expires_in=600)
    endpoint.now += 600
    assert endpoint.redeem("alice", secret) == (403, refused("invite expired"))
    assert endpoint.reasons("alice") == ["invite expired"]
    record = endpoint.store.get("alice")
    assert record is not None and record.status is HostStatus.INVITED


def test_no_invite_and_a_wrong_secret_get_the_same_answer_and_the_operator_tells_them_apart(
        endpoint: Endpoint) -> None:
    endpoint.invite("alice")
    assert endpoint.redeem("alice", new_secret()) == UNVERIFIED_ANSWER
    endpoint.now += 1
    assert endpoint.redeem("bob", new_secret()) == UNVERIFIED_ANSWER
    kept = [(r.host, r.kind, r.reason) for r in endpoint.store.refusals()]
    assert kept == [("alice", RefusalKind.UNVERIFIED, "wrong secret"),
                    (UNKNOWN_HOST, RefusalKind.UNVERIFIED, "no invite for this host")]  # bob is not invited
    record = endpoint.store.get("alice")
    assert record is not None and record.status is HostStatus.INVITED


def test_a_renewal_no_key_of_the_id_signed_gets_the_same_answer(endpoint: Endpoint) -> None:
    endpoint.redeemed("alice")
    endpoint.invite("bob")  # invited, not redeemed: no key bound
    stranger = Ed25519PrivateKey.generate()
    answers = [endpoint.renew(host, stranger) for host in ("alice", "bob", "carol")]
    assert answers == [UNVERIFIED_ANSWER] * 3
    assert endpoint.reasons("alice") == ["signature does not match the host's registered key"]
    assert endpoint.reasons("bob") == ["host has not redeemed its invite"]
    assert endpoint.reasons(UNKNOWN_HOST) == ["unknown host"]


def test_a_replayed_or_stale_renewal_is_refused_as_temporary(endpoint: Endpoint) -> None:
    key = endpoint.redeemed("alice")
    signed = sign_renewal(key, "alice", endpoint.now).model_dump(mode="json")
    assert endpoint.call("/renew", signed)[0] == 200
    endpoint.now += 1
    assert endpoint.call("/renew", signed) == (403, refused(REPLAYED, temporary=True))
    endpoint.now += 400  # and once its time is out of the window, for that reason
    status, body = endpoint.call("/renew", signed)
    assert status == 403 and body["temporary"] and body["error"].startswith("issued_at is 401 s behind")
    (stale,) = endpoint.store.refusals("alice")
    assert (stale.kind, stale.count, stale.first_reason, stale.reason) == (RefusalKind.STALE, 2, REPLAYED,
                                                                           body["error"])
    assert endpoint.store.requests_counted("alice", endpoint.now) == 0  # neither spent alice's budget


def test_an_invalid_participant_id(endpoint: Endpoint) -> None:
    for host in ("../alice", "global", "a" * 64):
        endpoint.now += 1
        status, body = endpoint.redeem(host, new_secret())
        assert status == 400 and body["error"].startswith("field 'host'") and not body["temporary"], body
    (kept,) = endpoint.store.refusals()
    assert (kept.host, kept.kind, kept.count) == (UNKNOWN_HOST, RefusalKind.MALFORMED, 3)
    assert "invalid participant id" in kept.first_reason and "at most 63" in kept.reason


def test_an_oversized_body(endpoint: Endpoint) -> None:
    secret = endpoint.invite("alice")
    big = {"host": "alice", "secret": secret, "public_key": public_key_of(Ed25519PrivateKey.generate()),
           "upload_key": public_key_of(Ed25519PrivateKey.generate()),
           "padding": "x" * 5000}
    assert endpoint.call("/redeem", big, b64=True) == (413, refused("the body is larger than 4096 bytes"))
    assert endpoint.reasons(UNKNOWN_HOST) == endpoint.reasons() == ["the body is larger than 4096 bytes"]
    record = endpoint.store.get("alice")
    assert record is not None and record.status is HostStatus.INVITED


def test_a_revoked_hosts_renewal(endpoint: Endpoint) -> None:
    key = endpoint.redeemed("alice")
    with acting_as(OPERATOR):
        assert not endpoint.store.invite("alice", secret_hash(new_secret()), T0 + 3600, T0)  # it holds a bound key
        endpoint.now += 10
        assert endpoint.store.revoke("alice", "left the project", endpoint.now)
        assert not endpoint.store.revoke("carol", "never invited", endpoint.now)
    assert endpoint.renew("alice", key) == (403, refused("host is revoked: left the project"))
    assert endpoint.reasons("alice") == ["host is revoked: left the project"]
    record = endpoint.store.get("alice")
    assert record is not None and record.status is HostStatus.REVOKED and record.revoked_at == T0 + 10


# --- floods: what they cannot do, and what they cost -----------------------------------------------------


def junk(endpoint: Endpoint, i: int) -> tuple[int, dict[str, Any]]:
    """The i-th request of a flood by someone with no secret and no key: unsigned renewals naming invited hosts,
    redemptions guessing secrets, ids never invited, garbage."""
    stranger = Ed25519PrivateKey.generate()
    match i % 5:
        case 0:
            return endpoint.renew("alice", stranger)
        case 1:
            return endpoint.redeem("bob", new_secret())
        case 2:
            return endpoint.redeem(f"flood-{i}", new_secret())
        case 3:
            return endpoint.renew(f"flood-{i}", stranger)
        case _:
            return endpoint.call("/renew", b'{"host": "alice", "nonce": 7}')


def test_unsigned_and_junk_requests_at_any_rate_leave_every_invited_hosts_signed_renewals_answered(
        endpoint: Endpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    limits = HostLimits(per_host_per_minute=3, all_hosts_per_minute=6, unverified_per_minute=10)  # small: a fast test
    deps = replace(credential_deps_from_env(), limits=limits)
    monkeypatch.setattr(credentials, "credential_deps_from_env", lambda: deps)
    alice = endpoint.redeemed("alice")
    secret = endpoint.invite("bob")
    junk_per_minute = 10 * limits.all_hosts_per_minute  # far past every budget: each host's, all hosts', unverified
    before = endpoint.items()
    honest: list[int] = []
    answers: dict[int, int] = {}
    for minute in range(2):
        for i in range(junk_per_minute):
            endpoint.now = T0 + 60 * minute + 1 + i * 50 / junk_per_minute
            status, body = junk(endpoint, i)
            answers[status] = answers.get(status, 0) + 1
            assert status in (400, 403, 429) and body["error"] != "", body
            if i % (junk_per_minute // 2) == 1:  # alice renews amid the flood, twice a minute
                honest.append(endpoint.renew("alice", alice)[0])
        assert endpoint.store.requests_counted(UNVERIFIED, endpoint.now) == junk_per_minute
        assert endpoint.store.requests_counted("alice", endpoint.now) == 3 - minute  # the redemption, the renewals
    assert honest == [200] * 4
    assert endpoint.redeem("bob", secret)[0] == 200  # bob redeems his invite after two minutes of guesses at it
    assert answers[429] == 2 * (junk_per_minute - limits.unverified_per_minute)  # past the unverified budget
    # Kept: one record per invited host (or UNKNOWN_HOST) and kind, with a count, whatever the flood sent.
    kept = {(r.host, r.kind): r.count for r in endpoint.store.refusals()}
    assert set(kept) <= {(h, k) for h in ("alice", "bob", UNKNOWN_HOST) for k in RefusalKind}
    assert sum(kept.values()) == 2 * limits.unverified_per_minute
    new_items = endpoint.items() - before
    assert new_items <= len(kept) + 2 * 3 + 4 + 1  # the records; per minute 3 counters; alice's nonces; bob's counter
    assert endpoint.store.requests_counted(ALL_HOSTS, endpoint.now) == 3  # only verified requests spend it


def test_the_budgets_of_verified_requests_still_hold(endpoint: Endpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_HOST_RATE, "3")
    monkeypatch.setenv(ENV_ALL_HOSTS_RATE, "4")
    key = endpoint.redeemed("alice")
    statuses = []
    for i in range(4):
        endpoint.now = T0 + 1 + i
        statuses.append(endpoint.renew("alice", key))
    assert [s for s, _ in statuses] == [200, 200, 429, 429]  # the redemption was the minute's first
    assert statuses[-1][1] == refused("too many requests for host alice; try again in a minute", temporary=True)
    assert endpoint.store.requests_counted("alice", endpoint.now) == 5
    assert endpoint.reasons() == []  # counted, not recorded one by one
    bob, carol = endpoint.invite("bob"), endpoint.invite("carol")
    assert endpoint.redeem("bob", bob)[0] == 200  # another host is not held back by alice's budget...
    assert endpoint.redeem("carol", carol) == (
        429, refused("too many requests to the credential endpoint; try again in a minute", temporary=True))
    endpoint.now = T0 + 60  # ...but all hosts' together are limited, until the next minute
    assert endpoint.redeem("carol", carol)[0] == 200


# --- what is not a request at all --------------------------------------------------------------------------


def test_wrong_methods_paths_and_bodies(endpoint: Endpoint) -> None:
    answers = []
    for method, path, body in (("GET", "/redeem", b""), ("POST", "/admin", b"{}"), ("POST", "/redeem", b"{not json"),
                               ("POST", "/renew", b'{"host": "alice"}')):
        endpoint.now += 1
        answers.append(endpoint.call(path, body, method=method))
    assert answers[:3] == [(405, refused("only POST is answered")),
                           (404, refused("no such path: POST /redeem or /renew")),
                           (400, refused("not a JSON document"))]
    assert answers[3][0] == 400 and answers[3][1]["error"].startswith("field 'issued_at': ")
    (kept,) = endpoint.store.refusals()
    assert (kept.host, kept.kind, kept.count, kept.first_reason) == (UNKNOWN_HOST, RefusalKind.MALFORMED, 4,
                                                                    "only POST is answered")
    assert kept.reason == answers[3][1]["error"] + " (naming host alice)"


def test_a_failure_is_answered_without_its_detail(endpoint: Endpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    secret = endpoint.invite("alice")

    def broken(host: str, generation: int, seconds: int) -> dict[str, str]:
        raise RuntimeError("sts is down")

    deps = replace(credential_deps_from_env(), issue=broken)
    monkeypatch.setattr(credentials, "credential_deps_from_env", lambda: deps)
    status, body = endpoint.redeem("alice", secret)
    assert status == 500 and secret not in json.dumps(body) and "sts" not in body["error"]
