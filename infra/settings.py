"""How a run is deployed: sizes, retention and protection, from the `[deploy]` table of the run's TOML file.

The `[run]` table of the same file is the run itself (`shared.config.RunConfig`), which the functions and
participants read too; `[deploy]` only matters to `cdk deploy`, so it lives here and never reaches them.
Every field has a default, so a file without `[deploy]` deploys as is.
"""

from __future__ import annotations

import math
import tomllib
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from shared.config import ConfigError, RunConfig, describe, load_config, parse_config

# The retention periods CloudWatch Logs accepts (days).
LOG_RETENTION_DAYS = (
    1,
    3,
    5,
    7,
    14,
    30,
    60,
    90,
    120,
    150,
    180,
    365,
    400,
    545,
    731,
    1096,
    1827,
    2192,
    2557,
    2922,
    3288,
    3653,
)
STACK_NAME_MAX = 128
FUNCTIONS = ("tick", "ingest", "join", "shard", "credentials")  # the [deploy] tables holding a FunctionSettings
# The participant sessions the credential endpoint issues: STS issues none shorter than 15 minutes, and the function
# assumes the participant role from its own role's session (role chaining), which AWS caps at one hour.
CREDENTIAL_MINUTES = (15, 60)

# Lambda's guidance for a queue it drains (an SQS event source): a visibility timeout of at least six times the
# function's timeout, and a redrive to the dead-letter queue after at least five receives. Lambda receives a batch
# before it knows it can invoke the function; throttled, it retries the invocation while the batch is invisible and
# otherwise hands it back, and each hand-back counts as a receive: fewer would dead-letter a message no invocation
# ever ran.
VISIBILITY_TIMEOUTS = 6
LEAST_RECEIVES = 5
MAX_QUEUE_RETENTION_SECONDS = 4 * 86400  # a task or join request this old is no one's concern any more
LEAST_SHARD_RETENTION_SECONDS = 2 * 3600  # beyond any tick's wait for its shards (at most 900 s - 30 s)
# Reserved concurrency by default: the tick and the shard workers each keep theirs, so no flood of ingest invocations
# can throttle them; ingest's is its cap. Together with the credential endpoint's 2: 271 of the account's 1,000.
TICK_RESERVED = 5  # the scheduled tick, one that overlaps it while aggregating, operators' ticks
SHARD_RESERVED = 64  # the shard queue's default maximum concurrency (shard_concurrency)
INGEST_RESERVED = 200


class FunctionSettings(BaseModel):
    """One Lambda function's size and async-invocation handling."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    memory_mb: int = Field(1769, ge=128, le=10240, description="1769 MB is one full vCPU.")
    timeout_seconds: int = Field(300, ge=10, le=900)
    ephemeral_storage_mb: int = Field(1024, ge=512, le=10240, description="/tmp, for streamed aggregation.")
    reserved_concurrency: int | None = Field(
        None, ge=1, description="Unset: shared account pool. Reserving needs 10 unreserved left in the account."
    )
    retry_attempts: int = Field(2, ge=0, le=2, description="Lambda retries of a failed async invocation.")
    max_event_age_seconds: int = Field(3600, ge=60, le=21600, description="Older async events go to the DLQ.")

    @property
    def queue_visibility_seconds(self) -> int:
        """The visibility timeout of a queue this function drains (`VISIBILITY_TIMEOUTS`)."""
        return VISIBILITY_TIMEOUTS * self.timeout_seconds


class DeploySettings(BaseModel):
    """Everything `cdk deploy` needs beyond the run itself."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    stack_name: str | None = Field(None, description="Default: fed-<run_id>. `-c stack=NAME` overrides both.")
    tick: FunctionSettings = Field(
        FunctionSettings(timeout_seconds=900, reserved_concurrency=TICK_RESERVED),
        description="The scheduled tick. Any tick may aggregate a round, and waits for its shard workers: its timeout "
        "(Lambda's most, 900 s) bounds a whole aggregation. Its reserved concurrency keeps it running whatever "
        "else takes the account's concurrency (a flood of uploads): it catches up with members' news the ingest "
        "events have not brought yet (`coordinator.catchup`), so rounds close and no live member is dropped.",
    )
    ingest: FunctionSettings = Field(
        FunctionSettings(timeout_seconds=900, reserved_concurrency=INGEST_RESERVED),
        description="Ingest streams an upload in 8 MiB blocks (memory does not grow with the model), then ticks: "
        "the tick that closes a round on its last update aggregates it, so the same 900 s as the tick. Its reserved "
        "concurrency is its cap: a flood of uploads (each an invocation, however many the upload budget drops) "
        "takes at most that much of the account; events beyond it are throttled, retried by Lambda for up to "
        "max_event_age_seconds, and alarmed (ingest throttles). Raise it for fleets whose updates arrive together.",
    )
    shard: FunctionSettings = Field(
        FunctionSettings(memory_mb=1769, timeout_seconds=900, ephemeral_storage_mb=512,
                         reserved_concurrency=SHARD_RESERVED),
        description="The shard worker: one aggregation shard per invocation, fed by the shard queue the aggregating "
        "tick fills (retry_attempts and max_event_age_seconds do not apply). It holds about min(updates, 8) x 8 MiB "
        "read "
        "buffers, two 8 MiB pieces and 24 MiB of accumulators (~100-200 MB) beside the runtime, so 512 MB would "
        "fit; 1769 MB is for the CPU: Lambda gives one full vCPU at 1769 MB, which the per-core aggregation "
        "throughput (and shard_bytes) assume. Less memory is as many GB-seconds but slower shards. No /tmp use. "
        "Its reserved concurrency (at least shard_concurrency) keeps an aggregation's workers running whatever else "
        "takes the account's concurrency.",
    )
    join: FunctionSettings = Field(
        FunctionSettings(memory_mb=512, timeout_seconds=60),
        description="The join function: it only registers joiners (no aggregation), so it needs little. It is "
        "invoked by its queue, not asynchronously: retry_attempts and max_event_age_seconds do not apply.",
    )
    credentials: FunctionSettings = Field(
        FunctionSettings(memory_mb=512, timeout_seconds=15, ephemeral_storage_mb=512, reserved_concurrency=2),
        description="The credential endpoint (`infra.hosts`): a few DynamoDB calls and one STS call per request, "
        "answered synchronously (retry_attempts and max_event_age_seconds do not apply). Its URL is public (the "
        "hosts have no AWS identity), so its reserved concurrency is required: it bounds what a flood of requests "
        "can cost and keeps the flood off the account's pool. Reserving needs 10 unreserved left in the account.",
    )
    credential_minutes: int = Field(
        60, description="Lifetime of the participant sessions the credential endpoint issues, 15 to 60 minutes; "
        "hosts renew them before they expire.",
    )
    host_requests_per_minute: int = Field(
        12, ge=1, description="Credential endpoint requests (redemptions and renewals) one host id may make a "
        "minute; more are answered 429.",
    )
    all_hosts_requests_per_minute: int = Field(
        120, ge=1, validate_default=True, description="Credential endpoint requests all hosts together may make a "
        "minute; more are answered 429. At least host_requests_per_minute.",
    )
    join_concurrency: int = Field(
        2, ge=2, le=1000, description="Join function invocations at once, at most (the join queue's event source "
        "mapping's maximum concurrency; 2 is Lambda's least): how much of the account's concurrency a burst of "
        "join requests can take.",
    )
    join_batch_size: int = Field(10, ge=1, le=100, description="Join requests per join function invocation.")
    shard_concurrency: int = Field(
        64, ge=2, le=1000, description="Shard-worker invocations at once, at most (the shard queue's event source "
        "mapping's maximum concurrency): K = model bytes / shard_bytes shards run at once up to this.",
    )
    shard_max_receives: int = Field(
        LEAST_RECEIVES, ge=LEAST_RECEIVES, le=1000, description="Receives of a shard task before the dead-letter "
        "queue: each death of its worker (out of memory, timeout) and each hand-back by a throttled Lambda counts; "
        "a shard that fails with an error is retried inside the worker and reported to the tick instead. At least "
        "5, Lambda's advice for a queue event source.",
    )
    join_max_receives: int = Field(
        LEAST_RECEIVES, ge=LEAST_RECEIVES, le=1000, description="Receives of a join request that keeps failing (or "
        "is handed back by a throttled Lambda) before the dead-letter queue; at least 5, Lambda's advice.",
    )
    log_retention_days: int = Field(30, description="Function log retention; a CloudWatch Logs period.")
    retain_data: bool = Field(True, description="Keep bucket, table and logs when the stack is deleted.")
    table_deletion_protection: bool = Field(True, description="DynamoDB deletion protection.")
    round_objects_expire_days: int = Field(
        30, ge=0, description="Expire objects under runs/<run>/rounds/ (updates and past globals); 0: never."
    )
    noncurrent_versions_expire_days: int = Field(
        7, ge=1, description="Expire overwritten object versions (heartbeats overwrite one key every few s)."
    )
    incomplete_upload_days: int = Field(1, ge=1, description="Abort multipart uploads left unfinished.")
    access_log_expire_days: int = Field(90, ge=1, description="Expire the bucket's server access logs.")
    stuck_round_multiple: float = Field(
        3.0, ge=1.0, description="Stuck-run alarm: no new round within this multiple of max_round_train_time."
    )
    alarm_email: str | None = Field(None, description="Subscribe this address to the alarms' SNS topic.")
    participant_principals: list[str] = Field(
        default_factory=list,
        description="IAM principal ARNs that may assume the participant role; empty: any principal of this "
        "account that its own policy allows (recommended: each host's identity policy fixes its tag).",
    )
    participant_session_hours: int = Field(12, ge=1, le=12, description="Participant role max session length.")

    @model_validator(mode="before")
    @classmethod
    def _function_defaults(cls, data: Any) -> Any:
        """A function's table overrides only the keys it names: `[deploy.shard] memory_mb = 3008` keeps the
        shard worker's own 900 s timeout, not FunctionSettings' generic defaults."""
        if not isinstance(data, dict):
            return data
        merged = dict(data)
        for name in FUNCTIONS:
            given = data.get(name)
            default = cls.model_fields[name].default
            if isinstance(given, dict) and isinstance(default, FunctionSettings):
                merged[name] = {**default.model_dump(), **given}
        return merged

    @field_validator("log_retention_days")
    @classmethod
    def _log_days(cls, value: int) -> int:
        if value not in LOG_RETENTION_DAYS:
            raise ValueError(f"must be one of CloudWatch Logs' periods: {', '.join(map(str, LOG_RETENTION_DAYS))}")
        return value

    @field_validator("stack_name")
    @classmethod
    def _stack_name(cls, value: str | None) -> str | None:
        if value is not None and not _valid_stack_name(value):
            raise ValueError("a stack name is 1-128 letters, digits and '-', starting with a letter")
        return value

    @field_validator("participant_principals")
    @classmethod
    def _principals(cls, value: list[str]) -> list[str]:
        for arn in value:
            if not arn.startswith("arn:"):
                raise ValueError(f"{arn!r} is not an ARN")
        return value

    @field_validator("credentials")
    @classmethod
    def _credentials(cls, value: FunctionSettings) -> FunctionSettings:
        if value.reserved_concurrency is None:
            raise ValueError("reserved_concurrency must be set: the credential endpoint's URL is public, and its "
                             "reserved concurrency bounds what a flood of requests can cost")
        return value

    @model_validator(mode="after")
    def _shard_reserve(self) -> DeploySettings:
        reserved = self.shard.reserved_concurrency
        if reserved is not None and reserved < self.shard_concurrency:
            raise ValueError(f"[deploy.shard] reserved_concurrency ({reserved}) is below shard_concurrency "
                             f"({self.shard_concurrency}): the shard queue would hand the workers more tasks at once "
                             "than may run, and the throttled ones come back as receives toward the dead-letter queue")
        return self

    @field_validator("credential_minutes")
    @classmethod
    def _credential_minutes(cls, value: int) -> int:
        low, high = CREDENTIAL_MINUTES
        if not low <= value <= high:
            raise ValueError(f"must be {low} to {high} minutes: STS issues no session shorter than {low} minutes, and "
                             f"one the credential function chains from its own role lasts at most {high} (role "
                             "chaining)")
        return value

    @field_validator("all_hosts_requests_per_minute")
    @classmethod
    def _all_hosts_rate(cls, value: int, info: ValidationInfo) -> int:
        per_host = info.data.get("host_requests_per_minute")
        if per_host is not None and value < per_host:
            raise ValueError(f"must be at least host_requests_per_minute ({per_host}): the limit over all hosts "
                             "cannot be below one host's")
        return value

    @property
    def credential_seconds(self) -> int:
        """The participant sessions' lifetime the credential function asks STS for."""
        return self.credential_minutes * 60

    def shard_retention_seconds(self) -> int:
        """How long the shard queue keeps a task: until a task that keeps killing its worker has been received
        shard_max_receives times (one visibility timeout apart) and moved to the dead-letter queue, where the alarm
        sees it; at most MAX_QUEUE_RETENTION_SECONDS, and at least well beyond the waiting tick's wait."""
        until_dead_lettered = (self.shard_max_receives + 1) * self.shard.queue_visibility_seconds
        return min(MAX_QUEUE_RETENTION_SECONDS, max(LEAST_SHARD_RETENTION_SECONDS, until_dead_lettered))

    def stuck_window_seconds(self, config: RunConfig) -> int:
        """The stuck-run alarm's period: a whole number of minutes CloudWatch accepts (60 s to 1 day)."""
        seconds = self.stuck_round_multiple * config.max_round_train_time
        return int(min(86400, max(60, math.ceil(seconds / 60) * 60)))


def _valid_stack_name(name: str) -> bool:
    return (
        0 < len(name) <= STACK_NAME_MAX
        and name[0].isascii()
        and name[0].isalpha()
        and all(c.isascii() and (c.isalnum() or c == "-") for c in name)
    )


def parse_deploy(data: dict[str, Any], source: str = "config") -> DeploySettings:
    """Validate the `[deploy]` table of a parsed run file; errors name every offending field."""
    table = data.get("deploy", {})
    try:
        return DeploySettings.model_validate(table)
    except ValidationError as exc:
        raise ConfigError(describe(exc, f"{source}: invalid [deploy] settings", "deploy.")) from None


def load_deploy(path: str | Path) -> tuple[RunConfig, DeploySettings]:
    """Read a run file: the run (`[run]`) and how to deploy it (`[deploy]`, optional)."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError):
        load_config(path)  # raises the run's own ConfigError for a missing or malformed file
        raise
    if "deploy" in data and "run" not in data:
        raise ConfigError(f"{path}: with a [deploy] table, put the run's keys under [run]")
    return parse_config(data, str(path)), parse_deploy(data, str(path))


def stack_name_for(config: RunConfig, settings: DeploySettings, override: str | None = None) -> str:
    name = override or settings.stack_name or f"fed-{config.run_id}"
    if not _valid_stack_name(name):
        raise ConfigError(f"stack name {name!r}: use 1-128 letters, digits and '-', starting with a letter")
    return name
