"""One stack per deployed run: it only composes the constructs, one per capability."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from aws_cdk import CfnOutput, Stack, Tags
from constructs import Construct

from infra.coordinator import Coordinator
from infra.hosts import HostAccess
from infra.lambdas import function_code
from infra.notifications import StateNotifications
from infra.observability import Observability
from infra.operators import OperatorAccess
from infra.participants import ParticipantAccess
from infra.settings import DeploySettings
from infra.storage import Storage
from infra.table import StateTable
from shared.config import RunConfig
from shared.naming import (
    OUTPUT_BUCKET,
    OUTPUT_CREDENTIAL_ENDPOINT,
    OUTPUT_OPERATOR_POLICY,
    OUTPUT_PARTICIPANT_ROLE,
    OUTPUT_RUN_ID,
    OUTPUT_STATE_TOPIC,
    OUTPUT_TABLE,
    OUTPUT_TICK_FUNCTION,
)


class FedRunStack(Stack):
    """Bucket, table, coordinator functions and their triggers (two lanes for uploads), the shard worker the
    ticks invoke, the run-state topic the ticks publish to, participant role, the credential endpoint invited hosts
    get participant sessions from, dashboard and alarms."""

    def __init__(
        self,
        scope: Construct,
        id: str,
        *,
        config: RunConfig,
        settings: DeploySettings,
        asset_dir: Path | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(scope, id, description=f"Federated training run {config.run_id} (fedcoord)", **kwargs)
        Tags.of(self).add("fed:run", config.run_id)
        self.storage = Storage(self, "Storage", config=config, settings=settings)
        self.state = StateTable(self, "State", config=config, settings=settings)
        bucket, table = self.storage.bucket, self.state.table
        self.notifications = StateNotifications(self, "StateTopic", config=config)
        topic = self.notifications.topic
        code = function_code(asset_dir)
        self.coordinator = Coordinator(
            self, "Coordinator", config=config, settings=settings, bucket=bucket, table=table, code=code,
            state_topic=topic,
        )  # fmt: skip
        self.participants = ParticipantAccess(
            self, "Participants", config=config, settings=settings, bucket=bucket, table=table, state_topic=topic
        )
        self.hosts = HostAccess(
            self, "Hosts", config=config, settings=settings, bucket=bucket, table=table, state_topic=topic,
            participant_role=self.participants.role, code=code,
        )  # fmt: skip
        self.participants.admit_issuer(self.hosts.role)
        functions = (*self.coordinator.functions, self.hosts.function)
        self.operators = OperatorAccess(
            self, "Operators", config=config, bucket=bucket, table=table, tick=self.coordinator.tick,
            functions=functions, schedule=self.coordinator.schedule,
            roles=[fn.role for fn in functions if fn.role is not None],
            participant_role=self.participants.role,
        )  # fmt: skip
        self.notifications.admit(
            publishers=[fn.role for fn in self.coordinator.committers if fn.role is not None],
            subscriber=self.participants.role, own_queue_arn=self.participants.own_queue_arn,
        )  # fmt: skip
        self.observability = Observability(
            self, "Observability", config=config, settings=settings, functions=functions,
            ingest=self.coordinator.ingest, dead_letters=self.coordinator.dead_letters,
            join_queue=self.coordinator.join_queue, shard=self.coordinator.shard, credentials=self.hosts.function,
        )  # fmt: skip
        # `fed-participant start --stack NAME` reads these five; a host needs nothing else.
        CfnOutput(self, OUTPUT_BUCKET, value=bucket.bucket_name, description="The run's bucket")
        CfnOutput(self, OUTPUT_TABLE, value=table.table_name, description="The run's state table")
        CfnOutput(self, OUTPUT_RUN_ID, value=config.run_id, description="The run id")
        CfnOutput(
            self, OUTPUT_PARTICIPANT_ROLE, value=self.participants.role.role_arn,
            description="Assume with the session tag participant=<id>",
        )  # fmt: skip
        CfnOutput(
            self, OUTPUT_STATE_TOPIC, value=topic.topic_arn,
            description="Subscribe the participant's own queue fed-<run>-p-<id> (SQS, raw delivery)",
        )  # fmt: skip
        # `fed` (operators) reads these three: the policy to attach to whoever operates the run, the tick to invoke,
        # the credential endpoint the invites name (`fed hosts invite`).
        CfnOutput(self, OUTPUT_OPERATOR_POLICY, value=self.operators.policy.managed_policy_arn,
                  description="Attach to the operators' roles: what every `fed` command needs")
        CfnOutput(self, OUTPUT_TICK_FUNCTION, value=self.coordinator.tick.function_name,
                  description="The tick function `fed run pause|resume` invokes")
        CfnOutput(self, OUTPUT_CREDENTIAL_ENDPOINT, value=self.hosts.url.url,
                  description="The credential endpoint `fed hosts invite` names: hosts redeem invites and renew there")
