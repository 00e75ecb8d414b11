"""moto's server routes each request to a service by first asking whether the host names one of moto's own
modules, and it answers that by listing moto's package directory and calling `isdir` on each of its ~200 entries,
for every request and under the router's one lock (`DomainDispatcherApplication.get_backend_for_host`). On the
local stack's busiest paths that listing was a tenth of the server's CPU (py-spy, `fed demo --task flower`). The
directory does not change while the server runs: `apply()` lists it once. Idempotent; the local server applies it."""

from __future__ import annotations

from collections.abc import Iterable

_applied = False


def apply() -> None:
    global _applied
    if _applied:
        return
    from moto import backends

    modules = frozenset(backends.list_of_moto_modules())

    def list_of_moto_modules() -> Iterable[str]:
        return modules

    backends.list_of_moto_modules = list_of_moto_modules
    _applied = True
