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
    MAX_ROLE_POLICY_CHARS,
    MAX_SESSION_SECONDS,
    PARTICIPANT_POLICY_BUDGET,
    HostLimits,
    HostRecord,
    HostStatus,
    Invite,
    InviteError,
    Revocation,
    credential_answer,
    denied,
    deny_policy,
    format_invite,
    new_nonce,
    new_secret,
    parse_invite,
    public_key_of,
    redeem_refusal,
    renew_refusal,
    renewal_message,
    room_frees_at,
    secret_hash,
    session_tag,
    sign_renewal,
    upload_refusal,
    verify_renewal,
)
from shared.messages import MessageError, RedeemRequest, RenewRequest, parse_message

NOW = 1_800_000_000.0
ENDPOINT = "https://abc.lambda-url.us-east-1.on.aws/"
SECRET = new_secret()
KEY = Ed25519PrivateKey.generate()
UPLOAD = Ed25519PrivateKey.generate()
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


def redeem(secret: str = SECRET, host: str = "alice", upload_key: str = "") -> RedeemRequest:
    return RedeemRequest(host=host, secret=secret, public_key=public_key_of(KEY),
                         upload_key=upload_key or public_key_of(UPLOAD))


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
    good = {"host": "alice", "secret": SECRET, "public_key": public_key_of(KEY),
            "upload_key": public_key_of(UPLOAD)}
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
    (invited(), redeem(upload_key=public_key_of(KEY)), NOW, "the host key and the upload key must differ"),
    (invited(generation=2, retired_keys=(public_key_of(KEY),)), redeem(), NOW,
     "a key of an earlier generation of this host: make new keys"),
    (invited(generation=2, retired_keys=(public_key_of(UPLOAD),)), redeem(), NOW,
     "a key of an earlier generation of this host: make new keys"),
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


# --- generations ----------------------------------------------------------------------------------------------


def test_ingest_lets_in_only_the_current_generation_once_redeemed() -> None:
    old, new = public_key_of(Ed25519PrivateKey.generate()), public_key_of(UPLOAD)
    first = active(upload_key=old)
    assert upload_refusal(None, join=False) is None  # no invited host of that id
    assert upload_refusal(first, join=False) is None  # generation 1 before its join: no earlier key to fear
    assert upload_refusal(replace(first, registered_key=old), join=False) is None
    revoked = replace(first, status=HostStatus.REVOKED, revoke_reason="stolen")
    assert upload_refusal(revoked, join=True) == upload_refusal(revoked, join=False) == "from a revoked host: stolen"
    # reinstated: invited again, so nothing is let in until it redeems, and then only its join until that is registered
    second = invited(generation=2, registered_key=old, retired_keys=(old,))
    assert upload_refusal(second, join=False) == (
        "from host alice, whose generation 2 has not redeemed its invite")
    redeemed = replace(second, status=HostStatus.ACTIVE, upload_key=new)
    assert upload_refusal(redeemed, join=True) is None
    assert upload_refusal(redeemed, join=False) == (
        "from host alice before the join of its generation 2 was registered (an earlier generation's key is refused)")
    assert upload_refusal(replace(redeemed, registered_key=new), join=False) is None


def test_a_revoked_generation_is_denied_for_the_longest_session_and_a_clock_allowance() -> None:
    revocations = [Revocation("alice", 1, NOW), Revocation("alice", 2, NOW + 100), Revocation("bob", 1, NOW + 200)]
    assert denied(revocations, NOW + 200) == ["alice.1", "alice.2", "bob.1"]
    # a session issued just before the revocation lives MAX_SESSION_SECONDS, and clocks disagree by a little
    assert "alice.1" in denied(revocations, NOW + MAX_SESSION_SECONDS + 299)
    assert denied(revocations, NOW + MAX_SESSION_SECONDS + 300) == ["alice.2", "bob.1"]
    # the policy is written as IAM counts it: no whitespace
    policy = deny_policy(["alice.1"])
    assert " " not in policy and json.loads(policy)["Statement"][0]["Condition"] == {
        "StringEquals": {"aws:PrincipalTag/fed-host": ["alice.1"]}}
    assert session_tag("gpu-7", 12) == "gpu-7.12"


def test_a_thousand_revocations_over_a_day_keep_the_policy_in_room_and_every_live_session_cut() -> None:
    # Given 1,000 revocations spread over a day, of the longest ids (63 characters, the worst case for room)
    day, n = 86400.0, 1000
    revocations = [Revocation(f"{i:04d}-" + "h" * 58, 1, NOW + i * day / n) for i in range(n)]
    room = MAX_ROLE_POLICY_CHARS - PARTICIPANT_POLICY_BUDGET
    largest = 0
    for i, revoked in enumerate(revocations):
        now = revoked.at  # each revocation rewrites the policy from the records kept
        tags = denied(revocations[: i + 1], now)
        largest = max(largest, len(deny_policy(tags)))
        # Then it fits beside the role's own policy
        assert len(deny_policy(tags)) <= room
        assert room_frees_at(revocations[: i + 1], now, room) == now
        # And every generation a session issued before its revocation could still act for is in it
        live = {session_tag(r.host, r.generation) for r in revocations[: i + 1] if now - r.at <= MAX_SESSION_SECONDS}
        assert live <= set(tags)
    assert largest < room  # (measured: see docs/deploy.md)
    print(f"largest deny policy: {largest} of {room} characters")


def test_past_the_room_it_says_when_room_frees_up() -> None:
    revocations = [Revocation(f"host-{i:03d}", 1, NOW + i) for i in range(200)]
    tags = denied(revocations, NOW + 199)
    room = len(deny_policy(tags[:100]))
    frees = room_frees_at(revocations, NOW + 199, room)
    # the first 100 must age out: the 100th oldest's revocation + the deny period
    assert frees == revocations[99].at + MAX_SESSION_SECONDS + 300
    assert frees is not None and len(deny_policy(denied(revocations, frees))) <= room
    assert room_frees_at(revocations, NOW + 199, 10) is None
