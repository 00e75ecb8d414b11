"""Each of the local stack's moto patches (local/moto/), shown against moto as released: one test per patch, named
after it. A scenario runs twice in one process, on moto unpatched (`unpatched()`) and patched, each in a fresh
mock: for a bug fix, moto 5.2.5 answers wrongly and the patched one as AWS does; for speed, the answers are the
same and the patched one does less (counted, never timed). On an upgrade of moto, a bug fix whose test fails
because moto now answers right is no longer needed.

Races are shown without timing: the other request runs in a thread at a chosen point (`Interleaving`), and this
one goes on once that thread has finished or waits for the lock the patch takes."""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import os
import re
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import boto3
import pytest
from botocore.config import Config
from botocore.exceptions import ClientError
from moto import mock_aws

import local.moto
from local.moto import PATCHES, apply_all, patch
from local.moto import s3 as local_s3
from local.moto import sns as local_sns
from local.moto.patches import BUG, SPEED, applied, unpatched

T = TypeVar("T")
ACCOUNT = "123456789012"
REGION = "us-east-1"
MiB = 1024 * 1024


@pytest.fixture(autouse=True)
def patched_moto(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                        "AWS_DEFAULT_REGION": REGION}.items():
        monkeypatch.setenv(name, value)
    apply_all()


def on_moto_and_ours(scenario: Callable[[], T], *server_patches: str) -> tuple[T, T]:
    """The scenario's result on moto as released, and on moto as the local stack runs it (with `server_patches`,
    the local server's own, too), each in a fresh mock."""
    with mock_aws(), unpatched():
        theirs = scenario()
    with mock_aws(), applied(patch(name) for name in server_patches):
        ours = scenario()
    return theirs, ours


_ABSENT = object()


@contextlib.contextmanager
def counted(owner: Any, name: str) -> Iterator[list[Any]]:
    """Calls of `owner.name` (a function, method or property) during the block: the arguments of each."""
    held = vars(owner).get(name, _ABSENT)
    current = inspect.getattr_static(owner, name)
    calls: list[Any] = []
    replacement: Any
    if isinstance(current, property):
        fget = current.fget
        assert fget is not None
        replacement = property(lambda self: calls.append((self,)) or fget(self), current.fset)
    else:
        def replacement(*args: Any, **kwargs: Any) -> Any:
            calls.append(args)
            return current(*args, **kwargs)
    setattr(owner, name, replacement)
    try:
        yield calls
    finally:
        if held is _ABSENT:
            delattr(owner, name)
        else:
            setattr(owner, name, held)


class SignallingLock(threading.Condition):
    """A lock (a condition) that sets `settled` when a thread has to wait for it."""

    def __init__(self, settled: threading.Event, lock: Any = None) -> None:
        super().__init__(lock)
        self.settled = settled

    def __enter__(self) -> bool:
        if not self.acquire(blocking=False):
            self.settled.set()
            self.acquire()
        return True


class Interleaving:
    """Another request, `other`, run in a thread at the moment `at_this_point()` is first called: it returns once
    that thread has finished, or has to wait for one of `lock()`'s locks (held here, by a patch)."""

    def __init__(self, other: Callable[[], object]) -> None:
        self.settled = threading.Event()
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self._run, args=(other,), daemon=True)

    def _run(self, other: Callable[[], object]) -> None:
        try:
            other()
        except BaseException as exc:  # (shown by the test)
            self.errors.append(exc)
        finally:
            self.settled.set()

    def lock(self, lock: Any = None) -> SignallingLock:
        return SignallingLock(self.settled, lock)

    def at_this_point(self) -> None:
        if self.thread.ident is None:
            self.thread.start()
            assert self.settled.wait(60), "the other request neither finished nor waited for a lock"

    def join(self) -> None:
        if self.thread.ident is not None:
            self.thread.join(60)
            assert not self.thread.is_alive()


# --- the registry itself ---------------------------------------------------------------------------------------


def test_every_patch_has_a_test_named_after_it() -> None:
    tests = {name for name in vars(sys.modules[__name__]) if name.startswith("test_")}
    assert [p.name for p in PATCHES if f"test_{p.name}" not in tests] == []
    assert len({p.name for p in PATCHES}) == len(PATCHES)


def test_the_package_lists_every_patch_with_its_kind() -> None:
    doc = local.moto.__doc__ or ""
    listed = dict(re.findall(r"^\| (\w+) \| (bug|speed)(?: \(local server only\))? \|$", doc, re.MULTILINE))
    assert listed == {p.name: p.kind for p in PATCHES}
    server_only = set(re.findall(r"^\| (\w+) \| (?:bug|speed) \(local server only\) \|$", doc, re.MULTILINE))
    assert server_only == {p.name for p in PATCHES if p.server_only}


def test_unpatched_is_moto_as_released_and_the_patches_come_back() -> None:
    apply_all(server=True)  # (as the local server does; they stay applied, as after any LocalServer in this process)
    from local.moto.patches import _resolve

    def held(target: str) -> object:
        owner, attribute = _resolve(target)
        return inspect.getattr_static(owner, attribute, None)

    def defined_in(value: object) -> str:
        value = value.fget if isinstance(value, property) else value
        return "absent" if value is None else str(getattr(value, "__module__", "?"))

    targets = [target for p in PATCHES for target in p.replaces]
    ours = {target: held(target) for target in targets}
    with unpatched():
        theirs = {target: held(target) for target in targets}
    assert [target for target in targets if theirs[target] is ours[target]] == []
    assert {target: defined_in(theirs[target]) for target in targets if not defined_in(theirs[target]).startswith(
        "moto.")} == {"moto.dynamodb.models.table:Table.__deepcopy__": "absent"}
    assert [target for target in targets if held(target) is not ours[target]] == []


# --- S3 ----------------------------------------------------------------------------------------------------------


class CountingFile:
    """An object's file, the bytes read from it counted."""

    def __init__(self, file: Any) -> None:
        self.file, self.bytes_read = file, 0

    def read(self, size: int | None = -1) -> bytes:
        block = bytes(self.file.read(size))
        self.bytes_read += len(block)
        return block

    def __getattr__(self, name: str) -> Any:
        return getattr(self.file, name)


def stored_key(bucket: str, key: str) -> Any:
    from moto.s3.models import s3_backends

    return s3_backends[ACCOUNT]["aws"].get_object(bucket, key)


def test_s3_object_bytes_in_blocks() -> None:
    data = os.urandom(20 * MiB + 5)

    def scenario() -> tuple[Any, ...]:
        # Given a 20 MiB object, the bytes read from its file counted
        s3 = boto3.client("s3", region_name=REGION)
        s3.create_bucket(Bucket="blocks")
        s3.put_object(Bucket="blocks", Key="big", Body=data)
        key = stored_key("blocks", "big")
        key._value_buffer = counting = CountingFile(key._value_buffer)
        # When it is read in two ranges, whole, and copied
        ranges = [s3.get_object(Bucket="blocks", Key="big", Range=r)["Body"].read()
                  for r in ("bytes=10-19", f"bytes={20 * MiB}-")]
        read_for_ranges = counting.bytes_read
        whole = s3.get_object(Bucket="blocks", Key="big")["Body"].read()
        etag = s3.copy_object(Bucket="blocks", Key="copy", CopySource={"Bucket": "blocks", "Key": "big"})[
            "CopyObjectResult"]["ETag"]
        copied = s3.get_object(Bucket="blocks", Key="copy")["Body"].read()
        return ranges, whole == data, etag, copied == data, read_for_ranges

    theirs, ours = on_moto_and_ours(scenario)
    # Then the answers are moto's: the ranges' bytes, the whole object, the copy and its ETag (the MD5)
    assert theirs[:4] == ours[:4] == ([data[10:20], data[20 * MiB:]], True, f'"{hashlib.md5(data).hexdigest()}"',
                                      True)
    # And the ranged reads read their bytes only (moto read the whole object for each)
    assert (theirs[4], ours[4]) == (2 * len(data), 10 + 5)


def test_s3_object_bytes_in_blocks_behind_the_server_stream_the_same_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    # (the same patch behind moto's server, where a whole large object streams from its file in blocks)
    from local.server import LocalServer

    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    data = os.urandom(local_s3.STREAM_FROM + 3)
    with LocalServer() as server:
        s3 = boto3.client("s3", endpoint_url=server.endpoint, region_name=REGION)
        s3.create_bucket(Bucket="streamed")
        s3.put_object(Bucket="streamed", Key="big", Body=data)

        def whole() -> tuple[bytes, str, int]:
            reply = s3.get_object(Bucket="streamed", Key="big")
            return reply["Body"].read(), reply["ETag"], reply["ContentLength"]

        with unpatched():
            theirs = whole()
        streams = []
        blocks = local_s3._blocks
        monkeypatch.setattr(local_s3, "_blocks", lambda key: streams.append(key) or blocks(key))
        ours = whole()
    assert theirs == ours == (data, f'"{hashlib.md5(data).hexdigest()}"', len(data))
    assert len(streams) == 1  # (ours streamed it)


def multipart(s3: Any, key: str, parts: list[bytes], **checksum: str) -> dict[str, Any]:
    started = s3.create_multipart_upload(Bucket="uploads", Key=key, **checksum)
    done = []
    for number, data in enumerate(parts, start=1):
        extra = {"ChecksumAlgorithm": checksum["ChecksumAlgorithm"]} if checksum else {}
        reply = s3.upload_part(Bucket="uploads", Key=key, UploadId=started["UploadId"], PartNumber=number, Body=data,
                               **extra)
        done.append({"PartNumber": number, "ETag": reply["ETag"]} | {
            k: v for k, v in reply.items() if k.startswith("Checksum") and k != "ChecksumType"})
    reply = s3.complete_multipart_upload(Bucket="uploads", Key=key, UploadId=started["UploadId"],
                                         MultipartUpload={"Parts": done})
    return {k: v for k, v in reply.items() if k == "ETag" or k.startswith("Checksum")}


def test_s3_completion_of_the_parts_files() -> None:
    parts = [os.urandom(5 * MiB), os.urandom(5 * MiB + 3), os.urandom(100)]

    def scenario() -> tuple[Any, ...]:
        # Given a bucket, and the reads of parts' bytes at completion counted
        s3 = boto3.client("s3", region_name=REGION, config=Config(response_checksum_validation="when_required"))
        s3.create_bucket(Bucket="uploads")
        with counted(local_s3, "_read") as reads:
            # When two uploads of three parts complete: one with a composite SHA-256 checksum, one with the default
            composite = multipart(s3, "composite", parts, ChecksumAlgorithm="SHA256")
            default = multipart(s3, "default", parts)
        got = [s3.get_object(Bucket="uploads", Key=k)["Body"].read() == b"".join(parts)
               for k in ("composite", "default")]
        held = type(stored_key("uploads", "composite")._value_buffer).__name__
        return composite, default, got, len(reads), held

    theirs, ours = on_moto_and_ours(scenario)
    # Then ours gives moto's ETags and checksums, and the objects are the parts' bytes
    assert theirs[:3] == ours[:3] and theirs[2] == [True, True]
    assert theirs[0]["ETag"].endswith('-3"')
    # And ours made the composite upload of the parts' files, reading none of them again (the full-object checksum
    # reads each part once); moto wrote a new file of the whole object
    assert ours[3:] == (len(parts), "_Span") and theirs[4] == "SpooledTemporaryFile"


class InterruptedFile(CountingFile):
    """An object's file: after the first 16 MiB block read of it (moto's ETag hashes 16 MiB at a time), another
    request runs."""

    def __init__(self, file: Any, interleaving: Interleaving) -> None:
        super().__init__(file)
        self.interleaving = interleaving

    def read(self, size: int | None = -1) -> bytes:
        block = super().read(size)
        if size == 16 * MiB:
            self.interleaving.at_this_point()
        return block


def test_s3_etag_under_the_object_lock() -> None:
    data = bytes(range(256)) * (16 * MiB // 256) + b"the last bytes"

    def scenario() -> tuple[str, bool]:
        # Given an object of more than 16 MiB whose ETag is not computed yet, and a read of the whole object that
        # comes while the ETag is being computed
        from moto.s3.models import s3_backends

        backend = s3_backends[ACCOUNT]["aws"]
        backend.create_bucket("etags", REGION)
        key = backend.put_object("etags", "k", data)
        key._etag = None
        read: list[bytes] = []
        other = Interleaving(lambda: read.append(key.value))
        key.lock = other.lock(threading.Lock())
        key._value_buffer = InterruptedFile(key._value_buffer, other)
        # When the ETag is computed
        etag = key.etag
        other.join()
        return etag, read == [data]

    theirs, ours = on_moto_and_ours(scenario)
    # Then moto's is the MD5 of the first 16 MiB (the read moved the file's position to its end, unlocked); ours
    # is the object's, and the read waited for it
    assert theirs == (f'"{hashlib.md5(data[:16 * MiB]).hexdigest()}"', True)
    assert ours == (f'"{hashlib.md5(data).hexdigest()}"', True)


def test_s3_part_of_a_gone_upload_is_no_such_upload() -> None:
    def scenario() -> str:
        # Given a multipart upload that was aborted
        s3 = boto3.client("s3", region_name=REGION)
        s3.create_bucket(Bucket="uploads")
        upload = s3.create_multipart_upload(Bucket="uploads", Key="k")["UploadId"]
        s3.abort_multipart_upload(Bucket="uploads", Key="k", UploadId=upload)
        # When a part is sent to it
        try:
            s3.upload_part(Bucket="uploads", Key="k", UploadId=upload, PartNumber=1, Body=b"late")
        except ClientError as exc:
            return f"{exc.response['ResponseMetadata']['HTTPStatusCode']} {exc.response['Error']['Code']}"
        except Exception as exc:  # (moto's server answers it with a 500)
            return f"internal error: {type(exc).__name__}"
        return "accepted"

    theirs, ours = on_moto_and_ours(scenario)
    # Then moto fails inside (the upload's KeyError), and ours refuses it as S3 does
    assert (theirs, ours) == ("internal error: KeyError", "404 NoSuchUpload")


# --- DynamoDB ----------------------------------------------------------------------------------------------------


def table() -> Any:
    ddb = boto3.client("dynamodb", region_name=REGION)
    ddb.create_table(TableName="t", BillingMode="PAY_PER_REQUEST",
                     KeySchema=[{"AttributeName": "pk", "KeyType": "HASH"},
                                {"AttributeName": "sk", "KeyType": "RANGE"}],
                     AttributeDefinitions=[{"AttributeName": "pk", "AttributeType": "S"},
                                           {"AttributeName": "sk", "AttributeType": "S"}])
    return ddb


def scan(ddb: Any) -> list[dict[str, Any]]:
    return sorted(ddb.scan(TableName="t")["Items"], key=lambda item: item["sk"]["S"])


def query(ddb: Any, prefix: str) -> list[dict[str, Any]]:
    pages = ddb.get_paginator("query").paginate(
        TableName="t", KeyConditionExpression="pk = :pk AND begins_with(sk, :p)",
        ExpressionAttributeValues={":pk": {"S": "run"}, ":p": {"S": prefix}})
    return [item for page in pages for item in page["Items"]]


def test_dynamodb_transaction_backs_up_its_items() -> None:
    from moto.dynamodb.models.dynamo_type import Item

    def scenario() -> tuple[Any, ...]:
        # Given a table of 300 records and a count, moto's item copies counted
        ddb = table()
        for i in range(300):
            ddb.put_item(TableName="t", Item={"pk": {"S": "run"}, "sk": {"S": f"p#{i:03d}"}})
        ddb.put_item(TableName="t", Item={"pk": {"S": "run"}, "sk": {"S": "count"}, "n": {"N": "300"}})
        count_up = {"Update": {"TableName": "t", "Key": {"pk": {"S": "run"}, "sk": {"S": "count"}},
                               "UpdateExpression": "ADD n :one", "ConditionExpression": "n < :limit",
                               "ExpressionAttributeValues": {":one": {"N": "1"}, ":limit": {"N": "302"}}}}

        def register(sk: str) -> str:
            try:
                ddb.transact_write_items(TransactItems=[
                    {"Put": {"TableName": "t", "Item": {"pk": {"S": "run"}, "sk": {"S": sk}},
                             "ConditionExpression": "attribute_not_exists(pk)"}}, count_up])
            except ClientError as exc:
                return str(exc.response["CancellationReasons"])
            return "written"

        with counted(Item, "__deepcopy__") as copies:
            # When two participants are registered, each in one transaction, and a third is refused (the count's
            # condition fails, so its record is not written either)
            outcomes = [register(sk) for sk in ("p#new1", "p#new2", "p#new3")]
        return outcomes, scan(ddb), len(copies)

    theirs, ours = on_moto_and_ours(scenario)
    # Then the outcomes and the table are moto's
    assert theirs[:2] == ours[:2] and theirs[0][:2] == ["written", "written"]
    assert len(theirs[1]) == 303 and {"pk": {"S": "run"}, "sk": {"S": "count"}, "n": {"N": "302"}} in theirs[1]
    # And ours copied the two items each transaction names, not the table (moto copied it whole, each time)
    assert ours[2] <= 6 and theirs[2] >= 3 * 300


def scrambled_keys() -> list[str]:
    keys = [f"p#{i:04d}" for i in range(100)] + [f"u#{r}#{i:04d}" for r in range(2) for i in range(100)]
    return sorted(keys, key=lambda k: hashlib.sha256(k.encode()).digest())


def test_dynamodb_query_sorts_on_key_values() -> None:
    from moto.dynamodb.models.dynamo_type import DynamoType

    def scenario() -> tuple[list[str], int]:
        # Given a partition of 300 items put in no order, and another partition; key comparisons counted
        ddb = table()
        for n, sk in enumerate(scrambled_keys()):
            ddb.put_item(TableName="t", Item={"pk": {"S": "run"}, "sk": {"S": sk}, "n": {"N": str(n)}})
        for i in range(10):
            ddb.put_item(TableName="t", Item={"pk": {"S": "other"}, "sk": {"S": f"p#{i}"}})
        # When 100 of them are queried
        with counted(DynamoType, "__lt__") as comparisons:
            got = [item["sk"]["S"] for item in query(ddb, "p#")]
        return got, len(comparisons)

    theirs, ours = on_moto_and_ours(scenario)
    # Then both come in key order; moto compared key objects to sort the whole table (~2,500 comparisons), ours
    # fewer than one per item of the partition (none to sort)
    assert theirs[0] == ours[0] == [f"p#{i:04d}" for i in range(100)]
    assert ours[1] < 300 < 3 * 300 < theirs[1]


def test_dynamodb_attribute_values_written_directly() -> None:
    from moto.core.serialize import ResponseSerializer

    scalars = {"s": {"S": "text é"}, "empty": {"S": ""}, "n": {"N": "-12.50"}, "b": {"B": b"\x00\xffbytes"},
               "ss": {"SS": ["a", "b"]}, "ns": {"NS": ["1", "2.5"]}, "bs": {"BS": [b"\x01", b"\x02"]},
               "yes": {"BOOL": True}, "no": {"BOOL": False}, "null": {"NULL": True}}
    everything = {"pk": {"S": "run"}, "sk": {"S": "everything"}, **scalars,
                  "m": {"M": {**scalars, "inner": {"M": {"l": {"L": [{"N": "1"}, {"B": b"x"}]}}}}},
                  "l": {"L": [{"M": scalars}, {"L": []}, {"M": {}}, *scalars.values()]}}

    def scenario() -> tuple[Any, ...]:
        # Given an item with an attribute of every kind, nested in a map and a list too, and 50 records; the
        # serializer's steps counted
        ddb = table()
        ddb.put_item(TableName="t", Item=everything)
        for i in range(50):
            ddb.put_item(TableName="t", Item={"pk": {"S": "run"}, "sk": {"S": f"p#{i:02d}"}, "n": {"N": str(i)}})
        # When it is read back by key, and all are queried
        with counted(ResponseSerializer, "_serialize") as steps:
            got = ddb.get_item(TableName="t", Key={"pk": {"S": "run"}, "sk": {"S": "everything"}})["Item"]
            queried = ddb.query(TableName="t", KeyConditionExpression="pk = :pk",
                                ExpressionAttributeValues={":pk": {"S": "run"}})["Items"]
        return got, queried, len(steps)

    theirs, ours = on_moto_and_ours(scenario)
    # Then ours writes what moto writes (the item as put), with fewer than half the serializer's steps
    assert theirs[:2] == ours[:2] and theirs[0] == everything and len(theirs[1]) == 51
    assert ours[2] * 2 < theirs[2]


def test_dynamodb_query_results_uncopied() -> None:
    from moto.dynamodb.models.dynamo_type import DynamoType

    def scenario() -> tuple[list[dict[str, Any]], int]:
        # Given 300 participant records and 5 other items, copies of their values counted
        ddb = table()
        for i in range(300):
            ddb.put_item(TableName="t", Item={"pk": {"S": "run"}, "sk": {"S": f"p#{i:03d}"}, "n": {"N": str(i)}})
        for i in range(5):
            ddb.put_item(TableName="t", Item={"pk": {"S": "run"}, "sk": {"S": f"u#{i}"}})
        # When the records are queried
        with counted(DynamoType, "__deepcopy__") as copies:
            records = query(ddb, "p#")
        return records, len(copies)

    theirs, ours = on_moto_and_ours(scenario, "dynamodb_query_results_uncopied")
    # Then the same items come back; moto copied each one, the local server's patch none
    assert theirs[0] == ours[0] and len(ours[0]) == 300
    assert theirs[1] >= 3 * 300 and ours[1] == 0


# --- SQS ---------------------------------------------------------------------------------------------------------


def sqs_queue(name: str) -> tuple[Any, Any, Any]:
    """(the backend, the queue, the client)"""
    from moto.sqs.models import sqs_backends

    client = boto3.client("sqs", region_name=REGION)
    client.create_queue(QueueName=name, **({"Attributes": {"FifoQueue": "true", "ContentBasedDeduplication": "true"}}
                                           if name.endswith(".fifo") else {}))
    backend = sqs_backends[ACCOUNT][REGION]
    return backend, backend.get_queue(name), client


def test_sqs_send_reads_one_attribute() -> None:
    from moto.sqs import models

    def scenario() -> tuple[Any, ...]:
        # Given a queue with a backlog of 50 and a FIFO queue deduplicating by content; the scans that count a
        # queue's messages counted
        _, _, sqs = sqs_queue("backlog")
        url = sqs.get_queue_url(QueueName="backlog")["QueueUrl"]
        fifo = sqs_queue("dedup.fifo")[2].get_queue_url(QueueName="dedup.fifo")["QueueUrl"]
        for i in range(50):
            sqs.send_message(QueueUrl=url, MessageBody=f"m{i}")
        # When one more is sent to each, and the same body twice and another once to the FIFO queue
        with counted(models.Queue, "approximate_number_of_messages") as scans:
            sqs.send_message(QueueUrl=url, MessageBody="one more")
            for body in ("same", "same", "other"):
                sqs.send_message(QueueUrl=fifo, MessageBody=body, MessageGroupId="g")
        names = ["ApproximateNumberOfMessages", "ContentBasedDeduplication"]
        return [sqs.get_queue_attributes(QueueUrl=u, AttributeNames=names)["Attributes"] for u in (url, fifo)], \
            len(scans)

    theirs, ours = on_moto_and_ours(scenario)
    # Then the queues hold the same (the FIFO queue two messages); moto counted the queue's messages at each send
    assert theirs[0] == ours[0] == [{"ApproximateNumberOfMessages": "51"},
                                    {"ApproximateNumberOfMessages": "2", "ContentBasedDeduplication": "true"}]
    assert theirs[1] >= 4 and ours[1] == 0


def test_sqs_retention_read_alone() -> None:
    from moto.sqs import models

    def scenario() -> tuple[list[str], int]:
        # Given a queue keeping messages 60 s, a message sent now and one sent 61 s ago
        backend, queue, sqs = sqs_queue("short")
        url = sqs.get_queue_url(QueueName="short")["QueueUrl"]
        sqs.set_queue_attributes(QueueUrl=url, Attributes={"MessageRetentionPeriod": "60"})
        for body in ("fresh", "old"):
            sqs.send_message(QueueUrl=url, MessageBody=body)
        queue._messages[1].sent_timestamp -= 61_000
        # When the queue is read, the reads of its attributes counted
        with counted(models.SQSBackend, "get_queue_attributes") as reads:
            bodies = [m["Body"] for m in sqs.receive_message(QueueUrl=url, MaxNumberOfMessages=10)["Messages"]]
        return bodies, len(reads)

    theirs, ours = on_moto_and_ours(scenario)
    # Then only the fresh one comes; moto read every attribute of the queue for each message it looked at
    assert theirs[0] == ours[0] == ["fresh"]
    assert theirs[1] >= 2 and ours[1] == 0


def test_sqs_delete_excludes_sends() -> None:
    def scenario() -> list[str]:
        # Given a queue with two delivered messages
        backend, queue, _ = sqs_queue("events")
        for body in ("first", "second"):
            backend.send_message("events", body)
        handles = {m.body: m.receipt_handle for m in backend.receive_message("events", 10, 0, 30)}
        # and, while the second is deleted, a request that deletes the first and then a send (the local server
        # serves each request in a thread of its own): it comes once the delete has walked the queue's list into
        # its new list of the other messages, and before it puts that in place

        def delete_first_and_send() -> None:
            backend.delete_message("events", handles["first"])
            backend.send_message("events", "sent meanwhile")

        other = Interleaving(delete_first_and_send)
        queue._messages_lock = other.lock()
        first = queue._messages[0]
        looked_up = first.had_receipt_handle
        looks = []

        def looking(receipt_handle: str) -> bool:
            looks.append(receipt_handle)
            if len(looks) == 2:  # (the delete's lookup looked once; now it walks the list)
                other.at_this_point()
            return bool(looked_up(receipt_handle))

        first.had_receipt_handle = looking
        # When the second is deleted
        backend.delete_message("events", handles["second"])
        other.join()
        assert other.errors == []
        # Then these are the queue's messages
        return [m.body for m in queue._messages]

    theirs, ours = on_moto_and_ours(scenario)
    # moto: the message sent meanwhile is lost, and the first, deleted, is back; ours: the message sent meanwhile
    assert (theirs, ours) == (["first"], ["sent meanwhile"])


class RecordedWaits(threading.Condition):
    """A queue's lock, the time each wait on it was given recorded."""

    def __init__(self) -> None:
        super().__init__()
        self.waits: list[float] = []

    def wait(self, timeout: float | None = None) -> bool:
        self.waits.append(float("inf") if timeout is None else timeout)
        return super().wait(timeout)


def test_sqs_long_poll_sleeps_until_due() -> None:
    def scenario() -> tuple[Any, list[float]]:
        # Given an empty queue, the waits of a receive on it recorded
        _, queue, sqs = sqs_queue("push")
        url = sqs.get_queue_url(QueueName="push")["QueueUrl"]
        queue._messages_lock = recorded = RecordedWaits()
        # When a poll of 2 s waits
        reply = sqs.receive_message(QueueUrl=url, WaitTimeSeconds=2)
        return reply.get("Messages"), recorded.waits

    theirs, ours = on_moto_and_ours(scenario)
    # Then neither got a message; moto woke once a second to look again, ours slept until the poll's end
    assert theirs[0] is None and ours[0] is None
    assert len(theirs[1]) >= 2 and max(theirs[1]) <= 1
    assert len(ours[1]) == 1 and ours[1][0] > 1.5


# --- SNS ---------------------------------------------------------------------------------------------------------


def queue_arn(sqs: Any, name: str) -> tuple[str, str]:
    url = sqs.create_queue(QueueName=name)["QueueUrl"]
    return url, sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]


def test_sns_publish_delivers_as_sns() -> None:
    def scenario() -> dict[str, Any]:
        sns, sqs = boto3.client("sns", region_name=REGION), boto3.client("sqs", region_name=REGION)
        seen: dict[str, Any] = {}
        # Given a topic with three queues subscribed, the first of them deleted since (its subscription kept)
        topic = sns.create_topic(Name="state")["TopicArn"]
        urls = []
        for i in range(3):
            url, arn = queue_arn(sqs, f"q{i:03d}")
            sns.subscribe(TopicArn=topic, Protocol="sqs", Endpoint=arn)
            urls.append(url)
        sqs.delete_queue(QueueUrl=urls[0])
        # When a message is published
        try:
            sns.publish(TopicArn=topic, Message="round 2")
            seen["publish"] = "ok"
        except ClientError as exc:
            seen["publish"] = exc.response["Error"]["Code"]
        seen["delivered"] = sum(bool(sqs.receive_message(QueueUrl=url).get("Messages")) for url in urls[1:])
        sqs.create_queue(QueueName="q000")  # (back, empty: the others got their message)
        # And given a queue subscribed for raw delivery, to which a message with a binary attribute is published
        url, arn = queue_arn(sqs, "raw")
        raw = sns.create_topic(Name="raw")["TopicArn"]
        sns.subscribe(TopicArn=raw, Protocol="sqs", Endpoint=arn, Attributes={"RawMessageDelivery": "true"})
        sns.publish(TopicArn=raw, Message="m",
                    MessageAttributes={"roster": {"DataType": "Binary", "BinaryValue": b"\x00\x01"}})
        try:
            got = sqs.receive_message(QueueUrl=url, MessageAttributeNames=["All"])["Messages"]
            seen["raw"] = got[0]["MessageAttributes"]["roster"]
        except TypeError as exc:  # (moto's server answers it with a 500)
            seen["raw"] = f"internal error: {exc}"
        return seen

    theirs, ours = on_moto_and_ours(scenario)
    # Then moto fails the publish at the deleted queue and delivers to none after it, and it cannot receive the raw
    # message it took; ours delivers to each of the other two, as SNS does, and the binary attribute as bytes
    assert theirs == {"publish": "AWS.SimpleQueueService.NonExistentQueue", "delivered": 0,
                      "raw": "internal error: Strings must be encoded before hashing"}
    assert ours == {"publish": "ok", "delivered": 2, "raw": {"DataType": "Binary", "BinaryValue": b"\x00\x01"}}


def test_sns_publish_delivers_as_sns_to_more_than_100_subscriptions() -> None:
    # (the same patch: moto reads a topic's subscriptions as one page of its own listing, 100)
    def scenario() -> int:
        # Given a topic with 101 queues subscribed (for raw delivery, as the run's: moto signs each message it
        # wraps with a key of its own)
        from moto.sns.models import sns_backends
        from moto.sqs.models import sqs_backends

        topics = sns_backends[ACCOUNT][REGION]
        topic = topics.create_topic("state")
        queues = [sqs_backends[ACCOUNT][REGION].create_queue(f"q{i:03d}") for i in range(101)]
        for queue in queues:
            subscription = topics.subscribe(topic.arn, queue.queue_arn, "sqs")
            topics.set_subscription_attributes(subscription.arn, "RawMessageDelivery", "true")
        # When a message is published
        boto3.client("sns", region_name=REGION).publish(TopicArn=topic.arn, Message="round 2")
        # Then these many queues have it
        return sum(len(queue._messages) for queue in queues)

    assert on_moto_and_ours(scenario) == (100, 101)


class Listed:
    """A subscription's topic whose comparison, as a topic's subscriptions are listed, lets another request run."""

    def __init__(self, topic: Any, interleaving: Interleaving) -> None:
        self.arn, self.topic, self.interleaving = topic.arn, topic, interleaving

    def __eq__(self, other: object) -> bool:
        self.interleaving.at_this_point()
        return self.topic is other

    __hash__ = None


def test_sns_subscriptions_under_one_lock(monkeypatch: pytest.MonkeyPatch) -> None:
    def scenario() -> tuple[str, int]:
        # Given a topic with a subscription, and another topic
        from moto.sns.models import sns_backends

        backend = sns_backends[ACCOUNT][REGION]
        state, other_topic = backend.create_topic("state"), backend.create_topic("other")
        queue = f"arn:aws:sqs:{REGION}:{ACCOUNT}:q"
        # and a subscribe to it that comes while its subscriptions are listed (the local server serves each request
        # in a thread of its own), when the listing has looked at the other topic's subscription
        other = Interleaving(lambda: backend.subscribe(state.arn, f"{queue}1", "sqs"))
        monkeypatch.setattr(local_sns, "_SUBSCRIPTIONS", other.lock(threading.RLock()))
        backend.subscribe(other_topic.arn, f"{queue}2", "sqs").topic = Listed(other_topic, other)
        backend.subscribe(state.arn, f"{queue}0", "sqs")
        # When the topic's subscriptions are listed
        try:
            listed = f"{len(backend.list_subscriptions_by_topic(state.arn)[0])} listed"
        except RuntimeError as exc:
            listed = str(exc)
        other.join()
        assert other.errors == []
        return listed, len(backend._get_topic_subscriptions(state))

    theirs, ours = on_moto_and_ours(scenario)
    # Then moto's listing fails (a 500 behind its server); ours lists it, the subscribe waiting for the listing
    assert theirs == ("OrderedDict mutated during iteration", 2)
    assert ours == ("1 listed", 2)


# --- S3's events to EventBridge ------------------------------------------------------------------------------------


def s3_events_to_a_queue() -> tuple[Any, Any, str]:
    """(S3, SQS, the queue's URL): a bucket whose events go to EventBridge, a rule sending objects' creation to the
    queue."""
    s3, sqs, events = (boto3.client(name, region_name=REGION) for name in ("s3", "sqs", "events"))
    s3.create_bucket(Bucket="objects")
    s3.put_bucket_notification_configuration(Bucket="objects",
                                             NotificationConfiguration={"EventBridgeConfiguration": {}})
    url, arn = queue_arn(sqs, "ingest")
    events.put_rule(Name="created", State="ENABLED",
                    EventPattern=json.dumps({"source": ["aws.s3"], "detail-type": ["Object Created"]}))
    events.put_targets(Rule="created", Targets=[{"Id": "ingest", "Arn": arn}])
    return s3, sqs, url


def created(sqs: Any, url: str) -> list[str]:
    messages = sqs.receive_message(QueueUrl=url, MaxNumberOfMessages=10).get("Messages", [])
    return [json.loads(m["Body"])["detail"]["object"]["key"] for m in messages]


def test_events_s3_delivery_tried_again() -> None:
    from moto.events.models import Rule

    def scenario() -> list[str]:
        # Given objects' events going to a queue, and the next delivery failing (as a race in moto's server would)
        s3, sqs, url = s3_events_to_a_queue()
        send = Rule.send_to_targets
        failures = []

        def flaky(self: Any, event: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
            if not failures:
                failures.append(event["detail"]["object"]["key"])
                raise RuntimeError("dictionary changed size during iteration")
            return send(self, event, *args, **kwargs)

        setattr(Rule, "send_to_targets", flaky)  # noqa: B010
        try:
            # When an object is put
            s3.put_object(Bucket="objects", Key="heartbeat", Body=b"{}")
        finally:
            setattr(Rule, "send_to_targets", send)  # noqa: B010
        assert failures == ["heartbeat"]
        return created(sqs, url)

    theirs, ours = on_moto_and_ours(scenario)
    # Then moto dropped its event without a word; ours delivered it again
    assert (theirs, ours) == ([], ["heartbeat"])


def test_events_multipart_upload_announced_once() -> None:
    def scenario() -> list[str]:
        # Given objects' events going to a queue
        s3, sqs, url = s3_events_to_a_queue()
        # When a multipart upload completes
        upload = s3.create_multipart_upload(Bucket="objects", Key="update")["UploadId"]
        etag = s3.upload_part(Bucket="objects", Key="update", UploadId=upload, PartNumber=1, Body=b"x")["ETag"]
        s3.complete_multipart_upload(Bucket="objects", Key="update", UploadId=upload,
                                     MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": etag}]})
        return created(sqs, url)

    theirs, ours = on_moto_and_ours(scenario)
    # Then moto announced it twice (its PUT's event, then the completion's); ours once, as S3 does
    assert (theirs, ours) == (["update", "update"], ["update"])


# --- moto's server -------------------------------------------------------------------------------------------------


def test_routing_modules_listed_once() -> None:
    def scenario() -> tuple[list[frozenset[str]], int]:
        # Given moto's listings of its package directory counted
        from moto import backends

        with counted(os, "listdir") as listings:
            # When the server routes three requests (each asks which of moto's modules a host names)
            answers = [frozenset(backends.list_of_moto_modules()) for _ in range(3)]
        return answers, len(listings)

    theirs, ours = on_moto_and_ours(scenario, "routing_modules_listed_once")
    # Then the answers are moto's; moto listed the directory for each, ours listed it once, when applied
    assert theirs[0] == ours[0] and "dynamodb" in theirs[0][0] and len(set(theirs[0])) == 1
    assert (theirs[1], ours[1]) == (3, 0)


# --- moto's request handling -----------------------------------------------------------------------------------


def test_core_method_names_listed_once() -> None:
    def scenario() -> tuple[list[Any], int]:
        # Given moto's listings of a handler class's functions counted
        with counted(inspect, "getmembers") as listings:
            # When three DynamoDB requests and an SQS one are dispatched
            ddb = table()
            answers: list[Any] = [ddb.describe_table(TableName="t")["Table"]["TableName"] for _ in range(2)]
            answers.append(boto3.client("sqs", region_name=REGION).list_queues().get("QueueUrls", []))
        return answers, len(listings)

    theirs, ours = on_moto_and_ours(scenario)
    # Then the answers are moto's; moto listed the handler's functions for every request, ours once a class
    assert theirs[0] == ours[0] == ["t", "t", []]
    assert theirs[1] >= 4 and ours[1] <= 2


def test_core_request_ids_from_urandom() -> None:
    import random as stdlib_random

    def scenario() -> tuple[list[str], int]:
        # Given moto's draws from Python's random counted
        with counted(stdlib_random.Random, "choice") as draws:
            # When three requests are answered
            sqs = boto3.client("sqs", region_name=REGION)
            ids = [sqs.list_queues()["ResponseMetadata"]["RequestId"] for _ in range(3)]
        return ids, len(draws)

    theirs, ours = on_moto_and_ours(scenario)
    # Then each answer carries a request id of 52 characters of moto's alphabet, a different one each time; moto
    # drew each character one by one, ours none
    for ids in (theirs[0], ours[0]):
        assert len(set(ids)) == 3 and all(len(i) == 52 and i.isascii() and i.isalnum() for i in ids)
    assert theirs[1] >= 3 * 52 and ours[1] == 0


def test_kinds_are_bug_or_speed() -> None:
    assert {p.kind for p in PATCHES} == {BUG, SPEED}
