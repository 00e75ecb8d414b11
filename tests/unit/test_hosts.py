"""Hosts outside AWS, the pure part (shared/hosts.py and the endpoint's messages): invites, renewals, refusals."""

from __future__ import annotations

import base64
import hashlib
import json
from dataclasses import replace
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shared.hosts import (
    INVITE_PREFIX,
    HostLimits,
    HostRecord,
    HostStatus,
    Invite,
    InviteError,
    credential_answer,
    format_invite,
    new_nonce,
    new_secret,
    parse_invite,
    public_key_of,
    redeem_refusal,
    renew_refusal,
    renewal_message,
    secret_hash,
    sign_renewal,
    verify_renewal,
)
from shared.messages import MessageError, RedeemRequest, RenewRequest, parse_message

NOW = 1_800_000_000.0
ENDPOINT = "https://abc.lambda-url.us-east-1.on.aws/"
SECRET = new_secret()
KEY = Ed25519PrivateKey.generate()
LIMITS = HostLimits()


def invite_line(**fields: Any) -> str:
    body = {"endpoint": ENDPOINT, "host": "alice", "secret": SECRET, "expires": int(NOW) + 3600, **fields}
    return INVITE_PREFIX + base64.urlsafe_b64encode(json.dumps(body, separators=(",", ":")).encode()).rstrip(
        b"=").decode()


def invited(**changes: Any) -> HostRecord:
    record = HostRecord("alice", HostStatus.INVITED, secret_hash(SECRET), invite_expires=NOW + 3600, invited_at=NOW)
    return replace(record, **changes)


def active(**changes: Any) -> HostRecord:
    return invited(**{"status": HostStatus.ACTIVE, "public_key": public_key_of(KEY), "redeemed_at": NOW, **changes})


def redeem(secret: str = SECRET, host: str = "alice") -> RedeemRequest:
    return RedeemRequest(host=host, secret=secret, public_key=public_key_of(KEY))


# --- invites ----------------------------------------------------------------------------------------------


def test_an_invite_reads_back_as_written_and_never_shows_its_secret() -> None:
    invite = Invite(ENDPOINT, "alice", SECRET, int(NOW))
    line = format_invite(invite)
    assert line.startswith(INVITE_PREFIX) and "=" not in line
    assert parse_invite(line) == invite
    assert parse_invite(f"  {line}\n") == invite  # pasted with its newline
    assert SECRET not in repr(invite)
    assert line == invite_line(expires=int(NOW))


@pytest.mark.parametrize(("line", "says"), [
    ("", "not an invite"),
    ("fed-invite-v2.abc", "not an invite"),
    (INVITE_PREFIX, "unpadded base64url"),
    (INVITE_PREFIX + "abc=", "unpadded base64url"),
    (INVITE_PREFIX + "a+b/", "unpadded base64url"),
    (INVITE_PREFIX + "x" * 5000, "longer than"),
    (INVITE_PREFIX + base64.urlsafe_b64encode(b"not json").decode().rstrip("="), "JSON document"),
    (INVITE_PREFIX + base64.urlsafe_b64encode(b"[1,2]").decode().rstrip("="), "JSON object"),
])
def test_a_garbled_line_is_refused_with_what_is_wrong(line: str, says: str) -> None:
    with pytest.raises(InviteError, match=says):
        parse_invite(line)


@pytest.mark.parametrize(("fields", "says"), [
    ({"endpoint": "ftp://x"}, "endpoint"),
    ({"endpoint": "https://a b"}, "endpoint"),
    ({"endpoint": 3}, "endpoint"),
    ({"host": "../etc"}, "invalid participant id"),
    ({"host": "global"}, "reserved"),
    ({"secret": "short"}, "secret"),
    ({"secret": "A" * 42 + "+"}, "secret"),
    ({"expires": True}, "expiry"),
    ({"expires": 1.5}, "expiry"),
    ({"expires": -1}, "expiry"),
    ({"extra": 1}, "unknown"),
])
def test_a_wrong_field_is_named_and_the_secret_never_repeated(fields: dict[str, Any], says: str) -> None:
    with pytest.raises(InviteError, match=says) as caught:
        parse_invite(invite_line(**fields))
    assert SECRET not in str(caught.value)


def test_a_missing_field_is_named() -> None:
    body = {"endpoint": ENDPOINT, "host": "alice", "expires": 1}
    line = INVITE_PREFIX + base64.urlsafe_b64encode(json.dumps(body).encode()).decode().rstrip("=")
    with pytest.raises(InviteError, match="lacks secret"):
        parse_invite(line)


def test_a_tampered_line_is_refused() -> None:
    line = format_invite(Invite(ENDPOINT, "alice", SECRET, int(NOW)))
    reordered = invite_line(expires=int(NOW)).replace(INVITE_PREFIX, "")  # the same fields, written otherwise:
    spaced = base64.urlsafe_b64encode(json.dumps(json.loads(base64.urlsafe_b64decode(reordered + "==")))
                                      .encode()).decode().rstrip("=")
    with pytest.raises(InviteError, match="not written as"):
        parse_invite(INVITE_PREFIX + spaced)
    for at in range(len(INVITE_PREFIX), len(line), 7):  # a character changed anywhere: refused or another invite
        changed = line[:at] + ("A" if line[at] != "A" else "B") + line[at + 1:]
        try:
            assert parse_invite(changed) != parse_invite(line)
        except InviteError as exc:
            assert SECRET not in str(exc)


def test_a_secret_is_stored_as_its_hash_only() -> None:
    assert secret_hash(SECRET) == hashlib.sha256(SECRET.encode()).hexdigest()
    assert len(SECRET) == 43 and len(base64.urlsafe_b64decode(SECRET + "=")) == 32
    assert new_secret() != new_secret()


# --- renewals ---------------------------------------------------------------------------------------------


def test_a_renewal_verifies_against_its_key_after_the_json_round_trip() -> None:
    request = sign_renewal(KEY, "alice", NOW + 0.123456)
    wire = json.dumps(request.model_dump(mode="json"))
    received = parse_message(RenewRequest, wire)
    assert received == request and verify_renewal(public_key_of(KEY), received)
    assert renewal_message("alice", NOW, "0" * 32) == f"fed-renew:v1\nalice\n{NOW!r}\n{'0' * 32}".encode()
    assert len(new_nonce()) == 32 and new_nonce() != new_nonce()


def test_a_renewal_signed_with_another_key_or_changed_does_not_verify() -> None:
    request = sign_renewal(KEY, "alice", NOW)
    assert not verify_renewal(public_key_of(Ed25519PrivateKey.generate()), request)
    for change in ({"host": "bob"}, {"issued_at": NOW + 1}, {"nonce": new_nonce()}):
        assert not verify_renewal(public_key_of(KEY), request.model_copy(update=change))
    assert not verify_renewal("not base64!", request)


# --- the endpoint's messages ------------------------------------------------------------------------------


@pytest.mark.parametrize(("body", "field"), [
    ({"host": "../x"}, "host"),
    ({"secret": "x" * 43 + "="}, "secret"),
    ({"public_key": base64.b64encode(b"k" * 31).decode()}, "public_key"),
    ({"public_key": "%%%"}, "public_key"),
    ({"extra": 1}, "extra"),
])
def test_a_malformed_redemption_names_its_field_not_its_secret(body: dict[str, Any], field: str) -> None:
    good = {"host": "alice", "secret": SECRET, "public_key": public_key_of(KEY)}
    with pytest.raises(MessageError) as caught:
        parse_message(RedeemRequest, json.dumps({**good, **body}))
    assert caught.value.fields == (field,) and SECRET not in str(caught.value)


@pytest.mark.parametrize(("body", "field"), [
    ({"nonce": "A" * 32}, "nonce"),
    ({"issued_at": "1"}, "issued_at"),
    ({"signature": base64.b64encode(b"s" * 63).decode()}, "signature"),
])
def test_a_malformed_renewal_names_its_field(body: dict[str, Any], field: str) -> None:
    good = sign_renewal(KEY, "alice", NOW).model_dump(mode="json")
    with pytest.raises(MessageError) as caught:
        parse_message(RenewRequest, json.dumps({**good, **body}))
    assert caught.value.fields == (field,)


def test_the_answer_is_checked_against_its_schema() -> None:
    creds = {"AccessKeyId": "ASIA" + "X" * 16, "SecretAccessKey": "s", "SessionToken": "t",
             "Expiration": "2027-01-15T10:00:00Z"}
    where = {"run_id": "r", "bucket": "b", "table": "t", "region": "us-east-1", "participant_role": "arn:role",
             "state_topic": "", "endpoint": None}
    assert credential_answer(creds, where) == {"credentials": creds, "connection": where}
    with pytest.raises(ValueError):
        credential_answer({**creds, "Expiration": "2027-01-15 10:00:00"}, where)
    with pytest.raises(ValueError):
        credential_answer(creds, {**where, "tick_function": "f"})


# --- refusals ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("record", "request_", "now", "reason"), [
    (invited(), redeem(), NOW, None),
    (None, redeem(), NOW, "no invite for this host"),
    (invited(), redeem(secret=new_secret()), NOW, "wrong secret"),
    (active(), redeem(secret=new_secret()), NOW, "wrong secret"),  # only the secret's holder learns more
    (active(), redeem(), NOW, "invite already redeemed"),
    (invited(status=HostStatus.REVOKED), redeem(), NOW, "host is revoked"),
    (invited(), redeem(), NOW + 3600, "invite expired"),
    (invited(secret_hash=""), redeem(), NOW, "wrong secret"),
])
def test_each_redemption_refusal(record: HostRecord | None, request_: RedeemRequest, now: float,
                                 reason: str | None) -> None:
    assert redeem_refusal(record, request_, now) == reason


def test_each_renewal_refusal() -> None:
    signed = sign_renewal(KEY, "alice", NOW)
    assert renew_refusal(active(), signed, NOW, LIMITS) is None
    assert renew_refusal(active(), signed, NOW + 300, LIMITS) is None  # the skew allowed, either way
    assert renew_refusal(active(), signed, NOW - 300, LIMITS) is None
    assert renew_refusal(None, signed, NOW, LIMITS) == "unknown host"
    assert renew_refusal(invited(), signed, NOW, LIMITS) == "host has not redeemed its invite"
    assert renew_refusal(invited(status=HostStatus.REVOKED), signed, NOW, LIMITS) == "host is revoked"
    assert renew_refusal(active(), signed, NOW + 301, LIMITS) == (
        "issued_at is 301 s behind the endpoint's clock (at most 300 s)")
    assert renew_refusal(active(), signed, NOW - 301, LIMITS) == (
        "issued_at is 301 s ahead of the endpoint's clock (at most 300 s)")
    other = sign_renewal(Ed25519PrivateKey.generate(), "alice", NOW)
    assert renew_refusal(active(), other, NOW, LIMITS) == "signature does not match the host's registered key"
    revoked = active(status=HostStatus.REVOKED, revoked_at=NOW, revoke_reason="left the project")
    assert renew_refusal(revoked, signed, NOW, LIMITS) == "host is revoked: left the project"
    assert renew_refusal(revoked, other, NOW, LIMITS) == "signature does not match the host's registered key"


def test_a_nonce_outlives_the_window_its_renewal_is_accepted_in() -> None:
    assert LIMITS.nonce_seconds > 2 * LIMITS.max_skew_seconds
