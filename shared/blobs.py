"""The run's bucket: the small S3 surface the coordinator and participants use."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import boto3
from botocore.config import Config
from botocore.exceptions import ClientError


class NotFound(Exception):
    pass


@dataclass(frozen=True)
class Blob:
    data: bytes
    etag: str
    metadata: dict[str, str]
    version_id: str = ""


def s3_client(endpoint: str | None = None, region: str = "us-east-1") -> Any:
    config = Config(retries={"max_attempts": 8, "mode": "standard"}, s3={"addressing_style": "path"})
    return boto3.client("s3", endpoint_url=endpoint, region_name=region, config=config)


class Bucket:
    def __init__(self, name: str, client: Any) -> None:
        self.name = name
        self.client = client

    def get(self, key: str, max_bytes: int | None = None, version_id: str = "") -> Blob:
        """Read an object (a given version if named); with max_bytes, refuse (ValueError) a larger one."""
        extra = {"VersionId": version_id} if version_id else {}
        try:
            resp = self.client.get_object(Bucket=self.name, Key=key, **extra)
        except ClientError as exc:
            if exc.response["Error"]["Code"] in {"NoSuchKey", "404"}:
                raise NotFound(key) from None
            raise
        body = resp["Body"]
        if max_bytes is not None and resp["ContentLength"] > max_bytes:
            body.close()
            raise ValueError(f"object is {resp['ContentLength']} bytes, over the {max_bytes}-byte limit")
        return Blob(
            body.read(), resp["ETag"].strip('"'), dict(resp.get("Metadata", {})), resp.get("VersionId") or ""
        )

    def head(self, key: str) -> dict[str, Any] | None:
        try:
            return dict(self.client.head_object(Bucket=self.name, Key=key))
        except ClientError as exc:
            if exc.response["Error"]["Code"] in {"NoSuchKey", "404", "NotFound"}:
                return None
            raise

    def put(self, key: str, data: bytes, metadata: dict[str, str] | None = None) -> str:
        resp = self.client.put_object(Bucket=self.name, Key=key, Body=data, Metadata=metadata or {})
        return str(resp["ETag"]).strip('"')

    def copy(self, source: str, dest: str) -> None:
        self.client.copy_object(Bucket=self.name, Key=dest, CopySource={"Bucket": self.name, "Key": source})

    def keys(self, prefix: str) -> list[str]:
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.name, Prefix=prefix)
        return [o["Key"] for page in pages for o in page.get("Contents", [])]
