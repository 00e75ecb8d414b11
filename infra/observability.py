"""The run at a glance on CloudWatch: a dashboard of the coordinator's metrics, and alarms.

The functions emit powertools EMF metrics in namespace METRICS_NAMESPACE with the dimensions `run` and
`service` (powertools adds the service name it was given); the dashboard and alarms read exactly those.
"""

from __future__ import annotations

from collections.abc import Sequence

from aws_cdk import Duration
from aws_cdk import aws_cloudwatch as cw
from aws_cdk import aws_cloudwatch_actions as cw_actions
from aws_cdk import aws_lambda as lambda_
from aws_cdk import aws_sns as sns
from aws_cdk import aws_sns_subscriptions as subscriptions
from aws_cdk import aws_sqs as sqs
from constructs import Construct

from infra.nag import acknowledge
from infra.settings import DeploySettings
from shared.config import RunConfig
from shared.naming import (
    METRIC_AGGREGATION_SECONDS,
    METRIC_PHASE_CHANGES,
    METRIC_ROUND,
    METRIC_ROUND_SECONDS,
    METRIC_TICK_CONFLICTS,
    METRIC_UPDATES_ACCEPTED,
    METRIC_UPDATES_REFUSED,
    METRICS_NAMESPACE,
)

# The service name functions/observability.py gives powertools' Metrics: part of every metric's dimensions.
METRICS_SERVICE = "fed-coordinator"
PERIOD = Duration.minutes(1)


# The shard-worker alarm on duration fires when an invocation took this share of the function's timeout: the
# next, larger round would be killed (the tick retries it, then fails); lower shard_bytes before that.
SHARD_DURATION_ALARM_SHARE = 0.8


class Observability(Construct):
    """Dashboard, stuck-run alarm, function-error and dead-letter alarms, shard-worker throttle and duration
    alarms, the credential endpoint's and ingest's throttle alarms, optional e-mail topic."""

    def __init__(
        self,
        scope: Construct,
        id: str,
        *,
        config: RunConfig,
        settings: DeploySettings,
        functions: Sequence[lambda_.Function],
        ingest: lambda_.Function,
        dead_letters: sqs.Queue,
        join_queue: sqs.Queue | None = None,
        shard: lambda_.Function | None = None,
        credentials: lambda_.Function | None = None,
    ) -> None:
        super().__init__(scope, id)
        self.run_id = config.run_id
        window = Duration.seconds(settings.stuck_window_seconds(config))

        self.alarms: list[cw.Alarm] = []
        # Stuck: participants are talking (ingest is invoked) but the round has not moved for a whole window.
        # DIFF compares the window's highest round with the previous window's, so the alarm fires between one
        # and two windows after the last round finished.
        self.stuck = cw.Alarm(
            self,
            "StuckRun",
            alarm_description=(
                f"Run {config.run_id}: no new round for {window.to_seconds()} s "
                f"({settings.stuck_round_multiple} x max_round_train_time) while participants are active."
            ),
            metric=cw.MathExpression(
                expression="IF(uploads > 0 AND DIFF(round) <= 0, 1, 0)",
                using_metrics={
                    "round": self.metric(METRIC_ROUND, "Maximum", window),
                    "uploads": ingest.metric_invocations(period=window, statistic="Sum"),
                },
                period=window,
                label="stuck",
            ),
            threshold=1,
            evaluation_periods=1,
            comparison_operator=cw.ComparisonOperator.GREATER_THAN_OR_EQUAL_TO_THRESHOLD,
            treat_missing_data=cw.TreatMissingData.NOT_BREACHING,
        )
        self.alarms.append(self.stuck)
        for fn in functions:
            self.alarms.append(
                cw.Alarm(
                    self,
                    f"{fn.node.id}Errors",
                    alarm_description=f"Run {config.run_id}: the {fn.node.id.lower()} function failed.",
                    metric=fn.metric_errors(period=Duration.minutes(5), statistic="Sum"),
                    threshold=1,
                    evaluation_periods=1,
                    comparison_operator=cw.ComparisonOperator.GREATER_THAN_OR_EQUAL_TO_THRESHOLD,
                    treat_missing_data=cw.TreatMissingData.NOT_BREACHING,
                )
            )
        self.shard_throttles: cw.Alarm | None = None
        self.shard_near_timeout: cw.Alarm | None = None
        if shard is not None:
            self._shard_alarms(config, settings, shard)
        self.credential_throttles: cw.Alarm | None = None
        if credentials is not None:
            self._credential_alarms(config, settings, credentials)
        self.ingest_throttles = self._ingest_throttles(config, settings, ingest)
        self.alarms.append(
            cw.Alarm(
                self,
                "DeadLetters",
                alarm_description=f"Run {config.run_id}: events the coordinator gave up on are waiting.",
                metric=dead_letters.metric_approximate_number_of_messages_visible(
                    period=Duration.minutes(5), statistic="Maximum"
                ),
                threshold=1,
                evaluation_periods=1,
                comparison_operator=cw.ComparisonOperator.GREATER_THAN_OR_EQUAL_TO_THRESHOLD,
                treat_missing_data=cw.TreatMissingData.NOT_BREACHING,
            )
        )
        self.topic: sns.Topic | None = None
        if settings.alarm_email:
            self.topic = sns.Topic(self, "Alarms", display_name=f"fed {config.run_id} alarms", enforce_ssl=True)
            self.topic.add_subscription(subscriptions.EmailSubscription(settings.alarm_email))
            acknowledge(
                self.topic,
                "SNS2",
                "Alarm notifications carry only alarm names and states, no model or participant data; CloudWatch "
                "cannot publish to a topic under the AWS-managed SNS key, and a customer key would add a fixed "
                "monthly cost to a stack meant to cost nothing while idle.",
            )
            for alarm in self.alarms:
                alarm.add_alarm_action(cw_actions.SnsAction(self.topic))

        self.dashboard = cw.Dashboard(self, "Dashboard", dashboard_name=f"fed-{config.run_id}")
        self._widgets(functions, dead_letters, join_queue, shard, settings.shard.timeout_seconds)

    def _shard_alarms(self, config: RunConfig, settings: DeploySettings, shard: lambda_.Function) -> None:
        """A throttled shard invocation is retried by the tick at once (a few times), then the aggregation fails:
        worth knowing before it does. A shard close to the timeout means the next larger round may not make it."""
        timeout_ms = settings.shard.timeout_seconds * 1000
        self.shard_throttles = cw.Alarm(
            self,
            "ShardThrottles",
            alarm_description=f"Run {config.run_id}: shard-worker invocations were throttled (account or reserved "
            "concurrency): an aggregation may fail. Raise the concurrency, or shard_bytes to use fewer workers.",
            metric=shard.metric_throttles(period=Duration.minutes(5), statistic="Sum"),
            threshold=1,
            evaluation_periods=1,
            comparison_operator=cw.ComparisonOperator.GREATER_THAN_OR_EQUAL_TO_THRESHOLD,
            treat_missing_data=cw.TreatMissingData.NOT_BREACHING,
        )
        self.shard_near_timeout = cw.Alarm(
            self,
            "ShardNearTimeout",
            alarm_description=f"Run {config.run_id}: a shard worker ran {SHARD_DURATION_ALARM_SHARE:.0%} of its "
            f"{settings.shard.timeout_seconds} s timeout or more: lower shard_bytes (more, smaller shards) before "
            "a shard times out.",
            metric=shard.metric_duration(period=Duration.minutes(5), statistic="Maximum"),
            threshold=SHARD_DURATION_ALARM_SHARE * timeout_ms,
            evaluation_periods=1,
            comparison_operator=cw.ComparisonOperator.GREATER_THAN_OR_EQUAL_TO_THRESHOLD,
            treat_missing_data=cw.TreatMissingData.NOT_BREACHING,
        )
        self.alarms += [self.shard_throttles, self.shard_near_timeout]

    def _ingest_throttles(self, config: RunConfig, settings: DeploySettings, ingest: lambda_.Function) -> cw.Alarm:
        """Ingest ran at its cap (its reserved concurrency): a flood of uploads, or more updates at once than the
        cap was sized for. Throttled events are retried by Lambda (and dead-lettered after max_event_age_seconds);
        the ticks, with concurrency of their own, catch up with the members' news meanwhile."""
        alarm = cw.Alarm(
            self,
            "IngestThrottles",
            alarm_description=f"Run {config.run_id}: ingest invocations were throttled (its cap, reserved "
            f"concurrency {settings.ingest.reserved_concurrency}): a flood of uploads (the table's dropped#<id> "
            "items count each participant's uploads dropped over its budget), or more uploads at once than "
            "[deploy.ingest] reserved_concurrency serves.",
            metric=ingest.metric_throttles(period=Duration.minutes(5), statistic="Sum"),
            threshold=1,
            evaluation_periods=1,
            comparison_operator=cw.ComparisonOperator.GREATER_THAN_OR_EQUAL_TO_THRESHOLD,
            treat_missing_data=cw.TreatMissingData.NOT_BREACHING,
        )
        self.alarms.append(alarm)
        return alarm

    def _credential_alarms(self, config: RunConfig, settings: DeploySettings, credentials: lambda_.Function) -> None:
        """The credential endpoint's errors are alarmed with every function's (`functions`); its throttles mean its
        reserved concurrency was used up: a flood, or more hosts renewing at once than it was sized for. Either
        way hosts are being turned away and will retry, and a host that cannot renew in time loses its session."""
        self.credential_throttles = cw.Alarm(
            self,
            "CredentialsThrottles",
            alarm_description=f"Run {config.run_id}: credential endpoint requests were throttled (reserved "
            f"concurrency {settings.credentials.reserved_concurrency}): a flood of requests, or more hosts at once "
            "than [deploy.credentials] reserved_concurrency serves.",
            metric=credentials.metric_throttles(period=Duration.minutes(5), statistic="Sum"),
            threshold=1,
            evaluation_periods=1,
            comparison_operator=cw.ComparisonOperator.GREATER_THAN_OR_EQUAL_TO_THRESHOLD,
            treat_missing_data=cw.TreatMissingData.NOT_BREACHING,
        )
        self.alarms.append(self.credential_throttles)

    def metric(self, name: str, statistic: str, period: Duration = PERIOD) -> cw.Metric:
        return cw.Metric(
            namespace=METRICS_NAMESPACE,
            metric_name=name,
            dimensions_map={"run": self.run_id, "service": METRICS_SERVICE},
            statistic=statistic,
            period=period,
        )

    def _widgets(self, functions: Sequence[lambda_.Function], dead_letters: sqs.Queue,
                 join_queue: sqs.Queue | None, shard: lambda_.Function | None, shard_timeout_seconds: int) -> None:
        m = self.metric
        width = 8
        self.dashboard.add_widgets(
            cw.TextWidget(markdown=f"# Run `{self.run_id}`", width=24, height=1),
        )
        self.dashboard.add_widgets(
            cw.GraphWidget(title="Round", left=[m(METRIC_ROUND, "Maximum")], width=width),
            cw.GraphWidget(title="Phase changes", left=[m(METRIC_PHASE_CHANGES, "Sum")], width=width),
            cw.GraphWidget(
                title="Updates accepted / refused",
                left=[m(METRIC_UPDATES_ACCEPTED, "Sum"), m(METRIC_UPDATES_REFUSED, "Sum")],
                stacked=True,
                width=width,
            ),
        )
        self.dashboard.add_widgets(
            cw.GraphWidget(
                title="Round duration (s)",
                left=[m(METRIC_ROUND_SECONDS, "Average"), m(METRIC_ROUND_SECONDS, "Maximum")],
                width=width,
            ),
            cw.GraphWidget(
                title="Aggregation time (s)",
                left=[m(METRIC_AGGREGATION_SECONDS, "Average"), m(METRIC_AGGREGATION_SECONDS, "Maximum")],
                width=width,
            ),
            cw.GraphWidget(title="Tick conflicts (lost races)", left=[m(METRIC_TICK_CONFLICTS, "Sum")], width=width),
        )
        self.dashboard.add_widgets(
            cw.GraphWidget(
                title="Function errors",
                left=[fn.metric_errors(period=PERIOD, label=fn.node.id) for fn in functions],
                width=width,
            ),
            cw.GraphWidget(
                title="Invocations / throttles",
                left=[fn.metric_invocations(period=PERIOD, label=fn.node.id) for fn in functions],
                right=[fn.metric_throttles(period=PERIOD, label=f"{fn.node.id} throttled") for fn in functions],
                width=width,
            ),
            cw.GraphWidget(
                title="Duration p95 (ms)",
                left=[fn.metric_duration(period=PERIOD, statistic="p95", label=fn.node.id) for fn in functions],
                width=width,
            ),
        )
        if shard is not None:  # an aggregation: K workers at once, each well under its timeout
            self.dashboard.add_widgets(
                cw.GraphWidget(
                    title="Shard workers: invocations / throttles",
                    left=[shard.metric_invocations(period=PERIOD, label="invocations")],
                    right=[shard.metric_throttles(period=PERIOD, label="throttled")],
                    width=width,
                ),
                cw.GraphWidget(
                    title="Shard workers running at once",
                    left=[shard.metric("ConcurrentExecutions", period=PERIOD, statistic="Maximum", label="workers")],
                    width=width,
                ),
                cw.GraphWidget(
                    title="Shard duration (ms) against its timeout",
                    left=[shard.metric_duration(period=PERIOD, statistic="Maximum", label="maximum"),
                          shard.metric_duration(period=PERIOD, statistic="p50", label="median")],
                    left_annotations=[
                        cw.HorizontalAnnotation(value=shard_timeout_seconds * 1000, label="timeout"),
                        cw.HorizontalAnnotation(value=SHARD_DURATION_ALARM_SHARE * shard_timeout_seconds * 1000,
                                                label="alarm"),
                    ],
                    width=width,
                ),
            )
        lane: list[cw.IWidget] = []
        if join_queue is not None:  # a burst of joins shows here, not as late heartbeats
            lane.append(cw.GraphWidget(
                title="Join lane backlog",
                left=[join_queue.metric_approximate_number_of_messages_visible(period=PERIOD, label="waiting")],
                right=[join_queue.metric_approximate_age_of_oldest_message(period=PERIOD, label="oldest (s)")],
                width=width,
            ))
        self.dashboard.add_widgets(
            cw.GraphWidget(
                title="Dead letters",
                left=[dead_letters.metric_approximate_number_of_messages_visible(period=PERIOD)],
                width=width,
            ),
            *lane,
            cw.AlarmStatusWidget(title="Alarms", alarms=self.alarms, width=24 - width * (1 + len(lane))),
        )
