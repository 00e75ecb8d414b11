"""The one helper that builds every coordinator Lambda function of the stack.

Each function gets its own role holding only the statements it is given (plus writing its own log
group), its own log group with a retention, a dead-letter queue for async events it failed on (functions
invoked asynchronously), and the shared code asset built by `infra.bundle`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from aws_cdk import AssetHashType, Duration, RemovalPolicy, Size
from aws_cdk import aws_iam as iam
from aws_cdk import aws_lambda as lambda_
from aws_cdk import aws_logs as logs
from aws_cdk import aws_sqs as sqs
from constructs import Construct

from infra import bundle
from infra.settings import FunctionSettings

RUNTIME = lambda_.Runtime.PYTHON_3_14
assert RUNTIME.name == f"python{bundle.LAMBDA_PYTHON}", "the asset's wheels must target the runtime's Python"
ARCHITECTURE = lambda_.Architecture.ARM_64  # Graviton: ~20 % less per GB-second; bundle.PLATFORMS are aarch64 wheels
assert ARCHITECTURE.name == bundle.LAMBDA_ARCHITECTURE, "the asset's wheels must target the runtime's architecture"


def function_code(asset_dir: Path | None = None) -> lambda_.Code:
    """The asset every function runs; built (or taken from the cache) now unless `asset_dir` is given."""
    if asset_dir is None:
        asset_dir = bundle.build_asset()
        key = bundle.asset_key()
    else:
        key = asset_dir.name
    # The asset directory's name already says what is in it; spare CDK re-hashing ~100 MB on every synth.
    return lambda_.Code.from_asset(str(asset_dir), asset_hash=key, asset_hash_type=AssetHashType.CUSTOM)


@dataclass(frozen=True)
class FunctionSpec:
    """What makes one function different from another."""

    name: str
    handler: str
    description: str
    settings: FunctionSettings
    statements: Sequence[iam.PolicyStatement]


def coordinator_function(
    scope: Construct,
    spec: FunctionSpec,
    *,
    code: lambda_.Code,
    environment: Mapping[str, str],
    dead_letter_queue: sqs.IQueue | None,
    log_retention_days: int,
    log_removal: RemovalPolicy,
) -> lambda_.Function:
    """A function; with a `dead_letter_queue`, one invoked asynchronously (retries, then that queue), without
    one, a function its queue invokes (the queue retries and dead-letters) or that is invoked synchronously (the
    caller gets the failure and retries)."""
    construct_id = spec.name.capitalize()
    log_group = logs.LogGroup(scope, f"{construct_id}Logs", removal_policy=log_removal)
    cfn_log_group = log_group.node.default_child
    assert isinstance(cfn_log_group, logs.CfnLogGroup)
    cfn_log_group.retention_in_days = log_retention_days
    write_logs = iam.PolicyStatement(
        sid="WriteOwnLogs",
        actions=["logs:CreateLogStream", "logs:PutLogEvents"],
        resources=[log_group.log_group_arn],
    )
    role = iam.Role(
        scope,
        f"{construct_id}Role",
        assumed_by=iam.ServicePrincipal("lambda.amazonaws.com"),
        description=f"The {spec.name} function: only what it uses (no managed policies).",
        inline_policies={"least-privilege": iam.PolicyDocument(statements=[write_logs, *spec.statements])},
    )
    s = spec.settings
    asynchronous: dict[str, object] = {}
    if dead_letter_queue is not None:
        asynchronous = dict(
            dead_letter_queue=dead_letter_queue,  # async events still failing after the retries land here
            retry_attempts=s.retry_attempts,
            max_event_age=Duration.seconds(s.max_event_age_seconds),
        )
    return lambda_.Function(
        scope,
        construct_id,
        description=spec.description,
        runtime=RUNTIME,
        architecture=ARCHITECTURE,
        handler=spec.handler,
        code=code,
        memory_size=s.memory_mb,
        timeout=Duration.seconds(s.timeout_seconds),
        ephemeral_storage_size=Size.mebibytes(s.ephemeral_storage_mb),
        reserved_concurrent_executions=s.reserved_concurrency,
        environment=dict(environment),
        role=role,
        log_group=log_group,
        **asynchronous,  # type: ignore[arg-type]
    )
