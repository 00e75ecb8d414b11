"""The synthesized stack has each property issue 3 asks for (Template assertions, one stack per session)."""

from __future__ import annotations

import fnmatch
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aws_cdk import App
from aws_cdk.assertions import Match, Template
from cdk_nag import AwsSolutionsChecks
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from functions.observability import metrics as function_metrics
from infra.app import build_app
from infra.observability import METRICS_SERVICE, SHARD_DURATION_ALARM_SHARE
from infra.participants import FORBIDDEN_IN_ID, QUEUE_ACTIONS
from shared import keys
from shared.keys import RESERVED_IDS
from shared.naming import (
    ENV_BUCKET,
    ENV_CONFIG,
    ENV_RUN_ID,
    ENV_SHARD_RUNNER,
    ENV_SHARD_WAIT,
    ENV_STATE_TOPIC,
    ENV_TABLE,
    METRIC_AGGREGATION_SECONDS,
    METRIC_PHASE_CHANGES,
    METRIC_ROUND,
    METRIC_ROUND_SECONDS,
    METRIC_UPDATES_ACCEPTED,
    METRIC_UPDATES_REFUSED,
    METRICS_NAMESPACE,
    OUTPUT_BUCKET,
    OUTPUT_PARTICIPANT_ROLE,
    OUTPUT_RUN_ID,
    OUTPUT_STATE_TOPIC,
    OUTPUT_TABLE,
    PARTICIPANT_TAG,
    TABLE_HASH_KEY,
    TABLE_RANGE_KEY,
    TICK_SCHEDULE_MINUTES,
    ingest_queue_name,
    ingest_rule_name,
    join_queue_name,
    join_request_pattern,
    join_rule_name,
    object_created_pattern,
    participant_queue_name,
    state_topic_name,
    tick_rule_name,
)
from shared.table_keys import run_pk
from tests.infrastructure.conftest import cdk_json_context

if TYPE_CHECKING:
    from tests.infrastructure.conftest import Synth

SELF = f"${{aws:PrincipalTag/{PARTICIPANT_TAG}}}"


def render(value: Any) -> Any:
    """A CloudFormation value as a string to compare: `<Logical.Attr>` for GetAtt, `<Logical>` for Ref."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and "Fn::GetAtt" in value:
        logical, attr = value["Fn::GetAtt"]
        return f"<{logical}.{attr}>"
    if isinstance(value, dict) and "Ref" in value:
        return f"<{value['Ref']}>"
    if isinstance(value, dict) and "Fn::Join" in value:
        sep, parts = value["Fn::Join"]
        return sep.join(render(p) for p in parts)
    raise AssertionError(f"unexpected value {value!r}")


def as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


def role_statements(synth: Synth, role_id: str) -> list[dict[str, Any]]:
    """Every statement granted to a role: its inline policies and the policies attached to it."""
    role = synth.resources[role_id]["Properties"]
    assert "ManagedPolicyArns" not in role, "no managed policies: each role holds only what it uses"
    documents = [p["PolicyDocument"] for p in role.get("Policies", [])]
    for policy in synth.of_type("AWS::IAM::Policy").values():
        if {"Ref": role_id} in policy["Properties"]["Roles"]:
            documents.append(policy["Properties"]["PolicyDocument"])
    return [s for d in documents for s in d["Statement"]]


def grants(statements: list[dict[str, Any]]) -> dict[str, set[str]]:
    """action -> the resources an Allow statement names for it (rendered); what a Deny takes back is judged by the
    access check's evaluator (tests/functional/test_access_check.py), never by a matcher of ours."""
    out: dict[str, set[str]] = {}
    for s in statements:
        if s["Effect"] != "Allow":
            continue
        for action in as_list(s["Action"]):
            out.setdefault(action, set()).update(render(r) for r in as_list(s["Resource"]))
    return out


def function_id(synth: Synth, handler: str) -> str:
    (fid,) = [k for k, v in synth.of_type("AWS::Lambda::Function").items() if v["Properties"]["Handler"] == handler]
    return fid


def function_role(synth: Synth, name: str) -> str:
    """The logical id of the role function `name` runs as."""
    return str(synth.resources[function_id(synth, f"functions.{name}.handler")]["Properties"]["Role"]["Fn::GetAtt"][0])


def own_log_group(synth: Synth, role_id: str) -> str:
    (log_group,) = [k for k in synth.of_type("AWS::Logs::LogGroup") if k.startswith(role_id.split("Role")[0])]
    return log_group


def test_bucket_notifies_eventbridge_without_a_custom_resource(synth: Synth) -> None:
    # Given the synthesized stack
    # When we look for custom resources and Lambda functions
    types = {v["Type"] for v in synth.resources.values()}
    functions = synth.of_type("AWS::Lambda::Function")
    # Then there is no notification custom resource, no custom resource at all, only our five functions
    assert "Custom::S3BucketNotifications" not in types
    assert not [t for t in types if t.startswith("Custom::") or t == "AWS::CloudFormation::CustomResource"]
    assert sorted(f["Properties"]["Handler"] for f in functions.values()) == [
        "functions.credentials.handler",
        "functions.ingest.handler",
        "functions.join.handler",
        "functions.shard.handler",
        "functions.tick.handler",
    ]
    # And the run bucket sends its events to EventBridge through its own property
    synth.template.has_resource_properties(
        "AWS::S3::Bucket",
        {"NotificationConfiguration": {"EventBridgeConfiguration": {"EventBridgeEnabled": True}}},
    )


def test_run_bucket_is_private_encrypted_versioned_logged_and_expires_round_objects(synth: Synth) -> None:
    # Given the run bucket and its access-log bucket
    bucket_id = synth.logical_id(synth.stack.storage.bucket)
    logs_id = synth.logical_id(synth.stack.storage.access_logs)
    bucket = synth.resources[bucket_id]["Properties"]
    # Then public access is blocked, objects are encrypted and versioned, access is logged
    assert bucket["PublicAccessBlockConfiguration"] == dict.fromkeys(
        ["BlockPublicAcls", "BlockPublicPolicy", "IgnorePublicAcls", "RestrictPublicBuckets"], True
    )
    assert bucket["BucketEncryption"]["ServerSideEncryptionConfiguration"][0]["ServerSideEncryptionByDefault"]
    assert bucket["VersioningConfiguration"] == {"Status": "Enabled"}
    assert bucket["LoggingConfiguration"]["DestinationBucketName"] == {"Ref": logs_id}
    # And old round objects expire after the configured days, overwritten versions and stale uploads too
    rules = {r["Id"]: r for r in bucket["LifecycleConfiguration"]["Rules"]}
    assert rules["expire-round-objects"]["Prefix"] == f"runs/{synth.config.run_id}/rounds/"
    assert rules["expire-round-objects"]["ExpirationInDays"] == synth.settings.round_objects_expire_days
    assert rules["expire-overwritten-versions"]["NoncurrentVersionExpiration"]["NoncurrentDays"] >= 1
    assert rules["abort-incomplete-uploads"]["AbortIncompleteMultipartUpload"]["DaysAfterInitiation"] >= 1
    # And only TLS requests are allowed
    synth.template.has_resource_properties(
        "AWS::S3::BucketPolicy",
        {
            "Bucket": {"Ref": bucket_id},
            "PolicyDocument": {
                "Statement": Match.array_with(
                    [Match.object_like({"Effect": "Deny", "Condition": {"Bool": {"aws:SecureTransport": "false"}}})]
                )
            },
        },
    )


def test_table_is_on_demand_with_point_in_time_recovery(synth: Synth) -> None:
    # Given the run's table
    (table,) = synth.of_type("AWS::DynamoDB::Table").values()
    props = table["Properties"]
    # Then CloudFormation names it (the functions read the name from their environment, participants from the
    # stack's outputs), and its keys are the ones the local run and the functions use
    assert "TableName" not in props
    assert props["KeySchema"] == [
        {"AttributeName": TABLE_HASH_KEY, "KeyType": "HASH"},
        {"AttributeName": TABLE_RANGE_KEY, "KeyType": "RANGE"},
    ]
    assert {a["AttributeName"]: a["AttributeType"] for a in props["AttributeDefinitions"]} == {
        TABLE_HASH_KEY: "S",
        TABLE_RANGE_KEY: "S",
    }
    # And it is on demand, recoverable to a point in time, deletion protection as configured
    assert props["BillingMode"] == "PAY_PER_REQUEST"
    assert props["PointInTimeRecoverySpecification"] == {"PointInTimeRecoveryEnabled": True}
    assert props["DeletionProtectionEnabled"] is synth.settings.table_deletion_protection


RETAINING = {"Retain", "RetainExceptOnCreate", "Snapshot"}


def test_no_resource_the_stack_leaves_behind_holds_a_fixed_name(synth: Synth) -> None:
    # Given the resources a deleted stack leaves behind (data kept: the bucket, its access logs, the table, the
    # functions' logs), and those a replacement leaves behind
    kept = {rid: r for rid, r in synth.resources.items()
            if r.get("DeletionPolicy") in RETAINING or r.get("UpdateReplacePolicy") in RETAINING}
    assert {r["Type"] for r in kept.values()} >= {"AWS::S3::Bucket", "AWS::DynamoDB::Table", "AWS::Logs::LogGroup"}
    # Then none has a name of ours: CloudFormation names each, so the same run deployed again after `cdk destroy`
    # (or a replacement) makes new ones beside them instead of failing on a name they still hold
    named = {rid: [p for p in r.get("Properties", {}) if p.endswith("Name")] for rid, r in kept.items()}
    assert not {rid: props for rid, props in named.items() if props}, named


def test_each_function_role_holds_only_what_the_function_uses(synth: Synth) -> None:
    # Given the two functions' roles (both tick: ingest ticks after recording, and either may aggregate)
    bucket = f"<{synth.logical_id(synth.stack.storage.bucket)}.Arn>"
    table = f"<{synth.logical_id(synth.stack.state.table)}.Arn>"
    dlq = f"<{synth.logical_id(synth.stack.coordinator.dead_letters)}.Arn>"
    shard_queue = f"<{synth.logical_id(synth.stack.coordinator.shard_queue)}.Arn>"
    tick_rule = (f"arn:<AWS::Partition>:events:<AWS::Region>:<AWS::AccountId>:rule/"
                 f"{tick_rule_name(synth.config.run_id)}")
    topic = f"<{synth.logical_id(synth.stack.notifications.topic)}>"
    run = f"{bucket}/runs/{synth.config.run_id}/"
    roles = {function_role(synth, n) for n in ("tick", "ingest", "join", "shard")}
    assert len(roles) == 4, "each function has its own role"
    for role_id in (function_role(synth, "tick"), function_role(synth, "ingest")):
        log_group = own_log_group(synth, role_id)
        # When we gather every statement granted to it
        allowed = grants(role_statements(synth, role_id))
        # Then it may do exactly this, on exactly these resources: read the run's objects (the staged aggregate
        # too: the source of its copy), write the coordinator's objects and the staged aggregate (and abort it),
        # send shard tasks to the shard queue (and failed events to the dead letters), publish state changes to
        # the run's state topic, switch this run's tick schedule on and off, and nothing else
        assert allowed == {
            "logs:CreateLogStream": {f"<{log_group}.Arn>"},
            "logs:PutLogEvents": {f"<{log_group}.Arn>"},
            "s3:GetObject": {f"{run}*"},
            "s3:GetObjectVersion": {f"{run}*"},
            "s3:ListBucket": {bucket},
            "s3:ListBucketVersions": {bucket},
            "s3:PutObject": {
                f"{run}rounds/*/global/*",
                f"{run}rounds/*/optimizer/*",
                f"{run}rounds/*/delta/*",
                f"{run}roster/*",
                f"{run}manifest.json",
                f"{run}config.json",
                f"{run}checkpoints/*",
                f"{run}rounds/*/staging/*",
            },
            "s3:AbortMultipartUpload": {f"{run}rounds/*/staging/*"},
            "dynamodb:GetItem": {table},
            "dynamodb:Query": {table},
            "dynamodb:PutItem": {table},
            "dynamodb:UpdateItem": {table},
            "dynamodb:DeleteItem": {table},
            "sqs:SendMessage": {dlq, shard_queue},
            "sns:Publish": {topic},
            "events:EnableRule": {tick_rule},
            "events:DisableRule": {tick_rule},
        }
        # And listing is of the run's own bucket, with no s3:prefix condition (S3's 404 for a missing key must not
        # depend on whether it judges that ListBucket with the key as the prefix: undocumented)
        (listing,) = [s for s in role_statements(synth, role_id) if "s3:ListBucket" in s["Action"]]
        assert "Condition" not in listing


def test_functions_run_the_configured_sizes_with_the_run_config(synth: Synth) -> None:
    for name, fn_settings in (("tick", synth.settings.tick), ("ingest", synth.settings.ingest)):
        # Given a function
        fn = synth.resources[function_id(synth, f"functions.{name}.handler")]["Properties"]
        # Then it runs the latest Python runtime with the sizes of its [deploy] table
        assert fn["Runtime"] == "python3.14"
        assert fn["MemorySize"] == fn_settings.memory_mb
        assert fn["Timeout"] == fn_settings.timeout_seconds
        assert fn["EphemeralStorage"] == {"Size": fn_settings.ephemeral_storage_mb}
        # And it reads the whole run config, the run id, bucket and table from its environment
        env = fn["Environment"]["Variables"]
        assert json.loads(env[ENV_CONFIG]) == json.loads(synth.config.model_dump_json())
        assert env[ENV_RUN_ID] == synth.config.run_id
        assert env[ENV_BUCKET] == {"Ref": synth.logical_id(synth.stack.storage.bucket)}
        assert env[ENV_TABLE] == {"Ref": synth.logical_id(synth.stack.state.table)}
        assert env["POWERTOOLS_METRICS_NAMESPACE"] == METRICS_NAMESPACE
        # And it hands an aggregation's shards to the shard queue, and waits for them a little less than it may run
        queue = synth.logical_id(synth.stack.coordinator.shard_queue)
        assert env[ENV_SHARD_RUNNER] == {"Fn::Join": ["", ["queue:", {"Ref": queue}]]}
        assert env[ENV_SHARD_WAIT] == str(max(30, fn_settings.timeout_seconds - 30))
        # And it publishes the state changes it commits to the run's state topic
        assert env[ENV_STATE_TOPIC] == {"Ref": synth.logical_id(synth.stack.notifications.topic)}
        # And failed async events go to the dead-letter queue, logs are kept for the configured days
        dlq = synth.logical_id(synth.stack.coordinator.dead_letters)
        assert render(fn["DeadLetterConfig"]["TargetArn"]) == f"<{dlq}.Arn>"
        log_group = synth.resources[fn["LoggingConfig"]["LogGroup"]["Ref"]]["Properties"]
        assert log_group["RetentionInDays"] == synth.settings.log_retention_days
    synth.template.resource_count_is("AWS::Lambda::EventInvokeConfig", 2)
    synth.template.has_resource_properties(
        "AWS::Lambda::EventInvokeConfig",
        {"MaximumRetryAttempts": synth.settings.ingest.retry_attempts,
         "MaximumEventAgeInSeconds": synth.settings.ingest.max_event_age_seconds},
    )  # fmt: skip


def participant_role(synth: Synth) -> dict[str, Any]:
    return synth.resources[synth.logical_id(synth.stack.participants.role)]["Properties"]


def test_participants_assume_the_role_only_with_their_id_as_session_tag(synth: Synth) -> None:
    # Given the participant role's trust policy
    trust = participant_role(synth)["AssumeRolePolicyDocument"]["Statement"]
    # (the credential endpoint's own statement, on the same conditions, is test_hosts.py's)
    allow = [s for s in trust if s["Effect"] == "Allow" and s.get("Sid") != "CredentialEndpoint"]
    deny = [s for s in trust if s["Effect"] == "Deny"]
    # Then assuming it needs exactly one session tag, the participant id, and sts:TagSession is allowed
    assert len(allow) == 1
    assert sorted(allow[0]["Action"]) == ["sts:AssumeRole", "sts:TagSession"]
    assert allow[0]["Condition"] == {
        "StringLike": {f"aws:RequestTag/{PARTICIPANT_TAG}": "?*"},
        "ForAllValues:StringEquals": {"aws:TagKeys": [PARTICIPANT_TAG]},
    }
    # And reserved names and characters no participant id has are refused as the tag's value
    refused = {json.dumps(s["Condition"], sort_keys=True) for s in deny}
    assert json.dumps({"StringEqualsIgnoreCase": {f"aws:RequestTag/{PARTICIPANT_TAG}": sorted(RESERVED_IDS)}},
                      sort_keys=True) in refused  # fmt: skip
    assert json.dumps({"StringLike": {f"aws:RequestTag/{PARTICIPANT_TAG}": list(FORBIDDEN_IN_ID)}},
                      sort_keys=True) in refused  # fmt: skip
    assert all(sorted(s["Action"]) == ["sts:AssumeRole", "sts:TagSession"] for s in deny)


def test_participant_policy_writes_only_keys_carrying_its_own_id(synth: Synth) -> None:
    # Given the participant role's permissions
    role_id = synth.logical_id(synth.stack.participants.role)
    statements = role_statements(synth, role_id)
    bucket = f"<{synth.logical_id(synth.stack.storage.bucket)}.Arn>"
    run = f"{bucket}/runs/{synth.config.run_id}/"
    table = f"<{synth.logical_id(synth.stack.state.table)}.Arn>"
    queue = own_queue(synth)
    topic = f"<{synth.logical_id(synth.stack.notifications.topic)}>"
    # Then it may write only its own join, init, heartbeat and update keys, read global models, manifest,
    # the published config and its own updates, read the run's items of the table and this stack's
    # outputs, use its own push queue and subscribe it to the run-state topic, and nothing else
    assert grants(statements) == {
        "s3:PutObject": {f"{run}join/{SELF}", f"{run}init/{SELF}", f"{run}heartbeat/{SELF}", f"{run}rounds/*/{SELF}"},
        "s3:AbortMultipartUpload": {f"{run}join/{SELF}", f"{run}init/{SELF}", f"{run}heartbeat/{SELF}",
                                    f"{run}rounds/*/{SELF}"},
        "s3:GetObject": {f"{run}rounds/*/global/*", f"{run}rounds/*/delta/*", f"{run}roster/*",
                         f"{run}manifest.json", f"{run}config.json", f"{run}rounds/*/{SELF}"},
        "s3:GetObjectVersion": {f"{run}rounds/*/{SELF}"},  # (its own upload read back by version after a restart)
        "dynamodb:GetItem": {table},
        "cloudformation:DescribeStacks": {"<AWS::StackId>"},
        **{action: {queue} for action in QUEUE_ACTIONS},
        "sns:Subscribe": {topic},
    }  # fmt: skip
    # And the writes hold only for a session tagged with a usable id
    (write,) = [s for s in statements if "s3:PutObject" in as_list(s["Action"]) and s["Effect"] == "Allow"]
    tag = f"aws:PrincipalTag/{PARTICIPANT_TAG}"
    assert write["Condition"] == {
        "Null": {tag: "false"},
        "StringNotEqualsIgnoreCase": {tag: sorted(RESERVED_IDS)},
        "StringNotLike": {tag: list(FORBIDDEN_IN_ID)},
    }
    # And reads of the table are limited to the run's partition
    (read_state,) = [s for s in statements if s["Action"] == "dynamodb:GetItem"]
    assert read_state["Condition"] == {
        "ForAllValues:StringEquals": {"dynamodb:LeadingKeys": [run_pk(synth.config.run_id)]}
    }


def s3_rules(synth: Synth) -> dict[str, dict[str, Any]]:
    """The rules routing S3 events, by name."""
    rules = synth.of_type("AWS::Events::Rule").values()
    return {r["Properties"]["Name"]: r["Properties"] for r in rules if "EventPattern" in r["Properties"]}


def test_object_created_rule_uses_the_local_runs_pattern_and_targets_ingest(synth: Synth) -> None:
    # Given the run bucket's logical id
    bucket = {"Ref": synth.logical_id(synth.stack.storage.bucket)}
    run = synth.config.run_id
    # When we find the rules routing S3 events
    rules = s3_rules(synth)
    # Then there are two lanes, and the main one's pattern is exactly the one the local run registers
    assert set(rules) == {ingest_rule_name(run), join_rule_name(run)}
    rule = rules[ingest_rule_name(run)]
    assert rule["EventPattern"] == object_created_pattern(bucket, run)  # type: ignore[arg-type]
    # And it excludes join requests and every key the coordinator writes, and nothing else
    not_uploads = [f"{keys.join_prefix(run)}*", *keys.coordinator_key_patterns(run)]
    assert rule["EventPattern"]["detail"]["object"]["key"] == [{"anything-but": {"wildcard": not_uploads}}]
    # And it invokes the ingest function, with undeliverable events kept in the dead-letter queue
    (target,) = rule["Targets"]
    assert target["Arn"] == {"Fn::GetAtt": [function_id(synth, "functions.ingest.handler"), "Arn"]}
    assert "DeadLetterConfig" in target


def test_join_requests_have_their_own_rule_and_queue_drained_at_a_bounded_concurrency(synth: Synth) -> None:
    # Given the join lane's rule, queue and function
    bucket = {"Ref": synth.logical_id(synth.stack.storage.bucket)}
    run = synth.config.run_id
    rule = s3_rules(synth)[join_rule_name(run)]
    queue_id = synth.logical_id(synth.stack.coordinator.join_queue)
    dlq = synth.logical_id(synth.stack.coordinator.dead_letters)
    join_fn = function_id(synth, "functions.join.handler")
    # Then the rule takes exactly the join requests (the local run registers the same pattern), to the queue,
    # undeliverable ones to the dead-letter queue
    assert rule["EventPattern"] == join_request_pattern(bucket, run)  # type: ignore[arg-type]
    assert rule["EventPattern"]["detail"]["object"]["key"] == [{"prefix": keys.join_prefix(run)}]
    (target,) = rule["Targets"]
    assert target["Arn"] == {"Fn::GetAtt": [queue_id, "Arn"]}
    assert render(target["DeadLetterConfig"]["Arn"]) == f"<{dlq}.Arn>"
    # And the queue is encrypted, TLS only, and moves a join request that keeps failing to the dead-letter queue
    queue = synth.resources[queue_id]["Properties"]
    assert queue["SqsManagedSseEnabled"] is True
    assert queue["RedrivePolicy"] == {"deadLetterTargetArn": {"Fn::GetAtt": [dlq, "Arn"]},
                                      "maxReceiveCount": synth.settings.join_max_receives}
    assert queue["RedrivePolicy"]["maxReceiveCount"] >= 5  # Lambda's advice, as for the shard queue
    assert queue["VisibilityTimeout"] == 6 * synth.settings.join.timeout_seconds
    # And only the join function drains it, at most join_concurrency invocations at once, reporting failures
    # record by record
    (mapping,) = [m for m in synth.of_type("AWS::Lambda::EventSourceMapping").values()
                  if m["Properties"]["FunctionName"] == {"Ref": join_fn}]
    props = mapping["Properties"]
    assert props["EventSourceArn"] == {"Fn::GetAtt": [queue_id, "Arn"]}
    assert props["ScalingConfig"] == {"MaximumConcurrency": synth.settings.join_concurrency}
    assert synth.settings.join_concurrency == 2
    assert props["BatchSize"] == synth.settings.join_batch_size
    assert props["FunctionResponseTypes"] == ["ReportBatchItemFailures"]
    # And the join function is invoked by its queue alone: no EventBridge permission, no async retries
    fn = synth.resources[join_fn]["Properties"]
    assert fn["MemorySize"] == synth.settings.join.memory_mb and fn["Timeout"] == synth.settings.join.timeout_seconds
    assert "DeadLetterConfig" not in fn
    permissions = synth.of_type("AWS::Lambda::Permission").values()
    assert all(p["Properties"]["FunctionName"] != {"Fn::GetAtt": [join_fn, "Arn"]} for p in permissions)


def test_the_join_function_reads_only_join_requests_and_heartbeats_and_writes_only_participants(
    synth: Synth,
) -> None:
    # Given the join function's role
    bucket = f"<{synth.logical_id(synth.stack.storage.bucket)}.Arn>"
    table = f"<{synth.logical_id(synth.stack.state.table)}.Arn>"
    queue = f"<{synth.logical_id(synth.stack.coordinator.join_queue)}.Arn>"
    run = f"{bucket}/runs/{synth.config.run_id}/"
    role_id = synth.resources[function_id(synth, "functions.join.handler")]["Properties"]["Role"]["Fn::GetAtt"][0]
    (log_group,) = [k for k in synth.of_type("AWS::Logs::LogGroup") if k.startswith(role_id.split("Role")[0])]
    # When we gather every statement granted to it
    allowed = grants(role_statements(synth, role_id))
    # Then it may read join requests and heartbeats, write participant records and drain its queue: no model,
    # no other object, no run state it could commit
    assert allowed == {
        "logs:CreateLogStream": {f"<{log_group}.Arn>"},
        "logs:PutLogEvents": {f"<{log_group}.Arn>"},
        "s3:GetObject": {f"{run}join/*", f"{run}heartbeat/*"},
        "s3:GetObjectVersion": {f"{run}join/*", f"{run}heartbeat/*"},
        "s3:ListBucket": {bucket},
        "dynamodb:GetItem": {table},
        "dynamodb:PutItem": {table},
        "dynamodb:UpdateItem": {table},
        "sqs:ReceiveMessage": {queue},
        "sqs:ChangeMessageVisibility": {queue},
        "sqs:GetQueueUrl": {queue},
        "sqs:DeleteMessage": {queue},
        "sqs:GetQueueAttributes": {queue},
    }


def test_the_shard_worker_runs_the_configured_size_and_is_fed_only_by_the_ticks_queue(synth: Synth) -> None:
    # Given the shard-worker function
    shard = function_id(synth, "functions.shard.handler")
    fn = synth.resources[shard]["Properties"]
    # Then it runs the shared code asset with the sizes of [deploy.shard]
    tick = synth.resources[function_id(synth, "functions.tick.handler")]["Properties"]
    assert fn["Code"] == tick["Code"] and fn["Runtime"] == tick["Runtime"]
    assert fn["MemorySize"] == synth.settings.shard.memory_mb == 3008
    assert fn["Timeout"] == synth.settings.shard.timeout_seconds == 600
    # (its own concurrency, so that no flood of ingest invocations can throttle an aggregation's workers)
    assert fn["ReservedConcurrentExecutions"] == synth.settings.shard.reserved_concurrency == 64
    # And it reads the run's names and config from its environment, but hands no shards on itself
    env = fn["Environment"]["Variables"]
    assert json.loads(env[ENV_CONFIG]) == json.loads(synth.config.model_dump_json())
    assert env[ENV_RUN_ID] == synth.config.run_id
    assert ENV_SHARD_RUNNER not in env
    # And it is fed by the shard queue alone: no asynchronous invocation (no dead-letter config of its own, no async
    # settings), no EventBridge trigger, and no role may invoke it directly
    assert "DeadLetterConfig" not in fn
    configs = synth.of_type("AWS::Lambda::EventInvokeConfig").values()
    assert all(c["Properties"]["FunctionName"] != {"Ref": shard} for c in configs)
    permissions = synth.of_type("AWS::Lambda::Permission").values()
    assert all(shard not in json.dumps(p["Properties"]["FunctionName"]) for p in permissions)
    assert all(shard not in json.dumps(r["Properties"].get("Targets", []))
               for r in synth.of_type("AWS::Events::Rule").values())  # fmt: skip
    assert not [r for r in synth.of_type("AWS::IAM::Role")
                if "lambda:InvokeFunction" in grants(role_statements(synth, r))]
    # And the queue is encrypted, TLS only, and follows Lambda's advice for a queue event source: it hides a received
    # task for six times the worker's timeout, and moves a task to the dead-letter queue (alarmed) only after at
    # least five receives (a throttled Lambda hands a task back, and each hand-back counts)
    queue_id = synth.logical_id(synth.stack.coordinator.shard_queue)
    dlq = synth.logical_id(synth.stack.coordinator.dead_letters)
    queue = synth.resources[queue_id]["Properties"]
    assert queue["SqsManagedSseEnabled"] is True
    assert queue["RedrivePolicy"] == {"deadLetterTargetArn": {"Fn::GetAtt": [dlq, "Arn"]},
                                      "maxReceiveCount": synth.settings.shard_max_receives}
    assert queue["RedrivePolicy"]["maxReceiveCount"] >= 5
    visibility = queue["VisibilityTimeout"]
    assert visibility == 6 * synth.settings.shard.timeout_seconds == 3600
    # And it keeps a task until one that kills its worker every time has been dead-lettered, longer than any tick
    # waits for its shards
    waits = [int(synth.resources[function_id(synth, f"functions.{name}.handler")]["Properties"]["Environment"]
                 ["Variables"][ENV_SHARD_WAIT]) for name in ("tick", "ingest")]
    assert queue["MessageRetentionPeriod"] >= synth.settings.shard_max_receives * visibility > max(waits)
    # And the shard worker drains it one task an invocation, at most shard_concurrency at once
    (mapping,) = [m for m in synth.of_type("AWS::Lambda::EventSourceMapping").values()
                  if m["Properties"]["FunctionName"] == {"Ref": shard}]
    props = mapping["Properties"]
    assert props["EventSourceArn"] == {"Fn::GetAtt": [queue_id, "Arn"]}
    assert props["BatchSize"] == 1
    assert props["ScalingConfig"] == {"MaximumConcurrency": synth.settings.shard_concurrency}
    # And exactly the tick and ingest roles may send to it
    senders = {role_id for role_id in synth.of_type("AWS::IAM::Role")
               if f"<{queue_id}.Arn>" in grants(role_statements(synth, role_id)).get("sqs:SendMessage", set())}
    assert senders == {function_role(synth, "tick"), function_role(synth, "ingest")}


def test_the_shard_worker_reads_round_objects_writes_only_staged_parts_and_never_the_table(synth: Synth) -> None:
    # Given the shard worker's role
    bucket = f"<{synth.logical_id(synth.stack.storage.bucket)}.Arn>"
    queue = f"<{synth.logical_id(synth.stack.coordinator.shard_queue)}.Arn>"
    run = f"{bucket}/runs/{synth.config.run_id}/"
    role_id = function_role(synth, "shard")
    log_group = own_log_group(synth, role_id)
    # When we gather every statement granted to it
    statements = role_statements(synth, role_id)
    allowed = grants(statements)
    # Then it may read the run's round objects (updates and globals, by version), list under the rounds, upload
    # parts of staged aggregates (and its shard's outcome beside them), the pieces of the optimizer state and
    # download delta, drain the shard queue, write its logs: nothing else (no table, no other queue or object)
    assert allowed == {
        "logs:CreateLogStream": {f"<{log_group}.Arn>"},
        "logs:PutLogEvents": {f"<{log_group}.Arn>"},
        "s3:GetObject": {f"{run}rounds/*"},
        "s3:GetObjectVersion": {f"{run}rounds/*"},
        "s3:ListBucket": {bucket},
        "s3:ListBucketVersions": {bucket},
        "s3:PutObject": {f"{run}rounds/*/staging/*", f"{run}rounds/*/optimizer/*", f"{run}rounds/*/delta/*"},
        **{f"sqs:{action}": {queue} for action in ("ReceiveMessage", "ChangeMessageVisibility", "GetQueueUrl",
                                                   "DeleteMessage", "GetQueueAttributes")},
    }
    assert not [a for a in allowed if a.startswith("dynamodb:")]
    (listing,) = [s for s in statements if "s3:ListBucket" in as_list(s["Action"])]
    assert "Condition" not in listing  # the run's own bucket: a missing input is a 404, whatever S3's s3:prefix


def layout_keys(run: str, round_no: int, pid: str, digest: str) -> list[str]:
    """Every kind of object of the layout but what a shard worker writes (the staged aggregate, the optimizer
    state's and download delta's pieces), for a participant, a round and a digest."""
    written = {keys.staging_key(run, round_no, digest), keys.optimizer_key(run, round_no, digest),
               keys.delta_key(run, round_no, digest)}
    return [keys.join_key(run, pid), keys.init_key(run, pid), keys.heartbeat_key(run, pid),
            keys.update_key(run, round_no, pid), keys.witness_key(run, round_no, pid),
            keys.health_key(run, round_no, pid),
            *(k for k in coordinator_keys(run, round_no, digest) if k not in written)]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pid=st.from_regex(keys.PARTICIPANT_ID_PATTERN, fullmatch=True), round_no=st.integers(0, 999_999),
       digest=st.text("0123456789abcdef", min_size=64, max_size=64))
def test_the_shard_worker_may_write_staged_aggregates_and_nothing_else_of_the_layout(
    synth: Synth, pid: str, round_no: int, digest: str
) -> None:
    # Given any participant id, round and digest (or job id)
    assume(pid.lower() not in RESERVED_IDS)
    allowed = grants(role_statements(synth, function_role(synth, "shard")))
    bucket, run = f"<{synth.logical_id(synth.stack.storage.bucket)}.Arn>", synth.config.run_id
    # Then the shard worker may upload parts of the round's staged aggregate and its optimizer state's pieces
    assert iam_allows(allowed["s3:PutObject"], bucket, keys.staging_key(run, round_no, digest), pid)
    assert iam_allows(allowed["s3:PutObject"], bucket, keys.optimizer_key(run, round_no, digest), pid)
    assert iam_allows(allowed["s3:PutObject"], bucket, keys.delta_key(run, round_no, digest), pid)
    assert iam_allows(allowed["s3:PutObject"], bucket, keys.shard_result_key(run, round_no, digest, 7), pid)
    # And no other object: no update, report, join request, heartbeat, global model, manifest or checkpoint
    for key in layout_keys(run, round_no, pid, digest):
        assert not iam_allows(allowed["s3:PutObject"], bucket, key, pid), key
    # And it reads the round's objects (updates, globals), none outside the rounds
    assert iam_allows(allowed["s3:GetObject"], bucket, keys.update_key(run, round_no, pid), pid)
    assert iam_allows(allowed["s3:GetObjectVersion"], bucket, keys.global_key(run, round_no, digest), pid)
    for key in (keys.join_key(run, pid), keys.heartbeat_key(run, pid), keys.manifest_key(run),
                keys.latest_checkpoint_key(run)):  # fmt: skip
        assert not iam_allows(allowed["s3:GetObject"], bucket, key, pid), key


def test_a_schedule_invokes_the_tick_function(synth: Synth) -> None:
    # When we find the scheduled rule
    (rule,) = [r["Properties"] for r in synth.of_type("AWS::Events::Rule").values()
               if "ScheduleExpression" in r["Properties"]]  # fmt: skip
    # Then it fires every TICK_SCHEDULE_MINUTES and invokes the tick function
    unit = "minute" if TICK_SCHEDULE_MINUTES == 1 else "minutes"
    assert rule["ScheduleExpression"] == f"rate({TICK_SCHEDULE_MINUTES} {unit})"
    (target,) = rule["Targets"]
    assert target["Arn"] == {"Fn::GetAtt": [function_id(synth, "functions.tick.handler"), "Arn"]}
    # And EventBridge may invoke each function only from its own rule (the credential endpoint's URL, whose
    # permissions admit anyone through that URL, is test_hosts.py's)
    credentials = {"Fn::GetAtt": [function_id(synth, "functions.credentials.handler"), "Arn"]}
    permissions = [p for p in synth.of_type("AWS::Lambda::Permission").values()
                   if p["Properties"]["FunctionName"] != credentials]
    assert sorted(p["Properties"]["Principal"] for p in permissions) == ["events.amazonaws.com"] * 2
    assert all("SourceArn" in p["Properties"] for p in permissions)


def test_outputs_name_what_a_participant_host_needs(synth: Synth) -> None:
    # Given the stack outputs
    outputs = synth.template.to_json()["Outputs"]
    # Then bucket, table, run id and participant role are there under the shared names
    assert outputs[OUTPUT_BUCKET]["Value"] == {"Ref": synth.logical_id(synth.stack.storage.bucket)}
    assert outputs[OUTPUT_TABLE]["Value"] == {"Ref": synth.logical_id(synth.stack.state.table)}
    assert outputs[OUTPUT_RUN_ID]["Value"] == synth.config.run_id
    assert outputs[OUTPUT_PARTICIPANT_ROLE]["Value"] == {
        "Fn::GetAtt": [synth.logical_id(synth.stack.participants.role), "Arn"]
    }
    # And the run-state topic its push queue subscribes to
    assert outputs[OUTPUT_STATE_TOPIC]["Value"] == {"Ref": synth.logical_id(synth.stack.notifications.topic)}


def test_dashboard_and_alarms_watch_the_run(synth: Synth) -> None:
    # Given the dashboard body
    (dashboard,) = synth.of_type("AWS::CloudWatch::Dashboard").values()
    body = json.dumps(dashboard["Properties"]["DashboardBody"])
    # Then it plots every coordinator metric of this run and the functions' errors
    for metric in (METRIC_ROUND, METRIC_PHASE_CHANGES, METRIC_UPDATES_ACCEPTED, METRIC_UPDATES_REFUSED,
                   METRIC_ROUND_SECONDS, METRIC_AGGREGATION_SECONDS):  # fmt: skip
        assert f'\\"{metric}\\"' in body, metric
    assert METRICS_NAMESPACE in body and synth.config.run_id in body and "Errors" in body
    assert "Join lane backlog" in body and "ApproximateAgeOfOldestMessage" in body
    # And the stuck-run alarm looks one configured multiple of the round deadline back
    alarms = synth.of_type("AWS::CloudWatch::Alarm")
    stuck = synth.resources[synth.logical_id(synth.stack.observability.stuck)]["Properties"]
    window = synth.settings.stuck_window_seconds(synth.config)
    assert window == 300  # 2.5 x 120 s
    (round_metric,) = [m for m in stuck["Metrics"] if m.get("MetricStat", {}).get("Metric", {}).get("MetricName")
                       == METRIC_ROUND]  # fmt: skip
    assert round_metric["MetricStat"]["Period"] == window
    assert {"Name": "run", "Value": synth.config.run_id} in round_metric["MetricStat"]["Metric"]["Dimensions"]
    # And every function's errors and the dead-letter queue raise alarms, all sent to the e-mail topic
    error_alarms = [a for a in alarms.values() if a["Properties"].get("MetricName") == "Errors"]
    assert len(error_alarms) == 5  # tick, ingest, join, shard, credentials
    # And the shard worker's throttles and a duration near its timeout raise alarms too, and it has its row
    shard = {"Name": "FunctionName", "Value": {"Ref": function_id(synth, "functions.shard.handler")}}
    throttles = synth.resources[synth.logical_id(synth.stack.observability.shard_throttles)]["Properties"]
    assert throttles["MetricName"] == "Throttles" and throttles["Dimensions"] == [shard]
    assert throttles["Threshold"] == 1
    near = synth.resources[synth.logical_id(synth.stack.observability.shard_near_timeout)]["Properties"]
    assert near["MetricName"] == "Duration" and near["Dimensions"] == [shard] and near["Statistic"] == "Maximum"
    assert near["Threshold"] == SHARD_DURATION_ALARM_SHARE * synth.settings.shard.timeout_seconds * 1000
    assert near["ComparisonOperator"] == "GreaterThanOrEqualToThreshold"
    assert "Shard workers running at once" in body and "ConcurrentExecutions" in body
    assert "Shard duration" in body and "Throttles" in body
    # And ingest, capped by its reserved concurrency, raises an alarm when it is throttled; the tick has its own
    ingest = function_id(synth, "functions.ingest.handler")
    capped = synth.resources[synth.logical_id(synth.stack.observability.ingest_throttles)]["Properties"]
    assert capped["MetricName"] == "Throttles" and capped["Threshold"] == 1
    assert capped["Dimensions"] == [{"Name": "FunctionName", "Value": {"Ref": ingest}}]
    assert synth.resources[ingest]["Properties"]["ReservedConcurrentExecutions"] == 200
    tick = synth.resources[function_id(synth, "functions.tick.handler")]["Properties"]
    assert tick["ReservedConcurrentExecutions"] == 5
    topic = synth.logical_id(synth.stack.observability.topic)
    assert all(a["Properties"]["AlarmActions"] == [{"Ref": topic}] for a in alarms.values())
    synth.template.has_resource_properties(
        "AWS::SNS::Subscription", {"Protocol": "email", "Endpoint": synth.settings.alarm_email}
    )


def test_cdk_nag_aws_solutions_finds_nothing_unacknowledged(synth: Synth) -> None:
    # When the AwsSolutions pack checks the app
    report = AwsSolutionsChecks().validate_scope(synth.app)
    # Then nothing is left unacknowledged
    assert report.success, [(v.rule_name, [r.construct_path for r in v.violating_resources])
                            for v in report.violations]  # fmt: skip
    # And every acknowledgement gives a specific reason
    reasons = [
        (rule, reason)
        for construct in synth.app.node.find_all()
        for entry in construct.node.metadata
        if entry.type == "aws:cdk:acknowledged-rules"
        for rule, reason in entry.data.items()
    ]
    assert reasons, "the stack needs some acknowledgements (IAM5 for prefix wildcards at least)"
    assert all(len(reason) >= 80 for _, reason in reasons), reasons


def test_dashboard_reads_the_dimensions_the_functions_emit() -> None:
    # Given the powertools Metrics object the handlers emit with
    # Then its namespace and service dimension are the ones the dashboard and alarms query
    assert function_metrics.namespace == METRICS_NAMESPACE
    assert function_metrics.service == METRICS_SERVICE


def iam_allows(patterns: set[str], bucket: str, key: str, participant: str) -> bool:
    """IAM's matching of an object ARN: the policy variable becomes the session's tag, `*` spans '/'."""
    arn = f"{bucket}/{key}"
    return any(fnmatch.fnmatchcase(arn, p.replace(SELF, participant)) for p in patterns)


def test_participant_write_patterns_admit_exactly_its_own_keys_of_the_layout(synth: Synth) -> None:
    # Given the participant role's write and read patterns, and keys of the layout for alice, bob and the
    # coordinator
    allowed = grants(role_statements(synth, synth.logical_id(synth.stack.participants.role)))
    bucket, run = f"<{synth.logical_id(synth.stack.storage.bucket)}.Arn>", synth.config.run_id

    def own(pid: str) -> list[str]:
        found = [keys.join_key(run, pid), keys.init_key(run, pid), keys.heartbeat_key(run, pid),
                 keys.update_key(run, 3, pid)]  # fmt: skip
        for name in ("witness_key", "health_key"):  # reports about a round, where the layout has them
            if hasattr(keys, name):
                found.append(getattr(keys, name)(run, 3, pid))
        return found

    coordinators = [keys.global_key(run, 3, "ab" * 32), keys.delta_key(run, 3, "cd" * 32), keys.manifest_key(run),
                    keys.config_key(run), keys.roster_key(run, "ef" * 32)]
    # When alice's session asks to write them
    # Then it may write each of its own keys, none of bob's and none of the coordinator's
    assert all(iam_allows(allowed["s3:PutObject"], bucket, k, "alice") for k in own("alice"))
    assert not any(
        iam_allows(allowed["s3:PutObject"], bucket, k, "alice") for k in own("bob") + own("xalice") + coordinators
    )
    # And it may read global models, download deltas, rosters, manifest, config and its own update, but not bob's
    readable = [*coordinators, keys.update_key(run, 3, "alice")]
    assert all(iam_allows(allowed["s3:GetObject"], bucket, k, "alice") for k in readable)
    assert not iam_allows(allowed["s3:GetObject"], bucket, keys.update_key(run, 3, "bob"), "alice")
    assert not iam_allows(allowed["s3:GetObject"], bucket, keys.join_key(run, "bob"), "alice")


def coordinator_keys(run: str, round_no: int, digest: str) -> list[str]:
    """Every object only the coordinator writes, and reads back (the staged aggregate too: its job id is a digest)."""
    return [keys.global_key(run, round_no, digest), keys.staging_key(run, round_no, digest), keys.manifest_key(run),
            keys.optimizer_key(run, round_no, digest), keys.checkpoint_optimizer_key(run, round_no, digest),
            keys.delta_key(run, round_no, digest), keys.roster_key(run, digest), keys.config_key(run),
            keys.checkpoint_global_key(run, round_no),
            keys.checkpoint_state_key(run, round_no), keys.latest_checkpoint_key(run)]  # fmt: skip


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pid=st.from_regex(keys.PARTICIPANT_ID_PATTERN, fullmatch=True), round_no=st.integers(0, 999_999),
       digest=st.text("0123456789abcdef", min_size=64, max_size=64))
def test_no_participant_session_may_write_any_coordinator_object(
    synth: Synth, pid: str, round_no: int, digest: str
) -> None:
    # Given any participant id a session tag may carry (the trust policy refuses reserved names)
    assume(pid.lower() not in RESERVED_IDS)
    allowed = grants(role_statements(synth, synth.logical_id(synth.stack.participants.role)))
    bucket = f"<{synth.logical_id(synth.stack.storage.bucket)}.Arn>"
    # Then none of the coordinator's objects (global models, staged aggregates, manifest, config, checkpoints) is
    # writable by it, nor can it abort the coordinator's multipart uploads
    for key in coordinator_keys(synth.config.run_id, round_no, digest):
        assert not iam_allows(allowed["s3:PutObject"], bucket, key, pid), (pid, key)
        assert not iam_allows(allowed["s3:AbortMultipartUpload"], bucket, key, pid), (pid, key)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(round_no=st.integers(0, 999_999), job=st.text("0123456789abcdef", min_size=64, max_size=64))
def test_no_participant_tag_the_trust_policy_admits_may_write_a_staged_aggregate(
    synth: Synth, round_no: int, job: str
) -> None:
    # Given a staged aggregate's key, and the one tag value that would make it end in "/<tag>": its job id
    key = keys.staging_key(synth.config.run_id, round_no, job)
    allowed = grants(role_statements(synth, synth.logical_id(synth.stack.participants.role)))
    bucket = f"<{synth.logical_id(synth.stack.storage.bucket)}.Arn>"
    # Then a session tagged with the job id would match the write pattern rounds/*/<tag> (IAM's * spans '/'), ...
    assert iam_allows(allowed["s3:PutObject"], bucket, key, job)
    # ... but no participant id is 64 characters long, and the trust policy refuses such a tag (and "staging" is a
    # reserved name), so no session the role can be assumed with carries it
    assert not keys.PARTICIPANT_ID_PATTERN.fullmatch(job)
    assert any(fnmatch.fnmatchcase(job, pattern) for pattern in FORBIDDEN_IN_ID)
    assert "staging" in RESERVED_IDS and "optimizer" in RESERVED_IDS and "delta" in RESERVED_IDS


def test_with_witnessing_participants_may_read_the_rounds_updates(tmp_path: Path) -> None:
    # Given a run whose rounds are witnessed
    run_file = tmp_path / "run.toml"
    run_file.write_text('[run]\nrun_id = "infra-witness"\nmin_clients = 3\nwitness_nodes = 2\n')
    # When it is synthesized (cdk-nag runs in synthesis: an unacknowledged finding would raise here)
    app, stack = build_app(App(context={**cdk_json_context(), "config": str(run_file)}))
    template = Template.from_stack(stack)
    # Then participants may read every object of the run's rounds, still write only their own keys
    role = next(r for r in template.find_resources("AWS::IAM::Role").values()
                if "participant" in json.dumps(r["Properties"].get("Policies", [])))  # fmt: skip
    statements = role["Properties"]["Policies"][0]["PolicyDocument"]["Statement"]
    reads = next(s for s in statements if s["Action"] == "s3:GetObject")
    assert any("runs/infra-witness/rounds/*" in json.dumps(r) and "PrincipalTag" not in json.dumps(r)
               for r in as_list(reads["Resource"]))  # fmt: skip
    # and read them by version id: witnesses fetch exactly the version the coordinator accepted
    versions = next(s for s in statements if s["Action"] == "s3:GetObjectVersion")
    assert all("runs/infra-witness/rounds/*" in json.dumps(r) for r in as_list(versions["Resource"]))


def test_the_tick_schedule_is_named_for_the_run_and_only_the_ticks_may_switch_it(synth: Synth) -> None:
    # Given the tick schedule
    rule = synth.resources[synth.logical_id(synth.stack.coordinator.schedule)]["Properties"]
    run = synth.config.run_id
    # Then it is named for the run (what the tick, `fed run` and the local stack switch), and starts enabled
    assert rule["Name"] == tick_rule_name(run) and rule["State"] == "ENABLED"
    minutes = TICK_SCHEDULE_MINUTES
    assert rule["ScheduleExpression"] == f"rate({minutes} minute{'s' if minutes > 1 else ''})"
    # And exactly the tick and ingest roles may enable and disable it, and no other rule
    arn = f"arn:<AWS::Partition>:events:<AWS::Region>:<AWS::AccountId>:rule/{tick_rule_name(run)}"
    switchers = {r: grants(role_statements(synth, r)).get("events:DisableRule")
                 for r in synth.of_type("AWS::IAM::Role")}
    assert {r: v for r, v in switchers.items() if v} == {function_role(synth, "tick"): {arn},
                                                         function_role(synth, "ingest"): {arn}}


def topic_policy(synth: Synth) -> list[dict[str, Any]]:
    """The statements of the run-state topic's policy."""
    topic = {"Ref": synth.logical_id(synth.stack.notifications.topic)}
    (policy,) = [p["Properties"] for p in synth.of_type("AWS::SNS::TopicPolicy").values() if p["Properties"]["Topics"]
                 == [topic]]  # fmt: skip
    statements: list[dict[str, Any]] = policy["PolicyDocument"]["Statement"]
    assert all(s["Resource"] == topic for s in statements), "the policy is about this topic only"
    return statements


def own_queue(synth: Synth) -> str:
    """The participant's own queue's ARN as IAM sees it: the session tag is substituted for the policy variable."""
    return f"arn:<AWS::Partition>:sqs:<AWS::Region>:<AWS::AccountId>:fed-{synth.config.run_id}-p-{SELF}"


def test_the_state_topic_is_named_for_the_run_encrypted_and_takes_only_tls(synth: Synth) -> None:
    # Given the run-state topic
    topic_id = synth.logical_id(synth.stack.notifications.topic)
    props = synth.resources[topic_id]["Properties"]
    # Then it has the name the functions and participants expect, is a standard topic (SQS subscribers), and is
    # encrypted with the AWS-managed SNS key (SNS decrypts on delivery: the participant queues need no key of it)
    assert props["TopicName"] == state_topic_name(synth.config.run_id)
    assert "FifoTopic" not in props
    assert props["KmsMasterKeyId"] == "alias/aws/sns"
    # And a publish without TLS is refused
    statements = topic_policy(synth)
    assert {"Effect": "Deny", "Principal": "*", "Action": "sns:Publish",
            "Condition": {"Bool": {"aws:SecureTransport": "false"}}}.items() <= next(
        s for s in statements if s.get("Condition", {}).get("Bool")).items()  # fmt: skip


def test_only_the_functions_that_commit_the_state_may_publish_it(synth: Synth) -> None:
    # Given the run-state topic, every role of the stack and every function
    topic = f"<{synth.logical_id(synth.stack.notifications.topic)}>"
    committers = {function_role(synth, "tick"), function_role(synth, "ingest")}
    # When we gather who may publish, by their own policies
    publishers = {r: grants(role_statements(synth, r)).get("sns:Publish", set())
                  for r in synth.of_type("AWS::IAM::Role")}
    # Then exactly tick and ingest (the functions that commit the run state) may, and only to this topic
    assert {r: v for r, v in publishers.items() if v and topic in v} == {r: {topic} for r in committers}
    # And the topic policy allows them and refuses every other principal, whatever its own policies say
    statements = topic_policy(synth)
    role_arns = [{"Fn::GetAtt": [r, "Arn"]} for r in sorted(committers)]
    (allow,) = [s for s in statements if s["Effect"] == "Allow" and s["Action"] == "sns:Publish"]
    assert sorted(allow["Principal"]["AWS"], key=json.dumps) == role_arns
    (deny,) = [s for s in statements if s["Effect"] == "Deny" and "ArnNotEquals" in s.get("Condition", {})]
    assert deny["Action"] == "sns:Publish" and deny["Principal"] == {"AWS": "*"}
    assert sorted(deny["Condition"]["ArnNotEquals"]["aws:PrincipalArn"], key=json.dumps) == role_arns
    # And only tick and ingest are told where to publish: join and the shard workers commit no state
    for name in ("tick", "ingest", "join", "shard"):
        env = synth.resources[function_id(synth, f"functions.{name}.handler")]["Properties"]["Environment"]
        assert (ENV_STATE_TOPIC in env["Variables"]) is (name in ("tick", "ingest")), name


def test_a_participant_may_use_exactly_its_own_queue_and_no_other(synth: Synth) -> None:
    # Given the participant role's statements
    statements = role_statements(synth, synth.logical_id(synth.stack.participants.role))
    allowed = grants(statements)
    # Then its SQS actions are exactly those a push queue needs, each on exactly its own queue's ARN: the session
    # tag in the policy variable, no wildcard (so no coordinator queue, no other participant's, no other run's)
    sqs_actions = {a for a in allowed if a.startswith("sqs:")}
    assert sqs_actions == set(QUEUE_ACTIONS) == {
        "sqs:CreateQueue", "sqs:GetQueueUrl", "sqs:GetQueueAttributes", "sqs:SetQueueAttributes",
        "sqs:ReceiveMessage", "sqs:DeleteQueue"}  # (it never deletes a message: none of DeleteMessage and co.)
    assert all(allowed[a] == {own_queue(synth)} for a in sqs_actions)
    assert "*" not in own_queue(synth) and "?" not in own_queue(synth)
    assert not [a for a in allowed if a == "sqs:SendMessage" or a.endswith(":*")]
    # And only over TLS, only for a session whose tag is a usable participant id
    (queue_statement,) = [s for s in statements if "sqs:CreateQueue" in as_list(s["Action"])]
    condition = queue_statement["Condition"]
    assert condition["Bool"] == {"aws:SecureTransport": "true"}
    assert condition["Null"] == {f"aws:PrincipalTag/{PARTICIPANT_TAG}": "false"}
    assert "StringNotEqualsIgnoreCase" in condition and "StringNotLike" in condition


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(me=st.from_regex(keys.PARTICIPANT_ID_PATTERN, fullmatch=True),
       other=st.from_regex(keys.PARTICIPANT_ID_PATTERN, fullmatch=True))
def test_no_participant_session_reaches_a_coordinator_queue_or_another_participants(
    synth: Synth, me: str, other: str
) -> None:
    # Given any two participant ids, and the queue names of the run
    assume(me != other)
    run = synth.config.run_id
    allowed = grants(role_statements(synth, synth.logical_id(synth.stack.participants.role)))
    prefix = "arn:<AWS::Partition>:sqs:<AWS::Region>:<AWS::AccountId>:"

    def reaches(session: str, queue: str | None) -> bool:
        return queue is not None and any(fnmatch.fnmatchcase(prefix + queue, p.replace(SELF, session))
                                         for p in allowed["sqs:ReceiveMessage"])

    # Then a session reaches its own queue (where its name fits SQS's 80 characters) ...
    mine = participant_queue_name(run, me)
    assert mine is None or reaches(me, mine)
    # ... and neither the other participant's, nor the coordinator's ingest or join queue
    for queue in (participant_queue_name(run, other), ingest_queue_name(run), join_queue_name(run)):
        assert not reaches(me, queue), queue


def test_a_participant_may_subscribe_only_its_own_queue_over_sqs(synth: Synth) -> None:
    # Given the participant role's Subscribe statement and the topic policy's
    topic = {"Ref": synth.logical_id(synth.stack.notifications.topic)}
    role_id = synth.logical_id(synth.stack.participants.role)
    statements = role_statements(synth, role_id)
    (subscribe,) = [s for s in statements if "sns:Subscribe" in as_list(s["Action"])]
    # Then it may subscribe to the run-state topic only, only over SQS, only its own queue, only over TLS
    assert as_list(subscribe["Action"]) == ["sns:Subscribe"] and subscribe["Resource"] == topic
    equals = subscribe["Condition"]["StringEquals"]
    assert equals["sns:Protocol"] == "sqs"
    assert render(equals["sns:Endpoint"]) == own_queue(synth)
    assert subscribe["Condition"]["Bool"] == {"aws:SecureTransport": "true"}
    assert subscribe["Condition"]["Null"] == {f"aws:PrincipalTag/{PARTICIPANT_TAG}": "false"}
    # And no other SNS action (no publishing, no unsubscribing others, no reading the topic's attributes)
    assert {a for a in grants(statements) if a.startswith("sns:")} == {"sns:Subscribe"}
    # And the topic policy admits the participant role on the same two conditions
    (admitted,) = [s for s in topic_policy(synth) if s["Action"] == "sns:Subscribe"]
    assert admitted["Effect"] == "Allow" and admitted["Principal"] == {"AWS": {"Fn::GetAtt": [role_id, "Arn"]}}
    assert admitted["Condition"]["StringEquals"]["sns:Protocol"] == "sqs"
    assert render(admitted["Condition"]["StringEquals"]["sns:Endpoint"]) == own_queue(synth)
