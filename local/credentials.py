"""The credential endpoint on loopback: the function behind its function URL, as `fed local` serves it to invited
hosts. Each HTTP request becomes the function URL's event (payload v2, the body base64) for the very same handler,
`functions.credentials.handler`, run as the credential function's role; moto's STS issues the sessions.
"""

from __future__ import annotations

import base64
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from local.context import LocalContext, local_invocation
from store.trace import acting_as, function

MAX_READ = 64 * 1024  # a function URL takes up to 6 MB; the handler refuses anything over its few KB anyway
FUNCTION_NAME = "fed-local-credentials"


def url_event(method: str, path: str, body: bytes) -> dict[str, Any]:
    return {"version": "2.0", "rawPath": path, "headers": {"content-type": "application/json"},
            "requestContext": {"http": {"method": method, "path": path, "sourceIp": "127.0.0.1"}},
            "body": base64.b64encode(body).decode(), "isBase64Encoded": True}


class LocalCredentialEndpoint:
    """`start()` serves on 127.0.0.1 (`url`), `stop()` stops; the function's settings come from the environment."""

    def __init__(self, port: int = 0) -> None:
        self.port = port
        self._server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        if self._server is None:
            raise RuntimeError("the credential endpoint is not running")
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> LocalCredentialEndpoint:
        from functions.credentials import handler

        invoke = local_invocation(handler)

        class Request(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                size = min(int(self.headers.get("Content-Length") or 0), MAX_READ)
                body = self.rfile.read(size) if size > 0 else b""
                with acting_as(function("credentials")):
                    result = invoke(url_event(self.command, self.path.split("?", 1)[0], body),
                                    LocalContext(function_name=FUNCTION_NAME))
                data = str(result.get("body", "")).encode()
                self.send_response(int(result.get("statusCode", 500)))
                for name, value in (result.get("headers") or {}).items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_POST = do_GET = do_PUT = do_DELETE = _answer  # noqa: N815 - http.server's names

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's signature
                return None

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Request)
        threading.Thread(target=self._server.serve_forever, name="credential-endpoint", daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

