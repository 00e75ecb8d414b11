"""What IAM checks for one HTTP request to an AWS API: its actions, the resource ARNs they act on, and the request's
condition keys (`s3:prefix`, `dynamodb:LeadingKeys`, `sns:Endpoint`, ...).

This is the service authorization reference written down for the calls this project's code makes (and their
neighbours), read off the wire as the service would read it: S3's REST shapes, DynamoDB's and EventBridge's JSON
targets, SQS's JSON or query protocol, SNS's and CloudFormation's query protocol, Lambda's REST paths. It decides
nothing: `local.access.evaluator` judges each question against the policies.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import parse_qs, unquote, urlsplit

from shared.naming import TABLE_HASH_KEY

_CREDENTIAL = re.compile(r"Credential=([^/,\s]+)/\d{8}/([^/,\s]+)/([^/,\s]+)/aws4_request")
_S3_HOST = re.compile(r"^(?:(?P<bucket>.+)\.)?s3(?:[.-](?P<region>[a-z0-9-]+))?\.amazonaws\.com(?::\d+)?$")


@dataclass(frozen=True)
class HttpCall:
    """One request as it arrives: method, URL parts, headers (lower-case names) and, where the service reads its
    parameters from it, the body."""

    method: str
    host: str
    path: str  # percent-encoded, as sent
    query: str
    headers: Mapping[str, str]
    body: bytes = b""

    @classmethod
    def from_url(cls, method: str, url: str, headers: Mapping[str, str | bytes], body: bytes = b"") -> HttpCall:
        parts = urlsplit(url)
        text = {k.lower(): v.decode("latin-1") if isinstance(v, bytes) else str(v) for k, v in headers.items()}
        return cls(method.upper(), parts.netloc, parts.path or "/", parts.query, text, body)

    def params(self) -> dict[str, str]:
        """Query-string parameters, and form-encoded body parameters (the query protocol's)."""
        found = {k: v[0] for k, v in parse_qs(self.query, keep_blank_values=True).items()}
        content_type = self.headers.get("content-type", "")
        if content_type.startswith("application/x-www-form-urlencoded") or (
                not content_type and self.body[:1] not in (b"", b"{", b"<")):
            found.update({k: v[0] for k, v in parse_qs(self.body.decode("utf-8", "replace"),
                                                        keep_blank_values=True).items()})
        return found

    def json(self) -> dict[str, object]:
        try:
            value = json.loads(self.body or b"{}")
        except ValueError:
            return {}
        return value if isinstance(value, dict) else {}


@dataclass(frozen=True)
class Need:
    """One authorization IAM makes for the request: `action` on `resource` with these condition keys."""

    action: str
    resource: str
    context: Mapping[str, str | list[str]] = field(default_factory=dict)


@dataclass(frozen=True)
class Request:
    """What a request asks of IAM. `key_read` names the (bucket, key) of an S3 read whose answer, for a missing
    key, depends on `s3:ListBucket` (404 with it, 403 without)."""

    service: str
    operation: str
    access_key: str
    region: str
    needs: tuple[Need, ...]
    key_read: tuple[str, str] | None = None


class Unmapped(ValueError):
    """A request whose authorization this module does not know: judged as denied, with this reason."""


def credential(headers: Mapping[str, str], query: str) -> tuple[str, str, str]:
    """(access key id, region, service) from the SigV4 credential scope (header or presigned query)."""
    text = headers.get("authorization", "") or unquote(query)
    match = _CREDENTIAL.search(text)
    if not match:
        return "", "", ""
    return match.group(1), match.group(2), match.group(3)


def parse(call: HttpCall, account: str) -> Request:
    """The request's authorizations; raises `Unmapped` for one it cannot read."""
    access_key, region, service = credential(call.headers, call.query)
    region = region or "us-east-1"
    target = call.headers.get("x-amz-target", "")
    if service == "s3" or (not service and _S3_HOST.match(call.host)):
        operation, needs, key_read = _s3(call)
        return Request("s3", operation, access_key, region, needs, key_read)
    if target.startswith("DynamoDB_"):
        operation = target.rsplit(".", 1)[-1]
        return Request("dynamodb", operation, access_key, region, _dynamodb(operation, call.json(), region, account))
    if service == "sqs" or target.startswith("AmazonSQS."):
        operation, args = (target.rsplit(".", 1)[-1], call.json()) if target else _query_args(call)
        return Request("sqs", operation, access_key, region, _sqs(operation, args, region, account))
    if target.startswith("AWSEvents."):
        operation = target.rsplit(".", 1)[-1]
        return Request("events", operation, access_key, region, _events(operation, call.json(), region, account))
    if service == "sns":
        operation, args = _query_args(call)
        return Request("sns", operation, access_key, region, _sns(operation, args, region, account))
    if service == "cloudformation":
        operation, args = _query_args(call)
        stack = str(args.get("StackName", "*"))
        arn = stack if stack.startswith("arn:") else f"arn:aws:cloudformation:{region}:{account}:stack/{stack}/*"
        return Request("cloudformation", operation, access_key, region, (Need(f"cloudformation:{operation}", arn),))
    if service == "lambda":
        operation, needs = _lambda(call, region, account)
        return Request("lambda", operation, access_key, region, needs)
    if service in ("sts", "iam"):
        operation, _ = _query_args(call)
        return Request(service, operation, access_key, region, ())
    raise Unmapped(f"no IAM mapping for {call.method} {call.host}{call.path} (service {service or '?'})")


def _query_args(call: HttpCall) -> tuple[str, dict[str, object]]:
    params: dict[str, object] = dict(call.params())
    return str(params.pop("Action", "")), params


# --- S3 --------------------------------------------------------------------------------------------------------

_BUCKET_READS = {  # GET /bucket?<subresource>: operation, action
    "versions": ("ListObjectVersions", "s3:ListBucketVersions"),
    "uploads": ("ListMultipartUploads", "s3:ListBucketMultipartUploads"),
    "location": ("GetBucketLocation", "s3:GetBucketLocation"),
    "versioning": ("GetBucketVersioning", "s3:GetBucketVersioning"),
    "notification": ("GetBucketNotificationConfiguration", "s3:GetBucketNotification"),
    "policy": ("GetBucketPolicy", "s3:GetBucketPolicy"),
    "acl": ("GetBucketAcl", "s3:GetBucketAcl"),
    "tagging": ("GetBucketTagging", "s3:GetBucketTagging"),
    "lifecycle": ("GetBucketLifecycleConfiguration", "s3:GetLifecycleConfiguration"),
    "encryption": ("GetBucketEncryption", "s3:GetEncryptionConfiguration"),
}
_BUCKET_WRITES = {  # PUT /bucket?<subresource>
    "versioning": ("PutBucketVersioning", "s3:PutBucketVersioning"),
    "notification": ("PutBucketNotificationConfiguration", "s3:PutBucketNotification"),
    "policy": ("PutBucketPolicy", "s3:PutBucketPolicy"),
    "tagging": ("PutBucketTagging", "s3:PutBucketTagging"),
    "lifecycle": ("PutBucketLifecycleConfiguration", "s3:PutLifecycleConfiguration"),
    "encryption": ("PutBucketEncryption", "s3:PutEncryptionConfiguration"),
}
_LIST_CONTEXT = {"prefix": "s3:prefix", "delimiter": "s3:delimiter", "max-keys": "s3:max-keys"}


def _bucket_and_key(call: HttpCall) -> tuple[str, str]:
    match = _S3_HOST.match(call.host)
    path = call.path.lstrip("/")
    if match and match.group("bucket"):  # virtual-hosted style
        return match.group("bucket"), unquote(path)
    bucket, _, key = path.partition("/")
    return unquote(bucket), unquote(key)


def _s3(call: HttpCall) -> tuple[str, tuple[Need, ...], tuple[str, str] | None]:
    bucket, key = _bucket_and_key(call)
    q = {k: v[0] for k, v in parse_qs(call.query, keep_blank_values=True).items()}
    bucket_arn = f"arn:aws:s3:::{bucket}"
    method = call.method
    if not key:
        if method in ("GET", "HEAD") and not bucket:
            return "ListBuckets", (Need("s3:ListAllMyBuckets", "*"),), None
        if method == "GET":
            for sub, (operation, action) in _BUCKET_READS.items():
                if sub in q:
                    context = {k: q[p] for p, k in _LIST_CONTEXT.items() if p in q} if sub == "versions" else {}
                    return operation, (Need(action, bucket_arn, context),), None
            context = {k: q[p] for p, k in _LIST_CONTEXT.items() if p in q}
            operation = "ListObjectsV2" if q.get("list-type") == "2" else "ListObjects"
            return operation, (Need("s3:ListBucket", bucket_arn, context),), None
        if method == "HEAD":
            return "HeadBucket", (Need("s3:ListBucket", bucket_arn),), None
        if method == "PUT":
            for sub, (operation, action) in _BUCKET_WRITES.items():
                if sub in q:
                    return operation, (Need(action, bucket_arn),), None
            return "CreateBucket", (Need("s3:CreateBucket", bucket_arn),), None
        if method == "DELETE":
            return "DeleteBucket", (Need("s3:DeleteBucket", bucket_arn),), None
        if method == "POST" and "delete" in q:
            keys = re.findall(rb"<Key>(.*?)</Key>", call.body)
            return "DeleteObjects", tuple(Need("s3:DeleteObject", f"{bucket_arn}/{k.decode()}") for k in keys), None
        raise Unmapped(f"no IAM mapping for S3 {method} on bucket {bucket}")
    object_arn = f"{bucket_arn}/{key}"
    version = q.get("versionId", "")
    if method in ("GET", "HEAD"):
        if "uploadId" in q:
            return "ListParts", (Need("s3:ListMultipartUploadParts", object_arn),), None
        if "tagging" in q:
            action = "s3:GetObjectVersionTagging" if version else "s3:GetObjectTagging"
            return "GetObjectTagging", (Need(action, object_arn),), None
        if "attributes" in q:
            action = "s3:GetObjectVersionAttributes" if version else "s3:GetObjectAttributes"
            return "GetObjectAttributes", (Need(action, object_arn),), None
        operation = "GetObject" if method == "GET" else "HeadObject"
        action = "s3:GetObjectVersion" if version else "s3:GetObject"
        return operation, (Need(action, object_arn),), (bucket, key)
    if method == "PUT":
        source = call.headers.get("x-amz-copy-source", "")
        if source:
            operation = "UploadPartCopy" if "uploadId" in q else "CopyObject"
            return operation, (Need("s3:PutObject", object_arn), _copy_source(source)), None
        if "uploadId" in q:
            return "UploadPart", (Need("s3:PutObject", object_arn),), None
        if "tagging" in q:
            return "PutObjectTagging", (Need("s3:PutObjectTagging", object_arn),), None
        return "PutObject", (Need("s3:PutObject", object_arn),), None
    if method == "POST":
        if "uploads" in q:
            return "CreateMultipartUpload", (Need("s3:PutObject", object_arn),), None
        if "uploadId" in q:
            return "CompleteMultipartUpload", (Need("s3:PutObject", object_arn),), None
        raise Unmapped(f"no IAM mapping for S3 POST on {key}")
    if method == "DELETE":
        if "uploadId" in q:
            return "AbortMultipartUpload", (Need("s3:AbortMultipartUpload", object_arn),), None
        action = "s3:DeleteObjectVersion" if version else "s3:DeleteObject"
        return "DeleteObject", (Need(action, object_arn),), None
    raise Unmapped(f"no IAM mapping for S3 {method} on {key}")


def _copy_source(header: str) -> Need:
    """CopyObject and UploadPartCopy read their source as a GET would (of its version, if one is named)."""
    source, _, query = unquote(header).lstrip("/").partition("?")
    version = parse_qs(query).get("versionId", [""])[0]
    return Need("s3:GetObjectVersion" if version else "s3:GetObject", f"arn:aws:s3:::{source}")


# --- DynamoDB --------------------------------------------------------------------------------------------------

_TRANSACT_WRITE = {"Put": "PutItem", "Update": "UpdateItem", "Delete": "DeleteItem",
                   "ConditionCheck": "ConditionCheckItem"}


def _table_arn(name: object, region: str, account: str) -> str:
    return f"arn:aws:dynamodb:{region}:{account}:table/{name}"


def _attribute_text(value: object) -> str | None:
    if isinstance(value, dict):
        for kind in ("S", "N", "B"):
            if kind in value:
                return str(value[kind])
    return None


def _leading_key_of_item(item: object) -> list[str]:
    if isinstance(item, dict):
        text = _attribute_text(item.get(TABLE_HASH_KEY))
        if text is not None:
            return [text]
    return []


def _leading_key_of_query(args: Mapping[str, object]) -> list[str]:
    """The partition key value a Query's key condition names (`pk = :v`, with `#n` placeholders resolved)."""
    condition = str(args.get("KeyConditionExpression", ""))
    names = args.get("ExpressionAttributeNames") or {}
    values = args.get("ExpressionAttributeValues") or {}
    assert isinstance(names, dict) and isinstance(values, dict)
    for placeholder in [TABLE_HASH_KEY, *(n for n, real in names.items() if real == TABLE_HASH_KEY)]:
        match = re.search(rf"(?<![\w#]){re.escape(placeholder)}\s*=\s*(:\w+)", condition)
        if match and match.group(1) in values:
            text = _attribute_text(values[match.group(1)])
            if text is not None:
                return [text]
    return []


def _as_parts(value: object) -> list[object]:
    return list(value) if isinstance(value, list) else []


def _item_need(action: str, args: Mapping[str, object], region: str, account: str) -> Need:
    item = args.get("Key") if "Key" in args else args.get("Item")
    keys = _leading_key_of_item(item)
    return Need(f"dynamodb:{action}", _table_arn(args.get("TableName"), region, account),
                {"dynamodb:LeadingKeys": keys} if keys else {})


def _dynamodb(operation: str, args: Mapping[str, object], region: str, account: str) -> tuple[Need, ...]:
    if operation in ("GetItem", "PutItem", "UpdateItem", "DeleteItem"):
        return (_item_need(operation, args, region, account),)
    if operation == "Query":
        keys = _leading_key_of_query(args)
        return (Need("dynamodb:Query", _table_arn(args.get("TableName"), region, account),
                     {"dynamodb:LeadingKeys": keys} if keys else {}),)
    if operation == "TransactWriteItems":  # no action of its own: each part is authorized as its item action
        needs = []
        for part in _as_parts(args.get("TransactItems")):
            for kind, action in _TRANSACT_WRITE.items():
                if isinstance(part, dict) and kind in part:
                    needs.append(_item_need(action, part[kind], region, account))
        return tuple(needs)
    if operation == "TransactGetItems":
        return tuple(_item_need("GetItem", part["Get"], region, account)
                     for part in _as_parts(args.get("TransactItems")) if isinstance(part, dict) and "Get" in part)
    if operation in ("BatchGetItem", "BatchWriteItem"):
        tables = args.get("RequestItems") or {}
        assert isinstance(tables, dict)
        return tuple(Need(f"dynamodb:{operation}", _table_arn(t, region, account)) for t in sorted(tables))
    return (Need(f"dynamodb:{operation}", _table_arn(args.get("TableName", "*"), region, account)),)


# --- SQS, SNS, EventBridge, Lambda -----------------------------------------------------------------------------


def _queue_arn_of_url(url: str, region: str, account: str) -> str:
    parts = [p for p in urlsplit(url).path.split("/") if p]
    if len(parts) >= 2:
        return f"arn:aws:sqs:{region}:{parts[-2]}:{parts[-1]}"
    return f"arn:aws:sqs:{region}:{account}:{parts[-1] if parts else '*'}"


def _sqs(operation: str, args: Mapping[str, object], region: str, account: str) -> tuple[Need, ...]:
    if operation in ("CreateQueue", "GetQueueUrl"):
        owner = str(args.get("QueueOwnerAWSAccountId") or account)
        return (Need(f"sqs:{operation}", f"arn:aws:sqs:{region}:{owner}:{args.get('QueueName')}"),)
    if operation == "ListQueues":
        return (Need("sqs:ListQueues", "*"),)
    arn = _queue_arn_of_url(str(args.get("QueueUrl", "")), region, account)
    action = {"SendMessageBatch": "SendMessage", "DeleteMessageBatch": "DeleteMessage",
              "ChangeMessageVisibilityBatch": "ChangeMessageVisibility"}.get(operation, operation)
    return (Need(f"sqs:{action}", arn),)


def _sns(operation: str, args: Mapping[str, object], region: str, account: str) -> tuple[Need, ...]:
    if operation == "CreateTopic":
        return (Need("sns:CreateTopic", f"arn:aws:sns:{region}:{account}:{args.get('Name')}"),)
    if operation in ("Unsubscribe", "GetSubscriptionAttributes", "SetSubscriptionAttributes"):
        subscription = str(args.get("SubscriptionArn", ""))
        return (Need(f"sns:{operation}", subscription.rsplit(":", 1)[0]),)
    if operation in ("ListTopics", "ListSubscriptions"):
        return (Need(f"sns:{operation}", "*"),)
    topic = str(args.get("TopicArn", ""))
    context: dict[str, str | list[str]] = {}
    if operation == "Subscribe":
        context = {"sns:Protocol": str(args.get("Protocol", "")), "sns:Endpoint": str(args.get("Endpoint", ""))}
    return (Need(f"sns:{operation}", topic, context),)


def _events(operation: str, args: Mapping[str, object], region: str, account: str) -> tuple[Need, ...]:
    name = args.get("Name") or args.get("Rule")
    if name:
        return (Need(f"events:{operation}", f"arn:aws:events:{region}:{account}:rule/{name}"),)
    return (Need(f"events:{operation}", "*"),)


def _lambda(call: HttpCall, region: str, account: str) -> tuple[str, tuple[Need, ...]]:
    match = re.match(r"^/\d{4}-\d{2}-\d{2}/functions/([^/]+)(/invocations|/configuration)?", call.path)
    if not match:
        raise Unmapped(f"no IAM mapping for Lambda {call.method} {call.path}")
    name = unquote(match.group(1))
    arn = name if name.startswith("arn:") else f"arn:aws:lambda:{region}:{account}:function:{name}"
    if match.group(2) == "/invocations":
        return "Invoke", (Need("lambda:InvokeFunction", arn),)
    return "GetFunction", (Need("lambda:GetFunction", arn),)
