"""A real headless Chromium for the dashboard's test, driven over the DevTools protocol through a pipe
(`--remote-debugging-pipe`: JSON messages separated by NUL bytes on file descriptors 3 and 4), with the standard
library only.

`chromium()` finds the browser, installing Debian's `chromium` package with apt-get when it is missing (as root);
where it cannot be had, the test is skipped with the reason.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest

NAMES = ("chromium", "chromium-browser", "google-chrome", "chrome")
INSTALL_TIMEOUT = 900


def find() -> str | None:
    return next((path for name in NAMES if (path := shutil.which(name))), None)


def chromium() -> str:
    """The browser's path; installed from the system's packages when missing; the test skipped where it cannot be."""
    found = find()
    if found:
        return found
    if not shutil.which("apt-get") or os.geteuid() != 0:
        pytest.skip("no Chromium on this machine, and it cannot be installed here (needs apt-get as root): "
                    "install the chromium package to run the dashboard's browser test")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    try:
        subprocess.run(["apt-get", "install", "-y", "-q", "chromium"], env=env, check=True, capture_output=True,
                       timeout=INSTALL_TIMEOUT)
    except (subprocess.SubprocessError, OSError):
        try:  # the package lists may be missing or stale
            subprocess.run(["apt-get", "update", "-q"], env=env, check=True, capture_output=True,
                           timeout=INSTALL_TIMEOUT)
            subprocess.run(["apt-get", "install", "-y", "-q", "chromium"], env=env, check=True, capture_output=True,
                           timeout=INSTALL_TIMEOUT)
        except (subprocess.SubprocessError, OSError) as exc:
            pytest.skip(f"Chromium could not be installed with apt-get: {exc}")
    found = find()
    if not found:
        pytest.skip("apt-get installed chromium, yet no chromium command is on PATH")
    return found


class BrowserError(RuntimeError):
    pass


def _high(fd: int) -> int:
    """The same pipe end as a descriptor of at least 10 (the original closed)."""
    moved = fcntl.fcntl(fd, fcntl.F_DUPFD, 10)
    os.close(fd)
    return moved


class Browser:
    """One headless Chromium; `open(url)` gives a `Page`."""

    def __init__(self, path: str) -> None:
        self.profile = tempfile.mkdtemp(prefix="fed-chromium-")
        commands_r, self._commands = os.pipe()  # we write, the browser reads (its fd 3)
        self._replies, replies_w = os.pipe()  # the browser writes (its fd 4), we read
        commands_r, replies_w = _high(commands_r), _high(replies_w)  # clear of 3 and 4, whatever they were

        # the pipe ends become the browser's fds 3 and 4 (bash's redirections at its exec: dash takes no fd over 9)
        redirect = f'exec "$@" 3<&{commands_r} 4>&{replies_w} {commands_r}<&- {replies_w}>&-'
        args = [shutil.which("bash") or "bash", "-c", redirect, "bash", path, "--headless=new",
                "--remote-debugging-pipe", "--no-sandbox", "--disable-gpu",
                "--disable-dev-shm-usage", "--no-first-run", "--no-default-browser-check", "--disable-extensions",
                "--disable-background-networking", "--window-size=1400,1000", f"--user-data-dir={self.profile}",
                "about:blank"]
        self.process = subprocess.Popen(args, pass_fds=(commands_r, replies_w), stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL)
        os.close(commands_r)
        os.close(replies_w)
        self._next = 0
        self._lock = threading.Lock()
        self._buffer = b""
        self._pending: dict[int, Any] = {}

    def send(self, method: str, params: dict[str, Any] | None = None, session: str | None = None,
             timeout: float = 30.0) -> dict[str, Any]:
        with self._lock:
            self._next += 1
            ident = self._next
            message: dict[str, Any] = {"id": ident, "method": method, "params": params or {}}
            if session:
                message["sessionId"] = session
            os.write(self._commands, json.dumps(message).encode() + b"\0")
            deadline = time.monotonic() + timeout
            while ident not in self._pending:
                if time.monotonic() > deadline:
                    raise BrowserError(f"no reply to {method} within {timeout:.0f}s")
                self._read()
            reply = self._pending.pop(ident)
        if "error" in reply:
            raise BrowserError(f"{method}: {reply['error']}")
        result: dict[str, Any] = reply.get("result", {})
        return result

    def _read(self) -> None:
        chunk = os.read(self._replies, 1 << 20)
        if not chunk:
            raise BrowserError(f"the browser closed its pipe (exit status {self.process.poll()})")
        self._buffer += chunk
        while b"\0" in self._buffer:
            raw, self._buffer = self._buffer.split(b"\0", 1)
            message = json.loads(raw)
            if "id" in message:
                self._pending[message["id"]] = message

    def open(self, url: str) -> Page:
        target = self.send("Target.createTarget", {"url": url})["targetId"]
        session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        return Page(self, session)

    def close(self) -> None:
        try:
            self.send("Browser.close", timeout=5)
        except (BrowserError, OSError):
            pass
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        for fd in (self._commands, self._replies):
            try:
                os.close(fd)
            except OSError:
                pass
        shutil.rmtree(self.profile, ignore_errors=True)


class Page:
    def __init__(self, browser: Browser, session: str) -> None:
        self.browser, self.session = browser, session

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (JSON-serialisable)."""
        reply = self.browser.send("Runtime.evaluate", {"expression": expression, "returnByValue": True},
                                  self.session)
        if "exceptionDetails" in reply:
            raise BrowserError(f"{expression}: {reply['exceptionDetails']}")
        return reply["result"].get("value")

    def wait_for(self, expression: str, timeout: float, what: str) -> Any:
        """Poll a JavaScript expression until it is truthy; its value."""
        deadline = time.monotonic() + timeout
        value: Any = None
        while time.monotonic() < deadline:
            try:
                value = self.evaluate(expression)
            except BrowserError:
                value = None
            if value:
                return value
            time.sleep(0.25)
        raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what} (last: {value!r})")

    def screenshot(self, path: Path) -> Path:
        data = self.browser.send("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True},
                                 self.session)["data"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))
        return path
