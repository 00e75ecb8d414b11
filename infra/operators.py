"""What an operator of the run needs: one managed policy, for the people (or the CI role) who run `fed`.

The stack creates no operator identity (who operates a run is the account owner's choice): it creates the policy,
and its ARN is a stack output (`OperatorPolicyArn`) to attach to an operator's role or user. With it, and nothing
else, every `fed` command works against the deployed run:

    fed status / dashboard / verify    read the run's state items and objects (every version: verify recomputes)
    fed run pause / resume             commit the request, switch the tick schedule, invoke the tick function
    fed run restore                    write the checkpoint's global model and optimizer state back, commit the state
    fed hosts invite / list / revoke / reinstate
                                       write and read the host records (invite stores a secret's hash), mark a host
                                       revoked (and record the revocation), and deny its sessions in the participant
                                       role's inline policy
    fed check                          list the stack's resources, read the functions' configuration and invoke
                                       the tick as a dry run, ask IAM's policy simulator about every role (this
                                       policy's own document included), read the bucket's notification setting
                                       and the three rules and test their patterns, open a participant session
                                       (the participant role, tagged) and try its keys

The operator never acts as the coordinator: a pause or resume is carried out by the tick function it invokes, so
the coordinator's roles alone write what they write and publish to the state topic.
"""

from __future__ import annotations

from collections.abc import Sequence

from aws_cdk import Aws, Stack
from aws_cdk import aws_dynamodb as dynamodb
from aws_cdk import aws_events as events
from aws_cdk import aws_iam as iam
from aws_cdk import aws_lambda as lambda_
from aws_cdk import aws_s3 as s3
from constructs import Construct

from infra import layout
from infra.nag import acknowledge, arn_ref
from shared.config import RunConfig
from shared.keys import run_prefix
from shared.naming import ingest_rule_name, join_rule_name

# What `fed check` (on AWS) asks of IAM, and how it opens a participant session to try.
SIMULATE = "iam:SimulatePrincipalPolicy"
# Actions the service authorization reference gives no resource type: IAM takes them only on "*". Neither reads
# anything of the account: each judges only what the request itself carries (an event and a pattern; a policy
# document, actions and ARNs).
RESOURCELESS = ("events:TestEventPattern", "iam:SimulateCustomPolicy")
# `fed hosts revoke|reinstate` writes the participant role's inline policy `shared.naming.REVOKED_HOSTS_POLICY` whole,
# from the revocation records (`fed.hosts.deny_sessions`): it never reads it back nor deletes it. It reads the role's
# own inline policy (`shared.naming.PARTICIPANT_POLICY`) for its size: IAM counts a role's inline policies together.
REVOKE_ACTIONS = ("iam:PutRolePolicy", "iam:GetRolePolicy")


def policy_name(run_id: str) -> str:
    """The operator policy's name: known before it exists, so the policy can let its holder read it back (`fed check`
    simulates it; a policy cannot name its own generated ARN). IAM names are global to the account, the run's other
    names regional: the region keeps the same run id deployable in two regions."""
    return f"fed-{run_id}-operator-{Aws.REGION}"


class OperatorAccess(Construct):
    """The operator's managed policy (`policy`)."""

    def __init__(
        self,
        scope: Construct,
        id: str,
        *,
        config: RunConfig,
        bucket: s3.IBucket,
        table: dynamodb.ITable,
        tick: lambda_.IFunction,
        functions: Sequence[lambda_.IFunction],
        schedule: events.IRule,
        roles: Sequence[iam.IRole],
        participant_role: iam.IRole,
    ) -> None:
        super().__init__(scope, id)
        run_id = config.run_id
        prefix = run_prefix(run_id)
        stack = Stack.of(self)
        name = policy_name(run_id)
        own_arn = stack.format_arn(service="iam", region="", resource="policy", resource_name=name)
        self.policy = iam.ManagedPolicy(
            self,
            "Policy",
            managed_policy_name=name,
            description=f"Operate run {run_id} with `fed` (status, dashboard, verify, pause, resume, restore, hosts, "
            "check).",
            statements=[
                iam.PolicyStatement(sid="ReadRunState", actions=["dynamodb:GetItem", "dynamodb:Query"],
                                    resources=[table.table_arn]),
                # pause and resume commit the request on the state item, restore a rebuilt state: whole (PutItem,
                # conditional on its version, as a tick commits)
                iam.PolicyStatement(sid="CommitRunState", actions=["dynamodb:PutItem"], resources=[table.table_arn]),
                iam.PolicyStatement(sid="ReadRunObjects", actions=["s3:GetObject", "s3:GetObjectVersion"],
                                    resources=[bucket.arn_for_objects(f"{prefix}*")]),
                iam.PolicyStatement(sid="ListRunBucket", actions=["s3:ListBucket", "s3:ListBucketVersions"],
                                    resources=[bucket.bucket_arn]),
                # restore puts the checkpoint's global model and optimizer state back where the run reads them
                iam.PolicyStatement(sid="RestoreModels", actions=["s3:PutObject"],
                                    resources=[bucket.arn_for_objects(layout.global_models(run_id)),
                                               bucket.arn_for_objects(layout.optimizer_objects(run_id))]),
                iam.PolicyStatement(sid="PaceTickSchedule", actions=["events:EnableRule", "events:DisableRule"],
                                    resources=[schedule.rule_arn]),
                # fed check: the bucket tells EventBridge of its objects, the two upload rules and the schedule are
                # there, on, with the patterns the code builds (tested against sample events)
                iam.PolicyStatement(sid="CheckBucketEvents", actions=["s3:GetBucketNotification"],
                                    resources=[bucket.bucket_arn]),
                iam.PolicyStatement(sid="CheckRules", actions=["events:DescribeRule"],
                                    resources=[schedule.rule_arn,
                                               *(stack.format_arn(service="events", resource="rule", resource_name=n)
                                                 for n in (ingest_rule_name(run_id), join_rule_name(run_id)))]),
                iam.PolicyStatement(sid="CheckResourcelessActions", actions=list(RESOURCELESS), resources=["*"]),
                iam.PolicyStatement(sid="InvokeTick", actions=["lambda:InvokeFunction"],
                                    resources=[tick.function_arn]),
                iam.PolicyStatement(sid="CheckFunctions", actions=["lambda:GetFunction"],
                                    resources=[fn.function_arn for fn in functions]),
                iam.PolicyStatement(sid="CheckRoles", actions=[SIMULATE],
                                    resources=[role.role_arn for role in (*roles, participant_role)]),
                # fed check simulates this policy's default version (iam:SimulateCustomPolicy)
                iam.PolicyStatement(sid="ReadOwnPolicy", actions=["iam:GetPolicy", "iam:GetPolicyVersion"],
                                    resources=[own_arn]),
                iam.PolicyStatement(sid="TryParticipantSession", actions=["sts:AssumeRole", "sts:TagSession"],
                                    resources=[participant_role.role_arn]),
                # fed hosts revoke marks the host item revoked and reinstate starts its next generation (invite's and
                # the revocation record's PutItem, list's and the revocation records' Query are granted above)
                iam.PolicyStatement(sid="RevokeHosts", actions=["dynamodb:UpdateItem"], resources=[table.table_arn]),
                # ... and on AWS writes the participant role's inline policy REVOKED_HOSTS_POLICY, a deny on the
                # revoked hosts' session tags, which cuts the sessions they already hold at once. IAM has no condition
                # key for an inline policy's name, so this reaches every inline policy of the participant role; its
                # permissions boundary (`ParticipantAccess`) keeps whatever is written there within what the template
                # grants participants, so this right cannot widen a participant session (nor the operator's own).
                iam.PolicyStatement(sid="RevokeHostSessions", actions=list(REVOKE_ACTIONS),
                                    resources=[participant_role.role_arn]),
                # the outputs (every `fed` command with --stack), the resources (fed check: functions, queues)
                iam.PolicyStatement(sid="ReadStack",
                                    actions=["cloudformation:DescribeStacks", "cloudformation:ListStackResources"],
                                    resources=[stack.stack_id]),
            ],
        )
        acknowledge(
            self.policy,
            "IAM5",
            "The operator reads every object of this run (status, verify recompute any round from its inputs) and "
            "restores global models and optimizer state of the checkpoint's round (rounds/<round>/global/<digest>, "
            "rounds/<round>/optimizer/<digest>); rounds and digests are not known at deploy time.",
            findings=[f"Resource::{arn_ref(bucket)}/{key}"
                      for key in (f"{prefix}*", layout.global_models(run_id), layout.optimizer_objects(run_id))],
        )
        acknowledge(
            self.policy,
            "IAM5",
            f"{' and '.join(RESOURCELESS)} act on no resource (the service authorization reference lists none), so "
            "IAM grants them only on '*'; neither reads anything of the account: `fed check` matches sample S3 "
            "events against the rules' patterns, and simulates this very policy's document.",
            findings=["Resource::*"],
        )
