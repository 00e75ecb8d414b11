"""Who may do what, read from the synthesized template and bound to the resources of one run.

The template (`infra.template`) is the one source of permissions: each function's role (its inline policies and
the policies CDK attaches to it, such as an event source's queue rights), the participant role, the operator
policy, and the resource policies of the bucket, topic and queues. CloudFormation's intrinsics (`Ref`,
`Fn::GetAtt`, `Fn::Join`, `Fn::Sub`, ...) are resolved against a `Binding`: the names the resources have where the
run lives (the local stack's, or a deployed stack's).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from shared.naming import OUTPUT_OPERATOR_POLICY, OUTPUT_PARTICIPANT_ROLE, PARTICIPANT_TAG

LOCAL_ACCOUNT = "123456789012"  # moto's account
PARTICIPANT = "participant"
OPERATOR = "operator"
FUNCTION = "function:"  # + the function's name (tick, ingest, join, shard, credentials): its handler's module
_HANDLER = re.compile(r"^functions\.(\w+)\.handler$")


class TemplateError(ValueError):
    """The template holds something this reader cannot resolve (a new intrinsic, an unknown resource)."""


@dataclass(frozen=True)
class Binding:
    """Physical names for the template's resources, by the id of the construct that made them (the last path
    segment before `Resource`, e.g. "Bucket", "Table", "JoinQueue"), for one account and region."""

    account: str
    region: str
    stack_name: str
    names: Mapping[str, str] = field(default_factory=dict)  # construct id -> physical name (queue: its name)
    endpoint_host: str = ""  # for queue URLs; empty: AWS's

    def queue_url(self, name: str) -> str:
        host = self.endpoint_host or f"https://sqs.{self.region}.amazonaws.com"
        return f"{host}/{self.account}/{name}"


@dataclass(frozen=True)
class Principal:
    """One identity as IAM knows it: a role (of a function, or the participants') or the operator's policy."""

    name: str  # "function:tick", "participant", "operator"
    arn: str  # the role's ARN ("" for the operator: whoever holds the policy)
    policies: Mapping[str, Any]  # policy name -> resolved document

    def statements(self) -> Iterator[tuple[str, dict[str, Any]]]:
        for policy_name, document in sorted(self.policies.items()):
            for statement in _as_list(document.get("Statement")):
                yield policy_name, statement

    def granted_actions(self) -> set[str]:
        """Every action an Allow statement names (actions are never wildcards in this stack's policies)."""
        return {a for _, s in self.statements() if s.get("Effect") == "Allow" for a in _as_list(s.get("Action"))}


@dataclass(frozen=True)
class AccessModel:
    account: str
    region: str
    principals: Mapping[str, Principal]
    resource_policies: Mapping[str, Any]  # bucket, topic or queue ARN -> its resolved policy document

    def resource_policy(self, resource_arn: str) -> tuple[str, Any | None]:
        """The ARN whose policy governs `resource_arn` (its own, or for an object its bucket's) and that policy."""
        if resource_arn in self.resource_policies:
            return resource_arn, self.resource_policies[resource_arn]
        if resource_arn.startswith("arn:aws:s3:::"):
            bucket = "arn:aws:s3:::" + resource_arn.split(":::", 1)[1].split("/", 1)[0]
            return bucket, self.resource_policies.get(bucket)
        return "", None

    def to_json(self) -> str:
        return json.dumps({"account": self.account, "region": self.region,
                           "principals": {k: asdict(v) for k, v in self.principals.items()},
                           "resource_policies": self.resource_policies})

    @classmethod
    def from_json(cls, text: str) -> AccessModel:
        data = json.loads(text)
        return cls(data["account"], data["region"],
                   {k: Principal(**v) for k, v in data["principals"].items()}, data["resource_policies"])


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    return value if isinstance(value, list) else [value]


def _construct_id(logical_id: str, resource: Mapping[str, Any]) -> str:
    path = resource.get("Metadata", {}).get("aws:cdk:path", "")
    parts = [p for p in path.split("/") if p and p != "Resource"]
    return parts[-1] if parts else logical_id


class _Resolver:
    def __init__(self, template: Mapping[str, Any], binding: Binding) -> None:
        self.resources: Mapping[str, Any] = template.get("Resources", {})
        self.b = binding
        self.stack_id = f"arn:aws:cloudformation:{binding.region}:{binding.account}:stack/{binding.stack_name}/local"

    def _name(self, logical_id: str) -> str:
        resource = self.resources[logical_id]
        props = resource.get("Properties", {})
        for prop in ("BucketName", "TableName", "QueueName", "TopicName", "Name", "FunctionName", "RoleName",
                     "LogGroupName", "ManagedPolicyName"):
            if isinstance(props.get(prop), str):
                return self.b.names.get(_construct_id(logical_id, resource), props[prop])
        return self.b.names.get(_construct_id(logical_id, resource), logical_id)

    def attribute(self, logical_id: str, attribute: str) -> str:
        if logical_id not in self.resources:
            raise TemplateError(f"{logical_id} is not a resource of the template")
        kind = self.resources[logical_id]["Type"]
        name, region, account = self._name(logical_id), self.b.region, self.b.account
        table: dict[str, dict[str, str]] = {
            "AWS::S3::Bucket": {"Ref": name, "Arn": f"arn:aws:s3:::{name}"},
            "AWS::DynamoDB::Table": {"Ref": name, "Arn": f"arn:aws:dynamodb:{region}:{account}:table/{name}"},
            "AWS::SQS::Queue": {"Ref": self.b.queue_url(name), "QueueUrl": self.b.queue_url(name), "QueueName": name,
                                "Arn": f"arn:aws:sqs:{region}:{account}:{name}"},
            "AWS::SNS::Topic": {"Ref": f"arn:aws:sns:{region}:{account}:{name}", "TopicName": name,
                                "TopicArn": f"arn:aws:sns:{region}:{account}:{name}"},
            "AWS::Events::Rule": {"Ref": name, "Arn": f"arn:aws:events:{region}:{account}:rule/{name}"},
            "AWS::IAM::Role": {"Ref": name, "Arn": f"arn:aws:iam::{account}:role/{name}"},
            "AWS::IAM::ManagedPolicy": {"Ref": f"arn:aws:iam::{account}:policy/{name}"},
            "AWS::Logs::LogGroup": {"Ref": name, "Arn": f"arn:aws:logs:{region}:{account}:log-group:{name}:*"},
            "AWS::Lambda::Function": {"Ref": name, "Arn": f"arn:aws:lambda:{region}:{account}:function:{name}"},
        }
        try:
            return table[kind][attribute]
        except KeyError:
            raise TemplateError(f"cannot resolve {attribute} of {logical_id} ({kind})") from None

    def pseudo(self, name: str) -> str:
        values = {"AWS::AccountId": self.b.account, "AWS::Region": self.b.region, "AWS::Partition": "aws",
                  "AWS::URLSuffix": "amazonaws.com", "AWS::StackName": self.b.stack_name,
                  "AWS::StackId": self.stack_id, "AWS::NoValue": ""}
        if name not in values:
            raise TemplateError(f"unknown pseudo parameter {name}")
        return values[name]

    def resolve(self, value: Any) -> Any:
        if isinstance(value, list):
            return [self.resolve(v) for v in value]
        if not isinstance(value, dict):
            return value
        if len(value) == 1:
            (fn, arg), = value.items()
            if fn == "Ref":
                return self.pseudo(arg) if arg.startswith("AWS::") else self.attribute(arg, "Ref")
            if fn == "Fn::GetAtt":
                logical, attribute = arg if isinstance(arg, list) else arg.split(".", 1)
                return self.attribute(logical, attribute)
            if fn == "Fn::Join":
                separator, parts = arg
                return separator.join(str(p) for p in self.resolve(parts))
            if fn == "Fn::Select":
                index, items = arg
                return self.resolve(items)[int(self.resolve(index))]
            if fn == "Fn::Split":
                separator, text = arg
                return str(self.resolve(text)).split(separator)
            if fn == "Fn::Sub":
                return self._sub(arg)
            if fn.startswith("Fn::"):
                raise TemplateError(f"cannot resolve {fn}")
        return {k: self.resolve(v) for k, v in value.items()}

    def _sub(self, arg: Any) -> str:
        text, variables = (arg, {}) if isinstance(arg, str) else (arg[0], self.resolve(arg[1]))

        def one(match: re.Match[str]) -> str:
            name = match.group(1)
            if name.startswith("!"):
                return "${" + name[1:] + "}"
            if name in variables:
                return str(variables[name])
            if name.startswith("AWS::"):
                return self.pseudo(name)
            if "." in name:
                logical, attribute = name.split(".", 1)
                return self.attribute(logical, attribute)
            if name in self.resources:
                return self.attribute(name, "Ref")
            return match.group(0)  # an IAM policy variable such as ${aws:PrincipalTag/participant}

        return re.sub(r"\$\{([^}]+)\}", one, text)


def _roles_of(props: Mapping[str, Any]) -> list[str]:
    return [r["Ref"] for r in _as_list(props.get("Roles")) if isinstance(r, dict) and "Ref" in r]


def build_model(template: Mapping[str, Any], binding: Binding) -> AccessModel:
    """Every principal of the template with its resolved identity policies, and every resource policy."""
    r = _Resolver(template, binding)
    resources = r.resources
    policies: dict[str, dict[str, Any]] = {}  # role logical id -> policy name -> document

    def attach(role: str, name: str, document: Any) -> None:
        policies.setdefault(role, {})[name] = r.resolve(document)

    resource_policies: dict[str, Any] = {}
    managed: dict[str, Any] = {}
    for logical_id, resource in resources.items():
        kind, props = resource["Type"], resource.get("Properties", {})
        if kind == "AWS::IAM::Role":
            policies.setdefault(logical_id, {})
            for inline in _as_list(props.get("Policies")):
                attach(logical_id, inline["PolicyName"], inline["PolicyDocument"])
            for arn in _as_list(props.get("ManagedPolicyArns")):
                if not (isinstance(arn, dict) and "Ref" in arn):
                    raise TemplateError(f"{logical_id} has a managed policy outside the template: {arn}")
        elif kind == "AWS::IAM::Policy":
            for role in _roles_of(props):
                attach(role, props.get("PolicyName", logical_id), props["PolicyDocument"])
        elif kind == "AWS::IAM::ManagedPolicy":
            managed[logical_id] = r.resolve(props["PolicyDocument"])
            for role in _roles_of(props):
                attach(role, logical_id, props["PolicyDocument"])
        elif kind == "AWS::S3::BucketPolicy":
            resource_policies[r.attribute(props["Bucket"]["Ref"], "Arn")] = r.resolve(props["PolicyDocument"])
        elif kind == "AWS::SNS::TopicPolicy":
            for topic in _as_list(props.get("Topics")):
                resource_policies[r.resolve(topic)] = r.resolve(props["PolicyDocument"])
        elif kind == "AWS::SQS::QueuePolicy":
            for queue in _as_list(props.get("Queues")):
                resource_policies[r.attribute(queue["Ref"], "Arn")] = r.resolve(props["PolicyDocument"])
    for logical_id, resource in resources.items():  # managed policies a role names by ARN
        if resource["Type"] == "AWS::IAM::Role":
            for arn in _as_list(resource.get("Properties", {}).get("ManagedPolicyArns")):
                attach(logical_id, arn["Ref"], resources[arn["Ref"]]["Properties"]["PolicyDocument"])

    principals: dict[str, Principal] = {}
    for logical_id, resource in resources.items():
        if resource["Type"] != "AWS::Lambda::Function":
            continue
        props = resource["Properties"]
        match = _HANDLER.match(str(props.get("Handler", "")))
        role = props.get("Role", {}).get("Fn::GetAtt", [None])[0]
        if match is None or role is None:
            raise TemplateError(f"function {logical_id} has no handler functions.<name>.handler or no role")
        name = FUNCTION + match.group(1)
        principals[name] = Principal(name, r.attribute(role, "Arn"), policies.get(role, {}))
    outputs = template.get("Outputs", {})
    participant_role = outputs.get(OUTPUT_PARTICIPANT_ROLE, {}).get("Value", {}).get("Fn::GetAtt", [None])[0]
    if participant_role is not None:
        principals[PARTICIPANT] = Principal(PARTICIPANT, r.attribute(participant_role, "Arn"),
                                            policies.get(participant_role, {}))
    operator = outputs.get(OUTPUT_OPERATOR_POLICY, {}).get("Value", {}).get("Ref")
    if operator is not None:
        principals[OPERATOR] = Principal(OPERATOR, f"arn:aws:iam::{binding.account}:role/operator",
                                         {operator: managed[operator]})
    return AccessModel(binding.account, binding.region, principals, resource_policies)


def participant_context(pid: str) -> dict[str, str]:
    """The condition keys a participant's session carries: its one session tag."""
    return {f"aws:PrincipalTag/{PARTICIPANT_TAG}": pid}
