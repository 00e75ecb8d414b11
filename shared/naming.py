"""Names and wiring shared by the CDK stack and the local run, so both stand up the same thing."""

from __future__ import annotations

from typing import Any

from shared.keys import run_prefix

METRICS_NAMESPACE = "FedCoordinator"
TICK_SCHEDULE_MINUTES = 1


def local_bucket_name(run_id: str) -> str:
    return f"fed-{run_id}"


def table_name(run_id: str) -> str:
    return f"fed-{run_id}-state"


def ingest_queue_name(run_id: str) -> str:
    return f"fed-{run_id}-ingest"


def ingest_rule_name(run_id: str) -> str:
    return f"fed-{run_id}-object-created"


def object_created_pattern(bucket: str, run_id: str) -> dict[str, Any]:
    """The EventBridge pattern routing the run's S3 uploads to the ingest function."""
    return {
        "source": ["aws.s3"],
        "detail-type": ["Object Created"],
        "detail": {"bucket": {"name": [bucket]}, "object": {"key": [{"prefix": run_prefix(run_id)}]}},
    }


# Environment variables the functions read (parsed once, in functions/settings.py).
ENV_RUN_ID = "FED_RUN_ID"
ENV_BUCKET = "FED_BUCKET"
ENV_TABLE = "FED_TABLE"
ENV_CONFIG = "FED_CONFIG_JSON"
ENV_ENDPOINT = "FED_AWS_ENDPOINT"

# DynamoDB table schema (one table per run; see shared/records.py for the items).
TABLE_HASH_KEY = "pk"
TABLE_RANGE_KEY = "sk"

# Metric names emitted by the functions (powertools EMF, namespace METRICS_NAMESPACE, dimension "run").
METRIC_ROUND = "Round"
METRIC_PHASE_CHANGES = "PhaseChanges"
METRIC_UPDATES_ACCEPTED = "UpdatesAccepted"
METRIC_UPDATES_REFUSED = "UpdatesRefused"
METRIC_ROUND_SECONDS = "RoundSeconds"
METRIC_AGGREGATION_SECONDS = "AggregationSeconds"
METRIC_TICK_CONFLICTS = "TickConflicts"

# CloudFormation outputs that `fed-participant start --stack NAME` reads.
OUTPUT_BUCKET = "BucketName"
OUTPUT_TABLE = "TableName"
OUTPUT_RUN_ID = "RunId"
OUTPUT_PARTICIPANT_ROLE = "ParticipantRoleArn"

# The session tag naming a participant; IAM policy variables use it to scope its keys.
PARTICIPANT_TAG = "participant"
