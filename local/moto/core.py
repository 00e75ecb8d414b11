"""moto's request handling shared by every service, as the local stack runs it (`PATCHES`): work it repeated for
each request though its answer never changes."""

from __future__ import annotations

import functools
import os
from typing import Any

from local.moto.patches import SPEED, Patch


def _method_names_listed_once(method_names_from_class: Any) -> tuple[object, ...]:
    """moto.core.responses.method_names_from_class (as `moto.core.responses` imported it)."""

    @functools.cache
    def listed(clazz: type) -> frozenset[str]:
        return frozenset(method_names_from_class(clazz))

    def method_names(clazz: object) -> frozenset[str]:
        return listed(clazz if isinstance(clazz, type) else type(clazz))

    return (method_names,)


def _request_ids_from_urandom(gen_amzn_requestid_long: Any) -> tuple[object, ...]:
    """moto.core.responses.gen_amzn_requestid_long (as `moto.core.responses` imported it)."""

    def request_id(headerdict: dict[str, Any] | None = None) -> str:
        """52 random characters of [0-9A-F] (moto's: of [0-9A-Za-z], drawn one by one from Python's `random`)."""
        req_id = os.urandom(26).hex().upper()
        if isinstance(headerdict, dict):
            headerdict["x-amzn-requestid"] = req_id
        return req_id

    return (request_id,)


PATCHES = (
    Patch(
        "core_method_names_listed_once", SPEED,
        ("moto.core.responses:method_names_from_class",),
        "To dispatch each request of a query-protocol or JSON service (DynamoDB, SQS, SNS, EventBridge) to its "
        "handler, moto lists every function of the handler's class with `inspect.getmembers`: about a millisecond "
        "a request, 5 % of the local server's CPU in `make bench-rounds` (yappi). A class's functions do not change "
        "while the server runs: this lists each class's once.",
        _method_names_listed_once),
    Patch(
        "core_request_ids_from_urandom", SPEED,
        ("moto.core.responses:gen_amzn_requestid_long",),
        "moto makes each response's request id of 52 characters drawn one at a time from Python's `random` (with a "
        "lock each): 4 % of the local server's CPU in `make bench-rounds` (yappi). The id only has to be random; "
        "this draws its 26 bytes at once.",
        _request_ids_from_urandom),
)
