"""Participant identity: one role, assumed with a session tag naming the participant.

A host assumes the role with the tag `participant=<id>`; IAM substitutes `${aws:PrincipalTag/participant}`
into the resource ARNs, so the session can write only keys ending in its own id, read the global models
and the manifest, and read the run's items in the table. Nothing else.

Who may assume it with which tag is decided by the host's own identity policy (see docs/deploy.md): the
trust policy admits principals of this account (or `[deploy] participant_principals`) only with exactly
that one tag, and refuses tag values that are not usable participant ids (reserved names such as
"global" would otherwise match the coordinator's own keys).
"""

from __future__ import annotations

from aws_cdk import Duration
from aws_cdk import aws_dynamodb as dynamodb
from aws_cdk import aws_iam as iam
from aws_cdk import aws_s3 as s3
from constructs import Construct

from infra.nag import acknowledge, arn_ref
from infra.settings import DeploySettings
from shared.config import RunConfig
from shared.keys import RESERVED_IDS, run_prefix
from shared.naming import PARTICIPANT_TAG
from shared.records import run_pk

TAG = f"aws:PrincipalTag/{PARTICIPANT_TAG}"
REQUEST_TAG = f"aws:RequestTag/{PARTICIPANT_TAG}"
SELF = f"${{{TAG}}}"  # the IAM policy variable: this session's own participant id
# Participant ids are letters, digits, '_' and '-' (shared.keys); session tag values may also hold these.
FORBIDDEN_IN_ID = ("*/*", "*.*", "*:*", "*=*", "*+*", "*@*", "* *")
# Keys a participant writes, each ending in its own id.
PARTICIPANT_WRITES = ("join/", "init/", "heartbeat/", "rounds/*/")
PARTICIPANT_READS = ("rounds/*/global", "manifest.json")


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
    ) -> None:
        super().__init__(scope, id)
        run_id = config.run_id
        prefix = run_prefix(run_id)
        trusted: list[iam.IPrincipal] = (
            [iam.ArnPrincipal(arn) for arn in settings.participant_principals]
            if settings.participant_principals
            else [iam.AccountRootPrincipal()]
        )
        self.role = iam.Role(
            self,
            "Role",
            description=f"Participants of run {run_id}, assumed with the session tag {PARTICIPANT_TAG}=<id>.",
            assumed_by=iam.PrincipalWithConditions(
                trusted[0],
                {
                    # Exactly one tag, the participant's id; checked on sts:AssumeRole and sts:TagSession.
                    "StringLike": {REQUEST_TAG: "?*"},
                    "ForAllValues:StringEquals": {"aws:TagKeys": [PARTICIPANT_TAG]},
                },
            ).with_session_tags(),
            max_session_duration=Duration.hours(settings.participant_session_hours),
            inline_policies={
                "participant": iam.PolicyDocument(statements=self._statements(prefix, bucket, table, run_id))
            },
        )
        trust = self.role.assume_role_policy
        assert trust is not None
        for other in trusted[1:]:
            trust.add_statements(
                iam.PolicyStatement(
                    actions=["sts:AssumeRole", "sts:TagSession"],
                    principals=[other],
                    conditions={
                        "StringLike": {REQUEST_TAG: "?*"},
                        "ForAllValues:StringEquals": {"aws:TagKeys": [PARTICIPANT_TAG]},
                    },
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
            self.role,
            "IAM5",
            "Wildcards stand only for the round number, below this run's prefix: a participant writes its "
            "update for any round at rounds/<round>/<its own id> (the id is the session tag, substituted by "
            "IAM) and reads the global model of any round; rounds are not known at deploy time.",
            findings=[
                f"Resource::{arn_ref(bucket)}/{prefix}rounds/*/<{TAG}>",  # how cdk-nag prints ${...}
                f"Resource::{arn_ref(bucket)}/{prefix}rounds/*/global",
            ],
        )

    @staticmethod
    def _statements(prefix: str, bucket: s3.IBucket, table: dynamodb.ITable, run_id: str) -> list[iam.PolicyStatement]:
        return [
            iam.PolicyStatement(
                sid="WriteOwnKeys",
                # AbortMultipartUpload: a participant retrying a large upload cleans up after itself.
                actions=["s3:PutObject", "s3:AbortMultipartUpload"],
                resources=[bucket.arn_for_objects(f"{prefix}{kind}{SELF}") for kind in PARTICIPANT_WRITES],
                conditions=id_conditions(TAG),
            ),
            iam.PolicyStatement(
                sid="ReadGlobalModels",
                actions=["s3:GetObject"],
                resources=[bucket.arn_for_objects(f"{prefix}{key}") for key in PARTICIPANT_READS],
            ),
            iam.PolicyStatement(
                sid="ReadRunState",
                actions=["dynamodb:GetItem"],
                resources=[table.table_arn],
                conditions={"ForAllValues:StringEquals": {"dynamodb:LeadingKeys": [run_pk(run_id)]}},
            ),
        ]
