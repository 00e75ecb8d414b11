"""The access check's judgments on the calls the review found refused on AWS, from the template `cdk synth` makes
(`local.access`): each of these failed on the roles deployed before the fix."""

from __future__ import annotations

import json

import boto3
import pytest
from botocore.exceptions import ClientError
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from local import access
from local.access.control import AccessControl
from local.access.requests import HttpCall, Need, parse
from shared import keys
from shared.config import RunConfig
from shared.naming import local_bucket_name, table_name
from store.blobs import Bucket, NotFound
from store.trace import acting_as, function, participant
from tests.functional.conftest import Harness

RUN = "access-run"
ACCOUNT = "123456789012"


@pytest.fixture(scope="module", params=[0, 2], ids=["no-witnesses", "witnesses"])
def check(request: pytest.FixtureRequest) -> AccessControl:
    model = access.model_for(RunConfig(run_id=RUN, witness_nodes=request.param))
    return AccessControl(model, access.shared_evaluator(), None)


def obj(key: str) -> str:
    return f"arn:aws:s3:::{local_bucket_name(RUN)}/{key}"


BUCKET = f"arn:aws:s3:::{local_bucket_name(RUN)}"
TABLE = f"arn:aws:dynamodb:us-east-1:{ACCOUNT}:table/{table_name(RUN)}"


def allowed(check: AccessControl, principal: str, action: str, resource: str, **context: str) -> bool:
    return check.decide(principal, Need(action, resource, context)).allowed


def test_a_participant_may_not_list_the_bucket_so_its_missing_keys_answer_403(check: AccessControl) -> None:
    # S3 answers 404 for a missing key only to a caller with s3:ListBucket; a participant has none (by design: it
    # must not learn which keys exist), so the participant reads a 403 on its own keys as "not there"
    assert not allowed(check, "participant:alice", "s3:ListBucket", BUCKET)
    assert allowed(check, "participant:alice", "s3:GetObject", obj(keys.update_key(RUN, 3, "alice")))
    assert allowed(check, "participant:alice", "s3:GetObject", obj(keys.config_key(RUN)))


def test_a_restarted_participant_reads_its_own_upload_back_by_version(check: AccessControl) -> None:
    assert allowed(check, "participant:alice", "s3:GetObjectVersion", obj(keys.update_key(RUN, 3, "alice")))


def test_the_coordinator_may_list_its_bucket_so_its_missing_keys_answer_404(check: AccessControl) -> None:
    for name in ("tick", "ingest", "join", "shard"):
        assert allowed(check, f"function:{name}", "s3:ListBucket", BUCKET), name


def test_a_tick_gives_its_round_lease_back(check: AccessControl) -> None:
    for name in ("tick", "ingest"):
        assert allowed(check, f"function:{name}", "dynamodb:DeleteItem", TABLE,
                       **{"dynamodb:LeadingKeys": f"run#{RUN}"}), name


def test_a_participant_cannot_write_or_read_a_shard_outcome_even_with_an_id_of_six_digits(check: AccessControl) -> None:
    outcome = keys.shard_result_key(RUN, 4, "a" * 64, 0)
    assert outcome.endswith("/000000")
    assert allowed(check, "participant:000000", "s3:PutObject", obj(keys.update_key(RUN, 4, "000000")))
    assert not allowed(check, "participant:000000", "s3:PutObject", obj(outcome))
    assert not allowed(check, "participant:000000", "s3:GetObject", obj(outcome))
    for key in (keys.global_key(RUN, 4, "b" * 64), keys.delta_key(RUN, 4, "c" * 64),
                keys.optimizer_key(RUN, 4, "d" * 64), keys.staging_key(RUN, 4, "e" * 64)):
        assert not allowed(check, "participant:000000", "s3:PutObject", obj(key)), key


def test_a_verified_read_may_look_for_the_coordinators_own_version(check: AccessControl) -> None:
    for name in ("tick", "ingest"):
        assert allowed(check, f"function:{name}", "s3:ListBucketVersions", BUCKET,
                       **{"s3:prefix": keys.global_key(RUN, 2, "f" * 64)}), name


def test_a_participant_writes_only_its_own_keys(check: AccessControl) -> None:
    assert allowed(check, "participant:alice", "s3:PutObject", obj(keys.heartbeat_key(RUN, "alice")))
    assert not allowed(check, "participant:alice", "s3:PutObject", obj(keys.heartbeat_key(RUN, "bob")))
    assert not allowed(check, "participant:alice", "s3:PutObject", obj(keys.manifest_key(RUN)))


def call(method: str, path: str, key_id: str, service: str = "s3", target: str = "", body: bytes = b"",
         query: str = "") -> HttpCall:
    headers = {"authorization": f"AWS4-HMAC-SHA256 Credential={key_id}/20261128/us-east-1/{service}/aws4_request, "
                                "SignedHeaders=host, Signature=0"}
    if target:
        headers["x-amz-target"] = target
        headers["content-type"] = "application/x-amz-json-1.0"
    return HttpCall(method, "127.0.0.1:5000", path, query, headers, body)


def test_a_refused_call_gets_the_services_own_error_and_a_missing_key_403(check: AccessControl) -> None:
    bucket = local_bucket_name(RUN)
    refused = check.before(call("PUT", f"/{bucket}/{keys.heartbeat_key(RUN, 'bob')}", "participant-alice"))
    assert refused.refusal is not None and refused.refusal[0] == 403 and b"<Code>AccessDenied</Code>" in \
        refused.refusal[2]
    head = call("HEAD", f"/{bucket}/{keys.update_key(RUN, 0, 'alice')}", "participant-alice")
    verdict = check.before(head)
    assert verdict.refusal is None
    replaced = check.after(head, verdict, 404)
    assert replaced is not None and replaced[0] == 403 and replaced[2] == b""
    tick_head = call("HEAD", f"/{bucket}/{keys.latest_checkpoint_key(RUN)}", "function-tick")
    assert check.after(tick_head, check.before(tick_head), 404) is None  # the tick may list: a plain 404
    body = json.dumps({"TableName": table_name(RUN), "Key": {"pk": {"S": f"run#{RUN}"}, "sk": {"S": "x"}}}).encode()
    refused = check.before(call("POST", "/", "participant-alice", "dynamodb", "DynamoDB_20120810.DeleteItem", body))
    assert refused.refusal is not None and b"AccessDeniedException" in refused.refusal[2]


def test_requests_are_read_as_iam_reads_them() -> None:
    def needs(c: HttpCall) -> list[tuple[str, str, dict[str, object]]]:
        return [(n.action, n.resource, dict(n.context)) for n in parse(c, ACCOUNT).needs]

    assert needs(call("GET", "/b/k/x", "k", query="versionId=3")) == [("s3:GetObjectVersion", "arn:aws:s3:::b/k/x", {})]
    assert needs(call("GET", "/b", "k", query="list-type=2&prefix=runs%2F")) == [
        ("s3:ListBucket", "arn:aws:s3:::b", {"s3:prefix": "runs/"})]
    assert needs(call("GET", "/b", "k", query="versions&prefix=a")) == [
        ("s3:ListBucketVersions", "arn:aws:s3:::b", {"s3:prefix": "a"})]
    assert needs(call("DELETE", "/b/k", "k", query="uploadId=1")) == [("s3:AbortMultipartUpload", "arn:aws:s3:::b/k",
                                                                       {})]
    copy = call("PUT", "/b/dst", "k")
    copy = HttpCall(copy.method, copy.host, copy.path, "", {**copy.headers, "x-amz-copy-source": "b/src?versionId=7"})
    assert needs(copy) == [("s3:PutObject", "arn:aws:s3:::b/dst", {}),
                           ("s3:GetObjectVersion", "arn:aws:s3:::b/src", {})]
    transaction = {"TransactItems": [
        {"Put": {"TableName": "t", "Item": {"pk": {"S": "run#r"}, "sk": {"S": "a"}}}},
        {"Update": {"TableName": "t", "Key": {"pk": {"S": "run#r"}, "sk": {"S": "b"}}}}]}
    assert [n[0] for n in needs(call("POST", "/", "k", "dynamodb", "DynamoDB_20120810.TransactWriteItems",
                                     json.dumps(transaction).encode()))] == ["dynamodb:PutItem", "dynamodb:UpdateItem"]
    query = {"TableName": "t", "KeyConditionExpression": "#0 = :0", "ExpressionAttributeNames": {"#0": "pk"},
             "ExpressionAttributeValues": {":0": {"S": "run#r"}}}
    assert needs(call("POST", "/", "k", "dynamodb", "DynamoDB_20120810.Query", json.dumps(query).encode())) == [
        ("dynamodb:Query", f"arn:aws:dynamodb:us-east-1:{ACCOUNT}:table/t", {"dynamodb:LeadingKeys": ["run#r"]})]
    subscribe = call("POST", "/", "k", "sns", body=b"Action=Subscribe&TopicArn=arn%3Aaws%3Asns%3Aus-east-1%3A1%3At"
                     b"&Protocol=sqs&Endpoint=arn%3Aaws%3Asqs%3Aus-east-1%3A1%3Aq")
    assert needs(subscribe) == [("sns:Subscribe", "arn:aws:sns:us-east-1:1:t",
                                 {"sns:Protocol": "sqs", "sns:Endpoint": "arn:aws:sqs:us-east-1:1:q"})]


def coordinator_keys(round_no: int, digest: str) -> list[str]:
    """Every object only the coordinator writes (a shard's outcome too: its last segment is six digits)."""
    return [keys.global_key(RUN, round_no, digest), keys.staging_key(RUN, round_no, digest),
            keys.shard_result_key(RUN, round_no, digest, round_no % 1000), keys.optimizer_key(RUN, round_no, digest),
            keys.delta_key(RUN, round_no, digest), keys.roster_key(RUN, digest), keys.manifest_key(RUN),
            keys.config_key(RUN), keys.checkpoint_global_key(RUN, round_no), keys.checkpoint_state_key(RUN, round_no),
            keys.checkpoint_optimizer_key(RUN, round_no, digest), keys.latest_checkpoint_key(RUN)]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pid=st.from_regex(keys.PARTICIPANT_ID_PATTERN, fullmatch=True) | st.from_regex(r"[0-9]{6}", fullmatch=True),
       round_no=st.integers(0, 999_999), digest=st.text("0123456789abcdef", min_size=64, max_size=64))
def test_no_participant_session_may_write_any_coordinator_object(check: AccessControl, pid: str, round_no: int,
                                                                 digest: str) -> None:
    # Given any participant id a session tag may carry (the trust policy refuses reserved names)
    assume(pid.lower() not in keys.RESERVED_IDS)
    # Then, as IAM judges it, no coordinator object is writable by it, nor can it abort the coordinator's uploads
    for key in coordinator_keys(round_no, digest):
        for action in ("s3:PutObject", "s3:AbortMultipartUpload"):
            assert not allowed(check, f"participant:{pid}", action, obj(key)), (pid, action, key)
    # And its own update is
    assert allowed(check, f"participant:{pid}", "s3:PutObject", obj(keys.update_key(RUN, round_no, pid)))


def test_a_participant_uses_its_own_queue_only_and_only_the_ticks_publish(check: AccessControl) -> None:
    # (the policy variable sits in an SQS ARN, which has no resource type: the evaluator's split is patched for it)
    def queue(name: str) -> str:
        return f"arn:aws:sqs:us-east-1:{ACCOUNT}:{name}"

    topic = f"arn:aws:sns:us-east-1:{ACCOUNT}:fed-{RUN}-state"
    for action in ("sqs:CreateQueue", "sqs:ReceiveMessage", "sqs:DeleteQueue"):
        assert allowed(check, "participant:alice", action, queue(f"fed-{RUN}-p-alice")), action
        assert not allowed(check, "participant:alice", action, queue(f"fed-{RUN}-p-bob")), action
        assert not allowed(check, "participant:alice", action, queue(f"fed-{RUN}-ingest")), action
    own = {"sns:Protocol": "sqs", "sns:Endpoint": queue(f"fed-{RUN}-p-alice")}
    assert allowed(check, "participant:alice", "sns:Subscribe", topic, **own)
    assert not allowed(check, "participant:alice", "sns:Subscribe", topic,
                       **{**own, "sns:Endpoint": queue(f"fed-{RUN}-p-bob")})
    assert not allowed(check, "participant:alice", "sns:Subscribe", topic, **{**own, "sns:Protocol": "https"})
    assert allowed(check, "function:tick", "sns:Publish", topic)
    assert not allowed(check, "function:join", "sns:Publish", topic)  # the topic's own policy refuses it
    assert not allowed(check, "participant:alice", "sns:Publish", topic)


@pytest.mark.access_denied_expected
def test_a_participant_reads_a_403_on_its_own_missing_key_as_missing(harness: Harness) -> None:
    # Given a run judged as IAM judges it, and a participant's view of the bucket
    harness.start(["alice", "bob"])
    client = boto3.client("s3", region_name="us-east-1")
    missing = keys.update_key(harness.config.run_id, 7, "alice")
    with acting_as(participant("alice")):
        # When it looks for its own update of a round it has not uploaded
        # Then S3 answers 403 (it may not list the bucket), which its bucket reads as "not there"
        with pytest.raises(ClientError) as refused:
            Bucket(harness.res.bucket, client).head(missing)
        assert refused.value.response["Error"]["Code"] == "403"
        assert Bucket(harness.res.bucket, client, unlisted=True).head(missing) is None
        with pytest.raises(NotFound):
            Bucket(harness.res.bucket, client, unlisted=True).get(keys.delta_key(harness.config.run_id, 7, "a" * 64))
        # And one it may not read at all is still refused (a 403 on another's key is not "missing")
        with pytest.raises(ClientError):
            Bucket(harness.res.bucket, client, unlisted=True).put(keys.heartbeat_key(harness.config.run_id, "bob"),
                                                                  b"{}")
    # And the coordinator, which may list its bucket, gets a plain 404
    with acting_as(function("tick")):
        assert Bucket(harness.res.bucket, client).head(missing) is None
