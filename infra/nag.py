"""cdk-nag (3.x) wiring: the AwsSolutions pack and this project's own checks as validation plugins, and
acknowledgements with reasons.

A finding fails synthesis. An acknowledgement sits next to the resource it excuses and names the exact
finding (for IAM5, the one resource or action it is about), so a new wildcard is never excused by an
old reason.

The AwsSolutions pack has no rule about Lambda function URLs; cdk-nag's rule that a function URL takes IAM auth
(LambdaFunctionUrlAuth) is in no pack it ships. `FedChecks` runs that rule, so a URL open to anyone is a finding
like any other and is deployed only with an acknowledgement that says what protects it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

import jsii
from aws_cdk import Acknowledgment, CfnElement, CfnResource, Stack, Validations
from aws_cdk import aws_lambda as lambda_
from cdk_nag import AwsSolutionsChecks, IApplyRule, NagMessageLevel, NagPack, NagRuleCompliance
from constructs import Construct, IConstruct

PACK = "AwsSolutions"
FED_PACK = "Fed"
URL_AUTH = "LambdaFunctionUrlAuth"  # cdk-nag's name for the rule


@jsii.implements(IApplyRule)
class _FunctionUrlAuth:
    """A function URL must take IAM auth (`FunctionUrlAuthType.AWS_IAM`). jsii reads the rule's fields through
    properties (plain attributes are not seen)."""

    def __init__(self, node: CfnResource) -> None:
        self._node = node

    @property
    def node(self) -> CfnResource:
        return self._node

    @property
    def rule_suffix_override(self) -> str:
        return URL_AUTH

    @property
    def info(self) -> str:
        return "The Lambda function URL takes no IAM auth: anyone who can reach it may invoke the function."

    @property
    def explanation(self) -> str:
        return ("A URL with auth type NONE is public. Only a function that authenticates its callers itself, and "
                "bounds what an unauthenticated flood of requests can cost, may have one.")

    @property
    def level(self) -> NagMessageLevel:
        return NagMessageLevel.ERROR

    def rule(self, node: CfnResource) -> NagRuleCompliance:
        if not isinstance(node, lambda_.CfnUrl):
            return NagRuleCompliance.NOT_APPLICABLE
        return NagRuleCompliance.NON_COMPLIANT if node.auth_type == "NONE" else NagRuleCompliance.COMPLIANT


class FedChecks(NagPack):
    """This project's rules that no shipped pack runs."""

    def __init__(self, *, verbose: bool = True) -> None:
        super().__init__(verbose=verbose)
        self._pack_name = FED_PACK

    @property
    def name(self) -> str:
        return FED_PACK

    def _check_resource(self, node: CfnResource) -> None:
        self._apply_rule(cast(IApplyRule, _FunctionUrlAuth(node)))  # (read-only properties: see the class)


def add_checks(app: Construct, *, verbose: bool = True) -> AwsSolutionsChecks:
    """Run the AwsSolutions pack and `FedChecks` over the whole app at synthesis."""
    checks = AwsSolutionsChecks(app, verbose=verbose)
    Validations.of(app).add_plugins(checks, FedChecks(verbose=verbose))
    return checks


def acknowledge(scope: IConstruct, rule: str, reason: str, *, findings: Iterable[str] = (), pack: str = PACK) -> None:
    """Acknowledge `rule` (e.g. "IAM5") of `pack` on `scope` and its children; with `findings`, only those ones."""
    rule_id = f"{pack}-{rule}"
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
