"""The coordinator: the tick and ingest functions, what invokes them, and where failed events go.

    EventBridge "Object Created" under runs/<run>/  -->  ingest (validate, record, tick)
    EventBridge schedule, every TICK_SCHEDULE_MINUTES  -->  tick (deadlines, liveness)

Both are asynchronous invocations: Lambda retries a failed one, then sends it to the dead-letter queue;
an event EventBridge itself cannot deliver goes to the same queue.
"""

from __future__ import annotations

from aws_cdk import Duration
from aws_cdk import aws_dynamodb as dynamodb
from aws_cdk import aws_events as events
from aws_cdk import aws_events_targets as targets
from aws_cdk import aws_iam as iam
from aws_cdk import aws_lambda as lambda_
from aws_cdk import aws_s3 as s3
from aws_cdk import aws_sqs as sqs
from constructs import Construct

from infra import layout
from infra.lambdas import FunctionSpec, coordinator_function
from infra.nag import acknowledge, arn_ref
from infra.settings import DeploySettings, FunctionSettings
from infra.storage import removal_policy
from shared.config import RunConfig
from shared.keys import run_prefix
from shared.naming import (
    ENV_BUCKET,
    ENV_CONFIG,
    ENV_RUN_ID,
    ENV_TABLE,
    METRICS_NAMESPACE,
    TICK_SCHEDULE_MINUTES,
    ingest_rule_name,
    object_created_pattern,
)

# DynamoDB actions the coordinator uses. A TransactWriteItems call has no IAM action of its own: IAM
# authorizes each of its parts (Put, Update, ConditionCheck), so those are what is granted.
STATE_ACTIONS = (
    "dynamodb:GetItem",
    "dynamodb:Query",
    "dynamodb:PutItem",
    "dynamodb:UpdateItem",
    "dynamodb:ConditionCheckItem",
)


def coordinator_statements(bucket: s3.IBucket, table: dynamodb.ITable, run_id: str) -> list[iam.PolicyStatement]:
    """What one tick needs; ingest needs the same, since it ticks after recording."""
    prefix = run_prefix(run_id)
    return [
        iam.PolicyStatement(
            sid="ReadRunObjects",
            # GetObjectVersion: the S3 event names the version that was uploaded.
            actions=["s3:GetObject", "s3:GetObjectVersion"],
            resources=[bucket.arn_for_objects(f"{prefix}*")],
        ),
        iam.PolicyStatement(
            sid="ListRunPrefix",
            # Without ListBucket, reading a missing key is AccessDenied (403) rather than NoSuchKey (404).
            actions=["s3:ListBucket"],
            resources=[bucket.bucket_arn],
            conditions={"StringLike": {"s3:prefix": [f"{prefix}*"]}},
        ),
        iam.PolicyStatement(
            sid="WriteCoordinatorObjects",
            actions=["s3:PutObject"],
            resources=[bucket.arn_for_objects(key) for key in layout.coordinator_writes(run_id)],
        ),
        iam.PolicyStatement(sid="RunState", actions=list(STATE_ACTIONS), resources=[table.table_arn]),
    ]


class Coordinator(Construct):
    """The functions, the S3-event rule, the tick schedule and the dead-letter queue."""

    def __init__(
        self,
        scope: Construct,
        id: str,
        *,
        config: RunConfig,
        settings: DeploySettings,
        bucket: s3.Bucket,
        table: dynamodb.Table,
        code: lambda_.Code,
    ) -> None:
        super().__init__(scope, id)
        run_id = config.run_id
        self.dead_letters = sqs.Queue(
            self,
            "DeadLetters",
            encryption=sqs.QueueEncryption.SQS_MANAGED,
            enforce_ssl=True,
            retention_period=Duration.days(14),
        )
        environment = {
            ENV_RUN_ID: run_id,
            ENV_BUCKET: bucket.bucket_name,
            ENV_TABLE: table.table_name,
            ENV_CONFIG: config.model_dump_json(),
            "POWERTOOLS_METRICS_NAMESPACE": METRICS_NAMESPACE,
        }
        statements = coordinator_statements(bucket, table, run_id)

        def build(name: str, description: str, fn_settings: FunctionSettings) -> lambda_.Function:
            spec = FunctionSpec(name, f"functions.{name}.handler", description, fn_settings, statements)
            return coordinator_function(
                self,
                spec,
                code=code,
                environment=environment,
                dead_letter_queue=self.dead_letters,
                log_retention_days=settings.log_retention_days,
                log_removal=removal_policy(settings),
            )

        self.tick = build("tick", f"Run {run_id}: scheduled tick (deadlines, liveness)", settings.tick)
        self.ingest = build("ingest", f"Run {run_id}: validate and record an upload, then tick", settings.ingest)
        self.functions = (self.tick, self.ingest)

        pattern = object_created_pattern(bucket.bucket_name, run_id)
        self.object_created = events.Rule(
            self,
            "ObjectCreated",
            rule_name=ingest_rule_name(run_id),
            description=f"Objects uploaded under {run_prefix(run_id)} go to the ingest function.",
            # The very dict the local run registers; only its keys are spelled the CDK way here.
            event_pattern=events.EventPattern(**{key.replace("-", "_"): value for key, value in pattern.items()}),
            targets=[self._target(self.ingest)],
        )
        self.schedule = events.Rule(
            self,
            "TickSchedule",
            description="The safety-net tick: deadlines and liveness advance even when nobody uploads.",
            schedule=events.Schedule.rate(Duration.minutes(TICK_SCHEDULE_MINUTES)),
            targets=[self._target(self.tick)],
        )
        self._acknowledge(bucket, run_id)

    def _target(self, fn: lambda_.Function) -> targets.LambdaFunction:
        return targets.LambdaFunction(
            fn, dead_letter_queue=self.dead_letters, retry_attempts=8, max_event_age=Duration.hours(2)
        )

    def _acknowledge(self, bucket: s3.Bucket, run_id: str) -> None:
        wildcards = [f"{run_prefix(run_id)}*", *(k for k in layout.coordinator_writes(run_id) if "*" in k)]
        for fn in self.functions:
            acknowledge(
                fn.role,  # type: ignore[arg-type]
                "IAM5",
                "Object ARNs end in a wildcard only below this run's prefix: the function reads any object "
                "of its run (uploads, join requests, heartbeats, models) and writes only global models of "
                "any round and checkpoints (besides manifest and config), whose keys are not known at deploy time.",
                findings=[f"Resource::{arn_ref(bucket)}/{key}" for key in wildcards],
            )
