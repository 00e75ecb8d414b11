"""The credential endpoint: how a host with no AWS identity gets participant sessions.

    host  --POST /redeem (the invite's secret and a new Ed25519 public key, once)-->  function URL (auth NONE)
    host  --POST /renew (signed with that key: timestamp and nonce, replay-proof)-->       |
                                                                                  credentials function
          <--  STS credentials for the participant role, session tag participant=<id>  --  (sts:AssumeRole)

The hosts have no AWS identity to sign a request with, so the URL takes no IAM auth; the function itself decides
(`functions.credentials`): an invite's secret is accepted once and only its hash is stored, every later request is
signed with the key bound at redemption and carries a nonce that is never accepted twice, bodies are bounded, and
requests are rate-limited per host and over all hosts. The function's reserved concurrency bounds what a flood of
requests can cost whatever gets through to it, and keeps the flood off the account's pool.

The function's role may do nothing but issue those sessions and read and write the run's items of the table, where
the host records live. The participant role trusts it only with the same session-tag conditions as any other
principal (`ParticipantAccess.admit_issuer`), so what a session may do is decided by the participant role's policy
alone, exactly as for a host that assumes the role itself.
"""

from __future__ import annotations

from aws_cdk import aws_dynamodb as dynamodb
from aws_cdk import aws_iam as iam
from aws_cdk import aws_lambda as lambda_
from aws_cdk import aws_s3 as s3
from aws_cdk import aws_sns as sns
from constructs import Construct

from infra.lambdas import FunctionSpec, coordinator_function
from infra.nag import FED_PACK, URL_AUTH, acknowledge
from infra.participants import run_items
from infra.settings import DeploySettings
from infra.storage import removal_policy
from shared.config import RunConfig
from shared.naming import (
    ENV_ALL_HOSTS_RATE,
    ENV_BUCKET,
    ENV_CONFIG,
    ENV_CREDENTIAL_SECONDS,
    ENV_HOST_RATE,
    ENV_PARTICIPANT_ROLE,
    ENV_RUN_ID,
    ENV_STATE_TOPIC,
    ENV_TABLE,
    METRICS_NAMESPACE,
)

NAME = "credentials"  # functions.credentials.handler; the access check knows the role as function:credentials
# The host records (host, nonce, rate-counter and refusal items): read one, create one conditionally, update one
# (a redemption, a counter's ADD, the time credentials were last issued). It never lists them: operators do.
HOST_RECORD_ACTIONS = ("dynamodb:GetItem", "dynamodb:PutItem", "dynamodb:UpdateItem")
# A participant session: assumed with the one session tag naming the host.
SESSION_ACTIONS = ("sts:AssumeRole", "sts:TagSession")


def host_record_statement(table: dynamodb.ITable, run_id: str) -> iam.PolicyStatement:
    """The run's items of the table and no other run's: every item a request reads or writes is in the run's
    partition, so the leading key is the condition (as the participant role's reads)."""
    return iam.PolicyStatement(
        sid="HostRecords",
        actions=list(HOST_RECORD_ACTIONS),
        resources=[table.table_arn],
        conditions=run_items(run_id),
    )


def session_statement(participant_role: iam.IRole) -> iam.PolicyStatement:
    return iam.PolicyStatement(sid="IssueParticipantSessions", actions=list(SESSION_ACTIONS),
                               resources=[participant_role.role_arn])


class HostAccess(Construct):
    """The credential function (`function`, running as `role`), its public URL (`url`) and what it is told."""

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
        participant_role: iam.IRole,
        code: lambda_.Code,
    ) -> None:
        super().__init__(scope, id)
        run_id = config.run_id
        # What the function answers a host with besides the credentials (`store.connection.Connection`), and what it
        # needs itself: the role it issues sessions of, their lifetime, its rate limits.
        environment = {
            ENV_RUN_ID: run_id,
            ENV_BUCKET: bucket.bucket_name,
            ENV_TABLE: table.table_name,
            ENV_CONFIG: config.model_dump_json(),
            ENV_STATE_TOPIC: state_topic.topic_arn,
            ENV_PARTICIPANT_ROLE: participant_role.role_arn,
            ENV_CREDENTIAL_SECONDS: str(settings.credential_seconds),
            ENV_HOST_RATE: str(settings.host_requests_per_minute),
            ENV_ALL_HOSTS_RATE: str(settings.all_hosts_requests_per_minute),
            "POWERTOOLS_METRICS_NAMESPACE": METRICS_NAMESPACE,
        }
        spec = FunctionSpec(NAME, f"functions.{NAME}.handler",
                            f"Run {run_id}: participant sessions for invited hosts (redeem an invite, renew)",
                            settings.credentials, [host_record_statement(table, run_id)])
        self.function = coordinator_function(
            self,
            spec,
            code=code,
            environment=environment,
            dead_letter_queue=None,  # invoked synchronously: the host gets the failure and retries
            log_retention_days=settings.log_retention_days,
            log_removal=removal_policy(settings),
        )
        assert self.function.role is not None
        self.role: iam.IRole = self.function.role
        # A policy of its own, not the role's inline one: the participant role's trust names this role, so this
        # role's inline policy naming the participant role would make each wait for the other in CloudFormation.
        self.sessions = iam.Policy(self, "IssueSessions", statements=[session_statement(participant_role)],
                                   roles=[self.role])
        self.function.node.add_dependency(self.sessions)
        self.url = self.function.add_function_url(auth_type=lambda_.FunctionUrlAuthType.NONE)
        acknowledge(
            self.url,
            URL_AUTH,
            "The credential endpoint's URL takes no IAM auth because the hosts calling it have no AWS identity: "
            "they come to get one. The function authenticates each request itself: an invite's one-time secret "
            "(only its hash is stored) redeems once and binds the host's Ed25519 public key; every renewal is "
            "signed with that key, with a timestamp and a nonce never accepted twice. Bodies are bounded, requests "
            "are rate-limited per host and over all hosts, every refusal is recorded, and the function's reserved "
            "concurrency bounds what a flood can cost. Its role can do nothing but issue participant sessions and "
            "keep the host records.",
            pack=FED_PACK,
        )
