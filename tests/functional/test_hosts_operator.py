"""`fed hosts invite|list|revoke` as an operator runs them against a deployed run (in-process moto standing in for
AWS, its IAM holding the participant role): the invite line, the listing, and a revocation that marks the host and
writes the participant role's deny on the revoked hosts' session tags."""

from __future__ import annotations

import json
from collections.abc import Iterator

import boto3
import pytest
from moto import mock_aws

from fed.hosts import HostsError, duration_seconds, invite, listing, revoke
from local.resources import create_resources
from shared.hosts import HostStatus, parse_invite, secret_hash
from shared.naming import PARTICIPANT_TAG, REVOKED_HOSTS_POLICY
from store.connection import Connection
from store.hosts import HostStore

RUN = "ops-hosts"
URL = "https://abc.lambda-url.us-east-1.on.aws/"


@pytest.fixture
def conn(monkeypatch: pytest.MonkeyPatch) -> Iterator[Connection]:
    for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                        "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(name, value)
    with mock_aws():
        res = create_resources(RUN)
        trust = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "sts:AssumeRole",
                                                         "Principal": {"AWS": "arn:aws:iam::123456789012:root"}}]}
        role = boto3.client("iam").create_role(RoleName=f"fed-{RUN}-participant",
                                               AssumeRolePolicyDocument=json.dumps(trust))["Role"]["Arn"]
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


def test_revoking_marks_the_host_and_denies_every_revoked_hosts_sessions(conn: Connection) -> None:
    for host in ("gpu-1", "gpu-2", "gpu-3"):
        invite(conn, host, 3600)
    assert "refused" in revoke(conn, "gpu-2", "stolen laptop")[0]
    revoke(conn, "gpu-3", "decommissioned")

    role_name = conn.participant_role.rsplit("/", 1)[-1]
    policy = boto3.client("iam").get_role_policy(RoleName=role_name, PolicyName=REVOKED_HOSTS_POLICY)["PolicyDocument"]
    policy = json.loads(policy) if isinstance(policy, str) else policy
    (statement,) = policy["Statement"]
    assert statement["Effect"] == "Deny" and statement["Action"] == "*" and statement["Resource"] == "*"
    assert statement["Condition"] == {"StringEquals": {f"aws:PrincipalTag/{PARTICIPANT_TAG}": ["gpu-2", "gpu-3"]}}
    shown = {h.host: (h.status, h.revoke_reason) for h in listing(conn)}
    assert shown == {"gpu-1": ("invited", ""), "gpu-2": ("revoked", "stolen laptop"),
                     "gpu-3": ("revoked", "decommissioned")}


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
    assert record is not None and store.redeem("gpu-1", record.secret_hash, "A" * 44, record.invited_at)
    with pytest.raises(HostsError, match="is active"):
        invite(conn, "gpu-1", 3600)
    with pytest.raises(HostsError, match="no credential endpoint"):
        invite(Connection(RUN, conn.bucket, conn.table), "gpu-9", 3600)
