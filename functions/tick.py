"""Lambda: the scheduled safety-net tick (deadlines, liveness) of the coordinator (`coordinator.service`)."""

from __future__ import annotations

from typing import Any

from coordinator.deps import Deps
from coordinator.service import on_schedule
from functions.observability import lambda_handler, tick_summary


def tick(deps: Deps, event: dict[str, Any]) -> dict[str, Any]:
    return tick_summary(on_schedule(deps))


handler = lambda_handler(tick)
