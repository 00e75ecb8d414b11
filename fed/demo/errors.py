"""The one error `fed demo` raises: every module of the demo reports a run it cannot finish with it."""

from __future__ import annotations


class DemoFailed(RuntimeError):
    """The demo could not finish; the message says why and where the logs are."""
