"""The run's tick schedule (an EventBridge rule, `shared.naming.tick_rule_name`), switched off while the run is
idle (finished, or paused with nothing pending) so that nothing is billed, and on again by whatever wakes it
(`fed run resume`, `fed run restore`): a commit that changes whether the run needs ticks switches it.
The same rule exists locally (moto's EventBridge; the local dispatcher ticks only while it is enabled)."""

from __future__ import annotations

import logging
from typing import Any

import boto3
from botocore.exceptions import ClientError

log = logging.getLogger("fed-coordinator")


class Schedule:
    def __init__(self, rule: str, client: Any) -> None:
        self.rule, self.client = rule, client

    @classmethod
    def connect(cls, rule: str, endpoint: str | None, region: str) -> Schedule:
        return cls(rule, boto3.client("events", endpoint_url=endpoint, region_name=region))

    def enabled(self) -> bool | None:
        """Whether the rule is on; None if there is no such rule (a test without a schedule)."""
        try:
            return bool(self.client.describe_rule(Name=self.rule)["State"] == "ENABLED")
        except ClientError as exc:
            if exc.response["Error"]["Code"] == "ResourceNotFoundException":
                return None
            raise

    def set_enabled(self, on: bool) -> None:
        """Turn the schedule on or off (idempotent); a missing rule is left alone (nothing to bill)."""
        try:
            (self.client.enable_rule if on else self.client.disable_rule)(Name=self.rule)
        except ClientError as exc:
            if exc.response["Error"]["Code"] != "ResourceNotFoundException":
                raise
            log.debug("no tick schedule %s to turn %s", self.rule, "on" if on else "off")
        else:
            log.info("tick schedule %s turned %s", self.rule, "on" if on else "off")
