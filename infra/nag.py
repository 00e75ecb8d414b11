"""cdk-nag (3.x) wiring: the AwsSolutions pack as a validation plugin, and acknowledgements with reasons.

A finding fails synthesis. An acknowledgement sits next to the resource it excuses and names the exact
finding (for IAM5, the one resource or action it is about), so a new wildcard is never excused by an
old reason.
"""

from __future__ import annotations

from collections.abc import Iterable

from aws_cdk import Acknowledgment, CfnElement, Stack, Validations
from cdk_nag import AwsSolutionsChecks
from constructs import Construct, IConstruct

PACK = "AwsSolutions"


def add_checks(app: Construct, *, verbose: bool = True) -> AwsSolutionsChecks:
    """Run the AwsSolutions pack over the whole app at synthesis."""
    checks = AwsSolutionsChecks(app, verbose=verbose)
    Validations.of(app).add_plugins(checks)
    return checks


def acknowledge(scope: IConstruct, rule: str, reason: str, *, findings: Iterable[str] = ()) -> None:
    """Acknowledge `rule` (e.g. "IAM5") on `scope` and its children; with `findings`, only those ones."""
    rule_id = f"{PACK}-{rule}"
    ids = [f"{rule_id}[{finding}]" for finding in findings] or [rule_id]
    Validations.of(scope).acknowledge(*(Acknowledgment(id=i, reason=reason) for i in ids))


def arn_ref(resource: IConstruct, attribute: str = "Arn") -> str:
    """How cdk-nag prints a `Fn::GetAtt` of `resource` in a finding: `<LogicalId.Arn>`."""
    logical_id = Stack.of(resource).resolve(Stack.of(resource).get_logical_id(_cfn(resource)))
    return f"<{logical_id}.{attribute}>"


def _cfn(resource: IConstruct) -> CfnElement:
    """The CloudFormation element behind an L2 construct (or the construct itself, if it is one)."""
    element = resource.node.default_child or resource
    if not isinstance(element, CfnElement):
        raise TypeError(f"{resource.node.path} has no CloudFormation element")
    return element
