"""How the local stack invokes a handler: the Lambda context object it passes (what powertools reads of it), and one
invocation's clean-up."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

Handler = Callable[[dict[str, Any], Any], Any]


@dataclass
class LocalContext:
    function_name: str = "fed-local"
    memory_limit_in_mb: int = 1024
    function_version: str = "$LATEST"
    invoked_function_arn: str = "arn:aws:lambda:us-east-1:000000000000:function:fed-local"
    aws_request_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    log_group_name: str = "/local/fed"
    log_stream_name: str = "local"

    def get_remaining_time_in_millis(self) -> int:
        return 900_000


def local_invocation(handler: Handler) -> Handler:
    """Call a handler as one Lambda invocation would, in a process that serves many at once.

    With POWERTOOLS_METRICS_DISABLED, powertools neither prints nor clears the metric set at the end of an
    invocation, so it grows across invocations until, at 100 values, it prints them to stdout anyway.
    Each Lambda process starts empty; clearing after each call keeps it that way here.
    """
    from functions.observability import metrics

    def invoke(event: dict[str, Any], context: Any) -> Any:
        try:
            return handler(event, context)
        finally:
            if os.environ.get("POWERTOOLS_METRICS_DISABLED", "").lower() == "true":
                metrics.clear_metrics()

    return invoke
