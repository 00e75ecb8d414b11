"""moto's server on the loopback interface: S3, DynamoDB, SQS and EventBridge for a local run; in a thread of this
process (`LocalServer`: tests) or in a process of its own (`ServerProcess`: `fed local`, `fed demo`).

moto's DynamoDB does not check a condition and write in one step, so two concurrent conditional writes
can both succeed (see FACTS.md). The coordinator relies on those conditions (the state's version, "record
an update once"), so every DynamoDB request is served under one lock: DynamoDB becomes serial, as
atomic as the real service, while S3 transfers stay concurrent.

With `count_requests`, every request is also counted by service and operation (`LocalServer.requests`,
and for other processes `GET /_fed/requests` on the endpoint, itself not counted): what a run costs in AWS
requests (the load test's figures, the cost model's inputs).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import parse_qs

from werkzeug.serving import BaseWSGIServer, WSGIRequestHandler, make_server
from werkzeug.wsgi import LimitedStream

from local.access.control import ACCESS_PATH, AccessMiddleware
from local.access.model import AccessModel
from shared import keys

LOOPBACK = "127.0.0.1"
SERVER_START_TIMEOUT = 60.0  # a server process's imports and start, on a loaded machine
COUNTS_PATH = "/_fed/requests"  # GET: the request counts so far, as JSON [[service, operation, count], ...]
OBJECTS_PATH = "/_fed/objects"  # GET: the S3 object requests so far by kind, as JSON [[operation, kind, count], ...]
# GET: every request so far, as JSON [[epoch seconds, client address, service, operation, S3 object path, seconds
# served, access key id], ...]
EVENTS_PATH = "/_fed/events"
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


_CREDENTIAL_SCOPE = re.compile(r"Credential=([^/,]+)/\d{8}/[^/,]+/([^/,]+)/aws4_request")


def credential_scope(environ: dict[str, Any]) -> re.Match[str] | None:
    """A request's SigV4 credential scope (header or presigned query): group 1 the access key id, 2 the service."""
    auth = environ.get("HTTP_AUTHORIZATION", "") or environ.get("QUERY_STRING", "").replace("X-Amz-", "")
    return _CREDENTIAL_SCOPE.search(auth.replace("%2F", "/"))


def classify(environ: dict[str, Any], scope: re.Match[str] | None) -> tuple[str, str]:
    """(service, operation) of one request, from its credential scope and its target or S3 shape."""
    service = scope.group(2) if scope else "other"
    target = environ.get("HTTP_X_AMZ_TARGET", "")
    if target:
        return service, target.rsplit(".", 1)[-1]
    if service != "s3":
        action = parse_qs(environ.get("QUERY_STRING", "")).get("Action", [""])[0]
        return service, action or environ.get("REQUEST_METHOD", "?")
    return service, _s3_operation(environ)


def _s3_operation(environ: dict[str, Any]) -> str:
    method = environ.get("REQUEST_METHOD", "?")
    path = environ.get("PATH_INFO", "/").lstrip("/")
    on_object = "/" in path and not path.endswith("/")  # path-style: bucket/key
    query = parse_qs(environ.get("QUERY_STRING", ""), keep_blank_values=True)
    if not on_object:
        if method == "GET" and not (set(query) - {"list-type", "prefix", "continuation-token", "max-keys",
                                                  "delimiter", "start-after", "encoding-type"}):
            return "ListObjects"
        if method == "GET" and "versions" in query:
            return "ListObjectVersions"
        return f"{method.capitalize()}Bucket"
    if method == "PUT" and environ.get("HTTP_X_AMZ_COPY_SOURCE"):
        return "CopyObject"
    if "uploads" in query or "uploadId" in query:
        return f"{method.capitalize()}Multipart"
    return {"GET": "GetObject", "PUT": "PutObject", "HEAD": "HeadObject", "DELETE": "DeleteObject"}.get(
        method, f"{method.capitalize()}Object"
    )


def object_kind(environ: dict[str, Any]) -> str:
    """The kind of run object (`shared.keys.ObjectKind`) an S3 object request names (path-style), or "other"."""
    path = environ.get("PATH_INFO", "/").lstrip("/")
    try:
        return keys.parse_key(path.split("/", 1)[1]).kind.value
    except (IndexError, keys.KeyError_):
        return "other"


# When a request arrived (epoch seconds), the client's address, service, operation, the path of an S3 object request
# ("" for any other), the seconds the server took to answer it, and the access key id that signed it
Event = tuple[float, str, str, str, str, float, str]


class RequestCounter:
    """WSGI middleware: count requests by (service, operation), and S3 object requests by (operation, the object's
    kind); `snapshot()` and `objects()` read the counts so far; with `keep_events`, `events()` every request (its
    time, the client's address, which object an S3 object request named and how long it took to answer:
    `make bench-rounds` attributes them and times each step of a round with them)."""

    def __init__(self, app: WSGIApp, keep_events: bool = False) -> None:
        self.app = app
        self.keep_events = keep_events
        self._lock = threading.Lock()
        self._counts: Counter[tuple[str, str]] = Counter()
        self._objects: Counter[tuple[str, str]] = Counter()
        self._events: list[Event] = []

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if environ.get("REQUEST_METHOD") == "GET" and path in (COUNTS_PATH, OBJECTS_PATH, EVENTS_PATH):
            if path == EVENTS_PATH:
                body = json.dumps(self.events()).encode()
            else:
                counts = self.snapshot() if path == COUNTS_PATH else self.objects()
                body = json.dumps([[a, b, n] for (a, b), n in sorted(counts.items())]).encode()
            start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
            return [body]
        scope = credential_scope(environ)
        key = classify(environ, scope)
        kind = object_kind(environ) if key[0] == "s3" and key[1].endswith("Object") else ""
        with self._lock:
            self._counts[key] += 1
            if kind:
                self._objects[(key[1], kind)] += 1
        if not self.keep_events:
            return self.app(environ, start_response)
        arrived = time.time()
        answer = self.app(environ, start_response)  # (moto answers whole: the body is built by now)
        with self._lock:
            self._events.append((arrived, environ.get("REMOTE_ADDR", ""), *key, path if kind else "",
                                 time.time() - arrived, scope.group(1) if scope else ""))
        return answer

    def events(self) -> list[Event]:
        with self._lock:
            return list(self._events)

    def snapshot(self) -> Counter[tuple[str, str]]:
        with self._lock:
            return Counter(self._counts)

    def objects(self) -> Counter[tuple[str, str]]:
        with self._lock:
            return Counter(self._objects)


class _NothingToRead:
    """What werkzeug's after-response drain of the socket reads: nothing (on a persistent connection, the bytes
    still in the socket are the client's next request)."""

    @staticmethod
    def read(size: int = -1) -> bytes:
        return b""


def persistent(handler: type[WSGIRequestHandler], connections: set[socket.socket]) -> type[WSGIRequestHandler]:
    """`handler` serving HTTP/1.1 with persistent connections (werkzeug's closes every connection after one
    response): a client's next request reuses its connection instead of a new TCP connection and a new server
    thread. Measured (sequential DynamoDB GetItem, S3 GET and PUT of 20 KB, four alternating runs): 4.0-4.5 ms
    a request against 4.8-5.0 ms, the server's CPU 2.1-2.4 ms a request against 2.9-3.0 ms.

    The body a request's application left unread is read off before the next request is parsed; responses go out
    without Nagle's delay (a response is two writes, headers then body: with it, the body waited for the client's
    delayed acknowledgement of the headers, 30 ms a request). Each open connection is in `connections` (for the
    server's stop to close them: a client must not go on talking to a stopped server's handler threads)."""

    class Persistent(handler):  # type: ignore[valid-type, misc]
        protocol_version = "HTTP/1.1"  # (werkzeug frames a response without Content-Length by chunks)
        rfile: Any
        _socket_in: Any

        def setup(self) -> None:
            super().setup()
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            connections.add(self.connection)

        def finish(self) -> None:
            connections.discard(self.connection)
            super().finish()

        def run_wsgi(self) -> None:
            self._socket_in = self.rfile
            self.rfile = _NothingToRead()
            try:
                super().run_wsgi()
            finally:
                self.rfile = self._socket_in
            body = self.environ.get("wsgi.input")
            if isinstance(body, LimitedStream):
                body.exhaust()
            elif body is not None:  # a chunked request body (werkzeug's dechunking reader)
                while body.read(1 << 20):
                    pass

        def make_environ(self) -> dict[str, Any]:
            self.rfile = self._socket_in
            try:
                environ: dict[str, Any] = super().make_environ()
            finally:
                self.rfile = _NothingToRead()
            if not environ.get("wsgi.input_terminated"):  # a body framed by its Content-Length (or none)
                environ["wsgi.input"] = LimitedStream(self._socket_in, int(environ.get("CONTENT_LENGTH") or 0))
            return environ

        def send_header(self, keyword: str, value: str) -> None:
            if keyword.lower() == "connection" and value.lower() == "close" and not self.close_connection:
                return  # werkzeug's: it closes every connection
            super().send_header(keyword, value)

    return Persistent


# Connections waiting to be accepted. werkzeug listens with a backlog of 128; a thousand participants connecting at
# once (the load test) overflowed it while the server was busy: the kernel dropped their SYNs, each connect waited
# seconds for its retransmission, requests timed out and were sent again, and the server's throughput collapsed
# (seen: the run stuck in admission, the listen queue at 129 of 128, 627 client threads in `create_connection`).
# The kernel caps it at net.core.somaxconn (4096 here).
LISTEN_BACKLOG = 4096


class LocalServer:
    """moto's server on 127.0.0.1 (port 0: any free port) in a background thread; `stop()` shuts it down."""

    def __init__(self, port: int = 0, host: str = LOOPBACK, count_requests: bool = False,
                 keep_events: bool = False) -> None:
        self.host, self.port = host, port
        self.count_requests, self.keep_events = count_requests, keep_events
        self.requests: RequestCounter | None = None  # with count_requests: every request served, by service
        self.access: AccessMiddleware | None = None  # the access check, once `enable_access` tells it the run
        self._server: BaseWSGIServer | None = None
        self._thread: threading.Thread | None = None
        self._connections: set[socket.socket] = set()  # the clients' open connections

    @property
    def endpoint(self) -> str:
        if self._server is None:
            raise RuntimeError("the local server is not running")
        return f"http://{self.host}:{self._server.server_port}"

    def start(self) -> LocalServer:
        # Imported here: moto costs about a second to import and only the local run needs it.
        from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app

        from local.moto import apply_all
        from local.moto.pin import check_moto

        check_moto()  # the patches replace moto internals of one release
        apply_all(server=True)  # (the server's too: SerialDynamoDB serves each request and response whole)

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no access log line per request
        self.access = AccessMiddleware(SerialDynamoDB(DomainDispatcherApplication(create_backend_app)))
        app: WSGIApp = self.access
        if self.count_requests:
            app = self.requests = RequestCounter(app, self.keep_events)
        try:
            self._server = make_server(self.host, self.port, app, threaded=True,
                                       request_handler=persistent(MotoRequestHandler, self._connections))
        except SystemExit:  # werkzeug prints a hint and exits when the port is taken
            raise OSError(f"port {self.port} on {self.host} is already in use") from None
        self._server.daemon_threads = True  # type: ignore[attr-defined]  # ThreadedWSGIServer has it; the stub says Base
        self._server.socket.listen(LISTEN_BACKLOG)  # (again: werkzeug listened with 128)
        self._thread = threading.Thread(target=self._server.serve_forever, name="moto-server", daemon=True)
        self._thread.start()
        return self

    def enable_access(self, model: AccessModel, enforce: bool) -> None:
        """Judge every request from now on against `model` (`local.access`)."""
        if self.access is None:
            raise RuntimeError("the local server is not running")
        self.access.configure(model, enforce)

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        for connection in list(self._connections):  # their handler threads wait for a next request: end them
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._server, self._thread = None, None

    def __enter__(self) -> LocalServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class ServerProcess:
    """The same server in a process of its own (`python -m local.server`), for `fed demo` and `fed local`: the
    functions, the dispatcher and the observer of this process then share no interpreter lock with the server
    that answers them, and two cores serve both (measured, `fed demo --task flower`, three runs of each alternating:
    median round 0.32-0.35 s against 0.37-0.48 s with the server in a thread, the 15 rounds 4.9-5.4 s against
    6.1-7.3 s). moto's state lives in that process. It exits when this process closes its stdin, or dies."""

    def __init__(self, port: int = 0, host: str = LOOPBACK, count_requests: bool = False,
                 keep_events: bool = False) -> None:
        self.host, self.port = host, port
        self.count_requests, self.keep_events = count_requests, keep_events
        self.requests: RemoteCounter | None = None  # with count_requests: the server's counts, read over HTTP
        self._process: subprocess.Popen[bytes] | None = None
        self._endpoint: str | None = None

    @property
    def endpoint(self) -> str:
        if self._endpoint is None:
            raise RuntimeError("the local server is not running")
        return self._endpoint

    @property
    def pid(self) -> int:
        if self._process is None:
            raise RuntimeError("the local server is not running")
        return self._process.pid

    def start(self, timeout: float = SERVER_START_TIMEOUT) -> ServerProcess:
        cmd = [sys.executable, "-m", "local.server", "--host", self.host, "--port", str(self.port)]
        cmd += ["--count"] if self.count_requests else []
        cmd += ["--events"] if self.keep_events else []
        self._process = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert self._process.stdout is not None
        ready, _, _ = select.select([self._process.stdout], [], [], timeout)
        line = self._process.stdout.readline() if ready else b""
        if not line:
            self.stop()
            raise RuntimeError(f"the local server's process did not start within {timeout:.0f}s (its errors are "
                               "above)")
        self._endpoint = str(json.loads(line)["endpoint"])
        if self.count_requests:
            self.requests = RemoteCounter(self._endpoint)
        return self

    def enable_access(self, model: AccessModel, enforce: bool) -> None:
        """Judge every request from now on against `model` (`local.access`), in the server's process."""
        body = json.dumps({"model": model.to_json(), "enforce": enforce}).encode()
        request = urllib.request.Request(f"{self.endpoint}{ACCESS_PATH}", data=body, method="POST")
        with urllib.request.urlopen(request, timeout=120) as resp:  # noqa: S310 - our own server on loopback
            resp.read()

    def stop(self) -> None:
        if self._process is not None:
            with contextlib.suppress(OSError):
                if self._process.stdin is not None:
                    self._process.stdin.close()  # (the server's signal to stop)
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._process, self._endpoint = None, None

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class RemoteCounter:
    """A server process's request counts, read from its endpoint (as `RequestCounter`'s methods read them)."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint

    def snapshot(self) -> Counter[tuple[str, str]]:
        return Counter({(a, b): n for a, b, n in self._get(COUNTS_PATH)})

    def objects(self) -> Counter[tuple[str, str]]:
        return Counter({(a, b): n for a, b, n in self._get(OBJECTS_PATH)})

    def events(self) -> list[Event]:
        return [(float(t), str(a), str(s), str(o), str(p), float(d), str(k))
                for t, a, s, o, p, d, k in self._get(EVENTS_PATH)]

    def _get(self, path: str) -> Any:
        with urllib.request.urlopen(f"{self.endpoint}{path}", timeout=30) as resp:  # noqa: S310 - our own server
            return json.loads(resp.read())


def main(argv: list[str] | None = None) -> None:
    """`python -m local.server`: serve until stdin closes; the first line on stdout is {"endpoint": ...}."""
    parser = argparse.ArgumentParser(description="moto's server for a local run (started by ServerProcess)")
    parser.add_argument("--host", default=LOOPBACK)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--count", action="store_true", help="count requests (GET /_fed/requests)")
    parser.add_argument("--events", action="store_true", help="keep every request (GET /_fed/events)")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the parent decides
    server = LocalServer(args.port, args.host, count_requests=args.count, keep_events=args.events).start()
    print(json.dumps({"endpoint": server.endpoint}), flush=True)
    sys.stdin.buffer.read()  # until the parent closes it, or dies
    # moto's state dies with this process: nothing to keep, so no graceful stop (werkzeug's shutdown waits out its
    # 0.5 s poll, then the interpreter tears moto down: 0.77 s of every demo's end, measured with `make bench-rounds`)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
