"""The coordinator: the tick, ingest, join and shard-worker functions, what invokes them, and where failed events go.

    EventBridge "Object Created", uploads but runs/<run>/join/  -->  ingest (validate, record, tick)
    EventBridge "Object Created" under runs/<run>/join/  -->  join queue  -->  join (register; no tick)
                                                   (event source mapping, maximum concurrency join_concurrency)
    EventBridge schedule, every TICK_SCHEDULE_MINUTES  -->  tick (deadlines, liveness)
    a commit (of tick or ingest) changing phase, round, epoch or model  -->  the run-state topic
    a tick (of tick or ingest) that aggregates a round  -->  shard queue  -->  shard, K at once
                            (event source mapping, maximum concurrency shard_concurrency; the tick waits for
                            the K outcomes the workers leave in the bucket, rounds/<r>/staging/<job>/<first>)

Ingest and tick are asynchronous invocations: Lambda retries a failed one, then sends it to the dead-letter
queue; an event EventBridge itself cannot deliver goes to the same queue. Join requests wait in their own
queue, so that a burst of them never takes the concurrency heartbeats and updates need; a join request that
keeps failing moves from that queue to the dead-letter queue too. Shard tasks wait in the shard queue: a worker
retries a failing shard itself and reports the failure to the waiting tick, which fails (and is retried,
dead-lettered and alarmed as a tick); a worker that dies (out of memory, timeout) leaves its message to be
delivered again (six worker timeouts later: `Coordinator`), and after shard_max_receives to the dead-letter queue.
"""

from __future__ import annotations

from collections.abc import Callable

from aws_cdk import Duration, Stack
from aws_cdk import aws_dynamodb as dynamodb
from aws_cdk import aws_events as events
from aws_cdk import aws_events_targets as targets
from aws_cdk import aws_iam as iam
from aws_cdk import aws_lambda as lambda_
from aws_cdk import aws_lambda_event_sources as event_sources
from aws_cdk import aws_s3 as s3
from aws_cdk import aws_sns as sns
from aws_cdk import aws_sqs as sqs
from constructs import Construct

from infra import layout
from infra.lambdas import FunctionSpec, coordinator_function
from infra.nag import acknowledge, arn_ref
from infra.settings import MAX_QUEUE_RETENTION_SECONDS, DeploySettings, FunctionSettings
from infra.storage import removal_policy
from shared.config import RunConfig
from shared.keys import heartbeat_prefix, join_prefix, run_prefix
from shared.naming import (
    ENV_BUCKET,
    ENV_CONFIG,
    ENV_RUN_ID,
    ENV_SHARD_RUNNER,
    ENV_SHARD_WAIT,
    ENV_STATE_TOPIC,
    ENV_TABLE,
    METRICS_NAMESPACE,
    TICK_SCHEDULE_MINUTES,
    ingest_rule_name,
    join_request_pattern,
    join_rule_name,
    object_created_pattern,
    tick_rule_name,
)

# DynamoDB actions the coordinator uses. A TransactWriteItems call has no IAM action of its own: IAM
# authorizes each of its parts (here Puts and Updates), so those are what is granted. DeleteItem gives a lease back
# (`store.table.StateStore.release`: the round's aggregation lease, once the round is committed).
STATE_ACTIONS = (
    "dynamodb:GetItem",
    "dynamodb:Query",
    "dynamodb:PutItem",
    "dynamodb:UpdateItem",
    "dynamodb:DeleteItem",
)


def list_bucket(bucket: s3.IBucket, *actions: str) -> iam.PolicyStatement:
    """s3:ListBucket on the run's bucket (its own: every key in it is the run's), with no s3:prefix condition.

    Without ListBucket, S3 answers a read of a missing key 403 AccessDenied instead of 404, and the coordinator
    reads keys that may be missing (a checkpoint, a shard's outcome, a heartbeat). Whether S3 judges that check with
    the missing key as s3:prefix is not documented, so a grant limited by s3:prefix is not relied on."""
    return iam.PolicyStatement(sid="ListRunBucket", actions=["s3:ListBucket", *actions],
                               resources=[bucket.bucket_arn])


def coordinator_statements(
    bucket: s3.IBucket, table: dynamodb.ITable, run_id: str, shard_queue: sqs.IQueue | None = None,
    state_topic: sns.ITopic | None = None,
) -> list[iam.PolicyStatement]:
    """What one tick needs; ingest needs the same, since it ticks after recording (and the tick that closes a
    round on its last update aggregates it)."""
    prefix = run_prefix(run_id)
    send = (
        # The tick hands an aggregation's shards to the shard queue (FED_SHARD_RUNNER): that queue and nothing else.
        [iam.PolicyStatement(sid="SendShardTasks", actions=["sqs:SendMessage"], resources=[shard_queue.queue_arn])]
        if shard_queue is not None else []
    )  # fmt: skip
    publish = (
        # A commit changing phase, round, epoch or model publishes the state to the topic (FED_STATE_TOPIC_ARN), and
        # only there. Its key is the AWS-managed SNS key, which admits the account's principals through SNS: no KMS.
        [iam.PolicyStatement(sid="PublishStateChanges", actions=["sns:Publish"], resources=[state_topic.topic_arn])]
        if state_topic is not None else []
    )  # fmt: skip
    return [
        iam.PolicyStatement(
            sid="ReadRunObjects",
            # GetObjectVersion: the S3 event names the version that was uploaded; ingest and aggregation read the
            # accepted versions of updates and globals by byte range, and the staged aggregate is copied to its
            # content address by its version (CopyObject reads its source with these two actions).
            actions=["s3:GetObject", "s3:GetObjectVersion"],
            resources=[bucket.arn_for_objects(f"{prefix}*")],
        ),
        # ListBucketVersions: a verified read (`store.blobs.Bucket.verified_version`) of an object the coordinator
        # wrote looks for its own version among later ones written over it (reported as tampered if none is).
        list_bucket(bucket, "s3:ListBucketVersions"),
        iam.PolicyStatement(
            sid="WriteCoordinatorObjects",
            # Global models: a small one PUT whole, a large one the destination of the CopyObject from staging.
            actions=["s3:PutObject"],
            resources=[bucket.arn_for_objects(key) for key in layout.coordinator_writes(run_id)],
        ),
        iam.PolicyStatement(
            sid="StageAggregates",
            # The aggregate's multipart upload: PutObject covers CreateMultipartUpload, UploadPart (shards on the
            # tick's own threads, without shard workers) and CompleteMultipartUpload; a failed one is aborted.
            actions=["s3:PutObject", "s3:AbortMultipartUpload"],
            resources=[bucket.arn_for_objects(layout.staging_objects(run_id))],
        ),
        *send,
        *publish,
        iam.PolicyStatement(
            sid="PaceTickSchedule",
            # Off while the run is idle (nothing billed), on when it needs ticks: this run's schedule only.
            actions=["events:EnableRule", "events:DisableRule"],
            resources=[Stack.of(bucket).format_arn(service="events", resource="rule",
                                                    resource_name=tick_rule_name(run_id))],
        ),
        iam.PolicyStatement(sid="RunState", actions=list(STATE_ACTIONS), resources=[table.table_arn]),
    ]


def shard_statements(bucket: s3.IBucket, run_id: str) -> list[iam.PolicyStatement]:
    """What a shard worker needs: read the round's accepted updates and its global model by range (by version id),
    upload parts of the staged aggregate. No table, no other object: it decides nothing, it computes. The bucket is
    encrypted with S3-managed keys (SSE-S3, `infra.storage`), so no KMS permission is needed (nor for the others)."""
    rounds = layout.round_objects(run_id)
    return [
        iam.PolicyStatement(
            sid="ReadRoundObjects",
            # GetObjectVersion: updates and the base global are read by the version ingest accepted.
            actions=["s3:GetObject", "s3:GetObjectVersion"],
            resources=[bucket.arn_for_objects(rounds)],
        ),
        # (a missing input is then reported as missing, left out of the round, rather than failing the aggregation;
        # ListBucketVersions: the optimizer state's pieces are verified reads, as the ticks' are)
        list_bucket(bucket, "s3:ListBucketVersions"),
        iam.PolicyStatement(
            sid="UploadStagedParts",
            # UploadPart is authorized as s3:PutObject; creating, completing and aborting the upload is the tick's.
            # The server optimizer's state and the download delta are written piece by piece by the worker
            # computing the piece.
            actions=["s3:PutObject"],
            resources=[bucket.arn_for_objects(layout.staging_objects(run_id)),
                       bucket.arn_for_objects(layout.optimizer_objects(run_id)),
                       bucket.arn_for_objects(layout.delta_objects(run_id))],
        ),
    ]


# What registering a joiner takes: reading its participant record, creating it with the participant count (one
# transaction of a Put and an Update), recording a refusal, taking a message's news (an Update).
JOIN_STATE_ACTIONS = ("dynamodb:GetItem", "dynamodb:PutItem", "dynamodb:UpdateItem")


def join_statements(bucket: s3.IBucket, table: dynamodb.ITable, run_id: str) -> list[iam.PolicyStatement]:
    """What the join function needs: read join requests (and the heartbeat that may have overtaken one), write
    participant records. No model, no run state: a flood of joins reaches nothing else."""
    return [
        iam.PolicyStatement(
            sid="ReadJoinRequestsAndHeartbeats",
            actions=["s3:GetObject", "s3:GetObjectVersion"],
            resources=[bucket.arn_for_objects(f"{join_prefix(run_id)}*"),
                       bucket.arn_for_objects(f"{heartbeat_prefix(run_id)}*")],
        ),
        list_bucket(bucket),  # (no heartbeat yet is then a 404, not a 403)
        iam.PolicyStatement(sid="Participants", actions=list(JOIN_STATE_ACTIONS), resources=[table.table_arn]),
    ]


class Coordinator(Construct):
    """The functions, the S3-event rule, the tick schedule and the dead-letter queue; the two functions that commit
    the run state (tick, and ingest, which ticks) publish its changes to `state_topic`.

    The shard and join queues follow Lambda's advice for a queue event source: a visibility timeout of six times
    the draining function's timeout, and a redrive to the dead-letter queue after at least five receives. Lambda
    receives a task before it knows it can invoke the function; throttled (the account's concurrency spent, or the
    worker's reserved concurrency), it retries the invocation while the task is invisible, then hands it back, and
    each hand-back counts as a receive. With a visibility of the timeout + 30 s and three receives, a shard task
    could reach the dead-letter queue without ever having run, while its tick waited for it until its deadline.

    The price is paid when a shard worker dies (out of memory, its timeout): its task is visible again only six
    timeouts later (90 minutes at 900 s), long after the tick waiting for it gave up (at its own timeout - 30 s:
    the tick fails, is alarmed, and is retried like any tick) and aborted the staged upload. Nothing waits for the
    redelivery. The round stays uncommitted in the table; the next tick plans it afresh: the same aggregation job
    (named by a digest of its inputs, so the same staging key and the same outcome keys), a new multipart upload,
    new tasks. The old task, delivered again later, does no harm. Its parts go to its own upload, which is gone
    (aborted; or completed, if the worker died after reporting), so S3 refuses them, and the worker then leaves no
    outcome (`functions.shard`): it would fall on the key where the current attempt's worker leaves its own. A tick
    takes an outcome only for the upload it started (`upload_id`), and what else a shard writes (optimizer state
    and download delta pieces) is content-addressed: the same bytes under the same keys. A task that kills its
    worker every time reaches the dead-letter queue (alarmed) after shard_max_receives visibility timeouts, so the
    shard queue keeps a task that long (`DeploySettings.shard_retention_seconds`)."""

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
        state_topic: sns.ITopic,
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

        def build(name: str, description: str, fn_settings: FunctionSettings, granted: list[iam.PolicyStatement],
                  asynchronous: bool = True, extra: dict[str, str] | None = None) -> lambda_.Function:
            spec = FunctionSpec(name, f"functions.{name}.handler", description, fn_settings, granted)
            return coordinator_function(
                self,
                spec,
                code=code,
                environment={**environment, **(extra or {})},
                dead_letter_queue=self.dead_letters if asynchronous else None,
                log_retention_days=settings.log_retention_days,
                log_removal=removal_policy(settings),
            )

        self._shard_worker(run_id, settings, bucket, build)
        statements = coordinator_statements(bucket, table, run_id, shard_queue=self.shard_queue,
                                            state_topic=state_topic)

        def shards(fn: FunctionSettings) -> dict[str, str]:
            # The waiting tick gives up a little before its own timeout (the shards' retries run inside that time).
            # It commits the state too, and publishes the commits that change phase, round, epoch or model.
            return {ENV_SHARD_RUNNER: f"queue:{self.shard_queue.queue_url}",
                    ENV_SHARD_WAIT: str(max(30, fn.timeout_seconds - 30)),
                    ENV_STATE_TOPIC: state_topic.topic_arn}

        self.tick = build("tick", f"Run {run_id}: scheduled tick (deadlines, liveness)", settings.tick, statements,
                          extra=shards(settings.tick))
        self.ingest = build("ingest", f"Run {run_id}: validate and record an upload, then tick", settings.ingest,
                            statements, extra=shards(settings.ingest))
        self.join = build("join", f"Run {run_id}: register joiners, from the join queue (no tick)", settings.join,
                          join_statements(bucket, table, run_id), asynchronous=False)
        self.functions = (self.tick, self.ingest, self.join, self.shard)
        self.committers = (self.tick, self.ingest)  # the functions that commit the run state (and publish it)

        self._rules(run_id, settings, bucket)
        self._acknowledge(bucket, run_id)

    def _shard_worker(self, run_id: str, settings: DeploySettings, bucket: s3.Bucket,
                      build: Callable[..., lambda_.Function]) -> None:
        """The shard worker, fed by the shard queue that whichever tick aggregates fills. It reads the table's name
        from the environment like the others, never the table."""
        self.shard = build("shard", f"Run {run_id}: aggregation shards, from the shard queue a tick fills",
                           settings.shard, shard_statements(bucket, run_id), asynchronous=False)
        self.shard_queue = sqs.Queue(
            self,
            "ShardQueue",
            encryption=sqs.QueueEncryption.SQS_MANAGED,
            enforce_ssl=True,
            # Lambda's advice for a queue event source (see the class docstring for what a late task does)
            visibility_timeout=Duration.seconds(settings.shard.queue_visibility_seconds),
            retention_period=Duration.seconds(settings.shard_retention_seconds()),
            dead_letter_queue=sqs.DeadLetterQueue(max_receive_count=settings.shard_max_receives,
                                                  queue=self.dead_letters),
        )
        self.shard.add_event_source(
            event_sources.SqsEventSource(self.shard_queue, batch_size=1, max_concurrency=settings.shard_concurrency)
        )

    def _rules(self, run_id: str, settings: DeploySettings, bucket: s3.Bucket) -> None:
        """What invokes the functions: uploads (ingest), join requests (their own lane: a queue and the join
        function draining it), and the schedule (tick)."""
        pattern = object_created_pattern(bucket.bucket_name, run_id)
        self.object_created = events.Rule(
            self,
            "ObjectCreated",
            rule_name=ingest_rule_name(run_id),
            description=f"Participants' uploads to the run's bucket but join requests ({join_prefix(run_id)}) go to "
            "the ingest function; the coordinator's own objects go nowhere.",
            # The very dict the local run registers; only its keys are spelled the CDK way here.
            event_pattern=events.EventPattern(**{key.replace("-", "_"): value for key, value in pattern.items()}),
            targets=[self._target(self.ingest)],
        )
        # The join lane: its own rule, a queue, and the join function draining it at a bounded concurrency.
        self.join_queue = sqs.Queue(
            self,
            "JoinQueue",
            encryption=sqs.QueueEncryption.SQS_MANAGED,
            enforce_ssl=True,
            # Lambda's advice for a queue event source, as the shard queue's
            visibility_timeout=Duration.seconds(settings.join.queue_visibility_seconds),
            retention_period=Duration.seconds(MAX_QUEUE_RETENTION_SECONDS),
            dead_letter_queue=sqs.DeadLetterQueue(max_receive_count=settings.join_max_receives,
                                                  queue=self.dead_letters),
        )
        join_pattern = join_request_pattern(bucket.bucket_name, run_id)
        self.join_requests = events.Rule(
            self,
            "JoinRequests",
            rule_name=join_rule_name(run_id),
            description=f"Join requests under {join_prefix(run_id)} wait in the join queue (their own lane).",
            event_pattern=events.EventPattern(**{key.replace("-", "_"): value for key, value in join_pattern.items()}),
            targets=[targets.SqsQueue(self.join_queue, dead_letter_queue=self.dead_letters, retry_attempts=8,
                                      max_event_age=Duration.hours(2))],
        )
        self.join.add_event_source(
            event_sources.SqsEventSource(
                self.join_queue,
                batch_size=settings.join_batch_size,
                max_concurrency=settings.join_concurrency,
                report_batch_item_failures=True,
            )
        )
        self.schedule = events.Rule(
            self,
            "TickSchedule",
            rule_name=tick_rule_name(run_id),
            description="The safety-net tick: deadlines and liveness advance even when nobody uploads. The run "
            "switches it off while idle (finished, or paused) and on again when woken (resume, restore).",
            schedule=events.Schedule.rate(Duration.minutes(TICK_SCHEDULE_MINUTES)),
            targets=[self._target(self.tick)],
        )

    def _target(self, fn: lambda_.Function) -> targets.LambdaFunction:
        return targets.LambdaFunction(
            fn, dead_letter_queue=self.dead_letters, retry_attempts=8, max_event_age=Duration.hours(2)
        )

    def _acknowledge(self, bucket: s3.Bucket, run_id: str) -> None:
        wildcards = [f"{run_prefix(run_id)}*", *(k for k in layout.coordinator_writes(run_id) if "*" in k),
                     layout.staging_objects(run_id)]
        for fn in (self.tick, self.ingest):
            acknowledge(
                fn.role,  # type: ignore[arg-type]
                "IAM5",
                "Object ARNs end in a wildcard only below this run's prefix: the function reads any object "
                "of its run (uploads, join requests, heartbeats, models) and writes only global models of "
                "any round, the server optimizer state's files (rounds/<round>/optimizer/<digest>), the download "
                "deltas' files (rounds/<round>/delta/<digest>), the run state's rosters (roster/<digest>), "
                "checkpoints (besides manifest and config) and the staged aggregate of any round "
                "(rounds/<round>/staging/<job id>), whose keys are not known at deploy time.",
                findings=[f"Resource::{arn_ref(bucket)}/{key}" for key in wildcards],
            )
        acknowledge(
            self.shard.role,  # type: ignore[arg-type]
            "IAM5",
            "The shard worker reads only objects of this run's rounds (the accepted updates and the global model of "
            "the round it aggregates, by version id) and uploads parts only to staged aggregates "
            "(rounds/<round>/staging/<job id>), the server optimizer state's and the download delta's piece files "
            "(rounds/<round>/optimizer/<digest>, rounds/<round>/delta/<digest>); rounds, job ids and digests are not "
            "known at deploy time.",
            findings=[f"Resource::{arn_ref(bucket)}/{key}"
                      for key in (layout.round_objects(run_id), layout.staging_objects(run_id),
                                  layout.optimizer_objects(run_id), layout.delta_objects(run_id))],
        )
        acknowledge(
            self.join.role,  # type: ignore[arg-type]
            "IAM5",
            "The join function reads only join requests and heartbeats of this run, one object per participant "
            "under each of the two prefixes; the participant ids are not known at deploy time.",
            findings=[f"Resource::{arn_ref(bucket)}/{key}*" for key in (join_prefix(run_id), heartbeat_prefix(run_id))],
        )
