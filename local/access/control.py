"""The local stack answers as AWS would where IAM decides: each request is judged against the policies of the
principal that makes it on AWS, refused with the service's own AccessDenied error when IAM would refuse it, and a
read of a missing key is answered 403 instead of 404 when the caller may not list the bucket (S3 does that, so that
a caller without s3:ListBucket cannot learn which keys exist).

Who makes a request: the X-Fed-Principal header (`store.trace.acting_as`: the local stack runs every function in
one process), else the access key, which a process of its own sets to say whom it stands for (participant-<id>,
function-<name>, operator). A request from anyone else (a test looking at the stack, the local stand-ins for
CloudFormation, EventBridge and Lambda's pollers) is not judged, only counted. This is a stand-in for IAM's
decisions, not a security boundary: locally anyone can name any principal.

`AccessControl` is used two ways: as WSGI middleware in front of moto's server (`middleware`), and inside
in-process moto (`install_in_process`), where botocore's requests never reach a socket.
"""

from __future__ import annotations

import hashlib
import html
import io
import json
import os
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from local.access import ledger as ledger_module
from local.access.evaluator import Decision, Evaluator
from local.access.ledger import CallKey, Denial, Ledger
from local.access.model import FUNCTION, OPERATOR, PARTICIPANT, AccessModel, participant_context
from local.access.requests import HttpCall, Need, Request, Unmapped, credential, parse
from shared.naming import HOST_TAG, REVOKED_HOSTS_POLICY
from store.trace import HEADER_CALLER, HEADER_PRINCIPAL, HEADER_TEST

Response = tuple[int, dict[str, str], bytes]
PARTICIPANT_KEY = "participant-"
FUNCTION_KEY = "function-"


def principal_of(headers: Mapping[str, str], query: str = "") -> str | None:
    """function:<name>, participant:<id>, operator, or None (not one of the system's principals)."""
    stamped = headers.get(HEADER_PRINCIPAL.lower())
    if stamped:
        return stamped
    access_key, _, _ = credential(headers, query)
    if access_key.startswith(PARTICIPANT_KEY):
        return f"{PARTICIPANT}:{access_key[len(PARTICIPANT_KEY):]}"
    if access_key.startswith(FUNCTION_KEY):
        return f"{FUNCTION}{access_key[len(FUNCTION_KEY):]}"
    if access_key == OPERATOR:
        return OPERATOR
    return _invited_host(access_key)


def _invited_host(access_key: str) -> str | None:
    """participant:<id> for a session moto's STS issued of a participant role (the local credential endpoint's, to
    an invited host: `coordinator.credentials`, whose session names say the host), else None. Looked up in moto's
    own backend, which lives in the process this check runs in."""
    if not access_key.startswith("ASIA"):
        return None
    from moto.sts.models import sts_backends

    from coordinator.credentials import host_of_session

    for account in list(sts_backends.keys()):
        for backend in sts_backends[account].values():
            role = backend.get_assumed_role_from_access_key(access_key)
            if role is not None and role.role_arn.endswith("-participant"):
                return f"{PARTICIPANT}:{host_of_session(role.session_name)}"
    return None


def _revoked_tag(headers: Mapping[str, str], query: str) -> str | None:
    """The `shared.hosts.HOST_TAG` of the invited host's session making the request, where the participant role's
    inline deny `REVOKED_HOSTS_POLICY` (`fed hosts revoke`, written to moto's IAM as on AWS) lists it; else None. The
    tag is read from the session's name (`coordinator.credentials.tag_of_session`): moto's STS keeps no tags."""
    if headers.get(HEADER_PRINCIPAL.lower()):
        return None
    access_key, _, _ = credential(headers, query)
    if not access_key.startswith("ASIA"):
        return None
    from moto.iam.models import iam_backends
    from moto.sts.models import sts_backends

    from coordinator.credentials import tag_of_session

    for account in list(sts_backends.keys()):
        for partition, backend in sts_backends[account].items():
            role = backend.get_assumed_role_from_access_key(access_key)
            if role is None or not role.role_arn.endswith("-participant"):
                continue
            tag = tag_of_session(role.session_name)
            try:
                iam_role = iam_backends[account][partition].get_role_by_arn(role.role_arn)
            except Exception:  # moto's NotFoundException: a role never created holds no deny
                return None
            document = iam_role.policies.get(REVOKED_HOSTS_POLICY)
            return tag if tag is not None and document and tag in _denied_tags(document) else None
    return None


def _denied_tags(document: str) -> set[str]:
    """The HOST_TAG values a deny policy as `fed.hosts.deny_sessions` writes it names."""
    denied: set[str] = set()
    for statement in json.loads(document).get("Statement", []):
        if statement.get("Effect") == "Deny":
            values = statement.get("Condition", {}).get("StringEquals", {}).get(f"aws:PrincipalTag/{HOST_TAG}", [])
            denied.update([values] if isinstance(values, str) else values)
    return denied


def _test_of(call: HttpCall) -> str:
    """The test that made the request: the caller's stamp, else the test running here (or that started this
    server's process: a process started by a test inherits its name)."""
    return call.headers.get(HEADER_TEST.lower(), "") or os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]


def role_of(principal: str) -> str:
    return PARTICIPANT if principal.startswith(f"{PARTICIPANT}:") else principal


@dataclass(frozen=True)
class Verdict:
    principal: str | None
    request: Request | None
    refusal: Response | None = None


class AccessControl:
    """Judges requests against `model`; with `enforce`, refuses what IAM would refuse."""

    def __init__(self, model: AccessModel, evaluator: Evaluator, ledger: Ledger | None = None,
                 enforce: bool = True) -> None:
        self.model = model
        self.evaluator = evaluator
        self.ledger = ledger
        self.enforce = enforce
        # One evaluator serves every model of the process (several local stacks, a test's altered roles): each
        # model's principals are loaded under a name of their own, and its resource policies named by their content.
        self._names = hashlib.sha256(model.to_json().encode()).hexdigest()[:16]
        for name, principal in model.principals.items():
            evaluator.load(f"{self._names}/{name}", principal.policies)
        self._policies = hashlib.sha256(json.dumps(model.resource_policies, sort_keys=True).encode()).hexdigest()

    # --- judging ---------------------------------------------------------------------------------------------

    def decide(self, principal: str, need: Need) -> Decision:
        role = role_of(principal)
        known = self.model.principals.get(role)
        if known is None:
            return Decision("ImplicitlyDenied", errors=f"the template has no principal {role!r}")
        context: dict[str, str | list[str]] = {
            "aws:SecureTransport": "true",  # the AWS SDKs call every service over TLS
            "aws:PrincipalArn": known.arn,
            "aws:PrincipalAccount": self.model.account,
            **need.context,
        }
        if need.action.startswith("s3:"):
            context["s3:TlsVersion"] = "1.3"
        if role == PARTICIPANT:
            context.update(participant_context(principal.split(":", 1)[1]))
        session = known.arn.replace(":iam::", ":sts::").replace(":role/", ":assumed-role/") + "/local"
        governing, policy = self.model.resource_policy(need.resource)
        return self.evaluator.judge(f"{self._names}/{role}", session, need.action, need.resource, self.model.account,
                                    context, policy,
                                    f"{self._policies}:{governing}" if policy is not None else "")

    def before(self, call: HttpCall) -> Verdict:
        principal = principal_of(call.headers, call.query)
        test = _test_of(call)
        caller = call.headers.get(HEADER_CALLER.lower(), "")
        if principal is None:
            self._count(CallKey(test, "", "", self._operation(call), ledger_module.UNJUDGED, caller))
            return Verdict(None, None)
        try:
            request = parse(call, self.model.account)
        except Unmapped as exc:
            return self._refuse(call, principal, None, Need("?", call.path), Decision("Error", errors=str(exc)))
        if role_of(principal) == PARTICIPANT and (tag := _revoked_tag(call.headers, call.query)) is not None:
            # IAM evaluates the role's inline deny on every request: a revoked generation's session is cut at once
            need = request.needs[0] if request.needs else Need(f"{request.service}:{request.operation}", "*")
            return self._refuse(call, principal, request, need,
                                Decision("ExplicitlyDenied", denied_by=(f"RevokedHosts ({HOST_TAG}={tag})",)))
        for need in request.needs:
            decision = self.decide(principal, need)
            if not decision.allowed:
                return self._refuse(call, principal, request, need, decision)
        for need in request.needs:
            self._count(CallKey(test, principal, role_of(principal), need.action, ledger_module.ALLOWED, caller))
        return Verdict(principal, request)

    def after(self, call: HttpCall, verdict: Verdict, status: int) -> Response | None:
        """A 404 for a read of a missing key becomes 403 when the caller may not list the bucket."""
        if verdict.principal is None or verdict.request is None or verdict.request.key_read is None:
            return None
        if status != 404:
            return None
        bucket, key = verdict.request.key_read
        # IAM is asked about s3:ListBucket on the bucket with no s3:prefix: whether S3 fills in the missing key as
        # the prefix is not documented, so a grant that depends on it is not relied on.
        decision = self.decide(verdict.principal, Need("s3:ListBucket", f"arn:aws:s3:::{bucket}"))
        test = _test_of(call)
        caller = call.headers.get(HEADER_CALLER.lower(), "")
        outcome = ledger_module.ALLOWED if decision.allowed else ledger_module.MISSING_AS_403
        self._count(CallKey(test, verdict.principal, role_of(verdict.principal), "s3:ListBucket", outcome, caller))
        if decision.allowed:
            return None
        message = f"{key} does not exist, and {verdict.principal} may not list {bucket} (no s3:ListBucket): S3 " \
                  "answers 403 AccessDenied"
        return _error("s3", verdict.request.operation, message, head=call.method == "HEAD")

    def _refuse(self, call: HttpCall, principal: str, request: Request | None, need: Need,
                decision: Decision) -> Verdict:
        role = role_of(principal)
        if decision.errors:
            why = f"the evaluator could not judge it: {decision.errors}"
        elif decision.denied_by:
            why = f"explicitly denied by statement(s) {', '.join(decision.denied_by)}"
        else:
            why = f"no statement of the {role} policies allows {need.action} on this resource " \
                  f"(context {json.dumps(dict(need.context))})"
        operation = request.operation if request else self._operation(call)
        test = _test_of(call)
        caller = call.headers.get(HEADER_CALLER.lower(), "")
        self._count(CallKey(test, principal, role, need.action, ledger_module.DENIED, caller))
        if self.ledger is not None:
            self.ledger.deny(Denial(test, principal, role, operation, need.action, need.resource, why, caller,
                                    ledger_module.now()))
        if not self.enforce:
            return Verdict(principal, request)
        message = f"User: {principal} is not authorized to perform: {need.action} on resource: {need.resource} " \
                  f"({why})"
        service = request.service if request else "s3"
        return Verdict(principal, request, _error(service, operation, message, head=call.method == "HEAD",
                                                  query_protocol=not call.headers.get("x-amz-target")))

    def _count(self, key: CallKey) -> None:
        if self.ledger is not None:
            self.ledger.count(key)

    @staticmethod
    def _operation(call: HttpCall) -> str:
        target = call.headers.get("x-amz-target", "")
        _, _, service = credential(call.headers, call.query)
        return f"{service or '?'} {target.rsplit('.', 1)[-1] if target else call.method}"

    # --- where it runs ---------------------------------------------------------------------------------------

    def middleware(self, app: Any) -> Any:
        return AccessMiddleware(app, self)


def _error(service: str, operation: str, message: str, head: bool = False, query_protocol: bool = True) -> Response:
    """The service's own AccessDenied error, as botocore parses it."""
    text = html.escape(message)
    if service in ("s3", "cloudformation", "sns") or (service == "sqs" and query_protocol):
        code = "AuthorizationError" if service == "sns" else "AccessDenied"
        if service == "s3":
            body = f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{text}</Message>' \
                   "<RequestId>local</RequestId></Error>"
        else:
            body = f"<ErrorResponse><Error><Type>Sender</Type><Code>{code}</Code><Message>{text}</Message></Error>" \
                   "<RequestId>local</RequestId></ErrorResponse>"
        return 403, {"Content-Type": "application/xml"}, b"" if head else body.encode()
    if service == "lambda":
        return 403, {"Content-Type": "application/json", "x-amzn-ErrorType": "AccessDeniedException"}, \
            json.dumps({"Type": "User", "Message": message}).encode()
    headers = {"Content-Type": "application/x-amz-json-1.0" if service == "dynamodb" else "application/x-amz-json-1.1"}
    if service == "sqs":
        headers["x-amzn-query-error"] = "AccessDenied;Sender"
    error_type = "AccessDeniedException"
    return 400, headers, json.dumps({"__type": f"com.amazon.coral.service#{error_type}", "message": message,
                                     "Message": message}).encode()


_STATUS_TEXT = {200: "OK", 400: "Bad Request", 403: "Forbidden", 404: "Not Found"}


# POST {"model": <AccessModel JSON>, "enforce": bool}: judge from now on. GET: the same object, as the server holds
# it ("model": null while it judges nothing): what `fed check` judges the roles against.
ACCESS_PATH = "/_fed/access"


class AccessMiddleware:
    """WSGI: judge each request before moto serves it; turn a 404 into 403 where S3 would. It judges nothing until
    told the run's model (`configure`, or a POST to ACCESS_PATH from another process)."""

    def __init__(self, app: Any, control: AccessControl | None = None) -> None:
        self.app = app
        self.control = control
        self._lock = threading.Lock()

    def configure(self, model: AccessModel, enforce: bool) -> None:
        with self._lock:
            self.control = control_for(model, enforce=enforce)

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("PATH_INFO") == ACCESS_PATH and environ.get("REQUEST_METHOD") == "POST":
            length = int(environ.get("CONTENT_LENGTH") or 0)
            body = json.loads(environ["wsgi.input"].read(length))
            self.configure(AccessModel.from_json(body["model"]), bool(body["enforce"]))
            return _respond(start_response, (200, {"Content-Type": "application/json"}, b"{}"))
        if environ.get("PATH_INFO") == ACCESS_PATH and environ.get("REQUEST_METHOD") == "GET":
            held = self.control
            told = {"model": held.model.to_json() if held else None, "enforce": bool(held and held.enforce)}
            return _respond(start_response, (200, {"Content-Type": "application/json"}, json.dumps(told).encode()))
        control = self.control
        if control is None:
            return self.app(environ, start_response)  # type: ignore[no-any-return]
        call = _call_of_environ(environ)
        verdict = control.before(call)
        if verdict.refusal is not None:
            return _respond(start_response, verdict.refusal)
        if verdict.request is None or verdict.request.key_read is None:
            return self.app(environ, start_response)  # type: ignore[no-any-return]
        captured: dict[str, Any] = {}

        def capture(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Callable[[bytes], None]:
            captured.update(status=status, headers=headers)
            return lambda data: None

        result = self.app(environ, capture)
        status = int(str(captured.get("status", "200")).split(" ", 1)[0])
        replacement = control.after(call, verdict, status)
        if replacement is not None:
            close = getattr(result, "close", None)
            if close is not None:
                close()
            return _respond(start_response, replacement)
        start_response(captured["status"], captured["headers"])
        return result  # type: ignore[no-any-return]


def _respond(start_response: Callable[..., Any], response: Response) -> list[bytes]:
    status, headers, body = response
    start_response(f"{status} {_STATUS_TEXT.get(status, 'Error')}",
                   [*headers.items(), ("Content-Length", str(len(body)))])
    return [body]


def _call_of_environ(environ: dict[str, Any]) -> HttpCall:
    headers = {k[5:].replace("_", "-").lower(): v for k, v in environ.items() if k.startswith("HTTP_")}
    if environ.get("CONTENT_TYPE"):
        headers["content-type"] = environ["CONTENT_TYPE"]
    query = environ.get("QUERY_STRING", "")
    _, _, service = credential(headers, query)
    body = b""
    if service != "s3" or (environ.get("REQUEST_METHOD") == "POST" and "delete" in query):
        length = int(environ.get("CONTENT_LENGTH") or 0)
        body = environ["wsgi.input"].read(length) if length else b""
        environ["wsgi.input"] = io.BytesIO(body)
    path = environ.get("RAW_URI") or environ.get("REQUEST_URI") or environ.get("PATH_INFO", "/")
    path = path.split("?", 1)[0]
    return HttpCall(environ.get("REQUEST_METHOD", "GET"), environ.get("HTTP_HOST", ""), path, query, headers, body)


# --- in-process moto -------------------------------------------------------------------------------------------

_in_process: AccessControl | None = None
_patched = False


def install_in_process(control: AccessControl | None) -> None:
    """Judge every request in-process moto serves (None: stop judging)."""
    global _in_process, _patched
    _in_process = control
    if _patched or control is None:
        return
    from moto.core.botocore_stubber import BotocoreStubber

    original = BotocoreStubber.process_request

    def process_request(self: Any, request: Any) -> Any:
        active = _in_process
        if active is None:
            return original(self, request)
        body = request.body
        if isinstance(body, str):
            body = body.encode()
        elif not isinstance(body, bytes | bytearray):
            body = b""
        call = HttpCall.from_url(request.method, request.url, dict(request.headers.items()), bytes(body))
        verdict = active.before(call)
        if verdict.refusal is not None:
            return verdict.refusal
        response = original(self, request)
        if response is not None and verdict.request is not None and verdict.request.key_read is not None:
            replacement = active.after(call, verdict, int(response[0]))
            if replacement is not None:
                return replacement
        return response

    BotocoreStubber.process_request = process_request  # type: ignore[method-assign]
    _patched = True


_evaluator: Evaluator | None = None
_ledger: Ledger | None = None


def shared_evaluator() -> Evaluator:
    """One Node process per Python process, whatever number of runs it judges."""
    global _evaluator
    if _evaluator is None:
        _evaluator = Evaluator()
    return _evaluator


def shared_ledger() -> Ledger | None:
    """This process's ledger (FED_ACCESS_LEDGER), or None when nothing records."""
    global _ledger
    if _ledger is None:
        _ledger = Ledger.from_env()
    return _ledger


def control_for(model: AccessModel, enforce: bool = True) -> AccessControl:
    return AccessControl(model, shared_evaluator(), shared_ledger(), enforce=enforce)
