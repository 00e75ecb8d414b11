"""The local moto server: DynamoDB conditional writes must be atomic under concurrency (FACTS.md)."""

from __future__ import annotations

import threading
from collections import Counter

import boto3
import pytest
from botocore.config import Config
from botocore.exceptions import ClientError

from local.server import LocalServer, ServerProcess
from shared import keys

THREADS = 10
INCREMENTS = 30
PYNAMODB_INCREMENTS = 10  # the same race, kept short: the boto3 test above is the 300/300 one


@pytest.fixture()
def server(monkeypatch: pytest.MonkeyPatch):
    for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                        "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    with LocalServer() as srv:
        yield srv


def test_binds_loopback_only(server: LocalServer) -> None:
    assert server.endpoint.startswith("http://127.0.0.1:")


def test_versioned_read_modify_write_loses_no_update(server: LocalServer) -> None:
    # Given a counter item with a version, and 10 threads each incrementing it 30 times
    ddb = boto3.client("dynamodb", endpoint_url=server.endpoint, region_name="us-east-1")
    ddb.create_table(
        TableName="counter",
        KeySchema=[{"AttributeName": "pk", "KeyType": "HASH"}],
        AttributeDefinitions=[{"AttributeName": "pk", "AttributeType": "S"}],
        BillingMode="PAY_PER_REQUEST",
    )
    ddb.put_item(TableName="counter", Item={"pk": {"S": "c"}, "n": {"N": "0"}, "v": {"N": "0"}})
    conflicts = []

    def worker() -> None:
        client = boto3.client("dynamodb", endpoint_url=server.endpoint, region_name="us-east-1")
        done = 0
        while done < INCREMENTS:
            item = client.get_item(TableName="counter", Key={"pk": {"S": "c"}}, ConsistentRead=True)["Item"]
            n, v = int(item["n"]["N"]), int(item["v"]["N"])
            try:
                client.put_item(
                    TableName="counter",
                    Item={"pk": {"S": "c"}, "n": {"N": str(n + 1)}, "v": {"N": str(v + 1)}},
                    ConditionExpression="v = :v",
                    ExpressionAttributeValues={":v": {"N": str(v)}},
                )
                done += 1
            except ClientError as exc:
                assert exc.response["Error"]["Code"] == "ConditionalCheckFailedException"
                conflicts.append(1)

    # When they all run at once
    threads = [threading.Thread(target=worker) for _ in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    # Then every increment that reported success is in the counter
    item = ddb.get_item(TableName="counter", Key={"pk": {"S": "c"}}, ConsistentRead=True)["Item"]
    assert int(item["n"]["N"]) == THREADS * INCREMENTS
    assert int(item["v"]["N"]) == THREADS * INCREMENTS
    assert conflicts, "the threads never raced: the test proves nothing"


def test_pynamodb_version_attribute_is_atomic(server: LocalServer) -> None:
    # Given pynamodb's optimistic locking against the server
    from pynamodb.attributes import NumberAttribute, UnicodeAttribute, VersionAttribute
    from pynamodb.exceptions import PutError
    from pynamodb.models import Model

    class Counter(Model):
        class Meta:
            table_name = "pyn-counter"
            host = server.endpoint
            region = "us-east-1"

        pk = UnicodeAttribute(hash_key=True)
        n = NumberAttribute(default=0)
        version = VersionAttribute()

    Counter.create_table(billing_mode="PAY_PER_REQUEST", wait=True)
    Counter("c").save()

    def worker() -> None:
        done = 0
        while done < PYNAMODB_INCREMENTS:
            item = Counter.get("c", consistent_read=True)
            item.n += 1
            try:
                item.save()
                done += 1
            except PutError as exc:
                assert exc.cause_response_code == "ConditionalCheckFailedException"

    # When 10 threads increment it concurrently
    threads = [threading.Thread(target=worker) for _ in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    # Then nothing is lost
    assert Counter.get("c", consistent_read=True).n == THREADS * PYNAMODB_INCREMENTS


def test_counts_requests_by_operation_and_object_requests_by_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a counting server and a bucket
    for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}.items():
        monkeypatch.setenv(name, value)
    with LocalServer(count_requests=True) as srv:
        s3 = boto3.client("s3", endpoint_url=srv.endpoint, region_name="us-east-1",
                          config=Config(s3={"addressing_style": "path"}))
        s3.create_bucket(Bucket="bucket")
        # When an update is uploaded and read twice, a heartbeat read once, and an object outside the layout read
        update, beat = keys.update_key("r-1", 3, "alice"), keys.heartbeat_key("r-1", "alice")
        for key in (update, beat, "notes.txt"):
            s3.put_object(Bucket="bucket", Key=key, Body=b"x")
        for key in (update, update, beat, "notes.txt"):
            s3.get_object(Bucket="bucket", Key=key)
        assert srv.requests is not None
        # Then each is counted by operation, and the object requests by the kind of object they name
        assert srv.requests.snapshot()[("s3", "GetObject")] == 4
        assert srv.requests.objects() == Counter({("GetObject", "update"): 2, ("GetObject", "heartbeat"): 1,
                                                  ("GetObject", "other"): 1, ("PutObject", "update"): 1,
                                                  ("PutObject", "heartbeat"): 1, ("PutObject", "other"): 1})


def test_a_server_process_serves_counts_and_keeps_every_request_and_ends_with_its_parent(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Given the server in a process of its own, counting and keeping each request
    for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}.items():
        monkeypatch.setenv(name, value)
    srv = ServerProcess(count_requests=True, keep_events=True).start()
    try:
        s3 = boto3.client("s3", endpoint_url=srv.endpoint, region_name="us-east-1",
                          config=Config(s3={"addressing_style": "path"}))
        # When a bucket is made and an update uploaded and read
        s3.create_bucket(Bucket="bucket")
        update = keys.update_key("r-1", 3, "alice")
        s3.put_object(Bucket="bucket", Key=update, Body=b"x")
        assert s3.get_object(Bucket="bucket", Key=update)["Body"].read() == b"x"
        # Then its counts and each request (time, client address, service, operation, the object's path, seconds
        # served) are read from its endpoint
        assert srv.requests is not None
        assert srv.requests.snapshot()[("s3", "GetObject")] == 1
        assert srv.requests.objects()[("PutObject", "update")] == 1
        events = srv.requests.events()
        assert [(e[2], e[3]) for e in events][-2:] == [("s3", "PutObject"), ("s3", "GetObject")]
        assert events[-2][1] == "127.0.0.1" and events[-2][4] == events[-1][4] == f"/bucket/{update}"
        assert all(e[5] >= 0 for e in events) and events[0][4] == ""  # (the bucket's creation names no object)
        assert len({e[6] for e in events}) == 1 and events[-1][6]  # (the access key id that signed them)
        process = srv._process
        assert process is not None and process.poll() is None
    finally:
        srv.stop()
    # And closing its stdin ends it
    assert process.returncode == 0


def test_routes_by_moto_modules_listed_once(server: LocalServer) -> None:
    import os

    import moto
    from moto import backends

    root = os.path.dirname(moto.__file__)
    listed = {d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)) and not d.startswith("__")}
    assert set(backends.list_of_moto_modules()) == listed and "dynamodb" in listed  # the same answer, kept
    s3 = boto3.client("s3", endpoint_url=server.endpoint, region_name="us-east-1")
    s3.create_bucket(Bucket="routed")
    s3.put_object(Bucket="routed", Key="k", Body=b"v")  # (routed to S3 by the host the request is signed for)
    assert s3.get_object(Bucket="routed", Key="k")["Body"].read() == b"v"


def test_listens_with_a_backlog_for_a_thousand_connecting_at_once(server: LocalServer) -> None:
    import shutil
    import subprocess

    from local.server import LISTEN_BACKLOG

    if shutil.which("ss") is None:
        pytest.skip("needs iproute2's ss to read a listening socket's backlog")
    port = server.endpoint.rsplit(":", 1)[1]
    listing = subprocess.run(["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True, check=True).stdout
    backlog = int(listing.split()[2])  # State Recv-Q Send-Q(= the backlog) Local Peer
    with open("/proc/sys/net/core/somaxconn") as f:
        assert backlog == min(LISTEN_BACKLOG, int(f.read())) and backlog >= 1024, listing


def test_a_connection_serves_request_after_request_until_the_server_stops(monkeypatch: pytest.MonkeyPatch) -> None:
    import http.client
    import json

    from local.server import COUNTS_PATH

    # Given a counting server and one HTTP/1.1 connection to it
    with LocalServer(count_requests=True) as srv:
        conn = http.client.HTTPConnection(srv.endpoint.removeprefix("http://"), timeout=10)
        # When a request carries a body that nothing reads (the counts ignore it), and two more follow
        answers, sockets = [], []
        for body in (b"never read by the server", None, None):
            conn.request("GET", COUNTS_PATH, body=body)
            resp = conn.getresponse()
            answers.append((resp.status, resp.getheader("Connection"), json.loads(resp.read())))
            sockets.append(conn.sock)  # (http.client drops its socket once the server closes the connection)
        # Then each is answered on the same connection, the unread body not mistaken for a request
        assert [(status, header) for status, header, _ in answers] == [(200, None)] * 3
        assert sockets[0] is not None and sockets == [sockets[0]] * 3
        assert len(srv._connections) == 1
    # And once the server stops, the connection is closed: nothing answers on it
    with pytest.raises((http.client.RemoteDisconnected, ConnectionError)):
        conn.request("GET", COUNTS_PATH)
        conn.getresponse()
    conn.close()
