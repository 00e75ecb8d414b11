"""The run-state topic: how participants learn of a new round without polling the table.

    tick λ, ingest λ  ──sns:Publish (a commit changing phase, round, epoch or model: the state item)──>
        SNS topic fed-<run>-state  ──raw message delivery──>  SQS fed-<run>-p-<id>, one per participant
                                                              (created, subscribed and long-polled by it)

Only the two functions that commit the run state may publish (their roles hold sns:Publish on this topic, and
the topic policy refuses every other principal). A participant may subscribe only its own queue, over SQS: the
topic policy and the participant role both demand `sns:Protocol` = sqs and `sns:Endpoint` = the ARN of
fed-<run>-p-<its session tag>. The participant gives its queue a policy letting this topic (`aws:SourceArn`)
send to it; topic, queue and role are in the stack's account, so the subscription needs no confirmation.

Encryption at rest: the topic uses the AWS-managed key `alias/aws/sns`. SNS decrypts a message when it sends it,
so a subscriber never needs the topic's key; what an SQS subscriber needs is a queue SNS may write to (SSE-SQS,
the default for new queues, or no SSE; not the AWS-managed `alias/aws/sqs` key, whose policy SNS cannot use). The
AWS-managed SNS key admits any principal of the account calling through SNS, so the publishing roles need no KMS
permission; only AWS services that publish as service principals (CloudWatch alarms, EventBridge) cannot use it,
and none publishes here. It costs no monthly key fee (a customer key would: a fixed cost in a stack meant to cost
nothing while idle). The messages carry only the run state item: phase, round, deadlines, digests.
"""

from __future__ import annotations

from collections.abc import Sequence

from aws_cdk import aws_iam as iam
from aws_cdk import aws_sns as sns
from constructs import Construct

from shared.config import RunConfig
from shared.naming import state_topic_name

AWS_MANAGED_SNS_KEY = "alias/aws/sns"
SUBSCRIBE_PROTOCOL = "sqs"


def subscribe_conditions(own_queue_arn: str) -> dict[str, dict[str, object]]:
    """Subscribing is allowed only over SQS, only to the caller's own queue (the ARN holds the policy variable)."""
    return {"StringEquals": {"sns:Protocol": SUBSCRIBE_PROTOCOL, "sns:Endpoint": own_queue_arn}}


class StateNotifications(Construct):
    """The topic; `admit` writes its policy once the publishing roles and the participant role exist."""

    def __init__(self, scope: Construct, id: str, *, config: RunConfig) -> None:
        super().__init__(scope, id)
        self.topic = sns.Topic(
            self,
            "Topic",
            topic_name=state_topic_name(config.run_id),
            display_name=f"fed {config.run_id} run state",
            enforce_ssl=True,
        )
        # The key by its alias, as SNS documents it (an imported alias would give its ARN; the same key).
        cfn_topic = self.topic.node.default_child
        assert isinstance(cfn_topic, sns.CfnTopic)
        cfn_topic.kms_master_key_id = AWS_MANAGED_SNS_KEY

    def admit(self, *, publishers: Sequence[iam.IRole], subscriber: iam.IRole, own_queue_arn: str) -> None:
        """Publishing by `publishers` only; subscribing by `subscriber` only over SQS to `own_queue_arn`."""
        topic = self.topic.topic_arn
        publisher_arns = [role.role_arn for role in publishers]
        for statement in (
            iam.PolicyStatement(
                sid="CoordinatorPublishes",
                principals=[iam.ArnPrincipal(arn) for arn in publisher_arns],
                actions=["sns:Publish"],
                resources=[topic],
            ),
            iam.PolicyStatement(
                # No other principal of the account (whatever its own policies say) can forge a state change.
                sid="NobodyElsePublishes",
                effect=iam.Effect.DENY,
                principals=[iam.AnyPrincipal()],
                actions=["sns:Publish"],
                resources=[topic],
                conditions={"ArnNotEquals": {"aws:PrincipalArn": publisher_arns}},
            ),
            iam.PolicyStatement(
                sid="ParticipantsSubscribeTheirOwnQueue",
                principals=[iam.ArnPrincipal(subscriber.role_arn)],
                actions=["sns:Subscribe"],
                resources=[topic],
                conditions=subscribe_conditions(own_queue_arn),
            ),
        ):
            self.topic.add_to_resource_policy(statement)
