"""Create, on any endpoint (moto here), the resources the CDK stack declares, from the same names.

Bucket (versioned, EventBridge notifications on), table (pk/sk), the state topic participants' queues
subscribe to (`shared.naming.state_topic_name`), the shard queue the ticks send aggregation shards to (the
dispatcher's shard lane delivers them to the shard-worker function), and the two "Object Created" rules: the main
lane (`shared.naming.object_created_pattern`, the participants' uploads but join requests), whose target here is an
SQS queue the local dispatcher polls (on AWS: the ingest function), and the join lane
(`join_request_pattern`), whose target is a second queue with its own dispatcher worker (on AWS: a queue the
join function drains at a bounded concurrency).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import boto3
from botocore.exceptions import ClientError

from shared.naming import (
    TABLE_HASH_KEY,
    TABLE_RANGE_KEY,
    ingest_queue_name,
    ingest_rule_name,
    join_queue_name,
    join_request_pattern,
    join_rule_name,
    local_bucket_name,
    object_created_pattern,
    shard_queue_name,
    state_topic_name,
    table_name,
    tick_rule_name,
)
from shared.table_keys import TTL_ATTRIBUTE
from store.blobs import s3_client


@dataclass(frozen=True)
class LocalResources:
    run_id: str
    bucket: str
    table: str
    queue_url: str  # the main lane: every upload but join requests (never the coordinator's own objects)
    endpoint: str | None
    region: str
    join_queue_url: str = ""  # the join lane: runs/<run>/join/
    state_topic: str = ""  # the SNS topic a commit that changes phase or round publishes to (participants' queues)
    shard_queue_url: str = ""  # the shard queue: a tick's aggregation shards, one task a message (`functions.shard`)

    @property
    def queue_urls(self) -> tuple[str, ...]:
        """Both lanes' queues (for draining checks)."""
        return tuple(url for url in (self.queue_url, self.join_queue_url) if url)


def client(service: str, endpoint: str | None, region: str) -> Any:
    return boto3.client(service, endpoint_url=endpoint, region_name=region)


def create_resources(run_id: str, endpoint: str | None = None, region: str = "us-east-1") -> LocalResources:
    """Idempotent: an existing resource is reused."""
    bucket, table = local_bucket_name(run_id), table_name(run_id)
    s3 = s3_client(endpoint, region)
    try:
        s3.create_bucket(Bucket=bucket)
    except ClientError as exc:
        if exc.response["Error"]["Code"] not in {"BucketAlreadyOwnedByYou", "BucketAlreadyExists"}:
            raise
    s3.put_bucket_versioning(Bucket=bucket, VersioningConfiguration={"Status": "Enabled"})
    s3.put_bucket_notification_configuration(
        Bucket=bucket, NotificationConfiguration={"EventBridgeConfiguration": {}}
    )
    ddb = client("dynamodb", endpoint, region)
    try:
        ddb.create_table(
            TableName=table,
            KeySchema=[
                {"AttributeName": TABLE_HASH_KEY, "KeyType": "HASH"},
                {"AttributeName": TABLE_RANGE_KEY, "KeyType": "RANGE"},
            ],
            AttributeDefinitions=[
                {"AttributeName": TABLE_HASH_KEY, "AttributeType": "S"},
                {"AttributeName": TABLE_RANGE_KEY, "AttributeType": "S"},
            ],
            BillingMode="PAY_PER_REQUEST",
        )
    except ClientError as exc:
        if exc.response["Error"]["Code"] != "ResourceInUseException":
            raise
    else:  # the credential endpoint's nonces, request counters and refusals expire (`store.hosts`)
        ddb.update_time_to_live(TableName=table, TimeToLiveSpecification={"Enabled": True,
                                                                          "AttributeName": TTL_ATTRIBUTE})
    sqs = client("sqs", endpoint, region)
    events = client("events", endpoint, region)
    lanes = (
        (ingest_queue_name(run_id), ingest_rule_name(run_id), object_created_pattern(bucket, run_id), "ingest"),
        (join_queue_name(run_id), join_rule_name(run_id), join_request_pattern(bucket, run_id), "join"),
    )
    urls = []
    for queue, rule, pattern, target in lanes:
        url = sqs.create_queue(QueueName=queue)["QueueUrl"]
        arn = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
        events.put_rule(Name=rule, EventPattern=json.dumps(pattern), State="ENABLED")
        events.put_targets(Rule=rule, Targets=[{"Id": target, "Arn": arn}])
        urls.append(url)
    shard_queue = sqs.create_queue(QueueName=shard_queue_name(run_id))["QueueUrl"]
    # The tick schedule (the dispatcher ticks while it is enabled; the run switches it off while idle)
    events.put_rule(Name=tick_rule_name(run_id), ScheduleExpression="rate(1 minute)", State="ENABLED")
    topic = client("sns", endpoint, region).create_topic(Name=state_topic_name(run_id))["TopicArn"]
    # The participant role, which holds the deny on revoked hosts' sessions (`fed hosts revoke` writes it, the local
    # access check applies it: `local.access.control`); moto's STS issues sessions of a role whether it exists or not.
    trust = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": ["sts:AssumeRole", "sts:TagSession"],
                                                     "Principal": {"AWS": "arn:aws:iam::123456789012:root"}}]}
    try:
        client("iam", endpoint, region).create_role(RoleName=f"fed-{run_id}-participant",
                                                    AssumeRolePolicyDocument=json.dumps(trust))
    except ClientError as exc:
        if exc.response["Error"]["Code"] != "EntityAlreadyExists":
            raise
    return LocalResources(run_id, bucket, table, urls[0], endpoint, region, join_queue_url=urls[1],
                          state_topic=topic, shard_queue_url=shard_queue)
