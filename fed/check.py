"""`fed check`: the deployed stack's wiring works, shown in seconds without a run.

Six checks, each a ✓ or ✗ line (with what to do about a ✗), on AWS (`--stack`) or against a local run
(`--connection`, `fed local`):

    stack        the stack and its outputs exist; the bucket and the table answer
    functions    AWS: each function Active, its last update Successful (runtime, architecture), the tick invokable
                 (a DryRun invoke). Locally: each handler the roles' model names imports and is callable
    roles        every call the code makes (`catalog`: each function role, the participant role with its session
                 tag, the operator policy) is allowed, as IAM judges it: AWS's policy simulator on the deployed
                 roles and this policy's default version; locally the access check's evaluator on the model the
                 local server holds (`local.access`)
    events       the bucket tells EventBridge of its objects; the main and join rules are on, with the patterns
                 `shared.naming` builds, and route sample "Object Created" events down exactly their lane
    schedule     the tick schedule exists with a rate, on while the run needs ticks
    participant  a participant session (the participant role, tagged) reads a missing key of its own as missing
                 (403 without s3:ListBucket, by design) and reads the run's config.json and state item

The catalog is the one list of what each principal calls, with sample keys of the layout (`shared.keys`); a test
holds it to every action the synthesized roles grant (`tests/functional/test_fed_check.py`).
"""

from __future__ import annotations

import json
import secrets
import time
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

import boto3
from botocore.config import Config
from botocore.exceptions import ClientError

from infra import layout
from shared import keys
from shared.config import RunConfig
from shared.hosts import session_tag
from shared.naming import (
    ENV_CONFIG,
    ENV_SHARD_RUNNER,
    HOST_TAG,
    OUTPUT_BUCKET,
    OUTPUT_OPERATOR_POLICY,
    OUTPUT_PARTICIPANT_ROLE,
    OUTPUT_RUN_ID,
    OUTPUT_STATE_TOPIC,
    OUTPUT_TABLE,
    OUTPUT_TICK_FUNCTION,
    PARTICIPANT_TAG,
    ingest_rule_name,
    join_request_pattern,
    join_rule_name,
    object_created_pattern,
    participant_queue_name,
    tick_rule_name,
)
from shared.table_keys import STATE_SK, run_pk
from store.blobs import Bucket, NotFound, s3_addressing
from store.connection import Connection

FUNCTIONS = ("tick", "ingest", "join", "shard", "credentials")  # functions.<name>.handler
CONSTRUCTS = {"credentials": "HostsCredentials"}  # a function's construct where it is not Coordinator<Name>
FUNCTION = "function:"
PARTICIPANT = "participant"
OPERATOR = "operator"
TICK_AND_INGEST = (f"{FUNCTION}tick", f"{FUNCTION}ingest")  # both run the coordinator: the same calls
OUTPUTS = (OUTPUT_BUCKET, OUTPUT_TABLE, OUTPUT_RUN_ID, OUTPUT_PARTICIPANT_ROLE, OUTPUT_STATE_TOPIC,
           OUTPUT_OPERATOR_POLICY, OUTPUT_TICK_FUNCTION)
# Sample values the catalog's keys are made of: any round, participant, digest or job would do.
SAMPLE_ROUND = 0
SAMPLE_PARTICIPANT = "fed-check"
SAMPLE_PEER = "fed-check-peer"  # another participant (a witness reads its update)
SAMPLE_DIGEST = "d" * 64
SAMPLE_JOB = "a" * 64
FAR_ROUND = 999_999  # a round no run reaches: its keys are missing
WHERE = {FUNCTION: "infra/coordinator.py", PARTICIPANT: "infra/participants.py", OPERATOR: "infra/operators.py"}
SIMULATOR_THREADS = 4


class Status(StrEnum):
    PASS = "pass"
    FAIL = "fail"
    SKIP = "skip"  # could not be shown (yet), and nothing says it is wrong: not a failure


MARKS = {Status.PASS: "✓", Status.FAIL: "✗", Status.SKIP: "–"}


@dataclass(frozen=True)
class Line:
    """One line of the report: a check's finding and, for a ✗ (or a –), what to do."""

    check: str  # stack | functions | roles | events | schedule | participant
    status: Status
    text: str
    fix: str = ""
    details: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"check": self.check, "status": self.status.value, "text": self.text, "fix": self.fix,
                "details": dict(self.details)}


@dataclass
class Report:
    run_id: str
    target: str  # "stack NAME (REGION)" or "local run at ENDPOINT"
    lines: list[Line] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not any(line.status is Status.FAIL for line in self.lines)

    def to_json(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "target": self.target, "ok": self.ok, "seconds": round(self.seconds, 2),
                "checks": [line.to_json() for line in self.lines]}


# --- where the run's pieces are ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Wiring:
    """The run's resources by name and ARN, as the catalog needs them: read from the stack on AWS (outputs,
    resources, the functions' configuration), from the local stack's names and its roles' model locally."""

    run_id: str
    account: str
    region: str
    bucket: str
    table: str
    state_topic: str  # ARN
    stack_id: str  # the CloudFormation stack's ARN
    join_queue: str  # ARN
    shard_queue: str  # ARN
    dead_letters: str  # ARN
    functions: Mapping[str, str]  # tick|ingest|join|shard -> function ARN
    log_groups: Mapping[str, str]  # tick|ingest|join|shard -> log group ARN (no trailing ":*")
    roles: Mapping[str, str]  # function:<name> | participant -> role ARN
    operator_policy: str  # ARN
    partition: str = "aws"

    def obj(self, key: str) -> str:
        return f"arn:{self.partition}:s3:::{self.bucket}/{key}"

    @property
    def bucket_arn(self) -> str:
        return f"arn:{self.partition}:s3:::{self.bucket}"

    @property
    def table_arn(self) -> str:
        return f"arn:{self.partition}:dynamodb:{self.region}:{self.account}:table/{self.table}"

    def rule(self, name: str) -> str:
        return f"arn:{self.partition}:events:{self.region}:{self.account}:rule/{name}"

    def own_queue(self, pid: str) -> str:
        name = participant_queue_name(self.run_id, pid) or ""
        return f"arn:{self.partition}:sqs:{self.region}:{self.account}:{name}"


# --- the catalog: what each principal calls ------------------------------------------------------------------


@dataclass(frozen=True)
class Call:
    """One authorization a principal's code needs: `action` on `resource` (a sample ARN), with these condition keys.
    `grant` is the resource pattern a statement allowing it would name; `why` says which code makes the call."""

    principal: str  # function:<name> | participant | operator
    action: str
    resource: str
    why: str
    grant: str = ""
    context: Mapping[str, str | list[str]] = field(default_factory=dict)

    def frozen_context(self) -> str:
        return json.dumps(dict(self.context), sort_keys=True)

    def __hash__(self) -> int:  # (the context is a mapping: hashed as its JSON)
        return hash((self.principal, self.action, self.resource, self.why, self.grant, self.frozen_context()))

    @property
    def where(self) -> str:
        """The file whose policy grants the principal its rights."""
        return WHERE[FUNCTION] if self.principal.startswith(FUNCTION) else WHERE[self.principal]

    def statement(self) -> dict[str, Any]:
        return {"Effect": "Allow", "Action": self.action, "Resource": self.grant or self.resource}


class _Catalog:
    """The calls as the catalog's parts add them, in order, and what the parts share: the run's resources, the
    pattern granting all of the run's objects, and the condition that keeps table calls to the run's items."""

    def __init__(self, w: Wiring) -> None:
        self.w = w
        self.calls: list[Call] = []
        self.everything = f"{keys.run_prefix(w.run_id)}*"
        self.leading: dict[str, str | list[str]] = {"dynamodb:LeadingKeys": [run_pk(w.run_id)]}

    def add(self, principals: str | Sequence[str], action: str, resource: str, why: str, grant: str = "",
            context: Mapping[str, str | list[str]] | None = None) -> None:
        for principal in [principals] if isinstance(principals, str) else principals:
            self.calls.append(Call(principal, action, resource, why, grant, dict(context or {})))

    def reads(self, principals: str | Sequence[str], action: str, key_list: Iterable[str], why: str,
              grant: str) -> None:
        for key in key_list:
            self.add(principals, action, self.w.obj(key), why, self.w.obj(grant))


def catalog(w: Wiring, witnessing: bool = False) -> list[Call]:
    """Every authorization the system's code needs, principal by principal, on sample keys of the layout.

    Read off the code paths: the coordinator (`coordinator/`, run by the tick and ingest functions: ingest ticks
    after recording, and a tick ingests what the event queue has not delivered yet), the join and shard functions
    (`functions/`), the stores (`store/`), the participant (`participant/`) and the operator's `fed` commands
    (`fed/`, `coordinator/operations.py`, `coordinator/verify.py`), and what Lambda itself does with a function's
    role (its logs, its dead-letter queue, its queue event sources)."""
    c = _Catalog(w)
    _coordinator_reads(c)
    _coordinator_writes(c)
    _coordinator_services(c)
    _join_function(c)
    _shard_function(c)
    _credential_function(c)
    _lambda_on_roles(c)
    _participant(c, witnessing)
    _operator(c)
    return c.calls


def _coordinator_reads(c: _Catalog) -> None:
    """What the coordinator (tick and ingest) reads: uploads, models, join requests, checkpoints, shard outcomes."""
    w, run, everything, ticks = c.w, c.w.run_id, c.everything, TICK_AND_INGEST
    r, nxt, d, job, pid = SAMPLE_ROUND, SAMPLE_ROUND + 1, SAMPLE_DIGEST, SAMPLE_JOB, SAMPLE_PARTICIPANT
    c.reads(ticks, "s3:GetObjectVersion", [keys.update_key(run, r, pid), keys.heartbeat_key(run, pid),
                                           keys.witness_key(run, r, pid), keys.health_key(run, r, pid)],
            "ingest reads an upload by the version its event names; aggregation reads the accepted updates by "
            "version (coordinator/intake/, coordinator/aggregation.py)", everything)
    c.reads(ticks, "s3:GetObjectVersion", [keys.init_key(run, pid), keys.global_key(run, r, d),
                                           keys.staging_key(run, nxt, job), keys.optimizer_key(run, r, d)],
            "models are read and copied by the version authenticated: the initial offer, the round's global, the "
            "staged aggregate, the optimizer state (coordinator/model_files.py, aggregation.py, optimizer_state.py)",
            everything)
    c.reads(ticks, "s3:GetObject", [keys.join_key(run, pid)],
            "an offer or update is checked against its sender's join request (coordinator/intake/)", everything)
    c.reads(ticks, "s3:GetObject", [keys.global_key(run, r, d), keys.roster_key(run, d),
                                    keys.optimizer_key(run, r, d)],
            "the global model, the state's roster and the optimizer state, read back and authenticated by digest "
            "(coordinator/model_files.py, store/rosters.py, coordinator/optimizer_state.py)", everything)
    c.reads(ticks, "s3:GetObject", [keys.latest_checkpoint_key(run), keys.shard_result_key(run, nxt, job, 0)],
            "the first tick looks for a checkpoint; a waiting tick looks for its shards' outcomes "
            "(coordinator/tick.py, coordinator/shard_queue.py)", everything)
    c.add(ticks, "s3:ListBucket", w.bucket_arn,
          "a read of a missing key (no checkpoint yet, a shard outcome not in yet) answers 404, not 403")
    c.add(ticks, "s3:ListBucketVersions", w.bucket_arn,
          "a verified read looks for the coordinator's own version among later ones (store/blobs.py "
          "verified_version)", context={"s3:prefix": keys.global_key(run, r, d)})


def _coordinator_writes(c: _Catalog) -> None:
    """What the coordinator writes to the bucket: the config, manifest, models, optimizer state, deltas, rosters,
    checkpoints, and an aggregation's staged upload."""
    w, run, ticks = c.w, c.w.run_id, TICK_AND_INGEST
    r, nxt, d, job = SAMPLE_ROUND, SAMPLE_ROUND + 1, SAMPLE_DIGEST, SAMPLE_JOB
    for key in (keys.config_key(run), keys.manifest_key(run), keys.global_key(run, nxt, d),
                keys.optimizer_key(run, nxt, d), keys.delta_key(run, nxt, d), keys.roster_key(run, d),
                keys.checkpoint_global_key(run, r), keys.checkpoint_state_key(run, r),
                keys.checkpoint_optimizer_key(run, r, d), keys.latest_checkpoint_key(run)):
        c.add(ticks, "s3:PutObject", w.obj(key),
              "the coordinator writes the config (first tick), manifest, global models, optimizer state, download "
              "deltas, rosters and checkpoints (coordinator/tick.py, aggregation.py, store/rosters.py)",
              w.obj(_pattern_of(run, key)))
    c.add(ticks, "s3:PutObject", w.obj(keys.staging_key(run, nxt, job)),
          "an aggregation's multipart upload: create, complete (and parts, on the tick's own threads) "
          "(coordinator/aggregation.py)", w.obj(layout.staging_objects(run)))
    c.add(ticks, "s3:AbortMultipartUpload", w.obj(keys.staging_key(run, nxt, job)),
          "a failed aggregation aborts its staged upload (coordinator/aggregation.py)",
          w.obj(layout.staging_objects(run)))


def _coordinator_services(c: _Catalog) -> None:
    """The coordinator's other calls: the run state's table, the shard queue, the state topic, the schedule, and
    Lambda's dead-letter queue for its failed invocations."""
    w, run, leading, ticks = c.w, c.w.run_id, c.leading, TICK_AND_INGEST
    for action, why in (
            ("dynamodb:GetItem", "the run state, a participant's record, counts, kept offers (store/table.py)"),
            ("dynamodb:Query", "a tick's snapshot: participants, the round's updates, proofs, reports"),
            ("dynamodb:PutItem", "the state's conditional commit, records, refusals, the aggregation lease"),
            ("dynamodb:UpdateItem", "last seen, accepted messages, the round's update count"),
            ("dynamodb:DeleteItem", "the aggregation lease given back (store/table.py release)")):
        c.add(ticks, action, w.table_arn, why, context=leading)
    c.add(ticks, "sqs:SendMessage", w.shard_queue,
          "an aggregation's shard tasks, for the shard workers (coordinator/shard_queue.py)")
    c.add(ticks, "sns:Publish", w.state_topic,
          "a commit that changes phase, round, epoch or model is pushed to the participants (store/push.py)")
    for action in ("events:EnableRule", "events:DisableRule"):
        c.add(ticks, action, w.rule(tick_rule_name(run)),
              "the schedule off while the run is idle, on when it needs ticks (store/schedule.py)")
    c.add(ticks, "sqs:SendMessage", w.dead_letters,
          "Lambda sends an asynchronous invocation that keeps failing to the dead-letter queue")


def _join_function(c: _Catalog) -> None:
    """The join function: it registers joiners, from the join queue."""
    w, run, leading, pid, join = c.w, c.w.run_id, c.leading, SAMPLE_PARTICIPANT, f"{FUNCTION}join"
    c.add(join, "s3:GetObjectVersion", w.obj(keys.join_key(run, pid)),
          "a join request, by the version its event names (coordinator/intake/)",
          w.obj(f"{keys.join_prefix(run)}*"))
    c.add(join, "s3:GetObject", w.obj(keys.heartbeat_key(run, pid)),
          "the heartbeat that overtook the join request (coordinator/intake/)",
          w.obj(f"{keys.heartbeat_prefix(run)}*"))
    c.add(join, "s3:ListBucket", w.bucket_arn, "no heartbeat yet answers 404, not 403")
    for action, why in (("dynamodb:GetItem", "the joiner's record, a kept offer"),
                        ("dynamodb:PutItem", "the new record (a transaction with the count), a refusal"),
                        ("dynamodb:UpdateItem", "the participant count, accepted messages, an adopted offer")):
        c.add(join, action, w.table_arn, f"{why} (store/table.py)", context=leading)


def _shard_function(c: _Catalog) -> None:
    """The shard worker: one aggregation shard per invocation, from the shard queue."""
    w, run, shard = c.w, c.w.run_id, f"{FUNCTION}shard"
    r, nxt, d, job, pid = SAMPLE_ROUND, SAMPLE_ROUND + 1, SAMPLE_DIGEST, SAMPLE_JOB, SAMPLE_PARTICIPANT
    c.reads(shard, "s3:GetObjectVersion", [keys.global_key(run, r, d), keys.update_key(run, r, pid)],
            "the round's global model and accepted updates, by range, by the versions recorded "
            "(coordinator/aggregation.py run_shard)", layout.round_objects(run))
    c.reads(shard, "s3:GetObject", [keys.optimizer_key(run, r, d)],
            "the server optimizer's state, authenticated by digest (coordinator/optimizer_state.py)",
            layout.round_objects(run))
    c.add(shard, "s3:ListBucket", w.bucket_arn, "a missing input answers 404 and is reported as missing")
    c.add(shard, "s3:ListBucketVersions", w.bucket_arn, "a verified read of the optimizer state looks for the "
          "coordinator's own version (store/blobs.py verified_version)",
          context={"s3:prefix": keys.optimizer_key(run, r, d)})
    for key, grant in ((keys.staging_key(run, nxt, job), layout.staging_objects(run)),
                       (keys.shard_result_key(run, nxt, job, 0), layout.staging_objects(run)),
                       (keys.optimizer_key(run, nxt, d), layout.optimizer_objects(run)),
                       (keys.delta_key(run, nxt, d), layout.delta_objects(run))):
        c.add(shard, "s3:PutObject", w.obj(key),
              "the shard's parts of the staged aggregate, its outcome for the waiting tick, its optimizer-state and "
              "download-delta pieces (coordinator/aggregation.py, coordinator/shard_queue.py)", w.obj(grant))


def _credential_function(c: _Catalog) -> None:
    """The credential endpoint: invited hosts' records, and the participant sessions it issues them."""
    w, leading, credentials = c.w, c.leading, f"{FUNCTION}credentials"
    for action, why in (("dynamodb:GetItem", "the host's record (redeem, renew)"),
                        ("dynamodb:PutItem", "a used nonce, a refusal (conditional puts)"),
                        ("dynamodb:UpdateItem", "a redemption, a request counted in its minute, the time of the "
                                                "last credentials")):
        c.add(credentials, action, w.table_arn, f"{why} (store/hosts.py)", context=leading)
    for action in ("sts:AssumeRole", "sts:TagSession"):
        c.add(credentials, action, w.roles.get(PARTICIPANT, ""), "a participant session tagged with the host's "
              "id and generation (coordinator/credentials.py)",
              context={f"aws:RequestTag/{PARTICIPANT_TAG}": SAMPLE_PARTICIPANT,
                       f"aws:RequestTag/{HOST_TAG}": session_tag(SAMPLE_PARTICIPANT, 1),
                       "aws:TagKeys": [PARTICIPANT_TAG, HOST_TAG]})


def _lambda_on_roles(c: _Catalog) -> None:
    """What Lambda does with each function's role: its logs; the queue event sources' polling."""
    w = c.w
    for name in FUNCTIONS:
        stream = f"{w.log_groups.get(name, '')}:log-stream:2026/01/01/[$LATEST]0"
        for action in ("logs:CreateLogStream", "logs:PutLogEvents"):
            c.add(f"{FUNCTION}{name}", action, stream, "Lambda writes the function's logs to its log group",
                  f"{w.log_groups.get(name, '')}:*")
    for name, queue in (("join", w.join_queue), ("shard", w.shard_queue)):
        for action in ("sqs:ReceiveMessage", "sqs:DeleteMessage", "sqs:GetQueueAttributes"):
            c.add(f"{FUNCTION}{name}", action, queue, f"Lambda's event source polls the {name} queue with the role")


def _participant(c: _Catalog, witnessing: bool) -> None:
    """The participant role, tagged participant=<id>: its own keys and queue, the run's models and state; with
    `witnessing`, the updates it witnesses and its proofs and health reports."""
    w, run, leading = c.w, c.w.run_id, c.leading
    r, d, pid, peer = SAMPLE_ROUND, SAMPLE_DIGEST, SAMPLE_PARTICIPANT, SAMPLE_PEER
    tag: dict[str, str | list[str]] = {f"aws:PrincipalTag/{PARTICIPANT_TAG}": pid}
    own = w.own_queue(pid)

    def p(action: str, resource: str, why: str, grant: str = "", context: Mapping[str, Any] | None = None) -> None:
        c.add(PARTICIPANT, action, resource, why, grant, {**tag, **(context or {})})

    p("cloudformation:DescribeStacks", w.stack_id, "`fed-participant start --stack` reads the outputs "
      "(store/connection.py)")
    p("dynamodb:GetItem", w.table_arn, "the run state, its own record, its update's record, round summaries "
      "(participant/remote.py)", context=leading)
    for key, grant, why in (
            (keys.config_key(run), keys.config_key(run), "the run's configuration"),
            (keys.global_key(run, r, d), layout.global_models(run), "the round's global model"),
            (keys.delta_key(run, r, d), layout.delta_objects(run), "a download delta"),
            (keys.roster_key(run, d), layout.rosters(run), "the state's roster"),
            (keys.update_key(run, r, pid), layout.own_updates(run), "did its own upload land (HEAD)"),
            (keys.witness_key(run, r, pid), layout.own_updates(run), "did its own witness proof land (HEAD)")):
        p("s3:GetObject", w.obj(key), f"{why} (participant/remote.py)", w.obj(grant))
    p("s3:GetObjectVersion", w.obj(keys.update_key(run, r, pid)),
      "a restarted participant reads its own upload back by version (participant/remote.py ours_since)",
      w.obj(layout.own_updates(run)))
    writes = [keys.join_key(run, pid), keys.init_key(run, pid), keys.heartbeat_key(run, pid),
              keys.update_key(run, r, pid)]
    if witnessing:
        p("s3:GetObjectVersion", w.obj(keys.update_key(run, r, peer)),
          "a witness downloads each update by the version the coordinator accepted (participant/witness_duty.py)",
          w.obj(layout.round_objects(run)))
        writes += [keys.witness_key(run, r, pid), keys.health_key(run, r, pid)]
    for key in writes:
        p("s3:PutObject", w.obj(key), "its join request, offer, heartbeats, updates (and, witnessing, proofs and "
          "health reports): keys ending in its own id (participant/)", w.obj(_pattern_of(run, key)))
    for key in (keys.init_key(run, pid), keys.update_key(run, r, pid)):
        p("s3:AbortMultipartUpload", w.obj(key), "a failed multipart upload of a model is aborted by the transfer "
          "manager (participant/remote.py)", w.obj(_pattern_of(run, key)))
    for action in ("sqs:CreateQueue", "sqs:GetQueueUrl", "sqs:GetQueueAttributes", "sqs:SetQueueAttributes",
                   "sqs:ReceiveMessage", "sqs:DeleteQueue"):
        p(action, own, "its own push queue: created, given the topic's delivery policy, long-polled, deleted "
          "(store/push.py)", w.own_queue(layout.SELF))
    p("sns:Subscribe", w.state_topic, "its own queue subscribed to the state topic, over SQS (store/push.py)",
      context={"sns:Protocol": "sqs", "sns:Endpoint": own})


def _operator(c: _Catalog) -> None:
    """The operator policy: every `fed` command (status, verify, run, check)."""
    w, run, everything, leading = c.w, c.w.run_id, c.everything, c.leading
    r, d, pid = SAMPLE_ROUND, SAMPLE_DIGEST, SAMPLE_PARTICIPANT
    o = OPERATOR
    c.add(o, "cloudformation:DescribeStacks", w.stack_id, "--stack reads the outputs (store/connection.py)")
    c.add(o, "cloudformation:ListStackResources", w.stack_id, "fed check finds the functions and queues")
    for action, why in (("dynamodb:GetItem", "fed status, verify, run: the run state (store/table.py)"),
                        ("dynamodb:Query", "fed status, verify: participants, updates, rounds, refusals"),
                        ("dynamodb:PutItem", "fed run pause|resume|restore commit the state "
                                             "(coordinator/operations.py); fed hosts invite records an invite"),
                        ("dynamodb:UpdateItem", "fed hosts revoke marks the host revoked (store/hosts.py)")):
        c.add(o, action, w.table_arn, why, context=leading)
    c.reads(o, "s3:GetObject", [keys.config_key(run), keys.roster_key(run, d), keys.global_key(run, r, d),
                                keys.latest_checkpoint_key(run), keys.checkpoint_state_key(run, r),
                                keys.checkpoint_global_key(run, r)],
            "fed status, verify and run restore read the config, rosters, models and checkpoints (fed/operate.py, "
            "coordinator/verify.py, coordinator/operations.py)", everything)
    c.reads(o, "s3:GetObjectVersion", [keys.update_key(run, r, pid), keys.checkpoint_optimizer_key(run, r, d)],
            "fed verify recomputes from the updates' accepted versions; restore copies the optimizer state by "
            "version (coordinator/verify.py, coordinator/operations.py)", everything)
    c.add(o, "s3:ListBucket", w.bucket_arn, "fed verify lists a round's stored global models (coordinator/verify.py)",
          context={"s3:prefix": keys.global_prefix(run, r)})
    c.add(o, "s3:ListBucketVersions", w.bucket_arn, "a verified read looks for the coordinator's own version "
          "(store/blobs.py verified_version)", context={"s3:prefix": keys.global_key(run, r, d)})
    c.add(o, "s3:PutObject", w.obj(keys.global_key(run, r, d)), "fed run restore puts the checkpoint's global model "
          "back (coordinator/operations.py)", w.obj(layout.global_models(run)))
    c.add(o, "s3:PutObject", w.obj(keys.optimizer_key(run, r, d)), "fed run restore puts the optimizer state back",
          w.obj(layout.optimizer_objects(run)))
    for action in ("events:EnableRule", "events:DisableRule"):
        c.add(o, action, w.rule(tick_rule_name(run)), "fed run pause|resume|restore pace the tick schedule "
              "(coordinator/operations.py)")
    for name in (tick_rule_name(run), ingest_rule_name(run), join_rule_name(run)):
        c.add(o, "events:DescribeRule", w.rule(name), "fed check reads the rules (fed/check.py)")
    c.add(o, "events:TestEventPattern", "*", "fed check matches sample events against the rules' patterns")
    c.add(o, "s3:GetBucketNotification", w.bucket_arn, "fed check: the bucket notifies EventBridge")
    c.add(o, "lambda:InvokeFunction", w.functions.get("tick", ""), "fed run pause|resume invoke the tick "
          "(fed/operate.py); fed check invokes it as a dry run")
    for name in FUNCTIONS:
        c.add(o, "lambda:GetFunction", w.functions.get(name, ""), "fed check reads each function's state")
    for principal in (*(f"{FUNCTION}{n}" for n in FUNCTIONS), PARTICIPANT):
        c.add(o, "iam:SimulatePrincipalPolicy", w.roles.get(principal, ""),
              f"fed check asks IAM's simulator about the {principal} role")
    c.add(o, "iam:PutRolePolicy", w.roles.get(PARTICIPANT, ""), "fed hosts revoke|reinstate deny the revoked "
          "generations' sessions on the participant role (fed/hosts.py)")
    c.add(o, "iam:GetRolePolicy", w.roles.get(PARTICIPANT, ""), "fed hosts revoke|reinstate read the participant "
          "role's own inline policy, whose size the deny's room is counted from (fed/hosts.py)")
    for action in ("iam:GetPolicy", "iam:GetPolicyVersion"):
        c.add(o, action, w.operator_policy, "fed check reads this policy's default version to simulate it")
    c.add(o, "iam:SimulateCustomPolicy", "*", "fed check simulates this policy's document")
    for action in ("sts:AssumeRole", "sts:TagSession"):
        c.add(o, action, w.roles.get(PARTICIPANT, ""), "fed check opens a tagged participant session",
              context={f"aws:RequestTag/{PARTICIPANT_TAG}": pid, "aws:TagKeys": [PARTICIPANT_TAG]})


def _pattern_of(run_id: str, key: str) -> str:
    """The layout's IAM pattern a sample key falls under (what a statement granting it names)."""
    parsed = keys.parse_key(key)
    kind = keys.ObjectKind
    by_kind = {
        kind.GLOBAL: layout.global_models(run_id), kind.OPTIMIZER: layout.optimizer_objects(run_id),
        kind.DELTA: layout.delta_objects(run_id), kind.ROSTER: layout.rosters(run_id),
        kind.STAGING: layout.staging_objects(run_id), kind.CHECKPOINT: f"{keys.checkpoints_prefix(run_id)}*",
        kind.UPDATE: layout.own_updates(run_id), kind.WITNESS: layout.own_updates(run_id),
        kind.HEALTH: layout.own_updates(run_id),
    }
    if parsed.participant is not None and parsed.kind in (kind.JOIN, kind.INIT, kind.HEARTBEAT):
        return key.removesuffix(parsed.participant) + layout.SELF
    return by_kind.get(parsed.kind, key)


# --- judging the catalog ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Verdict:
    allowed: bool
    denied_by: tuple[str, ...] = ()  # explicit denies: the statements (locally) or policies (AWS) that deny
    note: str = ""  # what else the judge said (missing context keys, an error)


Judge = Callable[[Sequence[Call]], dict[Call, Verdict]]


def local_judge(model: Any) -> tuple[Judge, Callable[[], None]]:
    """The access check's evaluator (`local.access`, as CI judges every test's calls) on `model`; and its closer."""
    from local.access.control import AccessControl
    from local.access.evaluator import Evaluator
    from local.access.requests import Need

    evaluator = Evaluator()  # a Node process of its own: the local server's shared one keeps its policies
    control = AccessControl(model, evaluator)

    def judge(calls: Sequence[Call]) -> dict[Call, Verdict]:
        out = {}
        for call in calls:
            principal = f"{PARTICIPANT}:{SAMPLE_PARTICIPANT}" if call.principal == PARTICIPANT else call.principal
            decision = control.decide(principal, Need(call.action, call.resource, call.context))
            out[call] = Verdict(decision.allowed, decision.denied_by, decision.errors or "")
        return out

    return judge, evaluator.close


def _context_entries(context: Mapping[str, str | list[str]]) -> list[dict[str, Any]]:
    entries = [{"ContextKeyName": "aws:SecureTransport", "ContextKeyValues": ["true"], "ContextKeyType": "boolean"}]
    for name, value in sorted(context.items()):
        values = value if isinstance(value, list) else [value]
        entries.append({"ContextKeyName": name, "ContextKeyValues": [str(v) for v in values],
                        "ContextKeyType": "stringList" if isinstance(value, list) else "string"})
    return entries


def iam_judge(iam: Any, roles: Mapping[str, str], operator_document: str) -> Judge:
    """IAM's policy simulator: each role by its ARN (`SimulatePrincipalPolicy`, its identity policies, permissions
    boundary and the organization's policies), the operator policy by its document (`SimulateCustomPolicy`). One
    request per principal, resource and context, a few at once."""

    def simulate(group: list[Call]) -> dict[Call, Verdict]:
        first = group[0]
        args: dict[str, Any] = {"ActionNames": sorted({c.action for c in group}), "ResourceArns": [first.resource],
                                "ContextEntries": _context_entries(first.context)}
        if first.principal == OPERATOR:
            pages = iam.get_paginator("simulate_custom_policy").paginate(PolicyInputList=[operator_document], **args)
        else:
            pages = iam.get_paginator("simulate_principal_policy").paginate(
                PolicySourceArn=roles[first.principal], **args)
        results = {r["EvalActionName"]: r for page in pages for r in page.get("EvaluationResults", [])}
        out = {}
        for call in group:
            result = results.get(call.action, {})
            decision = str(result.get("EvalDecision", "missing"))
            denied = tuple(sorted({str(m.get("SourcePolicyId", "")) for m in result.get("MatchedStatements", [])}))
            missing = result.get("MissingContextValues") or []
            note = f"the simulator lacked context keys {', '.join(missing)}" if missing else ""
            out[call] = Verdict(decision == "allowed", denied if decision == "explicitDeny" else (), note)
        return out

    def judge(calls: Sequence[Call]) -> dict[Call, Verdict]:
        groups: dict[tuple[str, str, str], list[Call]] = {}
        out: dict[Call, Verdict] = {}
        for call in calls:
            if not call.resource:
                out[call] = Verdict(False, note="the stack has no such resource")
            elif call.principal != OPERATOR and not roles.get(call.principal):
                out[call] = Verdict(False, note=f"the stack has no {call.principal} role")
            else:
                groups.setdefault((call.principal, call.resource, call.frozen_context()), []).append(call)
        with ThreadPoolExecutor(SIMULATOR_THREADS) as pool:
            for found in pool.map(simulate, groups.values()):
                out.update(found)
        return out

    return judge


def role_lines(calls: Sequence[Call], verdicts: Mapping[Call, Verdict]) -> list[Line]:
    """One ✓ per principal whose every call is allowed; one ✗ per call refused, with the statement to add."""
    lines = []
    principals = sorted({c.principal for c in calls}, key=lambda p: (not p.startswith(FUNCTION), p))
    for principal in principals:
        mine = [c for c in calls if c.principal == principal]
        refused = [c for c in mine if not verdicts.get(c, Verdict(False, note="not judged")).allowed]
        if not refused:
            actions = len({c.action for c in mine})
            lines.append(Line("roles", Status.PASS, f"roles: {principal}: the {len(mine)} calls its code makes "
                                                    f"({actions} actions) are allowed"))
            continue
        for call in refused:
            verdict = verdicts.get(call, Verdict(False, note="not judged"))
            if verdict.denied_by:
                fix = f"explicitly denied by {', '.join(verdict.denied_by)}: narrow that statement in {call.where}"
            else:
                fix = f"add to the {principal} policy ({call.where}) a statement {json.dumps(call.statement())}"
                carried = {k: v for k, v in call.context.items() if not k.startswith("aws:PrincipalTag/")}
                if carried:
                    fix += f" (the request carries {json.dumps(carried)})"
            if verdict.note:
                fix += f" ({verdict.note})"
            lines.append(Line("roles", Status.FAIL, f"roles: {principal} may not {call.action} on "
                                                    f"{call.resource}: {call.why}", fix,
                              {"principal": principal, "action": call.action, "resource": call.resource,
                               "context": dict(call.context), "why": call.why, "statement": call.statement(),
                               "denied_by": list(verdict.denied_by)}))
    return lines


# --- sample events ---------------------------------------------------------------------------------------------


def object_created(bucket: str, key: str, account: str, region: str) -> dict[str, Any]:
    """An "Object Created" event as S3 sends it to EventBridge (the fields a pattern may name)."""
    return {
        "version": "0", "id": "00000000-0000-0000-0000-000000000000", "detail-type": "Object Created",
        "source": "aws.s3", "account": account, "time": "2026-01-01T00:00:00Z", "region": region,
        "resources": [f"arn:aws:s3:::{bucket}"],
        "detail": {"version": "0", "bucket": {"name": bucket},
                   "object": {"key": key, "size": 1, "etag": "0", "version-id": "0", "sequencer": "0"},
                   "request-id": "0", "requester": account, "reason": "PutObject"},
    }


def lane_samples(run_id: str) -> list[tuple[str, str, bool, bool]]:
    """(what, key, main rule matches, join rule matches): an upload down each lane, a coordinator object down none."""
    return [("a heartbeat", keys.heartbeat_key(run_id, SAMPLE_PARTICIPANT), True, False),
            ("a join request", keys.join_key(run_id, SAMPLE_PARTICIPANT), False, True),
            ("a global model", keys.global_key(run_id, SAMPLE_ROUND + 1, SAMPLE_DIGEST), False, False)]


# --- the checks --------------------------------------------------------------------------------------------------


class CheckFailed(Exception):
    """A check that cannot go on: its ✗ (or –) line."""

    def __init__(self, line: Line) -> None:
        super().__init__(line.text)
        self.line = line


def _error(exc: BaseException) -> str:
    if isinstance(exc, ClientError):
        error = exc.response.get("Error", {})
        return f"{error.get('Code', '?')}: {error.get('Message', '')}".strip()
    return f"{type(exc).__name__}: {exc}"


def _parsed(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


CHECKS = ("stack", "functions", "roles", "events", "schedule", "participant")


class _Checker:
    """What the local and the AWS checks share: the events, the schedule and the participant's reads, made through
    the run's endpoint (AWS's, or the local server's), and the roles' catalog."""

    matcher = "events:TestEventPattern"  # how sample events are matched against the rules' patterns

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.run_id = conn.run_id
        self.wiring: Wiring | None = None
        self.config: RunConfig | None = None
        self._operator: boto3.Session | None = None
        self._clients: dict[tuple[str, int], Any] = {}

    # how the checks reach the services: the operator's session (the caller's credentials on AWS), or another's
    def session(self) -> boto3.Session:
        return boto3.Session(region_name=self.conn.region)

    def participant_session(self, pid: str) -> boto3.Session:
        raise NotImplementedError

    def client(self, service: str, session: boto3.Session | None = None) -> Any:
        if session is None:
            self._operator = session = self._operator or self.session()
        key = (service, id(session))
        if key not in self._clients:
            config = Config(retries={"max_attempts": 4, "mode": "standard"}, s3=s3_addressing(self.conn.endpoint),
                            connect_timeout=5, read_timeout=30)
            self._clients[key] = session.client(service, endpoint_url=self.conn.endpoint, config=config)
        return self._clients[key]

    def run(self) -> list[Line]:
        lines: list[Line] = []
        for name in CHECKS:
            if name != "stack" and self.wiring is None:
                lines.append(Line(name, Status.SKIP, f"{name}: not checked: the stack check found no run to check",
                                  "fix the stack first"))
                continue
            try:
                lines += getattr(self, f"check_{name}")()
            except CheckFailed as exc:
                lines.append(exc.line)
            except Exception as exc:  # a check that breaks is a finding; the others still run
                lines.append(Line(name, Status.FAIL, f"{name}: could not be checked: {_error(exc)}",
                                  "fix what the error names, then run fed check again"))
        return lines

    def state(self) -> tuple[int, bool]:
        """The run state item's version (0: none yet) and whether the run needs ticks, read as the operator."""
        from store.records import joined_body, state_from_body

        got = self.client("dynamodb").get_item(TableName=self.conn.table, ConsistentRead=True,
                                               Key={"pk": {"S": run_pk(self.run_id)}, "sk": {"S": STATE_SK}})
        if "Item" not in got:
            return 0, True
        version = int(got["Item"].get("version", {}).get("N", "0"))
        try:  # (whether it needs ticks is in the item's own part: no roster needed)
            return version, state_from_body(joined_body(json.loads(got["Item"]["body"]["S"]), {}), version).needs_ticks
        except (KeyError, ValueError, TypeError):
            return version, True

    def bucket_and_table(self) -> str:
        self.client("s3").head_bucket(Bucket=self.conn.bucket)
        version, _ = self.state()
        return (f"bucket {self.conn.bucket} answers, table {self.conn.table} answers "
                f"({f'state version {version}' if version else 'no run state yet'})")

    # 3. roles
    def judge(self) -> tuple[Judge, Callable[[], None], str]:
        """How the catalog is judged: the judge, what closes it, and what it is (shown on the first line)."""
        raise NotImplementedError

    def check_roles(self) -> list[Line]:
        judge, close, how = self.judge()
        assert self.wiring is not None
        witnessing = bool(self.config and self.config.witness_nodes > 0)
        calls = catalog(self.wiring, witnessing)
        try:
            lines = role_lines(calls, judge(calls))
        finally:
            close()
        how += "; with witnessing" if witnessing else ""
        return [replace(line, text=f"{line.text} ({how})") if i == 0 else line for i, line in enumerate(lines)]

    # 4. events
    def eventbridge_enabled(self, notification: Mapping[str, Any]) -> tuple[bool, str]:
        return "EventBridgeConfiguration" in notification, ""

    def matches(self, pattern: str, event: dict[str, Any]) -> bool:
        return bool(self.client("events").test_event_pattern(EventPattern=pattern, Event=json.dumps(event))["Result"])

    def check_events(self) -> list[Line]:
        assert self.wiring is not None
        bucket, run = self.conn.bucket, self.run_id
        lines = []
        bridged, note = self.eventbridge_enabled(self.client("s3").get_bucket_notification_configuration(Bucket=bucket))
        if not bridged:
            lines.append(Line("events", Status.FAIL, f"events: bucket {bucket} does not notify EventBridge: no upload "
                                                     "reaches the coordinator",
                              "deploy the stack again: infra/storage.py turns the bucket's EventBridge notifications "
                              "on"))
        expected = {ingest_rule_name(run): object_created_pattern(bucket, run),
                    join_rule_name(run): join_request_pattern(bucket, run)}
        patterns: dict[str, str] = {}
        for name, want in expected.items():
            try:
                rule = self.client("events").describe_rule(Name=name)
            except ClientError as exc:
                lines.append(Line("events", Status.FAIL, f"events: rule {name}: {_error(exc)}",
                                  "deploy the stack again (infra/coordinator.py makes both rules); a refusal: attach "
                                  "the stack's OperatorPolicyArn (it allows events:DescribeRule on them)"))
                continue
            patterns[name] = str(rule.get("EventPattern", ""))
            if rule.get("State") != "ENABLED":
                lines.append(Line("events", Status.FAIL, f"events: rule {name} is {rule.get('State')}: the uploads of "
                                                         "its lane reach nothing",
                                  f"aws events enable-rule --name {name}"))
            if _parsed(patterns[name]) != want:
                lines.append(Line("events", Status.FAIL, f"events: rule {name} has another pattern than "
                                                         f"shared.naming builds: {patterns[name][:300]}",
                                  "deploy this version of the stack (infra/coordinator.py uses shared.naming's)",
                                  {"deployed": patterns[name], "expected": want}))
        lanes = {(True, False): "the main lane", (False, True): "the join lane", (False, False): "no lane",
                 (True, True): "both lanes"}
        if len(patterns) == len(expected):
            main, joins = patterns[ingest_rule_name(run)], patterns[join_rule_name(run)]
            for what, key, to_main, to_join in lane_samples(run):
                event = object_created(bucket, key, self.wiring.account, self.wiring.region)
                got = (self.matches(main, event), self.matches(joins, event))
                if got != (to_main, to_join):
                    lines.append(Line("events", Status.FAIL, f"events: {what} ({key}) goes down {lanes[got]}, not "
                                                             f"{lanes[(to_main, to_join)]}",
                                      "deploy this version of the stack: its rules' patterns are shared.naming's"))
        if not lines:
            lines.append(Line("events", Status.PASS, f"events: bucket {bucket} notifies EventBridge{note}; rules "
                                                     f"{ingest_rule_name(run)} and {join_rule_name(run)} ENABLED with "
                                                     "shared.naming's patterns: a heartbeat goes down the main lane, "
                                                     f"a join request the join lane, a global model neither "
                                                     f"({self.matcher})"))
        return lines

    # 5. schedule
    def check_schedule(self) -> list[Line]:
        name = tick_rule_name(self.run_id)
        try:
            rule = self.client("events").describe_rule(Name=name)
        except ClientError as exc:
            raise CheckFailed(Line("schedule", Status.FAIL, f"schedule: rule {name}: {_error(exc)}",
                                   "deploy the stack again (infra/coordinator.py makes the tick schedule)")) from None
        expression, state = str(rule.get("ScheduleExpression", "")), str(rule.get("State", ""))
        if not expression.startswith("rate("):
            return [Line("schedule", Status.FAIL, f"schedule: rule {name} has no rate expression ({expression!r})",
                         "deploy this version of the stack: the tick schedule is a rate")]
        _, needs = self.state()
        if state != "ENABLED" and needs:
            return [Line("schedule", Status.FAIL, f"schedule: {name} {expression} is {state} while the run needs "
                                                  "ticks: deadlines and liveness do not advance",
                         f"fed run resume (it switches the schedule on), or aws events enable-rule --name {name}")]
        why = "on" if state == "ENABLED" else "off while the run is idle (finished, or paused), as it should be"
        return [Line("schedule", Status.PASS, f"schedule: {name} {expression}, {state}: {why}")]

    # 6. participant
    def check_participant(self) -> list[Line]:
        from store.trace import acting_as, participant

        pid = f"{SAMPLE_PARTICIPANT}-{secrets.token_hex(3)}"
        session = self.participant_session(pid)
        key, config_key = keys.update_key(self.run_id, FAR_ROUND, pid), keys.config_key(self.run_id)
        with acting_as(participant(pid)):  # (locally: these requests are the participant's, not the operator's)
            s3 = self.client("s3", session)
            try:
                s3.head_object(Bucket=self.conn.bucket, Key=key)
                answer = "200"
            except ClientError as exc:
                answer = str(exc.response.get("Error", {}).get("Code", "?"))
            own = Bucket(self.conn.bucket, s3, unlisted=True)  # as the participant reads (participant/remote.py)
            missing = own.head(key) is None
            try:
                own.get(config_key)
                config = "read"
            except NotFound:
                config = "missing"
            except ClientError as exc:
                config = _error(exc)
            try:
                self.client("dynamodb", session).get_item(
                    TableName=self.conn.table, Key={"pk": {"S": run_pk(self.run_id)}, "sk": {"S": STATE_SK}})
                state = "read"
            except ClientError as exc:
                state = _error(exc)
        lines = []
        if answer not in ("403", "404") or not missing:
            lines.append(Line("participant", Status.FAIL, f"participant {pid}: a HEAD of its own missing key {key} "
                                                          f"answered {answer}, not 403 or 404 read as missing",
                              "the participant role must allow s3:GetObject on runs/<run>/rounds/*/<its id> "
                              "(infra/participants.py ReadModelsAndConfig)"))
        if state != "read":
            lines.append(Line("participant", Status.FAIL, f"participant {pid} cannot read the run state: {state}",
                              "the participant role needs dynamodb:GetItem on the table for the run's partition key "
                              "(infra/participants.py ReadRunState)"))
        if config == "missing" and Bucket(self.conn.bucket, self.client("s3")).head(config_key) is None:
            lines.append(Line("participant", Status.SKIP, f"participant {pid}: {config_key} is not there: the run has "
                                                          "not ticked yet",
                              "the first tick writes it (the schedule ticks every minute): run fed check again in a "
                              "minute; if it stays missing, read the tick function's logs"))
        elif config != "read":
            seen = "403: the operator sees it there" if config == "missing" else config
            lines.append(Line("participant", Status.FAIL, f"participant {pid} may not read {config_key} ({seen})",
                              "add s3:GetObject on runs/<run>/config.json to the participant role "
                              "(infra/participants.py ReadModelsAndConfig)"))
        if not any(line.status is Status.FAIL for line in lines):
            done = "reads config.json and the run state" if config == "read" else "reads the run state"
            lines.insert(0, Line("participant", Status.PASS,
                                 f"participant {pid}: its own missing key {key} answers {answer} (no s3:ListBucket, "
                                 f"by design) and reads as missing; it {done}"))
        return lines


class LocalChecker(_Checker):
    """Against a local run (`fed local`): the operator's requests under the access key `operator`, the participant's
    under `participant-<id>`, so that the local server judges each as the principal it stands for (`local.access`)."""

    matcher = "moto's matcher, which routes the local run's events: moto has no TestEventPattern"

    def __init__(self, conn: Connection) -> None:
        super().__init__(conn)
        self.model: Any = None  # the roles' model the local server holds (None: it judges nothing)
        self.enforce = False

    def session(self) -> boto3.Session:
        return boto3.Session(aws_access_key_id=OPERATOR, aws_secret_access_key="local", region_name=self.conn.region)

    def participant_session(self, pid: str) -> boto3.Session:
        from local.access.control import PARTICIPANT_KEY

        return boto3.Session(aws_access_key_id=f"{PARTICIPANT_KEY}{pid}", aws_secret_access_key="local",
                             region_name=self.conn.region)

    def check_stack(self) -> list[Line]:
        from local.access.control import ACCESS_PATH
        from local.access.model import AccessModel

        with urllib.request.urlopen(f"{self.conn.endpoint}{ACCESS_PATH}", timeout=30) as resp:  # noqa: S310 - ours
            held = json.loads(resp.read())
        if held.get("model"):
            self.model, self.enforce = AccessModel.from_json(held["model"]), bool(held.get("enforce"))
        self.config = self.read_config()
        self.wiring = local_wiring(self.conn, self.model)
        return [Line("stack", Status.PASS, f"stack: local run {self.run_id} at {self.conn.endpoint} (no CloudFormation "
                                           f"stack: its connection file names it); {self.bucket_and_table()}")]

    def read_config(self) -> RunConfig | None:
        try:
            return RunConfig.model_validate_json(
                Bucket(self.conn.bucket, self.client("s3")).get(keys.config_key(self.run_id)).data)
        except NotFound:
            return None

    def check_functions(self) -> list[Line]:
        import importlib

        names = sorted(n[len(FUNCTION):] for n in self.model.principals if n.startswith(FUNCTION)) \
            if self.model is not None else list(FUNCTIONS)
        lines, fine = [], []
        for name in names:
            try:
                handler = getattr(importlib.import_module(f"functions.{name}"), "handler", None)
            except Exception as exc:  # whatever stops the import is the finding
                lines.append(Line("functions", Status.FAIL, f"functions: functions.{name} does not import: "
                                                            f"{_error(exc)}", "fix the import error it names"))
                continue
            if callable(handler):
                fine.append(f"functions.{name}.handler")
            else:
                lines.append(Line("functions", Status.FAIL, f"functions: functions.{name}.handler is not callable",
                                  f"define handler(event, context) in functions/{name}.py"))
        if fine:
            lines.insert(0, Line("functions", Status.PASS, f"functions: {', '.join(fine)} import and are callable "
                                                           "(the local dispatcher runs them in Lambda's place)"))
        return lines

    def judge(self) -> tuple[Judge, Callable[[], None], str]:
        from local import access

        how = "local.access's evaluator on the model the local server holds"
        if self.model is None:
            missing = access.unavailable()
            if missing:
                raise CheckFailed(Line("roles", Status.SKIP, "roles: not judged: the local server judges nothing (its "
                                                             f"access check is off), and here {missing}",
                                       "install what is missing (`npm ci`, `pip install '.[infra]'`) and restart fed "
                                       "local without FED_ACCESS_CHECK=off"))
            self.model = access.model_for(self.config or RunConfig(run_id=self.run_id), self.conn.region,
                                          self.conn.endpoint)
            self.wiring = local_wiring(self.conn, self.model)
            how = "local.access's evaluator on the template `cdk synth` makes (the local server judges nothing)"
        elif not self.enforce:
            how += " (it records its judgments and refuses nothing)"
        judge, close = local_judge(self.model)
        return judge, close, how

    def eventbridge_enabled(self, notification: Mapping[str, Any]) -> tuple[bool, str]:
        # moto's S3 keeps the bucket's EventBridgeConfiguration but leaves it out of its answer; the local stack sets
        # it at start (local/resources.py), and moto delivers every object's event to the rules.
        return True, " (set by the local stack at start: moto's S3 does not echo the setting back)"

    def matches(self, pattern: str, event: dict[str, Any]) -> bool:
        from moto.events.models import EventPattern

        return bool(EventPattern.load(pattern).matches_event(event))  # type: ignore[arg-type]


def local_wiring(conn: Connection, model: Any) -> Wiring:
    """The local stack's names (`local.access.local_binding`, as the server's model is bound). What a local run has
    no stand-in for (the functions as Lambda functions, their log groups, the operator policy as an IAM object) is
    named as the model's own grants name it: locally those calls show that a grant exists; on AWS, that it names the
    deployed resource."""
    from local.access import local_binding
    from local.access.model import LOCAL_ACCOUNT

    region = model.region if model is not None else conn.region
    binding = local_binding(conn.run_id, region, conn.endpoint, model.account if model is not None else LOCAL_ACCOUNT)
    account, names = binding.account, binding.names

    def granted(principal: str, action: str, match: str = "") -> str:
        """The first resource an Allow statement of `principal` names for `action` (and holding `match`)."""
        if model is None or principal not in model.principals:
            return ""
        for _, statement in model.principals[principal].statements():
            actions, resources = statement.get("Action"), statement.get("Resource")
            if statement.get("Effect") == "Allow" and action in (actions if isinstance(actions, list) else [actions]):
                for resource in resources if isinstance(resources, list) else [resources]:
                    if match in str(resource):
                        return str(resource)
        return ""

    def queue(name: str) -> str:
        return f"arn:aws:sqs:{region}:{account}:{name}"

    fallback = f"{conn.run_id}-missing"  # a name no grant holds: judged, and refused
    return Wiring(
        run_id=conn.run_id, account=account, region=region, bucket=conn.bucket, table=conn.table,
        state_topic=conn.state_topic or f"arn:aws:sns:{region}:{account}:{names['Topic']}",
        stack_id=f"arn:aws:cloudformation:{region}:{account}:stack/{binding.stack_name}/local",  # (as model.py's)
        join_queue=queue(names["JoinQueue"]), shard_queue=queue(names["ShardQueue"]),
        dead_letters=queue(names["DeadLetters"]),
        functions={n: granted(OPERATOR, "lambda:GetFunction",
                              f":function:{CONSTRUCTS.get(n, f'Coordinator{n.capitalize()}')}")
                   or f"arn:aws:lambda:{region}:{account}:function:{fallback}-{n}" for n in FUNCTIONS},
        log_groups={n: granted(f"{FUNCTION}{n}", "logs:PutLogEvents").removesuffix(":*")
                    or f"arn:aws:logs:{region}:{account}:log-group:{fallback}-{n}" for n in FUNCTIONS},
        roles={name: p.arn for name, p in model.principals.items() if name != OPERATOR} if model is not None else {},
        operator_policy=granted(OPERATOR, "iam:GetPolicyVersion") or f"arn:aws:iam::{account}:policy/{fallback}")


class AwsChecker(_Checker):
    """Against a deployed stack, with the caller's credentials (the stack's operator policy is what it needs)."""

    def __init__(self, conn: Connection, stack: str) -> None:
        super().__init__(conn)
        self.stack = stack
        self.outputs: dict[str, str] = {}
        self.functions: dict[str, dict[str, Any]] = {}  # tick|ingest|join|shard -> GetFunction's Configuration

    def participant_session(self, pid: str) -> boto3.Session:
        role = self.outputs.get(OUTPUT_PARTICIPANT_ROLE, "")
        try:
            creds = self.client("sts").assume_role(RoleArn=role, RoleSessionName=pid, DurationSeconds=900,
                                                   Tags=[{"Key": PARTICIPANT_TAG, "Value": pid}])["Credentials"]
        except ClientError as exc:
            raise CheckFailed(Line("participant", Status.FAIL, f"participant: cannot assume {role} with the tag "
                                                               f"{PARTICIPANT_TAG}={pid}: {_error(exc)}",
                                   "attach the stack's OperatorPolicyArn to the identity running fed check (it allows "
                                   "sts:AssumeRole and sts:TagSession on the participant role, which trusts this "
                                   "account: docs/deploy.md, section 4)")) from None
        return boto3.Session(aws_access_key_id=creds["AccessKeyId"], aws_secret_access_key=creds["SecretAccessKey"],
                             aws_session_token=creds["SessionToken"], region_name=self.conn.region)

    def check_stack(self) -> list[Line]:
        described = self.client("cloudformation").describe_stacks(StackName=self.stack)["Stacks"][0]
        self.outputs = {o["OutputKey"]: o["OutputValue"] for o in described.get("Outputs", [])}
        stack_id, status = str(described["StackId"]), str(described.get("StackStatus", ""))
        missing = [name for name in OUTPUTS if not self.outputs.get(name)]
        if missing:
            raise CheckFailed(Line("stack", Status.FAIL, f"stack: {self.stack} ({status}) has no output "
                                                         f"{', '.join(missing)}",
                                   "deploy this version of the stack: npx cdk deploy -c config=runs/<name>.toml"))
        self.wiring, self.functions, self.config = aws_wiring(self.client("cloudformation"), self.client("lambda"),
                                                              self.stack, stack_id, self.outputs, self.conn.region)
        if not status.endswith("_COMPLETE") or "ROLLBACK" in status:
            return [Line("stack", Status.FAIL, f"stack: {self.stack} is {status}",
                         "read the stack's events (aws cloudformation describe-stack-events --stack-name "
                         f"{self.stack}), fix what failed and deploy again")]
        return [Line("stack", Status.PASS, f"stack: {self.stack} {status}, outputs {', '.join(OUTPUTS)}; "
                                           f"{self.bucket_and_table()}")]

    def check_functions(self) -> list[Line]:
        lines, fine = [], []
        for name in FUNCTIONS:
            conf = self.functions.get(name)
            if conf is None:
                lines.append(Line("functions", Status.FAIL, "functions: the stack has no function whose handler is "
                                                            f"functions.{name}.handler", "deploy this version"))
                continue
            state, update = conf.get("State"), conf.get("LastUpdateStatus")
            shown = f"{name} ({conf.get('Runtime')}, {'/'.join(conf.get('Architectures') or [])})"
            if state == "Active" and update == "Successful":
                fine.append(shown)
                continue
            reason = conf.get("StateReason") or conf.get("LastUpdateStatusReason") or ""
            lines.append(Line("functions", Status.FAIL, f"functions: {shown} is {state}, last update {update}: "
                                                        f"{reason}", "fix what the reason names and deploy again"))
        tick = self.outputs.get(OUTPUT_TICK_FUNCTION, "")
        try:
            code = self.client("lambda").invoke(FunctionName=tick, InvocationType="DryRun")["StatusCode"]
        except ClientError as exc:
            lines.append(Line("functions", Status.FAIL, f"functions: a DryRun invoke of the tick {tick} was refused: "
                                                        f"{_error(exc)}",
                              "attach the stack's OperatorPolicyArn (it allows lambda:InvokeFunction on the tick)"))
        else:
            if not lines:
                lines.append(Line("functions", Status.PASS, f"functions: {', '.join(fine)}: Active, last update "
                                                            f"Successful; the tick accepts a DryRun invoke ({code})"))
        return lines

    def judge(self) -> tuple[Judge, Callable[[], None], str]:
        assert self.wiring is not None
        iam = self.client("iam")
        arn = self.wiring.operator_policy
        default = iam.get_policy(PolicyArn=arn)["Policy"]["DefaultVersionId"]
        document = iam.get_policy_version(PolicyArn=arn, VersionId=default)["PolicyVersion"]["Document"]
        text = document if isinstance(document, str) else json.dumps(document)
        return (iam_judge(iam, self.wiring.roles, text), lambda: None,
                f"IAM's policy simulator; the operator policy's version {default}")


def _queue_arn(url: str, partition: str, region: str) -> str:
    parts = [p for p in url.split("/") if p]
    return f"arn:{partition}:sqs:{region}:{parts[-2]}:{parts[-1]}" if len(parts) >= 2 else ""


def aws_wiring(cfn: Any, lam: Any, stack: str, stack_id: str, outputs: Mapping[str, str], region: str
               ) -> tuple[Wiring, dict[str, dict[str, Any]], RunConfig | None]:
    """The deployed stack's resources: its functions (each function's configuration: role, log group, dead-letter
    queue, the shard queue it sends to, the run config), its queues and the outputs."""
    _, partition, _, _, account, _ = (stack_id.split(":", 5) + [""] * 6)[:6]
    resources = [r for page in cfn.get_paginator("list_stack_resources").paginate(StackName=stack)
                 for r in page.get("StackResourceSummaries", [])]
    functions: dict[str, dict[str, Any]] = {}
    for r in resources:
        if r.get("ResourceType") == "AWS::Lambda::Function" and r.get("PhysicalResourceId"):
            conf = lam.get_function(FunctionName=r["PhysicalResourceId"])["Configuration"]
            handler = str(conf.get("Handler", ""))
            if handler.startswith("functions.") and handler.endswith(".handler"):
                functions[handler.split(".")[1]] = conf
    queues = {r["LogicalResourceId"]: _queue_arn(str(r.get("PhysicalResourceId", "")), partition, region)
              for r in resources if r.get("ResourceType") == "AWS::SQS::Queue"}

    def queue(prefix: str) -> str:
        return next((arn for logical, arn in sorted(queues.items()) if logical.startswith(prefix)), "")

    tick = functions.get("tick", {})
    env = (tick.get("Environment") or {}).get("Variables") or {}
    runner = str(env.get(ENV_SHARD_RUNNER, ""))
    shard_queue = _queue_arn(runner.partition(":")[2], partition, region) if runner.startswith("queue:") else ""
    config = None
    if env.get(ENV_CONFIG):
        try:
            config = RunConfig.model_validate_json(env[ENV_CONFIG])
        except ValueError:
            config = None

    def log_group(conf: Mapping[str, Any]) -> str:
        name = (conf.get("LoggingConfig") or {}).get("LogGroup") or f"/aws/lambda/{conf.get('FunctionName', '')}"
        return f"arn:{partition}:logs:{region}:{account}:log-group:{name}"

    wiring = Wiring(
        run_id=outputs[OUTPUT_RUN_ID], account=account, region=region, bucket=outputs[OUTPUT_BUCKET],
        table=outputs[OUTPUT_TABLE], state_topic=outputs[OUTPUT_STATE_TOPIC], stack_id=stack_id,
        join_queue=queue("CoordinatorJoinQueue"), shard_queue=shard_queue or queue("CoordinatorShardQueue"),
        dead_letters=str((tick.get("DeadLetterConfig") or {}).get("TargetArn") or queue("CoordinatorDeadLetters")),
        functions={n: str(c.get("FunctionArn", "")) for n, c in functions.items()},
        log_groups={n: log_group(c) for n, c in functions.items()},
        roles={**{f"{FUNCTION}{n}": str(c.get("Role", "")) for n, c in functions.items()},
               PARTICIPANT: outputs[OUTPUT_PARTICIPANT_ROLE]},
        operator_policy=outputs[OUTPUT_OPERATOR_POLICY], partition=partition or "aws")
    return wiring, functions, config


def run_checks(conn: Connection, stack: str | None = None, checker: _Checker | None = None) -> Report:
    """Every check against the run `conn` names: the deployed `stack` (AWS), or the local run at its endpoint."""
    started = time.monotonic()
    if checker is None:
        checker = LocalChecker(conn) if conn.endpoint else AwsChecker(conn, stack or "")
    target = f"local run at {conn.endpoint}" if conn.endpoint else f"stack {stack} ({conn.region})"
    report = Report(conn.run_id, target, checker.run())
    report.seconds = time.monotonic() - started
    return report


__all__ = ["AwsChecker", "Call", "Line", "LocalChecker", "Report", "Status", "Wiring", "aws_wiring", "catalog",
           "local_wiring", "run_checks"]
