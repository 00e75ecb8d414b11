"""Every S3 client of the product names the bucket in the host on AWS (AWS deprecated path-style requests) and in the
path at a custom endpoint (the local stack's moto server on 127.0.0.1 has no host name per bucket)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import pytest

from participant.remote import participant_s3_client
from store.blobs import s3_client

CLIENTS: dict[str, Callable[[str | None, str], Any]] = {
    "coordinator": s3_client, "participant": participant_s3_client,
}


def request_url(client: Any) -> tuple[str, str]:
    """Host and path of a GetObject of runs/r/m.json in bucket fed-run-bucket (a presigned URL: no request
    is made, and the URL is the one the client would send)."""
    url = client.generate_presigned_url("get_object", Params={"Bucket": "fed-run-bucket", "Key": "runs/r/m.json"})
    parts = urlsplit(url)
    return parts.netloc, parts.path


@pytest.fixture(autouse=True)
def credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")


@pytest.mark.parametrize("who", sorted(CLIENTS))
@pytest.mark.parametrize("region", ["us-east-1", "eu-central-1"])
def test_on_aws_the_bucket_is_named_in_the_host(who: str, region: str) -> None:
    # Given the client a function or a participant uses on AWS (no endpoint)
    host, path = request_url(CLIENTS[who](None, region))
    # Then its requests are virtual-hosted: the bucket is the host's first label, the path is the key alone
    assert host.startswith("fed-run-bucket.s3.") and host.endswith(".amazonaws.com"), host
    assert path == "/runs/r/m.json"


@pytest.mark.parametrize("who", sorted(CLIENTS))
def test_at_a_custom_endpoint_the_bucket_is_named_in_the_path(who: str) -> None:
    # Given the client at the local stack's endpoint
    host, path = request_url(CLIENTS[who]("http://127.0.0.1:4566", "us-east-1"))
    # Then its requests go to that host, the bucket first in the path
    assert host == "127.0.0.1:4566"
    assert path == "/fed-run-bucket/runs/r/m.json"
