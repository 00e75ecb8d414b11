"""The local dispatcher in a process of its own, faults optional: `python -m tests.e2e.dispatcher_process`.

The chaos test runs the dispatcher here rather than in the test process so that it can SIGKILL it in the
middle of an aggregation, as a crashed Lambda host would die; the load test, so that the functions do not
share the server's interpreter lock (on AWS they run elsewhere too). Started with the functions'
environment (the test's, which the local stack set up); reports on stdout, one JSON object a line:

    {"event": "started"}                        polling and ticking
    {"fault": "<kind>", ...}                    a fault it injected (kinds from chaos_support)
    {"event": "blocked", "round": r, "point": p}   stuck mid-aggregation: kill me now
    {"event": "stopped", "stats": {...}}        after SIGTERM, once deliveries in flight finished
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import signal
import sys
import threading
from typing import Any

from local.dispatcher import Dispatcher
from local.resources import LocalResources
from local.stack import route_function_logs
from store.trace import install_from_env
from tests.e2e.chaos_support import DispatcherPlan, RandomFaults, install_crash_hooks

_out = threading.Lock()


def emit(**report: Any) -> None:
    with _out:
        sys.stdout.write(json.dumps(report) + "\n")
        sys.stdout.flush()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--resources", required=True)
    parser.add_argument("--plan", required=True)
    parser.add_argument("--log-file", required=True)
    args = parser.parse_args()
    resources = LocalResources(**json.loads(args.resources))
    plan = DispatcherPlan(**json.loads(args.plan))
    install_from_env()  # each function's calls carry its role, for the access check (`local.access`)

    log_stream = open(args.log_file, "a", buffering=1)  # noqa: SIM115 - open for the life of the process
    logging.basicConfig(stream=log_stream, level=logging.WARNING,
                        format="%(asctime)s dispatcher %(levelname)s %(name)s: %(message)s")
    route_function_logs("WARNING", log_stream)

    def report(kind: str, info: dict[str, Any]) -> None:
        if kind == "blocked":
            emit(event="blocked", **info)
        else:
            emit(fault=kind, **info)

    rng = random.Random(plan.seed)
    faults = None
    if plan.faulty:
        install_crash_hooks(random.Random(rng.random()), report, plan.kill_at, plan.kill_point,
                            plan.aggregation_crash_rate, plan.ingest_crash_rate)
        faults = RandomFaults(random.Random(rng.random()), lambda kind, key: emit(fault=kind, key=key),
                              plan.hold_rate, plan.copies_rate, plan.again_rate)
    dispatcher = Dispatcher(resources, plan.tick_interval, plan.workers, visibility_timeout=plan.visibility_timeout,
                            max_attempts=plan.max_attempts, faults=faults, join_workers=plan.join_workers)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    dispatcher.start()
    emit(event="started", plan=json.loads(args.plan))
    parent = os.getppid()
    while not stop.wait(1.0) and os.getppid() == parent:  # SIGTERM, or the test process is gone
        pass
    # Deliveries in flight finish first; if the server is gone they could retry for long: give up after a while.
    watchdog = threading.Timer(30, lambda: os._exit(3))
    watchdog.daemon = True
    watchdog.start()
    dispatcher.stop()
    s = dispatcher.stats
    emit(event="stopped", stats={"delivered": s.delivered, "joins_delivered": s.joins_delivered, "failed": s.failed,
                                 "dropped": s.dropped, "ticks": s.ticks, "tick_failures": s.tick_failures,
                                 "errors": s.errors[-5:]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
