"""Retries through transient AWS faults; credentials and permission errors surface at once."""

from __future__ import annotations

import json
import threading

import pytest
from botocore.exceptions import ClientError, EndpointConnectionError, NoCredentialsError
from pynamodb.exceptions import GetError

from participant.remote import FatalRemoteError, Remote, Retrier, Stopped, is_transient
from shared.signing import Signer, verify
from store.blobs import NotFound
from store.connection import Connection


def client_error(code: str) -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": code}}, "GetObject")


def flaky(failures: list[BaseException], result: str = "ok"):  # type: ignore[no-untyped-def]
    calls = {"n": 0}

    def fn() -> str:
        calls["n"] += 1
        if failures:
            raise failures.pop(0)
        return result

    return fn, calls


def test_transient_errors_are_retried_until_success(caplog: pytest.LogCaptureFixture) -> None:
    errors: list[BaseException] = [
        EndpointConnectionError(endpoint_url="http://127.0.0.1:1"),
        client_error("SlowDown"),
        client_error("InternalError"),
        GetError("get failed", cause=client_error("ProvisionedThroughputExceededException")),
        ConnectionResetError("reset"),
    ]
    fn, calls = flaky(errors)
    retrier = Retrier(threading.Event(), first_delay=0.001, max_delay=0.002)
    with caplog.at_level("WARNING", logger="participant"):
        assert retrier.call("reading", fn) == "ok"
    assert calls["n"] == 6
    assert sum("reading failed" in r.message for r in caplog.records) == 5


@pytest.mark.parametrize(
    "error",
    [client_error("AccessDenied"), client_error("InvalidAccessKeyId"), NoCredentialsError(),
     GetError("get failed", cause=NoCredentialsError())],
)
def test_credential_and_permission_errors_are_fatal(error: BaseException) -> None:
    fn, calls = flaky([error])
    with pytest.raises(FatalRemoteError):
        Retrier(threading.Event(), first_delay=0.001).call("reading", fn)
    assert calls["n"] == 1
    assert not is_transient(error)


def test_not_found_and_programming_errors_pass_through() -> None:
    for error in (NotFound("k"), ValueError("bug")):
        fn, calls = flaky([error])
        with pytest.raises(type(error)):
            Retrier(threading.Event(), first_delay=0.001).call("reading", fn)
        assert calls["n"] == 1


def test_stop_interrupts_retrying() -> None:
    stop = threading.Event()
    calls = {"n": 0}

    def always_down() -> None:
        calls["n"] += 1
        if calls["n"] == 3:
            stop.set()  # e.g. SIGTERM arrives while the endpoint is down
        raise EndpointConnectionError(endpoint_url="http://127.0.0.1:1")

    with pytest.raises(Stopped):
        Retrier(stop, first_delay=0.001).call("reading", always_down)
    assert calls["n"] == 3


def test_a_message_put_fresh_is_built_anew_for_each_attempt() -> None:
    # Given a participant's remote whose first two uploads fail with transient errors
    conn = Connection("run", "bucket", "table", "http://127.0.0.1:1", "us-east-1")
    remote = Remote(conn, "alice", Retrier(threading.Event(), first_delay=0.001, max_delay=0.002), Signer.generate())
    sent: list[tuple[str, bytes, dict[str, str]]] = []
    failures: list[BaseException] = [client_error("SlowDown"), EndpointConnectionError(endpoint_url="http://x")]

    def put(key: str, data: bytes, metadata: dict[str, str]) -> None:
        if failures:
            raise failures.pop(0)
        sent.append((key, data, metadata))

    remote.bucket.put = put  # type: ignore[method-assign]
    built = iter(range(1, 10))
    # When a message that says when it was sent is put
    remote.put_fresh_json("k", lambda: {"sent_at": float(next(built))}, "sending a heartbeat")
    # Then the attempt that got through carries the time of that attempt, signed over what it carries
    assert [json.loads(data) for _, data, _ in sent] == [{"sent_at": 3.0}]
    key, data, metadata = sent[0]
    verify(remote.signer.public_key, key, data, metadata)
