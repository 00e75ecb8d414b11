"""The Lambda context object the local dispatcher passes to handlers (what powertools reads of it)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field


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
