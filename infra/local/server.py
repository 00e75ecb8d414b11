"""moto's server, in this process, on the loopback interface: S3, DynamoDB, SQS and EventBridge for a local run.

moto's DynamoDB does not check a condition and write in one step, so two concurrent conditional writes
can both succeed (see FACTS.md). The coordinator relies on those conditions (the state's version, "record
an update once"), so every DynamoDB request is served under one lock: DynamoDB becomes serial, as
atomic as the real service, while S3 transfers stay concurrent.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any

from werkzeug.serving import BaseWSGIServer, make_server

LOOPBACK = "127.0.0.1"
DYNAMODB_TARGET_PREFIX = "DynamoDB_"  # X-Amz-Target of every DynamoDB API call ("DynamoDB_20120810.PutItem")

WSGIApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


class SerialDynamoDB:
    """WSGI middleware: serve DynamoDB requests one at a time, everything else concurrently."""

    def __init__(self, app: WSGIApp) -> None:
        self.app = app
        self.lock = threading.Lock()

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if not environ.get("HTTP_X_AMZ_TARGET", "").startswith(DYNAMODB_TARGET_PREFIX):
            return self.app(environ, start_response)
        with self.lock:
            result = self.app(environ, start_response)
            try:
                return [b"".join(result)]  # the whole response is produced under the lock
            finally:
                close = getattr(result, "close", None)
                if close is not None:
                    close()


class LocalServer:
    """moto's server on 127.0.0.1 (port 0: any free port) in a background thread; `stop()` shuts it down."""

    def __init__(self, port: int = 0, host: str = LOOPBACK) -> None:
        self.host, self.port = host, port
        self._server: BaseWSGIServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def endpoint(self) -> str:
        if self._server is None:
            raise RuntimeError("the local server is not running")
        return f"http://{self.host}:{self._server.server_port}"

    def start(self) -> LocalServer:
        # Imported here: moto costs about a second to import and only the local run needs it.
        from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no access log line per request
        app = SerialDynamoDB(DomainDispatcherApplication(create_backend_app))
        try:
            self._server = make_server(self.host, self.port, app, threaded=True, request_handler=MotoRequestHandler)
        except SystemExit:  # werkzeug prints a hint and exits when the port is taken
            raise OSError(f"port {self.port} on {self.host} is already in use") from None
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="moto-server", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._server, self._thread = None, None

    def __enter__(self) -> LocalServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
