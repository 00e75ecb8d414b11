"""The credential endpoint in the template (issue 33): its public function URL, its role, the participant role's trust
in it, its reserved concurrency and alarms, the operator's rights to revoke hosts, and the [deploy] settings."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from aws_cdk import App, Stack
from aws_cdk import aws_lambda as lambda_
from aws_cdk.assertions import Template
from pydantic import ValidationError

from infra.app import build_app
from infra.nag import FED_PACK, URL_AUTH, FedChecks
from infra.participants import FORBIDDEN_IN_ID
from infra.settings import DeploySettings, FunctionSettings, load_deploy
from shared.config import ConfigError
from shared.hosts import PARTICIPANT_POLICY_BUDGET, policy_chars
from shared.keys import RESERVED_IDS
from shared.naming import (
    ENV_ALL_HOSTS_RATE,
    ENV_BUCKET,
    ENV_CONFIG,
    ENV_CREDENTIAL_SECONDS,
    ENV_HOST_RATE,
    ENV_PARTICIPANT_ROLE,
    ENV_RUN_ID,
    ENV_STATE_TOPIC,
    ENV_TABLE,
    HOST_TAG,
    METRICS_NAMESPACE,
    OUTPUT_CREDENTIAL_ENDPOINT,
    PARTICIPANT_POLICY,
    PARTICIPANT_TAG,
)
from tests.infrastructure.conftest import cdk_json_context
from tests.infrastructure.test_stack import function_id, function_role, own_log_group, role_statements

if TYPE_CHECKING:
    from tests.infrastructure.conftest import Synth

HANDLER = "functions.credentials.handler"
REQUEST_TAG = f"aws:RequestTag/{PARTICIPANT_TAG}"
MANAGED_POLICY_CHARS = 6144  # IAM's limit on a managed policy's document, white space not counted


def getatt(logical_id: str, attribute: str = "Arn") -> dict[str, Any]:
    return {"Fn::GetAtt": [logical_id, attribute]}


def credential_function(synth: Synth) -> dict[str, Any]:
    return synth.resources[function_id(synth, HANDLER)]


def policy_statements(synth: Synth, construct: Any) -> dict[str, dict[str, Any]]:
    """The statements of a managed policy, by Sid."""
    document = synth.resources[synth.logical_id(construct)]["Properties"]["PolicyDocument"]
    return {s["Sid"]: s for s in document["Statement"] if "Sid" in s}


def test_the_endpoint_is_a_function_url_without_iam_auth_named_in_the_outputs(synth: Synth) -> None:
    # Given the credential function and the function URLs of the stack
    fn = function_id(synth, HANDLER)
    (url_id, url), = synth.of_type("AWS::Lambda::Url").items()
    # Then its one URL takes no IAM auth (the hosts have no AWS identity) and invokes it
    assert url["Properties"] == {"AuthType": "NONE", "TargetFunctionArn": getatt(fn)}
    # And anyone may invoke it, but only through that URL
    public = [p["Properties"] for p in synth.of_type("AWS::Lambda::Permission").values() if p["Properties"]["Principal"]
              == "*"]  # fmt: skip
    assert sorted(public, key=lambda p: p["Action"]) == [
        {"Action": "lambda:InvokeFunction", "FunctionName": getatt(fn), "InvokedViaFunctionUrl": True,
         "Principal": "*"},
        {"Action": "lambda:InvokeFunctionUrl", "FunctionName": getatt(fn), "FunctionUrlAuthType": "NONE",
         "Principal": "*"},
    ]  # fmt: skip
    # And the invites name it: the URL is an output under the shared name
    assert synth.template.to_json()["Outputs"][OUTPUT_CREDENTIAL_ENDPOINT]["Value"] == getatt(url_id, "FunctionUrl")


def test_the_function_is_synchronous_small_reserved_and_told_what_a_host_needs(synth: Synth) -> None:
    # Given the credential function
    fn = credential_function(synth)["Properties"]
    settings = synth.settings
    # Then it is small and short (a few DynamoDB calls and one STS call), with the reserved concurrency that bounds a
    # flood's cost, and invoked synchronously: no dead-letter queue, no async retries
    assert fn["MemorySize"] == settings.credentials.memory_mb == 512
    assert fn["Timeout"] == settings.credentials.timeout_seconds == 15
    assert fn["ReservedConcurrentExecutions"] == settings.credentials.reserved_concurrency == 2
    assert "DeadLetterConfig" not in fn
    configured = [c["Properties"]["FunctionName"] for c in synth.of_type("AWS::Lambda::EventInvokeConfig").values()]
    assert {"Ref": function_id(synth, HANDLER)} not in configured
    # And its environment names the run's resources as the other functions' does, the role it issues sessions of,
    # their lifetime and its rate limits, and nothing else
    env = dict(fn["Environment"]["Variables"])
    assert json.loads(env.pop(ENV_CONFIG)) == json.loads(synth.config.model_dump_json())
    assert env == {
        ENV_RUN_ID: synth.config.run_id,
        ENV_BUCKET: {"Ref": synth.logical_id(synth.stack.storage.bucket)},
        ENV_TABLE: {"Ref": synth.logical_id(synth.stack.state.table)},
        ENV_STATE_TOPIC: {"Ref": synth.logical_id(synth.stack.notifications.topic)},
        ENV_PARTICIPANT_ROLE: getatt(synth.logical_id(synth.stack.participants.role)),
        ENV_CREDENTIAL_SECONDS: "3600",
        ENV_HOST_RATE: "12",
        ENV_ALL_HOSTS_RATE: "120",
        "POWERTOOLS_METRICS_NAMESPACE": METRICS_NAMESPACE,
    }


def test_its_role_may_only_issue_participant_sessions_and_keep_the_run_s_records(synth: Synth) -> None:
    # Given every statement granted to the credential function's role
    role_id = function_role(synth, "credentials")
    statements = role_statements(synth, role_id)
    # Then it writes its own logs, reads and writes only the run's partition of the table, and assumes only the
    # participant role (tagging the session): nothing else
    assert sorted(statements, key=lambda s: s["Sid"]) == [
        {"Sid": "HostRecords", "Effect": "Allow",
         "Action": ["dynamodb:GetItem", "dynamodb:PutItem", "dynamodb:UpdateItem"],
         "Resource": getatt(synth.logical_id(synth.stack.state.table)),
         "Condition": {"ForAllValues:StringEquals": {"dynamodb:LeadingKeys": [f"RUN#{synth.config.run_id}"]}}},
        {"Sid": "IssueParticipantSessions", "Effect": "Allow", "Action": ["sts:AssumeRole", "sts:TagSession"],
         "Resource": getatt(synth.logical_id(synth.stack.participants.role))},
        {"Sid": "WriteOwnLogs", "Effect": "Allow", "Action": ["logs:CreateLogStream", "logs:PutLogEvents"],
         "Resource": getatt(own_log_group(synth, role_id))},
    ]  # fmt: skip
    # And the session grant is a policy of its own, not the role's inline one: the participant role's trust names
    # this role, and both naming each other inside the two roles would be a dependency cycle for CloudFormation
    inline = json.dumps(synth.resources[role_id]["Properties"]["Policies"])
    assert synth.logical_id(synth.stack.participants.role) not in inline
    assert synth.logical_id(synth.stack.hosts.sessions) in credential_function(synth)["DependsOn"]


def test_the_participant_role_trusts_it_only_with_the_participant_tag(synth: Synth) -> None:
    # Given the participant role's trust policy
    role = synth.resources[synth.logical_id(synth.stack.participants.role)]["Properties"]
    trust = role["AssumeRolePolicyDocument"]["Statement"]
    # Then the credential function's role may assume it, only with exactly one session tag holding a usable
    # participant id: the conditions every principal is held to, spelled out on its own statement too
    (endpoint,) = [s for s in trust if s.get("Sid") == "CredentialEndpoint"]
    assert endpoint == {
        "Sid": "CredentialEndpoint",
        "Effect": "Allow",
        "Action": ["sts:AssumeRole", "sts:TagSession"],
        "Principal": {"AWS": getatt(function_role(synth, "credentials"))},
        "Condition": {
            "StringLike": {REQUEST_TAG: "?*", f"aws:RequestTag/{HOST_TAG}": "?*.?*"},
            "ForAllValues:StringEquals": {"aws:TagKeys": [PARTICIPANT_TAG, HOST_TAG]},
            "Null": {REQUEST_TAG: "false"},
            "StringNotEqualsIgnoreCase": {REQUEST_TAG: sorted(RESERVED_IDS)},
            "StringNotLike": {REQUEST_TAG: list(FORBIDDEN_IN_ID)},
        },
    }
    # And the existing principals' statement is still there, as it was (hosts can still assume the role themselves)
    others = [s for s in trust if s["Effect"] == "Allow" and s is not endpoint]
    assert len(others) == 1 and "Sid" not in others[0]
    assert others[0]["Condition"] == {"StringLike": {REQUEST_TAG: "?*"},
                                      "ForAllValues:StringEquals": {"aws:TagKeys": [PARTICIPANT_TAG]}}


def test_the_participant_role_is_bounded_by_its_own_statements(synth: Synth) -> None:
    # Given the participant role, its inline policy and its permissions boundary
    role = synth.resources[synth.logical_id(synth.stack.participants.role)]["Properties"]
    boundary = synth.resources[synth.logical_id(synth.stack.participants.boundary)]["Properties"]
    # Then the boundary holds exactly what the inline policy grants: whatever an operator writes into the role's
    # inline policies (`fed hosts revoke` may write them) grants nothing beyond the template's statements
    assert role["PermissionsBoundary"] == {"Ref": synth.logical_id(synth.stack.participants.boundary)}
    (inline,) = role["Policies"]
    assert boundary["PolicyDocument"] == inline["PolicyDocument"]
    # And its own inline policy leaves the deny on revoked generations the room `shared.hosts` counts on (IAM counts a
    # role's inline policies together, without whitespace)
    assert inline["PolicyName"] == PARTICIPANT_POLICY
    assert policy_chars(json.dumps(inline["PolicyDocument"])) <= PARTICIPANT_POLICY_BUDGET
    assert "Roles" not in boundary and "Users" not in boundary and "Groups" not in boundary


def test_the_operator_may_revoke_hosts_and_check_the_endpoint(synth: Synth) -> None:
    # Given the operator policy's statements
    statements = policy_statements(synth, synth.stack.operators.policy)
    participant_role = getatt(synth.logical_id(synth.stack.participants.role))
    table = getatt(synth.logical_id(synth.stack.state.table))
    # Then `fed hosts revoke` may mark a host revoked and write the participant role's inline policies (its deny on
    # the revoked hosts' tags, written whole), on that role only; invite's put and list's query are the run-state
    # grants
    assert statements["RevokeHosts"] == {"Sid": "RevokeHosts", "Effect": "Allow", "Action": "dynamodb:UpdateItem",
                                         "Resource": table}
    assert statements["RevokeHostSessions"] == {"Sid": "RevokeHostSessions", "Effect": "Allow",
                                                "Action": ["iam:PutRolePolicy", "iam:GetRolePolicy"],
                                                "Resource": participant_role}
    assert statements["ReadRunState"]["Action"] == ["dynamodb:GetItem", "dynamodb:Query"]
    assert statements["CommitRunState"]["Action"] == "dynamodb:PutItem"
    # And no other IAM write anywhere in it
    writes = {a for s in statements.values() for a in ([s["Action"]] if isinstance(s["Action"], str) else s["Action"])
              if a.startswith("iam:") and not a.startswith(("iam:Get", "iam:Simulate"))}
    assert writes == {"iam:PutRolePolicy"}
    # And `fed check` may read the credential function and simulate its role, as every function's
    assert getatt(function_id(synth, HANDLER)) in statements["CheckFunctions"]["Resource"]
    assert getatt(function_role(synth, "credentials")) in statements["CheckRoles"]["Resource"]


def test_its_errors_and_throttles_raise_alarms(synth: Synth) -> None:
    # Given the alarms on the credential function
    dimension = [{"Name": "FunctionName", "Value": {"Ref": function_id(synth, HANDLER)}}]
    alarms = {a["Properties"]["MetricName"]: a["Properties"] for a in synth.of_type("AWS::CloudWatch::Alarm").values()
              if a["Properties"].get("Dimensions") == dimension}  # fmt: skip
    # Then a failed request and a throttled one (the reserved concurrency used up: a flood, or too many hosts at
    # once) each raise an alarm, sent to the alarm topic
    assert set(alarms) == {"Errors", "Throttles"}
    throttles = synth.resources[synth.logical_id(synth.stack.observability.credential_throttles)]["Properties"]
    assert throttles == alarms["Throttles"]
    topic = {"Ref": synth.logical_id(synth.stack.observability.topic)}
    for alarm in alarms.values():
        assert alarm["Threshold"] == 1 and alarm["Statistic"] == "Sum"
        assert alarm["ComparisonOperator"] == "GreaterThanOrEqualToThreshold"
        assert alarm["TreatMissingData"] == "notBreaching" and alarm["AlarmActions"] == [topic]


def test_a_url_without_iam_auth_is_a_finding_unless_acknowledged_with_what_protects_it(synth: Synth) -> None:
    # Given a bare app with a function URL open to anyone
    app = App()
    fn = lambda_.Function(Stack(app, "Bare"), "Fn", runtime=lambda_.Runtime.PYTHON_3_14, handler="index.handler",
                          code=lambda_.Code.from_inline("def handler(event, context): pass"))
    fn.add_function_url(auth_type=lambda_.FunctionUrlAuthType.NONE)
    # When the project's own pack checks it, Then the URL is a finding (the AwsSolutions pack has no such rule)
    bare = FedChecks().validate_scope(app)
    assert not bare.success and [v.rule_name for v in bare.violations] == [f"{FED_PACK}-{URL_AUTH}"]
    # And the stack's URL is acknowledged, with a reason that says why there is no IAM auth and what protects it
    assert FedChecks().validate_scope(synth.app).success
    (reason,) = [text for entry in synth.stack.hosts.url.node.metadata if entry.type == "aws:cdk:acknowledged-rules"
                 for rule, text in entry.data.items() if rule.endswith(f"{FED_PACK}-{URL_AUTH}")]
    for words in ("no AWS identity", "one-time secret", "Ed25519", "nonce", "rate-limited", "reserved concurrency"):
        assert words in reason, words


LONG_RUN = """
[run]
run_id = "{run_id}"
min_clients = 3
witness_nodes = 2

[deploy]
credential_minutes = 15
host_requests_per_minute = 6
all_hosts_requests_per_minute = 600

[deploy.credentials]
reserved_concurrency = 5
"""


def resolved_size(template: Mapping[str, Any], document: Any) -> int:
    """A policy document's length as IAM counts it, each reference resolved to a name as long as AWS makes them
    (a 63-character bucket name, 64-character generated role and function names, a 128-character stack name)."""
    resources = template["Resources"]
    arn = {"AWS::S3::Bucket": 76, "AWS::DynamoDB::Table": 130, "AWS::SNS::Topic": 130, "AWS::IAM::Role": 100,
           "AWS::Lambda::Function": 125, "AWS::Events::Rule": 120, "AWS::SQS::Queue": 130, "AWS::Logs::LogGroup": 130,
           "AWS::IAM::ManagedPolicy": 100}
    pseudo = {"AWS::Partition": "aws-us-gov", "AWS::Region": "ap-southeast-2", "AWS::AccountId": "1" * 12,
              "AWS::StackId": f"arn:aws-us-gov:cloudformation:ap-southeast-2:{'1' * 12}:stack/{'s' * 128}/{'u' * 36}",
              "AWS::URLSuffix": "amazonaws.com", "AWS::StackName": "s" * 128}

    def resolve(value: Any) -> Any:
        if isinstance(value, list):
            return [resolve(v) for v in value]
        if not isinstance(value, dict):
            return value
        if "Fn::Join" in value:
            separator, parts = value["Fn::Join"]
            return separator.join(str(resolve(p)) for p in parts)
        if "Ref" in value:
            ref = value["Ref"]
            return pseudo[ref] if ref in pseudo else "x" * arn[resources[ref]["Type"]]
        if "Fn::GetAtt" in value:
            return "x" * arn[resources[value["Fn::GetAtt"][0]]["Type"]]
        return {k: resolve(v) for k, v in value.items()}

    return len(json.dumps(resolve(document), separators=(",", ":")))


def test_configured_limits_reach_the_function_and_the_managed_policies_fit_iam(tmp_path: Path) -> None:
    # Given a run with the longest run id, witnessing on (the participant's largest policy) and its own limits
    run_file = tmp_path / "run.toml"
    run_file.write_text(LONG_RUN.format(run_id="r" * 40))
    # When it is synthesized (cdk-nag runs in synthesis: an unacknowledged finding would raise here)
    with tempfile.TemporaryDirectory() as asset:
        _, stack = build_app(App(context={**cdk_json_context(), "config": str(run_file)}), asset_dir=Path(asset))
        template = Template.from_stack(stack).to_json()
    # Then the function gets those limits and that reserved concurrency
    (fn,) = [r["Properties"] for r in template["Resources"].values()
             if r["Type"] == "AWS::Lambda::Function" and r["Properties"]["Handler"] == HANDLER]  # fmt: skip
    env = fn["Environment"]["Variables"]
    assert (env[ENV_CREDENTIAL_SECONDS], env[ENV_HOST_RATE], env[ENV_ALL_HOSTS_RATE]) == ("900", "6", "600")
    assert fn["ReservedConcurrentExecutions"] == 5 and fn["MemorySize"] == 512  # the rest keeps its defaults
    # And both managed policies (the operator's, the participant role's boundary) stay within IAM's size limit
    managed = {k: r["Properties"]["PolicyDocument"] for k, r in template["Resources"].items()
               if r["Type"] == "AWS::IAM::ManagedPolicy"}  # fmt: skip
    assert len(managed) == 2
    sizes = {k: resolved_size(template, document) for k, document in managed.items()}
    assert all(size <= MANAGED_POLICY_CHARS for size in sizes.values()), sizes


def test_the_endpoint_settings_default_to_an_hour_and_modest_rates() -> None:
    settings = DeploySettings()
    assert settings.credential_minutes == 60 and settings.credential_seconds == 3600
    assert settings.host_requests_per_minute == 12 and settings.all_hosts_requests_per_minute == 120
    assert settings.credentials.reserved_concurrency == 2


@pytest.mark.parametrize(
    ("deploy", "field", "words"),
    [
        ("credential_minutes = 10", "deploy.credential_minutes", "15 to 60 minutes"),
        ("credential_minutes = 61", "deploy.credential_minutes", "role chaining"),
        ("host_requests_per_minute = 0", "deploy.host_requests_per_minute", "greater than or equal to 1"),
        ("all_hosts_requests_per_minute = 0", "deploy.all_hosts_requests_per_minute", "greater than or equal to 1"),
        ("all_hosts_requests_per_minute = 11", "deploy.all_hosts_requests_per_minute",
         "at least host_requests_per_minute (12)"),
        ("host_requests_per_minute = 200", "deploy.all_hosts_requests_per_minute",
         "at least host_requests_per_minute (200)"),
        ("[deploy.credentials]\nreserved_concurrency = 0", "deploy.credentials.reserved_concurrency",
         "greater than or equal to 1"),
        ("[deploy.credentials]\nbogus = 1", "deploy.credentials.bogus", "Extra inputs"),
    ],
)
def test_bad_endpoint_settings_are_refused_naming_the_field(tmp_path: Path, deploy: str, field: str,
                                                           words: str) -> None:
    # Given a run file with one bad credential-endpoint setting
    path = tmp_path / "run.toml"
    path.write_text(f'[run]\nrun_id = "r1x"\n[deploy]\n{deploy}\n')
    # When it is loaded, Then the error names the field and says what is wrong
    with pytest.raises(ConfigError) as caught:
        load_deploy(path)
    line = next(line for line in str(caught.value).splitlines() if line.strip().startswith(f"{field}:"))
    assert words in line, line


def test_the_endpoint_must_keep_a_reserved_concurrency() -> None:
    # Given credential-function settings without a reserved concurrency (the shared pool: a flood unbounded)
    # Then they are refused, saying why
    with pytest.raises(ValidationError, match="reserved_concurrency must be set"):
        DeploySettings(credentials=FunctionSettings())
