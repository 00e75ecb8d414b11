"""local.moto.s3: a completed multipart upload and a copy are written block by block, and are moto's own
objects, ETags and checksums byte for byte; ranged and whole reads return the object's bytes."""

from __future__ import annotations

import base64
import hashlib
import os
from typing import Any

import boto3
import pytest
from botocore.config import Config
from botocore.exceptions import ClientError
from moto.s3.models import FakeMultipart

from local.moto import s3 as moto_s3
from local.moto.patches import original

MiB = 1024 * 1024
BUCKET = "objects"


def s3_with_bucket() -> Any:
    s3 = boto3.client("s3", region_name="us-east-1")
    s3.create_bucket(Bucket=BUCKET)
    return s3


def upload(s3: Any, key: str, parts: list[bytes], **checksum: str) -> dict[str, Any]:
    started = s3.create_multipart_upload(Bucket=BUCKET, Key=key, **checksum)
    algorithm = checksum.get("ChecksumAlgorithm")
    done = []
    for number, data in enumerate(parts, start=1):
        extra = {"ChecksumAlgorithm": algorithm} if algorithm else {}
        reply = s3.upload_part(Bucket=BUCKET, Key=key, UploadId=started["UploadId"], PartNumber=number, Body=data,
                               **extra)
        done.append({"PartNumber": number, "ETag": reply["ETag"]} | {
            k: v for k, v in reply.items() if k.startswith("Checksum") and k != "ChecksumType"})
    return dict(s3.complete_multipart_upload(Bucket=BUCKET, Key=key, UploadId=started["UploadId"],
                                             MultipartUpload={"Parts": done}))


@pytest.mark.parametrize("checksum", [
    {}, {"ChecksumAlgorithm": "CRC32"}, {"ChecksumAlgorithm": "SHA256"}, {"ChecksumAlgorithm": "SHA1"},
    {"ChecksumAlgorithm": "CRC32", "ChecksumType": "FULL_OBJECT"},
], ids=["default", "crc32", "sha256", "sha1", "crc32-full-object"])
def test_a_completed_upload_is_motos_own_object_etag_and_checksum(aws: None, monkeypatch: pytest.MonkeyPatch,
                                                                  checksum: dict[str, str]) -> None:
    # Given moto's own completion run beside ours on the same parts
    seen: list[tuple[Any, Any]] = []
    ours = FakeMultipart.complete

    def both(self: Any, body: Any) -> Any:
        body = list(body)
        seen.append((original("moto.s3.models:FakeMultipart.complete")(self, iter(body)), ours(self, iter(body))))
        return seen[-1][1]

    monkeypatch.setattr(FakeMultipart, "complete", both)
    s3 = s3_with_bucket()
    parts = [os.urandom(5 * MiB), os.urandom(5 * MiB + 3), os.urandom(MiB // 2)]
    # When a multipart upload of three parts completes
    upload(s3, "model", parts, **checksum)
    # Then ours gives moto's ETag and checksum, and the stored object is the parts' bytes, as moto's would be
    (value, etag, details), (blocks, our_etag, our_details) = seen[0]
    assert isinstance(blocks, moto_s3._Joined) and len(blocks) == len(value)
    assert our_etag == etag and our_details == details
    assert etag == hashlib.md5(b"".join(hashlib.md5(p).digest() for p in parts)).hexdigest() + "-3"
    assert s3.get_object(Bucket=BUCKET, Key="model")["Body"].read() == value == b"".join(parts)


def test_a_copy_is_the_source_byte_for_byte_with_the_md5_etag(aws: None) -> None:
    # Given a 20 MiB object (larger than a block) and a small one
    s3 = s3_with_bucket()
    big, small = os.urandom(20 * MiB + 5), b"tiny"
    s3.put_object(Bucket=BUCKET, Key="big", Body=big)
    s3.put_object(Bucket=BUCKET, Key="small", Body=small)
    for source, data in (("big", big), ("small", small)):
        # When each is copied
        reply = s3.copy_object(Bucket=BUCKET, Key=f"{source}-copy", CopySource={"Bucket": BUCKET, "Key": source})
        # Then the copy holds the same bytes, and its ETag is their MD5, as S3's is for a copy
        assert s3.get_object(Bucket=BUCKET, Key=f"{source}-copy")["Body"].read() == data
        assert reply["CopyObjectResult"]["ETag"].strip('"') == hashlib.md5(data).hexdigest()
    # And the source is unchanged and still readable in ranges
    assert s3.get_object(Bucket=BUCKET, Key="big", Range="bytes=10-19")["Body"].read() == big[10:20]


def test_a_completed_upload_copied_keeps_its_checksum(aws: None) -> None:
    # Given a completed upload with a SHA-256 checksum (composite: of the parts' checksums)
    s3 = s3_with_bucket()
    parts = [os.urandom(5 * MiB), os.urandom(100)]
    upload(s3, "staged", parts, ChecksumAlgorithm="SHA256")
    of_parts = hashlib.sha256(b"".join(hashlib.sha256(p).digest() for p in parts)).digest()
    stored = s3.head_object(Bucket=BUCKET, Key="staged", ChecksumMode="ENABLED")
    assert stored["ChecksumSHA256"].split("-")[0] == base64.b64encode(of_parts).decode()
    # When it is copied to its final name
    s3.copy_object(Bucket=BUCKET, Key="final", CopySource={"Bucket": BUCKET, "Key": "staged"})
    # Then the copy is the whole object, with the source's checksum (of its parts: not one of the bytes a GET
    # returns, so read without checking it, as the project's readers do)
    reader = boto3.client("s3", region_name="us-east-1", config=Config(response_checksum_validation="when_required"))
    assert reader.get_object(Bucket=BUCKET, Key="final")["Body"].read() == b"".join(parts)
    copied = s3.head_object(Bucket=BUCKET, Key="final", ChecksumMode="ENABLED")
    assert copied["ChecksumSHA256"] == stored["ChecksumSHA256"]


def stored(key: str) -> Any:
    from moto.s3.models import s3_backends

    return s3_backends["123456789012"]["aws"].get_object(BUCKET, key)


def test_a_completed_upload_is_its_parts_files_and_its_composite_checksum_reads_no_part(
        aws: None, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given an upload with a composite SHA-256 checksum, whose parts' bytes completion must not read again
    s3 = s3_with_bucket()
    parts = [os.urandom(5 * MiB), os.urandom(6 * MiB), os.urandom(100)]

    def no_read(*_: Any) -> Any:
        raise AssertionError("completion read a part's bytes")

    monkeypatch.setattr(moto_s3, "_read", no_read)
    # When it completes
    upload(s3, "staged", parts, ChecksumAlgorithm="SHA256")
    # Then its checksum is of the parts' checksums, taken as they arrived, and its bytes are the parts' files
    of_parts = hashlib.sha256(b"".join(hashlib.sha256(p).digest() for p in parts)).digest()
    head = s3.head_object(Bucket=BUCKET, Key="staged", ChecksumMode="ENABLED")
    assert head["ChecksumSHA256"].split("-")[0] == base64.b64encode(of_parts).decode()
    span = stored("staged")._value_buffer
    assert isinstance(span, moto_s3._Span)
    assert [length for _, _, length in span.segments] == [len(p) for p in parts]
    whole = b"".join(parts)
    reader = boto3.client("s3", region_name="us-east-1", config=Config(response_checksum_validation="when_required"))
    assert reader.get_object(Bucket=BUCKET, Key="staged")["Body"].read() == whole
    across = f"bytes={5 * MiB - 10}-{11 * MiB + 20}"  # (a range across three parts)
    assert reader.get_object(Bucket=BUCKET, Key="staged", Range=across)["Body"].read() == \
        whole[5 * MiB - 10:11 * MiB + 21]


def test_a_copy_shares_the_sources_files_which_close_when_neither_is_left(aws: None) -> None:
    # Given a 20 MiB object (held in a file) and a completed upload (its parts' files)
    s3 = s3_with_bucket()
    big = os.urandom(20 * MiB + 5)
    s3.put_object(Bucket=BUCKET, Key="big", Body=big)
    parts = [os.urandom(5 * MiB), os.urandom(7)]
    upload(s3, "staged", parts, ChecksumAlgorithm="SHA256")
    for source, data in (("big", big), ("staged", b"".join(parts))):
        # When each is copied
        s3.copy_object(Bucket=BUCKET, Key=f"{source}-copy", CopySource={"Bucket": BUCKET, "Key": source})
        # Then the copy is made of the source's files, no byte written again
        files = [shared for shared, _, _ in stored(source)._value_buffer.segments]
        assert [shared for shared, _, _ in stored(f"{source}-copy")._value_buffer.segments] == files
        assert all(shared.users == 2 for shared in files)
        # And once the source is deleted, the copy still reads its bytes, whole and in ranges
        s3.delete_object(Bucket=BUCKET, Key=source)
        reader = boto3.client("s3", region_name="us-east-1",
                              config=Config(response_checksum_validation="when_required"))
        assert reader.get_object(Bucket=BUCKET, Key=f"{source}-copy")["Body"].read() == data
        assert reader.get_object(Bucket=BUCKET, Key=f"{source}-copy", Range="bytes=3-9")["Body"].read() == data[3:10]
        assert not any(shared.file.closed for shared in files)
        # And once the copy is deleted too, the files are closed
        s3.delete_object(Bucket=BUCKET, Key=f"{source}-copy")
        assert all(shared.file.closed and shared.users == 0 for shared in files)


@pytest.mark.parametrize("ended", ["completed", "aborted"])
def test_a_part_for_an_upload_that_ended_is_refused_with_no_such_upload(aws: None, ended: str) -> None:
    # Given a multipart upload that was completed, or aborted
    s3 = s3_with_bucket()
    upload_id = s3.create_multipart_upload(Bucket=BUCKET, Key="staged")["UploadId"]
    etag = s3.upload_part(Bucket=BUCKET, Key="staged", UploadId=upload_id, PartNumber=1, Body=b"x")["ETag"]
    if ended == "completed":
        s3.complete_multipart_upload(Bucket=BUCKET, Key="staged", UploadId=upload_id,
                                     MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": etag}]})
    else:
        s3.abort_multipart_upload(Bucket=BUCKET, Key="staged", UploadId=upload_id)
    # When a late writer sends it a part, Then S3's refusal comes back (not a server error)
    with pytest.raises(ClientError) as refused:
        s3.upload_part(Bucket=BUCKET, Key="staged", UploadId=upload_id, PartNumber=2, Body=b"y")
    assert refused.value.response["Error"]["Code"] == "NoSuchUpload"
