"""Lambda: the credential endpoint, behind a function URL with auth NONE (the hosts it serves have no AWS identity;
they prove themselves by an invite's secret, then by their bound key: `coordinator.credentials`).

The event is the function URL's payload v2 (`requestContext.http.method`, `rawPath`, `body`, `isBase64Encoded`);
the result its response: `{"statusCode", "headers", "body"}`, the body JSON. A failure is answered 500 with no
detail (it is logged); no answer or log line carries a secret or a credential.
"""

from __future__ import annotations

import base64
import binascii
import json
import time
from collections.abc import Callable
from typing import Any

from aws_lambda_powertools.utilities.typing import LambdaContext

from coordinator.credentials import answer
from functions.observability import logger, metrics
from functions.settings import credential_deps_from_env
from shared.hosts import error_body

clock: Callable[[], float] = time.time  # the endpoint's clock (a test sets its own)


def request_of(event: dict[str, Any]) -> tuple[str, str, bytes]:
    """(method, path, body) of a function URL event; a body that is not valid base64 is passed on as it came."""
    method = str(((event.get("requestContext") or {}).get("http") or {}).get("method", ""))
    text = event.get("body") or ""
    body = text.encode() if isinstance(text, str) else b""
    if event.get("isBase64Encoded"):
        try:
            body = base64.b64decode(body, validate=True)
        except (binascii.Error, ValueError):
            pass
    return method.upper(), str(event.get("rawPath", "")), body


def response(status: int, payload: dict[str, Any]) -> dict[str, Any]:
    headers = {"content-type": "application/json", "cache-control": "no-store"}
    if status == 405:
        headers["allow"] = "POST"
    return {"statusCode": status, "headers": headers, "body": json.dumps(payload)}


@logger.inject_lambda_context
@metrics.log_metrics
def handler(event: dict[str, Any], context: LambdaContext) -> dict[str, Any]:
    method, path, body = request_of(event)
    try:
        status, payload = answer(credential_deps_from_env(), method, path, body, clock())
    except Exception:
        logger.exception("credential request failed", method=method[:10], path=path[:100])
        status, payload = 500, error_body("the credential endpoint failed; try again", temporary=True)
    if status != 200:
        logger.info("credential request refused", status=status, reason=payload.get("error", ""), path=path[:100])
    return response(status, payload)
