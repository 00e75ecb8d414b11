"""The one moto version the local stack runs on.

The local stack serves the run with moto, and the modules of `local/moto/` replace parts of moto's internals
(private names, methods of its classes) for speed and to fix its bugs. Written against one release, they can
silently do the wrong thing under another, so the stack starts only on the version they were written and tested
for (pinned in the `local` extra of pyproject.toml; `tests/functional/test_moto_pin.py` keeps the two the same).
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

MOTO_VERSION = "5.2.5"


class MotoVersionMismatch(RuntimeError):
    """The installed moto is not the one the local stack's patches were written for."""


def check_moto(installed: str | None = None) -> None:
    """Raise MotoVersionMismatch, saying what to do, unless moto MOTO_VERSION is installed."""
    if installed is None:
        try:
            installed = version("moto")
        except PackageNotFoundError:
            installed = "none"
    if installed != MOTO_VERSION:
        raise MotoVersionMismatch(
            f"the local stack runs on moto {MOTO_VERSION}, and moto {installed} is installed: its patches of moto's "
            f"internals (local/moto/) were written and tested for {MOTO_VERSION} only. Install it with "
            f"`pip install 'moto[server]=={MOTO_VERSION}'` (or `pip install -e '.[local]'`); to move to another "
            "version, change MOTO_VERSION in local/moto/pin.py and the pin in pyproject.toml together, and run "
            "the local stack's tests (tests/functional/test_local_*.py), which show the moto behaviour each patch "
            "replaces.")
