"""A real `fed-participant` process: SIGTERM stops it cleanly even while it retries an unreachable endpoint."""

from __future__ import annotations

import json
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # nothing listens once the socket is closed


def lines_of(stream) -> queue.Queue[str]:  # type: ignore[no-untyped-def]
    q: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        for line in stream:
            q.put(line)

    threading.Thread(target=pump, daemon=True).start()
    return q


def wait_for_line(q: queue.Queue[str], needle: str, deadline: float) -> list[str]:
    seen: list[str] = []
    while time.monotonic() < deadline:
        try:
            line = q.get(timeout=max(0.01, deadline - time.monotonic()))
        except queue.Empty:
            break
        seen.append(line)
        if needle in line:
            return seen
    raise AssertionError(f"{needle!r} not seen; output so far:\n{''.join(seen)}")


def test_sigterm_stops_a_participant_that_is_retrying(tmp_path: Path) -> None:
    # Given a participant whose endpoint is down, retrying its join request
    conn = tmp_path / "local.json"
    conn.write_text(json.dumps({"run_id": "local", "bucket": "fed-local", "table": "fed-local-state",
                                "endpoint": f"http://127.0.0.1:{closed_port()}", "region": "us-east-1"}))
    cmd = [sys.executable, "-c", "from participant.cli import app; app()", "start", "--id", "alice",
           "--connection", str(conn), "--state-dir", str(tmp_path / "state")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        err = lines_of(proc.stderr)
        seen = wait_for_line(err, "sending the join request failed", time.monotonic() + 60)
        assert any("retry 1" in line for line in seen)
        # When it gets SIGTERM
        proc.send_signal(signal.SIGTERM)
        # Then it stops promptly and cleanly
        assert proc.wait(timeout=20) == 0
        wait_for_line(err, "SIGTERM received", time.monotonic() + 5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
