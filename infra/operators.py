"""What an operator of the run needs: one managed policy, for the people (or the CI role) who run `fed`.

The stack creates no operator identity (who operates a run is the account owner's choice): it creates the policy,
and its ARN is a stack output (`OperatorPolicyArn`) to attach to an operator's role or user. With it, and nothing
else, every `fed` command works against the deployed run:

    fed status / dashboard / verify    read the run's state items and objects (every version: verify recomputes)
    fed run pause / resume             commit the request, switch the tick schedule, invoke the tick function
    fed run restore                    write the checkpoint's global model and optimizer state back, commit the state
    fed check                          ask IAM's policy simulator about the stack's roles, open a participant
                                       session (the participant role, tagged) and try its keys, invoke the
                                       functions' wiring without a run

The operator never acts as the coordinator: a pause or resume is carried out by the tick function it invokes, so
the coordinator's roles alone write what they write and publish to the state topic.
"""

from __future__ import annotations

from collections.abc import Sequence

from aws_cdk import Stack
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

# What `fed check` (on AWS) asks of IAM, and how it opens a participant session to try.
SIMULATE = "iam:SimulatePrincipalPolicy"


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
        self.policy = iam.ManagedPolicy(
            self,
            "Policy",
            description=f"Operate run {run_id} with `fed` (status, dashboard, verify, pause, resume, restore, check).",
            statements=[
                iam.PolicyStatement(sid="ReadRunState", actions=["dynamodb:GetItem", "dynamodb:Query"],
                                    resources=[table.table_arn]),
                # pause and resume commit the request on the state item; restore commits a rebuilt state
                iam.PolicyStatement(sid="CommitRunState", actions=["dynamodb:PutItem", "dynamodb:UpdateItem"],
                                    resources=[table.table_arn]),
                iam.PolicyStatement(sid="ReadRunObjects", actions=["s3:GetObject", "s3:GetObjectVersion"],
                                    resources=[bucket.arn_for_objects(f"{prefix}*")]),
                iam.PolicyStatement(sid="ListRunBucket", actions=["s3:ListBucket", "s3:ListBucketVersions"],
                                    resources=[bucket.bucket_arn]),
                # restore puts the checkpoint's global model and optimizer state back where the run reads them
                iam.PolicyStatement(sid="RestoreModels", actions=["s3:PutObject"],
                                    resources=[bucket.arn_for_objects(layout.global_models(run_id)),
                                               bucket.arn_for_objects(layout.optimizer_objects(run_id))]),
                iam.PolicyStatement(sid="PaceTickSchedule",
                                    actions=["events:EnableRule", "events:DisableRule", "events:DescribeRule"],
                                    resources=[schedule.rule_arn]),
                iam.PolicyStatement(sid="InvokeTick", actions=["lambda:InvokeFunction"],
                                    resources=[tick.function_arn]),
                iam.PolicyStatement(sid="CheckFunctions", actions=["lambda:GetFunction"],
                                    resources=[fn.function_arn for fn in functions]),
                iam.PolicyStatement(sid="CheckRoles", actions=[SIMULATE],
                                    resources=[role.role_arn for role in (*roles, participant_role)]),
                iam.PolicyStatement(sid="TryParticipantSession", actions=["sts:AssumeRole", "sts:TagSession"],
                                    resources=[participant_role.role_arn]),
                iam.PolicyStatement(sid="ReadStack", actions=["cloudformation:DescribeStacks"],
                                    resources=[Stack.of(self).stack_id]),
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
