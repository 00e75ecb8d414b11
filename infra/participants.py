"""Participant identity: one role, assumed with a session tag naming the participant.

A host assumes the role with the tag `participant=<id>`; IAM substitutes `${aws:PrincipalTag/participant}`
into the resource ARNs, so the session can write only keys ending in its own id, read the global models,
the manifest, the published config and its own updates, read the run's items in the table and this
stack's outputs, create, use and delete one SQS queue, fed-<run>-p-<its own id>, and subscribe that queue
(and no other endpoint) to the run-state topic (`infra.notifications`). Nothing else.

Who may assume it with which tag is decided by the host's own identity policy (see docs/deploy.md): the
trust policy admits principals of this account (or `[deploy] participant_principals`) only with exactly
that one tag, and refuses tag values that are not usable participant ids (reserved names such as
"global" would otherwise match the coordinator's own keys).
"""

from __future__ import annotations

from aws_cdk import ArnFormat, Aws, Duration, Stack
from aws_cdk import aws_dynamodb as dynamodb
from aws_cdk import aws_iam as iam
from aws_cdk import aws_s3 as s3
from aws_cdk import aws_sns as sns
from constructs import Construct, IConstruct

from infra import layout
from infra.nag import acknowledge, arn_ref
from infra.notifications import subscribe_conditions
from infra.settings import DeploySettings
from shared.config import RunConfig
from shared.keys import RESERVED_IDS
from shared.naming import HOST_TAG, PARTICIPANT_POLICY, PARTICIPANT_TAG, participant_queue_prefix
from shared.table_keys import run_pk

TAG = f"aws:PrincipalTag/{PARTICIPANT_TAG}"
REQUEST_TAG = f"aws:RequestTag/{PARTICIPANT_TAG}"
# Participant ids are letters, digits, '_' and '-' (shared.keys); session tag values may also hold these.
# Longer than 63 characters (no participant id is): a 64-character tag could otherwise write a global
# model's content-addressed key rounds/<r>/global/<sha256>.
FORBIDDEN_IN_ID = ("*/*", "*.*", "*:*", "*=*", "*+*", "*@*", "* *", "?" * 64 + "*")


# Assuming the role takes exactly one session tag, the participant id; checked on AssumeRole and TagSession.
TRUST_CONDITIONS = {
    "StringLike": {REQUEST_TAG: "?*"},
    "ForAllValues:StringEquals": {"aws:TagKeys": [PARTICIPANT_TAG]},
}


# What a participant does with its own queue (`store.push`): create it (SSE-SQS, the default for new queues: IAM has
# no condition key for a queue's attributes, so that cannot be demanded here), give it the policy that lets the state
# topic send to it, long-poll it, and delete the queue when it leaves. It never deletes a message (a received state
# stays in flight until the queue's short retention drops it), so it is not granted DeleteMessage.
QUEUE_ACTIONS = (
    "sqs:CreateQueue",
    "sqs:GetQueueUrl",
    "sqs:GetQueueAttributes",
    "sqs:SetQueueAttributes",
    "sqs:ReceiveMessage",
    "sqs:DeleteQueue",
)
# The AWS SDKs always call SQS and SNS over HTTPS; a request without TLS is not this participant's.
OVER_TLS = {"Bool": {"aws:SecureTransport": "true"}}


def own_queue_arn(scope: IConstruct, run_id: str) -> str:
    """arn:<partition>:sqs:<region>:<account>:fed-<run>-p-${aws:PrincipalTag/participant}: the session's own queue
    (`shared.naming.participant_queue_name`), in the stack's account and region; exactly that name, no wildcard."""
    return Stack.of(scope).format_arn(service="sqs", resource=f"{participant_queue_prefix(run_id)}{layout.SELF}",
                                      arn_format=ArnFormat.NO_RESOURCE_NAME)


def run_items(run_id: str) -> dict[str, dict[str, object]]:
    """The condition that keeps table requests to the run's own items: every key in the run's partition."""
    return {"ForAllValues:StringEquals": {"dynamodb:LeadingKeys": [run_pk(run_id)]}}


def _reserved() -> list[str]:
    return sorted(RESERVED_IDS)


def id_conditions(key: str) -> dict[str, dict[str, object]]:
    """The tag `key` is present, is not a reserved name, and holds no character a participant id cannot."""
    return {
        "Null": {key: "false"},
        "StringNotEqualsIgnoreCase": {key: _reserved()},
        "StringNotLike": {key: list(FORBIDDEN_IN_ID)},
    }


class ParticipantAccess(Construct):
    """The participant role and its policy."""

    def __init__(
        self,
        scope: Construct,
        id: str,
        *,
        config: RunConfig,
        settings: DeploySettings,
        bucket: s3.IBucket,
        table: dynamodb.ITable,
        state_topic: sns.ITopic,
    ) -> None:
        super().__init__(scope, id)
        run_id = config.run_id
        self.own_queue_arn = own_queue_arn(self, run_id)
        trusted: list[iam.IPrincipal] = (
            [iam.ArnPrincipal(arn) for arn in settings.participant_principals]
            if settings.participant_principals
            else [iam.AccountRootPrincipal()]
        )
        witnessing = config.witness_nodes > 0

        def statements() -> list[iam.PolicyStatement]:
            return (self._statements(bucket, table, run_id, witnessing=witnessing)
                    + self._state_statements(state_topic, self.own_queue_arn))

        # The same statements again as the role's permissions boundary: the operator may write the role's inline
        # policies (`fed hosts revoke` denies revoked hosts' sessions there, and IAM cannot limit that right to one
        # policy name), and the boundary keeps anything written there within what this template grants.
        self.boundary = iam.ManagedPolicy(
            self, "Boundary", statements=statements(),
            description=f"The most a participant session of run {run_id} may do, whatever its inline policies say.",
        )  # fmt: skip
        self.role = iam.Role(
            self,
            "Role",
            description=f"Participants of run {run_id}, assumed with the session tag {PARTICIPANT_TAG}=<id>.",
            assumed_by=iam.PrincipalWithConditions(trusted[0], TRUST_CONDITIONS).with_session_tags(),
            max_session_duration=Duration.hours(settings.participant_session_hours),
            inline_policies={PARTICIPANT_POLICY: iam.PolicyDocument(statements=statements())},
            permissions_boundary=self.boundary,
        )
        trust = self.role.assume_role_policy
        assert trust is not None
        self._trust = trust
        for other in trusted[1:]:
            trust.add_statements(
                iam.PolicyStatement(
                    actions=["sts:AssumeRole", "sts:TagSession"],
                    principals=[other],
                    conditions=TRUST_CONDITIONS,
                )
            )
        for sid, operator, values in (
            ("RefuseReservedIds", "StringEqualsIgnoreCase", _reserved()),
            ("RefuseNonIdCharacters", "StringLike", list(FORBIDDEN_IN_ID)),
        ):
            trust.add_statements(
                iam.PolicyStatement(
                    sid=sid,
                    effect=iam.Effect.DENY,
                    principals=[iam.AnyPrincipal()],
                    actions=["sts:AssumeRole", "sts:TagSession"],
                    conditions={operator: {REQUEST_TAG: values}},
                )
            )
        acknowledge(
            self,  # the role's policy and its boundary
            "IAM5",
            "Wildcards stand only for the round (and, under it, the kind of report) below this run's prefix: a "
            "participant writes and checks its update, witness proof or health report for any round at "
            "rounds/<round>/[witness/|health/]<its own id> (the id is the session tag, substituted by IAM) and "
            "reads the global model and download delta of any round (with witnessing on, every object of the run's "
            "rounds: witnesses evaluate the other participants' updates) and the run state's rosters "
            "(roster/<digest>); rounds and digests are not known at deploy time.",
            findings=[
                # cdk-nag prints the policy variable ${aws:PrincipalTag/participant} as <aws:PrincipalTag/...>
                f"Resource::{arn_ref(bucket)}/{layout.own_updates(run_id).replace('${', '<').replace('}', '>')}",
                f"Resource::{arn_ref(bucket)}/{layout.global_models(run_id)}",
                f"Resource::{arn_ref(bucket)}/{layout.delta_objects(run_id)}",
                f"Resource::{arn_ref(bucket)}/{layout.round_objects(run_id)}",
                f"Resource::{arn_ref(bucket)}/{layout.rosters(run_id)}",
            ],
        )

    def admit_issuer(self, issuer: iam.IRole) -> None:
        """Trust `issuer` (the credential endpoint's role, `infra.hosts`) to assume the role for a host: with the
        session tag naming a usable participant id, as every other principal, and the host's generation
        (`shared.naming.HOST_TAG`, which the deny on revoked generations reads: no other principal may set it); the
        conditions are written out here as well as in the deny statements, so this statement admits nothing on its
        own that they would refuse."""
        self._trust.add_statements(
            iam.PolicyStatement(
                sid="CredentialEndpoint",
                actions=["sts:AssumeRole", "sts:TagSession"],
                principals=[iam.ArnPrincipal(issuer.role_arn)],
                conditions={"StringLike": {REQUEST_TAG: "?*", f"aws:RequestTag/{HOST_TAG}": "?*.?*"},
                            "ForAllValues:StringEquals": {"aws:TagKeys": [PARTICIPANT_TAG, HOST_TAG]},
                            **id_conditions(REQUEST_TAG)},
            )
        )

    @staticmethod
    def _state_statements(state_topic: sns.ITopic, own_queue: str) -> list[iam.PolicyStatement]:
        """Its own queue, and subscribing that queue to the run-state topic: no other queue (the coordinator's
        fed-<run>-ingest and -join, another participant's), no other endpoint or protocol."""
        return [
            iam.PolicyStatement(
                sid="OwnStateQueue",
                actions=list(QUEUE_ACTIONS),
                resources=[own_queue],
                conditions={**id_conditions(TAG), **OVER_TLS},
            ),
            iam.PolicyStatement(
                sid="SubscribeOwnQueueToState",
                actions=["sns:Subscribe"],
                resources=[state_topic.topic_arn],
                conditions={**id_conditions(TAG), **subscribe_conditions(own_queue), **OVER_TLS},
            ),
        ]

    @staticmethod
    def _statements(
        bucket: s3.IBucket, table: dynamodb.ITable, run_id: str, witnessing: bool
    ) -> list[iam.PolicyStatement]:
        return [
            iam.PolicyStatement(
                sid="WriteOwnKeys",
                # AbortMultipartUpload: a participant retrying a large upload cleans up after itself.
                actions=["s3:PutObject", "s3:AbortMultipartUpload"],
                resources=[bucket.arn_for_objects(key) for key in layout.participant_writes(run_id)],
                conditions=id_conditions(TAG),
            ),
            # IAM's `*` spans `/`, so rounds/*/<own id> also matches a key the coordinator writes below a round whose
            # last segment can be a participant id (a shard's outcome, rounds/<r>/staging/<job>/000000, is one for the
            # participant "000000"): no participant writes below the coordinator's names, nor reads what is staged
            # (a shard's outcome names the aggregate's upload).
            iam.PolicyStatement(
                sid="NoCoordinatorWrites",
                effect=iam.Effect.DENY,
                actions=["s3:PutObject", "s3:AbortMultipartUpload"],
                resources=[bucket.arn_for_objects(key) for key in layout.coordinator_round_objects(run_id)],
            ),
            iam.PolicyStatement(
                sid="NoStagedReads",
                effect=iam.Effect.DENY,
                actions=["s3:GetObject", "s3:GetObjectVersion"],
                resources=[bucket.arn_for_objects(layout.staging_objects(run_id))],
            ),
            iam.PolicyStatement(
                sid="ReadModelsAndConfig",
                actions=["s3:GetObject"],
                resources=[bucket.arn_for_objects(key) for key in layout.participant_reads(run_id, witnessing)],
            ),
            # A witness downloads each update by the version the coordinator accepted (GetObject with a VersionId
            # needs s3:GetObjectVersion), so an upload that replaced it cannot be evaluated instead; a participant
            # restarted after uploading reads its own update back by the version it uploaded.
            iam.PolicyStatement(sid="ReadUpdateVersions", actions=["s3:GetObjectVersion"],
                                resources=[bucket.arn_for_objects(layout.round_objects(run_id) if witnessing
                                                                  else layout.own_updates(run_id))]),
            iam.PolicyStatement(
                sid="ReadStackOutputs",
                # `fed-participant start --stack NAME` finds bucket, table and run id in this stack's outputs,
                # so a host holding only a participant session can still start from the stack name.
                actions=["cloudformation:DescribeStacks"],
                resources=[Aws.STACK_ID],
            ),
            iam.PolicyStatement(
                sid="ReadRunState",
                actions=["dynamodb:GetItem"],
                resources=[table.table_arn],
                conditions=run_items(run_id),
            ),
        ]
