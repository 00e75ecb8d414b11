"""Create, on any endpoint (moto here), the resources the CDK stack declares, from the same names.

Bucket (versioned, EventBridge notifications on), table (pk/sk), and the "Object Created" rule of
`shared.naming.object_created_pattern`, whose target here is an SQS queue the local dispatcher polls
(on AWS the target is the ingest function).
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
    local_bucket_name,
    object_created_pattern,
    table_name,
)


@dataclass(frozen=True)
class LocalResources:
    run_id: str
    bucket: str
    table: str
    queue_url: str
    endpoint: str | None
    region: str


def client(service: str, endpoint: str | None, region: str) -> Any:
    return boto3.client(service, endpoint_url=endpoint, region_name=region)


def create_resources(run_id: str, endpoint: str | None = None, region: str = "us-east-1") -> LocalResources:
    """Idempotent: an existing resource is reused."""
    bucket, table = local_bucket_name(run_id), table_name(run_id)
    s3 = client("s3", endpoint, region)
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
    sqs = client("sqs", endpoint, region)
    queue_url = sqs.create_queue(QueueName=ingest_queue_name(run_id))["QueueUrl"]
    queue_arn = sqs.get_queue_attributes(QueueUrl=queue_url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    events = client("events", endpoint, region)
    rule = ingest_rule_name(run_id)
    events.put_rule(Name=rule, EventPattern=json.dumps(object_created_pattern(bucket, run_id)), State="ENABLED")
    events.put_targets(Rule=rule, Targets=[{"Id": "ingest", "Arn": queue_arn}])
    return LocalResources(run_id, bucket, table, queue_url, endpoint, region)
