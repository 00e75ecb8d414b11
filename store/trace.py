"""Who makes each AWS request, and from where in the code: stamped on the request for the local stack's access check.

On AWS a request's principal is its credentials: each function runs as its own role, each participant as the
participant role tagged with its id. Locally several of them share one process (the local stack runs every
function's handler in one), so the code that stands in for Lambda says whom it is running (`acting_as`), and
every request then carries that name, the code path that made it and the test that ran it, in headers the local
server reads (`local.access`). Nothing here changes a request's meaning; with FED_ACCESS_TRACE unset (on AWS,
always) `install_from_env` does nothing.

A principal is "function:<name>", "participant:<id>" or "operator".
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ENV_TRACE = "FED_ACCESS_TRACE"  # "1": stamp every AWS request of this process
HEADER_PRINCIPAL = "X-Fed-Principal"
HEADER_CALLER = "X-Fed-Caller"
HEADER_TEST = "X-Fed-Test"

_REPO = Path(__file__).resolve().parent.parent
_PRODUCT = ("shared", "store", "coordinator", "functions", "participant", "fed", "local", "tests", "benchmarks")
_SKIP = (str(Path(__file__).resolve()),)
_principal: contextvars.ContextVar[str | None] = contextvars.ContextVar("fed_principal", default=None)
_caller: contextvars.ContextVar[str | None] = contextvars.ContextVar("fed_caller", default=None)
_installed = False
_lock = threading.Lock()


OPERATOR = "operator"


def function(name: str) -> str:
    """The principal of the function whose handler is functions.<name>.handler (its role on AWS)."""
    return f"function:{name}"


def participant(pid: str) -> str:
    """A participant's principal (on AWS: the participant role, session tag participant=<pid>)."""
    return f"participant:{pid}"


@contextlib.contextmanager
def acting_as(principal: str) -> Iterator[None]:
    """Requests made inside (and in pool threads started inside) are `principal`'s."""
    token = _principal.set(principal)
    try:
        yield
    finally:
        _principal.reset(token)


def current_principal() -> str | None:
    return _principal.get()


def code_path(depth: int = 3, skip: int = 1) -> str:
    """The innermost `depth` frames of this project's code on the stack: "store/blobs.py:88 head < ..."."""
    found: list[str] = []
    frame = sys._getframe(skip)
    while frame is not None and len(found) < depth:
        filename = frame.f_code.co_filename
        if filename not in _SKIP and filename.startswith(str(_REPO)):
            relative = filename[len(str(_REPO)) + 1:]
            if relative.split("/", 1)[0] in _PRODUCT:
                found.append(f"{relative}:{frame.f_lineno} {frame.f_code.co_name}")
        frame = frame.f_back  # type: ignore[assignment]
    return " < ".join(found)


def _stamp(request: Any, **kwargs: Any) -> None:
    path = code_path(skip=2) or _caller.get() or ""
    headers = request.headers
    principal = _principal.get()
    if principal:
        headers[HEADER_PRINCIPAL] = principal
    if path:
        headers[HEADER_CALLER] = path.encode("ascii", "replace").decode()
    test = os.environ.get("PYTEST_CURRENT_TEST", "")
    if test:
        headers[HEADER_TEST] = test.rsplit(" (", 1)[0].encode("ascii", "replace").decode()


def _submit_in_context(original: Any) -> Any:
    """ThreadPoolExecutor.submit, running the task in the submitter's context (its principal), and remembering
    where it was submitted from (a transfer thread's own stack holds none of our code)."""

    def submit(self: ThreadPoolExecutor, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
        context = contextvars.copy_context()
        where = code_path(skip=2)
        if where:
            context.run(_caller.set, where)
        return original(self, context.run, fn, *args, **kwargs)

    return submit


def install() -> None:
    """Stamp every request of every botocore session this process creates from now on (and of boto3's default
    session if it exists already)."""
    global _installed
    with _lock:
        if _installed:
            return
        from botocore.handlers import BUILTIN_HANDLERS

        BUILTIN_HANDLERS.append(("before-sign", _stamp))
        import boto3

        if boto3.DEFAULT_SESSION is not None:
            boto3.DEFAULT_SESSION.events.register("before-sign", _stamp)
        ThreadPoolExecutor.submit = _submit_in_context(ThreadPoolExecutor.submit)  # type: ignore[method-assign]
        _installed = True


def install_from_env() -> None:
    if os.environ.get(ENV_TRACE) == "1":
        install()
