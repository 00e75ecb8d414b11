"""One Lambda function's sandbox, as the Python runtime runs it: executed by path, never imported.

    python -I -S -B lambda_sandbox.py ASSET HANDLER --name NAME [--timeout S] [--memory MB] [--queue URL --endpoint URL]

It imports nothing from the repository. `-I -S` leave sys.path holding only the standard library; ASSET (the
function's code and its dependencies, boto3 included, as `infra.bundle` builds it) goes first, where Lambda puts
/var/task. Then, as Lambda's init does, it imports HANDLER's module once; an import that fails is remembered and
every invocation fails with it (Lambda's Runtime.ImportModuleError). It serves one invocation at a time, each a JSON
line on stdin, each answered by one JSON line on its stdout:

    {"event": {...}}    ->  {"result": <what the handler returned>}  or  {"error": {errorType, errorMessage, ...}}
    {"modules": true}   ->  {"modules": {<module name>: <its file, or null>}}

Its first line is {"ready": {"sys_path": [...], "environ": [its variables' names], "init_error": null or the
error}}. The function's own output (its logs: print, powertools) goes to stderr, so that the answers are never mixed
with it.

With --queue it also polls that SQS queue as Lambda's event source mapping does (batch size 1, with the function's
own credentials, as the mapping uses the function's role): each message is an invocation with an SQS event of one
record, deleted when the invocation succeeds and left to come back after its visibility timeout when it fails; each
is reported as {"polled": {"messageId": ..., "ok": ..., "error": ...}}, and a failing receive or delete as
{"poller_error": ...}. The sandbox exits when its stdin closes.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import os
import sys
import threading
import time
import traceback
import uuid
from typing import Any


class Context:
    """What Lambda's runtime hands a handler as its second argument (the attributes powertools reads)."""

    def __init__(self, name: str, region: str, timeout: float, memory: int) -> None:
        self.function_name = name
        self.function_version = "$LATEST"
        self.invoked_function_arn = f"arn:aws:lambda:{region}:123456789012:function:{name}"
        self.memory_limit_in_mb = memory
        self.aws_request_id = str(uuid.uuid4())
        self.log_group_name = f"/aws/lambda/{name}"
        self.log_stream_name = f"{time.strftime('%Y/%m/%d')}/[$LATEST]{uuid.uuid4().hex}"
        self._deadline = time.monotonic() + timeout

    def get_remaining_time_in_millis(self) -> int:
        return max(0, int((self._deadline - time.monotonic()) * 1000))


def error(exc: BaseException, error_type: str | None = None, message: str | None = None) -> dict[str, Any]:
    return {
        "errorType": error_type or type(exc).__name__,
        "errorMessage": str(exc) if message is None else message,
        "stackTrace": traceback.format_exception(exc),
    }


class Sandbox:
    def __init__(self, handler: str, name: str, region: str, timeout: float, memory: int, answers: Any) -> None:
        self.name, self.region, self.timeout, self.memory = name, region, timeout, memory
        self.answers = answers
        self.write_lock = threading.Lock()
        self.invoke_lock = threading.Lock()  # one invocation at a time, as in one Lambda sandbox
        self.function: Any = None
        self.init_error: dict[str, Any] | None = None
        module, _, attr = handler.rpartition(".")
        try:
            self.function = getattr(importlib.import_module(module), attr)
        except Exception as exc:  # (Lambda reports it on each invocation, not at start)
            self.init_error = error(exc, "Runtime.ImportModuleError", f"Unable to import module '{module}': {exc}")

    def answer(self, message: dict[str, Any]) -> None:
        line = json.dumps(message, default=str)
        with self.write_lock:
            self.answers.write(line + "\n")
            self.answers.flush()

    def invoke(self, event: dict[str, Any]) -> dict[str, Any]:
        if self.init_error is not None:
            return {"error": self.init_error}
        with self.invoke_lock:
            try:
                result = self.function(event, Context(self.name, self.region, self.timeout, self.memory))
                json.dumps(result)  # Lambda serializes the result: one that cannot be is an error
            except Exception as exc:
                return {"error": error(exc)}
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
        return {"result": result}

    def modules(self) -> dict[str, str | None]:
        return {name: getattr(module, "__file__", None) for name, module in sorted(sys.modules.items())}

    def serve(self) -> None:
        for line in sys.stdin:
            if not line.strip():
                continue
            request = json.loads(line)
            if request.get("modules"):
                self.answer({"modules": self.modules()})
            else:
                self.answer(self.invoke(request["event"]))

    def poll(self, queue_url: str, endpoint: str) -> None:
        """Lambda's SQS event source mapping, batch size 1."""
        import boto3  # (from the asset, as the function's own)

        sqs = boto3.client("sqs", endpoint_url=endpoint, region_name=self.region)
        arn = sqs.get_queue_attributes(QueueUrl=queue_url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
        while True:
            try:
                got = sqs.receive_message(
                    QueueUrl=queue_url, MaxNumberOfMessages=1, WaitTimeSeconds=20, AttributeNames=["All"]
                )
            except Exception as exc:
                self.answer({"poller_error": error(exc)})
                time.sleep(1)  # a mapping backs off after a failed receive
                continue
            for message in got.get("Messages", []):
                record = {
                    "messageId": message["MessageId"],
                    "receiptHandle": message["ReceiptHandle"],
                    "body": message["Body"],
                    "attributes": message.get("Attributes", {}),
                    "messageAttributes": {},
                    "md5OfBody": hashlib.md5(message["Body"].encode()).hexdigest(),  # noqa: S324 (SQS's own checksum)
                    "eventSource": "aws:sqs",
                    "eventSourceARN": arn,
                    "awsRegion": self.region,
                }
                outcome = self.invoke({"Records": [record]})
                if "error" not in outcome:
                    try:
                        sqs.delete_message(QueueUrl=queue_url, ReceiptHandle=message["ReceiptHandle"])
                    except Exception as exc:
                        self.answer({"poller_error": error(exc)})
                self.answer({"polled": {"messageId": message["MessageId"], "ok": "error" not in outcome,
                                        "error": outcome.get("error")}})  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("asset")
    parser.add_argument("handler")
    parser.add_argument("--name", required=True)
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--memory", type=int, default=1769)
    parser.add_argument("--queue", default="")
    parser.add_argument("--endpoint", default=None)
    args = parser.parse_args()
    # The answers get the original stdout; whatever the function writes to its stdout goes to stderr (its logs).
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1, encoding="utf-8")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    sys.path.insert(0, args.asset)
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
    sandbox = Sandbox(args.handler, args.name, region, args.timeout, args.memory, answers)
    ready = {"sys_path": list(sys.path), "environ": sorted(os.environ), "init_error": sandbox.init_error}
    sandbox.answer({"ready": ready})
    if args.queue:  # (with an init error too: each message's invocation then fails with it, as on Lambda)
        threading.Thread(target=sandbox.poll, args=(args.queue, args.endpoint), daemon=True).start()
    sandbox.serve()
    answers.flush()
    os._exit(0)  # (not waiting for the poller's long poll)


if __name__ == "__main__":
    main()
