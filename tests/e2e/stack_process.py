"""The local stack's server (moto, resources; no dispatcher) in a process of its own, counting requests:
`python -m tests.e2e.stack_process --config '<RunConfig JSON>'`.

The load test runs its 200 participant threads in the test process; moto's server in the same process
would have to win the interpreter lock against them for every request it serves (and hold DynamoDB's
serializing lock meanwhile), which slows it several times over. Reports on stdout, one JSON object a line:

    {"event": "ready", "resources": {...LocalResources...}}
    {"event": "stopped"}                          after SIGTERM

Request counts are read from the endpoint's `GET /_fed/requests` (local/server.py).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from dataclasses import asdict

from local.stack import LocalStack
from shared.config import RunConfig


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    args = parser.parse_args()
    config = RunConfig.model_validate_json(args.config)
    # The load test's simulated participants are threads of the test, not principals the access check can tell
    # apart, and the functions' calls are judged by every other test: the check would only add its cost to the one
    # server process whose capacity this test measures.
    os.environ["FED_ACCESS_CHECK"] = "off"
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with LocalStack(config, dispatch=False, count_requests=True, log_level="WARNING") as stack:
        assert stack.resources is not None
        print(json.dumps({"event": "ready", "resources": asdict(stack.resources)}), flush=True)
        parent = os.getppid()
        while not stop.wait(1.0) and os.getppid() == parent:  # SIGTERM, or the test process is gone
            pass
    print(json.dumps({"event": "stopped"}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
