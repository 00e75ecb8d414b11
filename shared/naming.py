"""Names and wiring shared by the CDK stack and the local run, so both stand up the same thing."""

from __future__ import annotations

from typing import Any

from shared.keys import coordinator_key_patterns, join_prefix

METRICS_NAMESPACE = "FedCoordinator"
TICK_SCHEDULE_MINUTES = 1


def local_bucket_name(run_id: str) -> str:
    return f"fed-{run_id}"


def table_name(run_id: str) -> str:
    """The local stack's state table. On AWS CloudFormation names it (a retained table keeps its name after the
    stack is gone); functions find it in their environment (ENV_TABLE), participants in the outputs (OUTPUT_TABLE)."""
    return f"fed-{run_id}-state"


def ingest_queue_name(run_id: str) -> str:
    return f"fed-{run_id}-ingest"


def ingest_rule_name(run_id: str) -> str:
    return f"fed-{run_id}-object-created"


def tick_rule_name(run_id: str) -> str:
    """The tick schedule's EventBridge rule: off while the run needs no tick (`shared.state.needs_ticks`)."""
    return f"fed-{run_id}-tick"


def join_queue_name(run_id: str) -> str:
    return f"fed-{run_id}-join"


def shard_queue_name(run_id: str) -> str:
    """The shard queue's name where the local stack (or a test of the functions) stands one up; on AWS CloudFormation
    names it and the functions read its URL from their environment."""
    return f"fed-{run_id}-shard"


def join_rule_name(run_id: str) -> str:
    return f"fed-{run_id}-join-requests"


def state_topic_name(run_id: str) -> str:
    """The SNS topic a commit that changes the run's phase or round publishes the state item's body to."""
    return f"fed-{run_id}-state"


MAX_QUEUE_NAME = 80  # SQS's limit


def participant_queue_name(run_id: str, pid: str) -> str | None:
    """The SQS queue a participant creates and subscribes to the state topic, to learn of a new round without
    polling; None where the name would pass SQS's 80 characters (that participant polls the state instead)."""
    name = f"{participant_queue_prefix(run_id)}{pid}"
    return name if len(name) <= MAX_QUEUE_NAME else None


PARTICIPANT_QUEUE_MARK = "-p-"  # no run id holds it in "<run id>-" (`RunConfig`): the first one ends the run id


def participant_queue_prefix(run_id: str) -> str:
    """What every participant queue's name of the run starts with. No other name starts so (no coordinator name
    holds the mark, and a run id may not: `RunConfig`), so a participant's rights over fed-<run>-p-* reach no
    other run's queue and no coordinator queue."""
    return f"fed-{run_id}{PARTICIPANT_QUEUE_MARK}"


# Two lanes for the participants' uploads, so that heartbeats and updates never wait behind join requests: the join
# lane takes runs/<run>/join/ and has a bounded number of consumers (on AWS an SQS queue drained by the join
# function at a maximum concurrency, locally a queue with its own dispatcher worker); the main lane takes every other
# object of the run's bucket (the bucket is the run's own) straight to ingest, except the coordinator's own objects:
# ingest has nothing to do with them (it records and ticks on uploads only; a waiting tick reads its shards'
# outcomes from the bucket, not from their events), and each would be an invocation for nothing, counted by the
# stuck-run alarm as participant activity. Over the uploads the two patterns are exact complements on the key, so
# every upload goes down exactly one lane; a key outside the layout goes down the main one, whose ingest records its
# refusal, unless it lies in one of the coordinator's folders (rounds/<r>/global/<id>, which a participant's IAM
# pattern rounds/*/<id> admits): that one goes nowhere, unrecorded, and changes nothing either way. The operators
# are ones EventBridge documents for event buses: `prefix`, and `anything-but` with a list of `wildcard`s (`*` stands
# for any text, '/' included); moto's matcher honours both, so the local stack routes alike.


def _object_created(bucket: str, key_filter: dict[str, Any]) -> dict[str, Any]:
    return {
        "source": ["aws.s3"],
        "detail-type": ["Object Created"],
        "detail": {"bucket": {"name": [bucket]}, "object": {"key": [key_filter]}},
    }


def object_created_pattern(bucket: str, run_id: str) -> dict[str, Any]:
    """The main lane: the run's S3 uploads other than join requests (heartbeats, updates, offers, proofs, health
    reports), to the ingest function; neither join requests nor anything the coordinator writes."""
    not_uploads = [f"{join_prefix(run_id)}*", *coordinator_key_patterns(run_id)]
    return _object_created(bucket, {"anything-but": {"wildcard": not_uploads}})


def join_request_pattern(bucket: str, run_id: str) -> dict[str, Any]:
    """The join lane: uploads under runs/<run>/join/, to the join queue."""
    return _object_created(bucket, {"prefix": join_prefix(run_id)})


# Environment variables the functions read (parsed once, in functions/settings.py).
ENV_RUN_ID = "FED_RUN_ID"
ENV_BUCKET = "FED_BUCKET"
ENV_TABLE = "FED_TABLE"
ENV_CONFIG = "FED_CONFIG_JSON"
ENV_ENDPOINT = "FED_AWS_ENDPOINT"
ENV_STATE_TOPIC = "FED_STATE_TOPIC_ARN"  # where a commit that changes phase or round publishes ("": nowhere)
# Where a tick's aggregation shards run: "queue:<url>" (the shard queue, which feeds the shard-worker function),
# unset: threads of the tick itself.
ENV_SHARD_RUNNER = "FED_SHARD_RUNNER"
ENV_SHARD_WAIT = "FED_SHARD_WAIT"  # seconds a tick waits for its queue-fed shards' outcomes
# The credential endpoint (`functions.credentials`): the role it issues sessions of, their lifetime, its rate limits
# (requests a minute, per host and over all hosts).
ENV_PARTICIPANT_ROLE = "FED_PARTICIPANT_ROLE_ARN"
ENV_CREDENTIAL_SECONDS = "FED_CREDENTIAL_SECONDS"
ENV_HOST_RATE = "FED_HOST_REQUESTS_PER_MINUTE"
ENV_ALL_HOSTS_RATE = "FED_ALL_HOSTS_REQUESTS_PER_MINUTE"

# DynamoDB table schema (one table per run; see store/records.py for the items).
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
OUTPUT_STATE_TOPIC = "StateTopicArn"
OUTPUT_OPERATOR_POLICY = "OperatorPolicyArn"  # what `fed` needs to operate the run: attach it to operators
OUTPUT_TICK_FUNCTION = "TickFunctionName"  # `fed run pause|resume` invokes it
OUTPUT_CREDENTIAL_ENDPOINT = "CredentialEndpointUrl"  # the function URL invites name (`fed hosts invite`)

# The participant role's inline policy `fed hosts revoke` writes: a deny on the revoked hosts' session tags. It is
# not part of the template, so a redeploy leaves it in place.
REVOKED_HOSTS_POLICY = "fed-revoked-hosts"
# The participant role's own inline policy (the template's): the deny above gets what room it leaves.
PARTICIPANT_POLICY = "participant"

# The session tag naming a participant; IAM policy variables use it to scope its keys.
PARTICIPANT_TAG = "participant"
HOST_TAG = "fed-host"  # an invited host session's second tag: <host id>.<generation> (`shared.hosts.session_tag`)
