"""Module-level powertools objects shared by the handlers (cheap to import; no AWS calls)."""

from __future__ import annotations

import importlib.util
import warnings
from typing import Any

from aws_lambda_powertools import Logger, Metrics

from shared.naming import METRICS_NAMESPACE

logger = Logger(service="fed-coordinator")
metrics = Metrics(namespace=METRICS_NAMESPACE, service="fed-coordinator")
# An invocation with nothing to count (a heartbeat, a join) is normal here, not a mistake worth a log line each time.
warnings.filterwarnings("ignore", message="No application metrics to publish", category=UserWarning)

tracer: Any = None
if importlib.util.find_spec("aws_xray_sdk") is not None:  # Tracer needs powertools' [tracer] extra
    from aws_lambda_powertools import Tracer

    tracer = Tracer(service="fed-coordinator")


def traced(fn: Any) -> Any:
    """`tracer.capture_lambda_handler` where a tracer is available; the function unchanged otherwise."""
    return tracer.capture_lambda_handler(fn) if tracer is not None else fn
