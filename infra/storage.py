"""The run's bucket: every model, update, join request and heartbeat is an object here.

S3 tells EventBridge about every new object through the bucket's own notification setting (the L1
property), not `add_event_notification`/`event_bridge_enabled`, which would each add a custom-resource
Lambda to the stack.
"""

from __future__ import annotations

from aws_cdk import Duration, RemovalPolicy
from aws_cdk import aws_s3 as s3
from constructs import Construct

from infra.settings import DeploySettings
from shared.config import RunConfig
from shared.keys import run_prefix

ACCESS_LOG_PREFIX = "s3-access/"


def removal_policy(settings: DeploySettings) -> RemovalPolicy:
    return RemovalPolicy.RETAIN if settings.retain_data else RemovalPolicy.DESTROY


class Storage(Construct):
    """The run bucket and the bucket receiving its server access logs."""

    def __init__(self, scope: Construct, id: str, *, config: RunConfig, settings: DeploySettings) -> None:
        super().__init__(scope, id)
        removal = removal_policy(settings)
        self.access_logs = s3.Bucket(
            self,
            "AccessLogs",
            block_public_access=s3.BlockPublicAccess.BLOCK_ALL,
            encryption=s3.BucketEncryption.S3_MANAGED,  # log delivery cannot write to SSE-KMS buckets
            enforce_ssl=True,
            minimum_tls_version=1.2,
            object_ownership=s3.ObjectOwnership.BUCKET_OWNER_ENFORCED,
            lifecycle_rules=[
                s3.LifecycleRule(id="expire-access-logs", expiration=Duration.days(settings.access_log_expire_days))
            ],
            removal_policy=removal,
        )
        self.bucket = s3.Bucket(
            self,
            "Bucket",
            block_public_access=s3.BlockPublicAccess.BLOCK_ALL,
            encryption=s3.BucketEncryption.S3_MANAGED,
            enforce_ssl=True,
            minimum_tls_version=1.2,
            versioned=True,
            object_ownership=s3.ObjectOwnership.BUCKET_OWNER_ENFORCED,
            server_access_logs_bucket=self.access_logs,
            server_access_logs_prefix=ACCESS_LOG_PREFIX,
            lifecycle_rules=self._lifecycle(config, settings),
            removal_policy=removal,
        )
        bucket = self.bucket.node.default_child
        assert isinstance(bucket, s3.CfnBucket)
        bucket.notification_configuration = s3.CfnBucket.NotificationConfigurationProperty(
            event_bridge_configuration=s3.CfnBucket.EventBridgeConfigurationProperty(event_bridge_enabled=True)
        )

    @staticmethod
    def _lifecycle(config: RunConfig, settings: DeploySettings) -> list[s3.LifecycleRule]:
        rules = [
            s3.LifecycleRule(
                id="expire-overwritten-versions",
                noncurrent_version_expiration=Duration.days(settings.noncurrent_versions_expire_days),
                expired_object_delete_marker=True,
            ),
            s3.LifecycleRule(
                id="abort-incomplete-uploads",
                abort_incomplete_multipart_upload_after=Duration.days(settings.incomplete_upload_days),
            ),
        ]
        if settings.round_objects_expire_days:
            rules.append(
                s3.LifecycleRule(
                    id="expire-round-objects",
                    prefix=f"{run_prefix(config.run_id)}rounds/",
                    expiration=Duration.days(settings.round_objects_expire_days),
                )
            )
        return rules
