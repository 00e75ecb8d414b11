"""`fed check` against a local run: every check passes on the stack as synthesized, and a role that lacks what the
code calls is named with the statement to add. The catalog of calls covers every action the synthesized roles
grant (or infra/unexercised_grants.toml says why not)."""

from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from coordinator.service import run_tick
from fed.check import (
    OPERATOR,
    PARTICIPANT,
    SAMPLE_PEER,
    AwsChecker,
    Call,
    Status,
    catalog,
    local_judge,
    local_wiring,
    run_checks,
)
from fed.cli import app
from functions.settings import deps_from_env
from local import access
from local.access.control import ACCESS_PATH
from local.access.model import AccessModel
from local.access.report import load_reasons
from local.stack import LocalStack
from shared import keys
from shared.config import RunConfig
from store.connection import Connection
from store.trace import acting_as, function

RUN = "check-run"


def config(**overrides: Any) -> RunConfig:
    values: dict[str, Any] = dict(run_id=RUN, min_clients=2, min_per_round=2, total_rounds=2, liveness_timeout=60,
                                  dataset_size=100)
    return RunConfig(**{**values, **overrides})


@pytest.fixture(scope="module")
def stack() -> Iterator[LocalStack]:
    """The local stack, without a dispatcher, ticked once (the first tick publishes config.json)."""
    if access.unavailable():
        pytest.skip(f"the access check cannot run here: {access.unavailable()}")
    with LocalStack(config(), dispatch=False, log_level="WARNING") as s:
        with acting_as(function("tick")):
            run_tick(deps_from_env())
        yield s


@pytest.fixture()
def connection(stack: LocalStack, tmp_path: Path) -> str:
    path = tmp_path / "local.json"
    stack.connection.save(path)
    return str(path)


def fed(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args))
    return result.exit_code, result.output


def held_model(stack: LocalStack) -> AccessModel:
    """The model the local server holds, as `fed check` reads it (GET ACCESS_PATH)."""
    with urllib.request.urlopen(f"{stack.endpoint}{ACCESS_PATH}", timeout=10) as resp:
        body = json.loads(resp.read())
    assert body["enforce"] is True
    return AccessModel.from_json(body["model"])


@pytest.fixture()
def served(stack: LocalStack) -> Iterator[Callable[[AccessModel], None]]:
    """Give the server another model for one test; the one it held is given back after."""
    original = held_model(stack)
    assert stack.server is not None
    yield lambda model: stack.server.enable_access(model, enforce=True)  # type: ignore[union-attr]
    stack.server.enable_access(original, enforce=True)


def without(model: AccessModel, principal: str, action: str, resource: str = "") -> AccessModel:
    """`model` with `action` (on `resource` only, if given) taken out of `principal`'s Allow statements."""
    data = json.loads(model.to_json())
    policies = data["principals"][principal]["policies"]
    taken = 0
    for document in policies.values():
        for statement in document["Statement"]:
            actions = statement["Action"] if isinstance(statement["Action"], list) else [statement["Action"]]
            if statement["Effect"] != "Allow" or action not in actions:
                continue
            if not resource:
                statement["Action"] = [a for a in actions if a != action]
                taken += 1
                continue
            resources = statement["Resource"] if isinstance(statement["Resource"], list) else [statement["Resource"]]
            if resource in resources:
                statement["Resource"] = [r for r in resources if r != resource]
                taken += 1
    assert taken, (principal, action, resource)
    return AccessModel.from_json(json.dumps(data))


def test_fed_check_passes_on_the_local_stack(connection: str) -> None:
    # When the operator checks a local run whose roles are the synthesized template's
    code, out = fed("check", "--connection", connection)
    # Then every check passes, one ✓ line each (and one per principal for the roles)
    assert code == 0, out
    assert "✗" not in out
    for line in ("✓ stack: local run", "✓ functions: functions.credentials.handler, functions.ingest.handler",
                 "✓ roles: function:tick",
                 "✓ roles: participant", "✓ roles: operator", "✓ events: bucket", "✓ schedule:",
                 "✓ participant fed-check-"):
        assert line in out, (line, out)
    assert "answers 403" in out and "reads config.json and the run state" in out
    # And --json says the same, machine-readably
    code, out = fed("check", "--connection", connection, "--json")
    report = json.loads(out)
    assert code == 0 and report["ok"] and report["run_id"] == RUN
    assert {c["check"] for c in report["checks"]} == {"stack", "functions", "roles", "events", "schedule",
                                                      "participant"}
    assert all(c["status"] == "pass" for c in report["checks"]), report
    assert report["seconds"] < 60


def test_a_function_role_without_a_permission_its_code_needs_is_named(
        stack: LocalStack, connection: str, served: Callable[[AccessModel], None]) -> None:
    # Given the tick's role without dynamodb:DeleteItem (the aggregation lease is given back with it)
    served(without(held_model(stack), "function:tick", "dynamodb:DeleteItem"))
    code, out = fed("check", "--connection", connection)
    # Then fed check fails, naming the principal, the action, the resource and the statement to add
    assert code == 1, out
    table = f"arn:aws:dynamodb:us-east-1:123456789012:table/{stack.connection.table}"
    assert f"✗ roles: function:tick may not dynamodb:DeleteItem on {table}" in out, out
    assert '"Action": "dynamodb:DeleteItem"' in out and "infra/coordinator.py" in out
    # And the other principals still pass
    assert "✓ roles: function:ingest" in out and "✓ roles: participant" in out
    code, out = fed("check", "--connection", connection, "--json")
    refused = [c for c in json.loads(out)["checks"] if c["status"] == "fail"]
    assert [(c["details"]["principal"], c["details"]["action"]) for c in refused] == [
        ("function:tick", "dynamodb:DeleteItem")]
    assert refused[0]["details"]["statement"] == {"Effect": "Allow", "Action": "dynamodb:DeleteItem",
                                                  "Resource": table}


@pytest.mark.access_denied_expected  # the participant session's read of config.json is refused, as checked
def test_a_participant_role_that_may_not_read_the_config_is_named(
        stack: LocalStack, connection: str, served: Callable[[AccessModel], None]) -> None:
    # Given the participant role without s3:GetObject on config.json
    config_arn = f"arn:aws:s3:::{stack.connection.bucket}/{keys.config_key(RUN)}"
    served(without(held_model(stack), PARTICIPANT, "s3:GetObject", config_arn))
    code, out = fed("check", "--connection", connection)
    # Then the catalog's call is refused, and the participant session's own read of it is too
    assert code == 1, out
    assert f"✗ roles: participant may not s3:GetObject on {config_arn}" in out, out
    assert "infra/participants.py" in out
    assert f"may not read {keys.config_key(RUN)} (403: the operator sees it there)" in out, out


@pytest.mark.access_denied_expected  # fed check's own reads of the rules are refused, as checked
def test_the_operator_policy_holds_what_fed_check_itself_calls(
        stack: LocalStack, connection: str, served: Callable[[AccessModel], None]) -> None:
    # Given an operator policy that may not read the rules
    served(without(held_model(stack), OPERATOR, "events:DescribeRule"))
    code, out = fed("check", "--connection", connection)
    # Then both the catalog and the events check (refused by the local server) say so
    assert code == 1, out
    assert "✗ roles: operator may not events:DescribeRule" in out and "infra/operators.py" in out
    assert "✗ events: rule" in out and "AccessDenied" in out


# --- the catalog against the synthesized roles -------------------------------------------------------------------


@pytest.fixture(scope="module", params=[0, 2], ids=["no-witnesses", "witnesses"])
def synthesized(request: pytest.FixtureRequest) -> tuple[AccessModel, list[Call]]:
    if access.unavailable():
        pytest.skip(f"the access check cannot run here: {access.unavailable()}")
    model = access.model_for(RunConfig(run_id=RUN, witness_nodes=request.param))
    conn = Connection(run_id=RUN, bucket=f"fed-{RUN}", table=f"fed-{RUN}-state", endpoint="http://127.0.0.1:1")
    return model, catalog(local_wiring(conn, model), witnessing=request.param > 0)


def test_every_granted_action_is_called_by_the_code_or_explained(synthesized: tuple[AccessModel, list[Call]]) -> None:
    # Given every action the synthesized roles grant, and the catalog of what the code calls
    model, calls = synthesized
    called = {(c.principal, c.action) for c in calls}
    granted = {(name, action) for name, p in model.principals.items() for action in p.granted_actions()}
    # Then each granted action is called by some code path, or infra/unexercised_grants.toml says why it is granted
    # (CDK's grant to a queue event source holds sqs:ChangeMessageVisibility and sqs:GetQueueUrl, which the catalog
    # does not claim Lambda's poller calls)
    uncovered = granted - called - set(load_reasons())
    assert not uncovered, f"granted, but in no catalog entry and unexplained: {sorted(uncovered)}"


def test_every_call_in_the_catalog_is_allowed_by_the_synthesized_roles(
        synthesized: tuple[AccessModel, list[Call]]) -> None:
    model, calls = synthesized
    judge, close = local_judge(model)
    try:
        verdicts = judge(calls)
    finally:
        close()
    refused = [(c.principal, c.action, c.resource) for c in calls if not verdicts[c].allowed]
    assert not refused
    # And the catalog asks about each principal of the template
    assert {c.principal for c in calls} == set(model.principals)


def test_the_statement_a_refusal_names_covers_the_call_it_was_made_for(
        synthesized: tuple[AccessModel, list[Call]]) -> None:
    _, calls = synthesized
    for call in calls:
        pid = call.context.get("aws:PrincipalTag/participant", "")
        grant = call.statement()["Resource"].replace("${aws:PrincipalTag/participant}", str(pid))
        assert re.fullmatch(re.escape(grant).replace(r"\*", ".*"), call.resource), (call, grant)


# --- the AWS path, against fakes that validate every request against botocore's service models --------------------


class FakeClient:
    """A client of `service` whose operations are `handlers` (by their Python names); every call's parameters are
    validated against botocore's model of the service, as a real client's are, and recorded."""

    def __init__(self, service: str, handlers: dict[str, Callable[..., Any]]) -> None:
        import botocore.session
        from botocore import xform_name

        self.model = botocore.session.get_session().get_service_model(service)
        self.operations = {xform_name(name): name for name in self.model.operation_names}
        self.handlers, self.calls = handlers, []  # type: ignore[var-annotated]

    def _call(self, method: str, kwargs: dict[str, Any]) -> Any:
        from botocore.validate import validate_parameters

        validate_parameters(kwargs, self.model.operation_model(self.operations[method]).input_shape)
        self.calls.append((method, kwargs))
        if method not in self.handlers:
            raise AssertionError(f"{self.model.service_name}.{method} was not expected")
        return self.handlers[method](**kwargs)

    def __getattr__(self, method: str) -> Callable[..., Any]:
        if method not in self.operations:
            raise AttributeError(method)
        return lambda **kwargs: self._call(method, kwargs)

    def get_paginator(self, method: str) -> Any:
        client = self

        class Pages:
            def paginate(self, **kwargs: Any) -> list[Any]:
                return [client._call(method, kwargs)]

        return Pages()


def client_error(code: str, operation: str) -> Exception:
    from botocore.exceptions import ClientError

    return ClientError({"Error": {"Code": code, "Message": code}}, operation)


class FakeAws:
    """A deployed stack as the AWS APIs `fed check` calls describe it, named after the synthesized template bound as
    the local stack binds it (so the roles' model judges the policy simulator's questions)."""

    def __init__(self, model: AccessModel, run_config: RunConfig) -> None:
        from local.access.control import AccessControl
        from local.access.evaluator import Evaluator
        from shared.naming import (
            join_request_pattern,
            object_created_pattern,
            state_topic_name,
            tick_rule_name,
        )

        self.model, self.evaluator = model, Evaluator()
        self.control = AccessControl(model, self.evaluator)
        self.conn = Connection(run_id=RUN, bucket=f"fed-{RUN}", table=f"fed-{RUN}-state", region="us-east-1")
        wiring = local_wiring(Connection(RUN, f"fed-{RUN}", f"fed-{RUN}-state", "http://x"), model)
        self.stack_id, self.wiring = wiring.stack_id, wiring
        account = model.account
        topic = f"arn:aws:sns:us-east-1:{account}:{state_topic_name(RUN)}"
        outputs = {"BucketName": self.conn.bucket, "TableName": self.conn.table, "RunId": RUN,
                   "ParticipantRoleArn": model.principals[PARTICIPANT].arn, "StateTopicArn": topic,
                   "OperatorPolicyArn": wiring.operator_policy,
                   "TickFunctionName": wiring.functions["tick"].rsplit(":", 1)[1]}
        queue_url = f"https://sqs.us-east-1.amazonaws.com/{account}/"
        resources = [{"LogicalResourceId": arn.rsplit(":", 1)[1], "PhysicalResourceId": arn.rsplit(":", 1)[1],
                      "ResourceType": "AWS::Lambda::Function"} for arn in wiring.functions.values()]
        resources += [{"LogicalResourceId": f"Coordinator{kind}1234ABCD", "PhysicalResourceId": queue_url + name,
                       "ResourceType": "AWS::SQS::Queue"}
                      for kind, name in (("JoinQueue", f"fed-{RUN}-join"), ("ShardQueue", f"fed-{RUN}-shard"),
                                         ("DeadLetters", f"fed-{RUN}-dead-letters"))]

        def function(FunctionName: str) -> dict[str, Any]:  # noqa: N803 - the API's names
            name = next(n for n, arn in wiring.functions.items() if arn.endswith(f":{FunctionName}"))
            return {"Configuration": {
                "FunctionName": FunctionName, "FunctionArn": wiring.functions[name],
                "Handler": f"functions.{name}.handler",
                "Role": model.principals[f"function:{name}"].arn, "Runtime": "python3.14", "Architectures": ["arm64"],
                "State": "Active", "LastUpdateStatus": "Successful",
                "LoggingConfig": {"LogGroup": wiring.log_groups[name].split(":log-group:", 1)[1]},
                "DeadLetterConfig": {"TargetArn": wiring.dead_letters} if name in ("tick", "ingest") else {},
                "Environment": {"Variables": {"FED_CONFIG_JSON": run_config.model_dump_json(),
                                              "FED_SHARD_RUNNER": f"queue:{queue_url}fed-{RUN}-shard"}}}}

        patterns = {f"fed-{RUN}-object-created": object_created_pattern(self.conn.bucket, RUN),
                    f"fed-{RUN}-join-requests": join_request_pattern(self.conn.bucket, RUN)}

        def rule(Name: str) -> dict[str, Any]:  # noqa: N803
            if Name == tick_rule_name(RUN):
                return {"Name": Name, "ScheduleExpression": "rate(1 minute)", "State": "ENABLED"}
            return {"Name": Name, "EventPattern": json.dumps(patterns[Name]), "State": "ENABLED"}

        def test_pattern(EventPattern: str, Event: str) -> dict[str, Any]:  # noqa: N803
            from moto.events.models import EventPattern as Pattern

            return {"Result": Pattern.load(EventPattern).matches_event(json.loads(Event))}

        state = {"Item": {"pk": {"S": f"RUN#{RUN}"}, "sk": {"S": "STATE"}, "version": {"N": "3"},
                          "body": {"S": json.dumps({"phase": "WaitingForMembers"})}}}
        self.operator = {
            "cloudformation": FakeClient("cloudformation", {
                "describe_stacks": lambda StackName: {"Stacks": [{  # noqa: N803
                    "StackName": StackName, "StackId": self.stack_id, "StackStatus": "UPDATE_COMPLETE",
                    "CreationTime": "2026-01-01T00:00:00Z",
                    "Outputs": [{"OutputKey": k, "OutputValue": v} for k, v in outputs.items()]}]},
                "list_stack_resources": lambda StackName: {"StackResourceSummaries": [  # noqa: N803
                    {**r, "ResourceStatus": "CREATE_COMPLETE", "LastUpdatedTimestamp": "2026-01-01T00:00:00Z"}
                    for r in resources]}}),
            "lambda": FakeClient("lambda", {"get_function": function,
                                            "invoke": lambda FunctionName, InvocationType: {"StatusCode": 204}}),  # noqa: N803
            "s3": FakeClient("s3", {"head_bucket": lambda Bucket: {},  # noqa: N803
                                    "get_bucket_notification_configuration":
                                        lambda Bucket: {"EventBridgeConfiguration": {}}}),  # noqa: N803
            "dynamodb": FakeClient("dynamodb", {"get_item": lambda **kw: state}),
            "events": FakeClient("events", {"describe_rule": rule, "test_event_pattern": test_pattern}),
            "sts": FakeClient("sts", {"assume_role": lambda **kw: {"Credentials": {
                "AccessKeyId": "ASIA", "SecretAccessKey": "s", "SessionToken": "t",
                "Expiration": "2026-01-01T00:15:00Z"}}}),
            "iam": FakeClient("iam", {
                "get_policy": lambda PolicyArn: {"Policy": {"Arn": PolicyArn, "DefaultVersionId": "v2"}},  # noqa: N803
                "get_policy_version": lambda PolicyArn, VersionId: {"PolicyVersion": {  # noqa: N803
                    "Document": next(iter(model.principals[OPERATOR].policies.values())), "VersionId": VersionId,
                    "IsDefaultVersion": True}},
                "simulate_principal_policy": lambda **kw: self.simulate(kw.pop("PolicySourceArn"), **kw),
                "simulate_custom_policy": lambda **kw: self.simulate(json.loads(kw.pop("PolicyInputList")[0]), **kw)}),
        }

        class Body:
            def read(self) -> bytes:
                return run_config.model_dump_json().encode()

        def get_object(Bucket: str, Key: str) -> dict[str, Any]:  # noqa: N803
            assert Key == keys.config_key(RUN)
            return {"Body": Body(), "ETag": '"0"', "ContentLength": 1, "Metadata": {}}

        def head_object(Bucket: str, Key: str) -> dict[str, Any]:  # noqa: N803
            raise client_error("403", "HeadObject")  # a participant may not list the bucket: S3's 403

        self.participant = {"s3": FakeClient("s3", {"head_object": head_object, "get_object": get_object}),
                            "dynamodb": FakeClient("dynamodb", {"get_item": lambda **kw: state})}

    def simulate(self, source: Any, ActionNames: list[str], ResourceArns: list[str],  # noqa: N803
                 ContextEntries: list[dict[str, Any]]) -> dict[str, Any]:
        from local.access.requests import Need

        if isinstance(source, dict):  # SimulateCustomPolicy: the operator policy's document
            assert source == next(iter(self.model.principals[OPERATOR].policies.values()))
            principal = OPERATOR
        else:
            principal = next(n for n, p in self.model.principals.items() if p.arn == source)
        context: dict[str, str | list[str]] = {
            e["ContextKeyName"]: e["ContextKeyValues"] if e["ContextKeyType"] == "stringList"
            else e["ContextKeyValues"][0] for e in ContextEntries}
        if principal == PARTICIPANT:
            principal = f"participant:{context['aws:PrincipalTag/participant']}"
        (resource,) = ResourceArns
        results = []
        for action in ActionNames:
            decision = self.control.decide(principal, Need(action, resource, context))
            results.append({"EvalActionName": action, "EvalResourceName": resource,
                            "EvalDecision": "allowed" if decision.allowed else "implicitDeny",
                            "MatchedStatements": [], "MissingContextValues": []})
        return {"EvaluationResults": results, "IsTruncated": False}


class FakeAwsChecker(AwsChecker):
    def __init__(self, aws: FakeAws) -> None:
        super().__init__(aws.conn, f"fed-{RUN}")
        self.aws = aws

    def client(self, service: str, session: Any = None) -> Any:
        return (self.aws.operator if session is None else self.aws.participant)[service]


@pytest.fixture()
def fake_aws(synthesized: tuple[AccessModel, list[Call]]) -> Iterator[FakeAws]:
    model, _ = synthesized
    witnessing = any(c.principal == PARTICIPANT and c.resource.endswith(SAMPLE_PEER) for c in synthesized[1])
    aws = FakeAws(model, RunConfig(run_id=RUN, witness_nodes=2 if witnessing else 0))
    yield aws
    aws.evaluator.close()


def test_on_aws_each_check_asks_the_apis_in_their_own_terms(fake_aws: FakeAws) -> None:
    # When fed check runs against a deployed stack (the AWS APIs faked, every request validated against botocore's
    # models of the services)
    report = run_checks(fake_aws.conn, f"fed-{RUN}", FakeAwsChecker(fake_aws))
    # Then every check passes, as on the local stack
    assert report.ok, [line.to_json() for line in report.lines if line.status is not Status.PASS]
    assert {line.check for line in report.lines} == {"stack", "functions", "roles", "events", "schedule",
                                                     "participant"}
    text = "\n".join(line.text for line in report.lines)
    assert "tick (python3.14, arm64)" in text and "DryRun invoke (204)" in text
    assert "IAM's policy simulator; the operator policy's version v2" in text
    # And it asked what the operator policy allows: the roles by their ARNs, the operator policy by its document
    iam = fake_aws.operator["iam"].calls  # type: ignore[attr-defined]
    sources = {kw.get("PolicySourceArn") for method, kw in iam if method == "simulate_principal_policy"}
    assert sources == {p.arn for n, p in fake_aws.model.principals.items() if n != OPERATOR}
    assert any(method == "simulate_custom_policy" for method, _ in iam)
    sts = fake_aws.operator["sts"].calls  # type: ignore[attr-defined]
    (_, assumed), = sts
    assert assumed["Tags"][0]["Key"] == "participant" and assumed["Tags"][0]["Value"].startswith("fed-check-")


def test_on_aws_a_refused_call_names_the_statement_to_add(fake_aws: FakeAws) -> None:
    # Given a deployed tick role without dynamodb:DeleteItem (as IAM's simulator would judge it)
    from local.access.control import AccessControl

    fake_aws.model = without(fake_aws.model, "function:tick", "dynamodb:DeleteItem")
    fake_aws.control = AccessControl(fake_aws.model, fake_aws.evaluator)
    report = run_checks(fake_aws.conn, f"fed-{RUN}", FakeAwsChecker(fake_aws))
    failed = [line for line in report.lines if line.status is Status.FAIL]
    assert not report.ok and [(f.details["principal"], f.details["action"]) for f in failed] == [
        ("function:tick", "dynamodb:DeleteItem")]
    assert "infra/coordinator.py" in failed[0].fix and '"Action": "dynamodb:DeleteItem"' in failed[0].fix
