"""moto's server, as the local stack runs it (`PATCHES`): its routing of requests to services."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from local.moto.patches import SPEED, Patch


def _modules_listed_once(list_of_moto_modules: Any) -> tuple[object, ...]:
    """moto.backends.list_of_moto_modules."""
    modules = frozenset(list_of_moto_modules())

    def listed() -> Iterable[str]:
        return modules

    return (listed,)


PATCHES = (
    Patch(
        "routing_modules_listed_once", SPEED,
        ("moto.backends:list_of_moto_modules",),
        "moto's server routes each request to a service by first asking whether the host names one of moto's own "
        "modules, and it answers that by listing moto's package directory and calling `isdir` on each of its ~200 "
        "entries, for every request and under the router's one lock (`DomainDispatcherApplication."
        "get_backend_for_host`). On the local stack's busiest paths that listing was a tenth of the server's CPU "
        "(py-spy, `fed demo --task flower`). The directory does not change while the server runs: this lists it "
        "once, when applied. For the local server (in a test process, nothing routes by host).",
        _modules_listed_once, server_only=True),
)
