"""`fed hosts invite|list|revoke` as an operator runs them against a deployed run (in-process moto standing in for
AWS, its IAM holding the participant role): the invite line, the listing, and a revocation that marks the host and
writes the participant role's deny on the revoked hosts' session tags."""

from __future__ import annotations

import json
from collections.abc import Iterator

import boto3
import pytest
from moto import mock_aws

from fed.hosts import HostsError, duration_seconds, invite, listing, reinstate, revoke
from local.resources import create_resources
from shared.hosts import (
    DENY_SECONDS,
    MAX_ROLE_POLICY_CHARS,
    UNKNOWN_HOST,
    HostStatus,
    RefusalKind,
    deny_policy,
    parse_invite,
    policy_chars,
    secret_hash,
)
from shared.naming import HOST_TAG, PARTICIPANT_POLICY, REVOKED_HOSTS_POLICY
from store.connection import Connection
from store.hosts import HostStore

RUN = "ops-hosts"
URL = "https://abc.lambda-url.us-east-1.on.aws/"
T = 1_800_000_000.0


@pytest.fixture
def conn(monkeypatch: pytest.MonkeyPatch) -> Iterator[Connection]:
    for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                        "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(name, value)
    with mock_aws():
        res = create_resources(RUN)  # (the participant role too, as `fed local` has it)
        role = boto3.client("iam").get_role(RoleName=f"fed-{RUN}-participant")["Role"]["Arn"]
        yield Connection(run_id=RUN, bucket=res.bucket, table=res.table, endpoint=None, region="us-east-1",
                         participant_role=role, credential_endpoint=URL)


def test_an_invite_names_the_endpoint_and_only_its_secrets_hash_is_stored(conn: Connection) -> None:
    line = invite(conn, "gpu-7", duration_seconds("24h"), now=1000.0)
    parsed = parse_invite(line)
    assert (parsed.endpoint, parsed.host, parsed.expires) == (URL, "gpu-7", 1000 + 86400)
    record = HostStore(conn.table, RUN, None, conn.region).get("gpu-7")
    assert record is not None and record.status is HostStatus.INVITED
    assert record.secret_hash == secret_hash(parsed.secret) and parsed.secret not in json.dumps(record.__dict__,
                                                                                                   default=str)
    assert [(h.host, h.status) for h in listing(conn)] == [("gpu-7", "expired")]  # (24 h after 1970)


def deny_list(conn: Connection) -> list[str]:
    role_name = conn.participant_role.rsplit("/", 1)[-1]
    policy = boto3.client("iam").get_role_policy(RoleName=role_name, PolicyName=REVOKED_HOSTS_POLICY)["PolicyDocument"]
    policy = json.loads(policy) if isinstance(policy, str) else policy
    (statement,) = policy["Statement"]
    assert statement["Effect"] == "Deny" and statement["Action"] == "*" and statement["Resource"] == "*"
    (condition,) = statement["Condition"].values()
    return list(condition[f"aws:PrincipalTag/{HOST_TAG}"])


def test_revoking_marks_the_host_and_denies_every_revoked_hosts_sessions(conn: Connection) -> None:
    for host in ("gpu-1", "gpu-2", "gpu-3"):
        invite(conn, host, 3600)
    assert "refused" in revoke(conn, "gpu-2", "stolen laptop")[0]
    revoke(conn, "gpu-3", "decommissioned")
    assert deny_list(conn) == ["gpu-2.1", "gpu-3.1"]
    shown = {h.host: (h.status, h.revoke_reason) for h in listing(conn)}
    assert shown == {"gpu-1": ("invited", ""), "gpu-2": ("revoked", "stolen laptop"),
                     "gpu-3": ("revoked", "decommissioned")}


def test_a_revoked_id_stays_revoked_and_comes_back_only_as_a_new_generation(conn: Connection) -> None:
    # Given alice revoked
    store = HostStore(conn.table, RUN, None, conn.region)
    invite(conn, "alice", 3600, now=T)
    invite(conn, "bob", 3600, now=T)
    revoke(conn, "alice", "stolen laptop", now=T + 10)
    # When the operator invites her id again, it is refused, naming the way back
    with pytest.raises(HostsError, match="fed hosts reinstate alice"):
        invite(conn, "alice", 3600, now=T + 20)
    record = store.get("alice")
    assert record is not None and record.status is HostStatus.REVOKED and record.generation == 1
    # And the next revocation (bob's) keeps alice in the deny list: it is read from the revocation records
    revoke(conn, "bob", "left", now=T + 30)
    assert deny_list(conn) == ["alice.1", "bob.1"]
    # When she is reinstated: a new generation, invited under a new secret, her old generation still denied
    line = reinstate(conn, "alice", 3600, now=T + 40)
    record = store.get("alice")
    assert record is not None and (record.status, record.generation) == (HostStatus.INVITED, 2)
    assert record.secret_hash == secret_hash(parse_invite(line).secret) and not record.public_key
    assert deny_list(conn) == ["alice.1", "bob.1"]
    # And renewing her invite before it is redeemed stays in that generation
    invite(conn, "alice", 3600, now=T + 50)
    assert store.get("alice").generation == 2  # type: ignore[union-attr]
    # And only a revoked host is reinstated
    with pytest.raises(HostsError, match="is invited, not revoked"):
        reinstate(conn, "alice", 3600, now=T + 60)
    with pytest.raises(HostsError, match="no host 'carol'"):
        reinstate(conn, "carol", 3600, now=T + 60)


def test_the_deny_list_sheds_generations_whose_sessions_have_all_expired(conn: Connection) -> None:
    for host in ("old", "new"):
        invite(conn, host, 3600, now=T)
    revoke(conn, "old", "gone", now=T)
    revoke(conn, "new", "gone", now=T + DENY_SECONDS - 1)
    assert deny_list(conn) == ["new.1", "old.1"]
    invite(conn, "later", 3600, now=T)
    revoke(conn, "later", "gone", now=T + DENY_SECONDS)  # old's sessions (at most an hour, and a clock allowance)
    assert deny_list(conn) == ["later.1", "new.1"]  # have all expired


def test_past_the_room_the_iam_step_is_refused_saying_when_room_frees_up(conn: Connection) -> None:
    # Given the participant role's own policy leaving room for a few tags only
    iam = boto3.client("iam")
    role_name = conn.participant_role.rsplit("/", 1)[-1]
    room = len(deny_policy(["host-0.1", "host-1.1"]))

    def filler(pad: int) -> dict[str, object]:
        return {"Version": "2012-10-17", "Statement": [
            {"Effect": "Allow", "Action": "s3:GetObject", "Resource": "arn:aws:s3:::b/" + "x" * pad}]}

    own = filler(MAX_ROLE_POLICY_CHARS - room - policy_chars(filler(0)))
    assert policy_chars(own) + room == MAX_ROLE_POLICY_CHARS
    own_text = json.dumps(own, indent=2)  # (IAM does not count the whitespace)
    iam.put_role_policy(RoleName=role_name, PolicyName=PARTICIPANT_POLICY, PolicyDocument=own_text)
    for i in range(4):
        invite(conn, f"host-{i}", 3600, now=T)
    revoke(conn, "host-0", "gone", now=T)
    revoke(conn, "host-1", "gone", now=T + 1)
    # When a revocation would take the policy past it
    with pytest.raises(HostsError, match=r"host-2 \(generation 1\) revoked.*room frees up in 3898 s"):
        revoke(conn, "host-2", "gone", now=T + 2)
    # Then the host is revoked all the same (endpoint and ingest refuse it), and the policy written is the last one
    assert store_of(conn).get("host-2").status is HostStatus.REVOKED  # type: ignore[union-attr]
    assert deny_list(conn) == ["host-0.1", "host-1.1"]
    # And once the oldest revocation's sessions have expired, the next one fits again
    with pytest.raises(HostsError, match="room frees up in 1 s"):  # host-1 and host-2 still in, host-3 would not fit
        revoke(conn, "host-3", "gone", now=T + DENY_SECONDS)
    revoke(conn, "host-3", "gone", now=T + DENY_SECONDS + 1)
    assert deny_list(conn) == ["host-2.1", "host-3.1"]


def store_of(conn: Connection) -> HostStore:
    return HostStore(conn.table, RUN, None, conn.region)


def test_what_cannot_be_done_says_why(conn: Connection) -> None:
    with pytest.raises(HostsError, match="no host 'nobody'"):
        revoke(conn, "nobody", "?")
    with pytest.raises(HostsError, match="not a duration"):
        duration_seconds("tomorrow")
    with pytest.raises(HostsError, match="longer than 30 days"):
        duration_seconds("31d")
    store = HostStore(conn.table, RUN, None, conn.region)
    invite(conn, "gpu-1", 3600)
    record = store.get("gpu-1")
    assert record is not None and store.redeem("gpu-1", record.secret_hash, "A" * 44, "B" * 44, record.invited_at)
    with pytest.raises(HostsError, match="is active"):
        invite(conn, "gpu-1", 3600)
    with pytest.raises(HostsError, match="no credential endpoint"):
        invite(Connection(RUN, conn.bucket, conn.table), "gpu-9", 3600)


def test_the_listing_reads_one_refusal_record_per_host_and_kind_however_many(conn: Connection) -> None:
    for host in ("gpu-1", "gpu-2"):
        invite(conn, host, 3600)
    store = HostStore(conn.table, RUN, None, conn.region)
    for i in range(50):  # a flood, as the endpoint records it: under the invited id, or under "?"
        store.record_refusal("gpu-1", RefusalKind.UNVERIFIED, f"wrong secret {i}", 1000.0 + i)
        store.record_refusal(UNKNOWN_HOST, RefusalKind.MALFORMED, f"not a JSON document {i}", 1000.0 + i)
    store.record_refusal("gpu-1", RefusalKind.REFUSED, "invite expired", 2000.0)
    kept = store.refusals()
    assert [(r.host, r.kind, r.count) for r in kept] == [(UNKNOWN_HOST, RefusalKind.MALFORMED, 50),
                                                         ("gpu-1", RefusalKind.UNVERIFIED, 50),
                                                         ("gpu-1", RefusalKind.REFUSED, 1)]
    assert (kept[1].first_reason, kept[1].first_at, kept[1].reason, kept[1].at) == ("wrong secret 0", 1000.0,
                                                                                    "wrong secret 49", 1049.0)
    shown = {h.host: (h.status, h.generation, h.refusals, h.last_refusal) for h in listing(conn)}
    assert shown == {"gpu-1": ("invited", 1, 51, "invite expired"), "gpu-2": ("invited", 1, 0, ""),
                     UNKNOWN_HOST: ("not invited", 0, 50, "not a JSON document 49")}
