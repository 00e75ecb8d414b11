"""The run's DynamoDB table: one item per run, participant, update and round, and the invited hosts' records (see
store/records.py)."""

from __future__ import annotations

from aws_cdk import aws_dynamodb as dynamodb
from constructs import Construct

from infra.settings import DeploySettings
from infra.storage import removal_policy
from shared.config import RunConfig
from shared.naming import TABLE_HASH_KEY, TABLE_RANGE_KEY
from shared.table_keys import TTL_ATTRIBUTE


class StateTable(Construct):
    """On-demand (idle costs nothing), point-in-time recovery, deletion protection as configured.

    CloudFormation names the table (<stack>-StateTable...-<suffix>): the table is retained when the stack is deleted
    (`retain_data`), and a name of ours would still be held by it, so that deploying the same run again would fail.
    The functions read the name from their environment, participants and operators from the stack's outputs."""

    def __init__(self, scope: Construct, id: str, *, config: RunConfig, settings: DeploySettings) -> None:
        super().__init__(scope, id)
        self.table = dynamodb.Table(
            self,
            "Table",
            partition_key=dynamodb.Attribute(name=TABLE_HASH_KEY, type=dynamodb.AttributeType.STRING),
            sort_key=dynamodb.Attribute(name=TABLE_RANGE_KEY, type=dynamodb.AttributeType.STRING),
            billing_mode=dynamodb.BillingMode.PAY_PER_REQUEST,
            point_in_time_recovery_specification=dynamodb.PointInTimeRecoverySpecification(
                point_in_time_recovery_enabled=True
            ),
            deletion_protection=settings.table_deletion_protection,
            removal_policy=removal_policy(settings),
            # the credential endpoint's used nonces, request counters and refusals expire (`store.hosts`)
            time_to_live_attribute=TTL_ATTRIBUTE,
        )
