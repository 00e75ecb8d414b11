"""Lambda: the scheduled safety-net tick (deadlines, liveness) of the coordinator (`coordinator.service`)."""

from __future__ import annotations

from typing import Any

from coordinator.service import on_schedule
from functions.observability import lambda_handler, tick_summary
from functions.settings import Deps


def tick(deps: Deps, event: dict[str, Any]) -> dict[str, Any]:
    return tick_summary(on_schedule(deps))


handler = lambda_handler(tick)
