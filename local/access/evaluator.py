"""IAM's decision on one request, from a maintained evaluator (`@cloud-copilot/iam-simulate`, npm) in a Node process.

We never match wildcards, policy variables or conditions ourselves: the simulator implements IAM's evaluation logic
(identity and resource policies, explicit denies, every condition operator, `${aws:PrincipalTag/...}`), and this
module only carries questions to it and answers back, one at a time over a pipe. Answers are cached: a run asks the
same question (this principal, this action on this resource, in this context) many times.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCRIPT = Path(__file__).with_name("iam_eval.cjs")
REPO = Path(__file__).resolve().parents[2]
ENV_NODE_MODULES = "FED_NODE_MODULES"  # where @cloud-copilot/iam-simulate is installed (default: the checkout's)
SIMULATOR = "@cloud-copilot/iam-simulate"
ALLOWED = "Allowed"
EXPLICIT_DENY = "ExplicitlyDenied"


class EvaluatorUnavailable(RuntimeError):
    """Node or the simulator package is missing (`npm ci` installs it from package-lock.json)."""


@dataclass(frozen=True)
class Decision:
    result: str  # Allowed | ImplicitlyDenied | ExplicitlyDenied | Error
    denied_by: tuple[str, ...] = ()  # the statements (Sid) that denied it explicitly
    errors: str | None = None  # the simulator refused the question (an unknown action, a malformed policy)

    @property
    def allowed(self) -> bool:
        return self.result == ALLOWED


def node_modules() -> Path:
    return Path(os.environ.get(ENV_NODE_MODULES) or REPO / "node_modules")


def available() -> str | None:
    """None if the evaluator can run here, else why not."""
    if shutil.which("node") is None:
        return "node is not installed"
    if not (node_modules() / SIMULATOR / "package.json").is_file():
        return f"{SIMULATOR} is not installed in {node_modules()} (run `npm ci`)"
    return None


def _freeze(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


class Evaluator:
    """One Node process; `judge` is safe from any thread. `close()` ends the process."""

    def __init__(self) -> None:
        missing = available()
        if missing:
            raise EvaluatorUnavailable(missing)
        env = {**os.environ, "NODE_PATH": str(node_modules())}
        self._proc = subprocess.Popen(
            ["node", str(SCRIPT)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True, bufsize=1
        )
        self._lock = threading.Lock()
        self._next = 0
        self._cache: dict[str, Decision] = {}
        self._loaded: dict[str, str] = {}

    def _ask(self, message: dict[str, Any]) -> dict[str, Any]:
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._next += 1
        message = {**message, "id": self._next}
        self._proc.stdin.write(json.dumps(message) + "\n")
        self._proc.stdin.flush()
        line = self._proc.stdout.readline()
        if not line:
            raise EvaluatorUnavailable(f"the IAM evaluator exited (code {self._proc.poll()})")
        answer: dict[str, Any] = json.loads(line)
        if answer.get("id") != message["id"]:
            raise EvaluatorUnavailable(f"the IAM evaluator answered {answer.get('id')} to {message['id']}")
        return answer

    def load(self, name: str, identity_policies: Mapping[str, Any]) -> None:
        """Name a principal's identity policies ({policy name: document}) for later questions."""
        documents = [{"name": n, "policy": p} for n, p in sorted(identity_policies.items())]
        frozen = _freeze(documents)
        with self._lock:
            if self._loaded.get(name) == frozen:
                return
            self._ask({"op": "load", "name": name, "identity": documents})
            self._loaded[name] = frozen
            self._cache = {k: v for k, v in self._cache.items() if not k.startswith(f"{name}\0")}

    def judge(self, identity: str, principal_arn: str, action: str, resource: str, account: str,
              context: Mapping[str, str | list[str]], resource_policy: Mapping[str, Any] | None = None,
              resource_policy_key: str | None = None) -> Decision:
        """IAM's decision on `principal_arn` (whose identity policies were loaded as `identity`) calling `action`
        on `resource` with these context keys, under the resource's own policy if it has one (`resource_policy_key`
        names that policy's content for the cache, where the caller knows it: freezing it each time costs more than
        the rest of a cached answer)."""
        policy_key = resource_policy_key if resource_policy_key is not None else _freeze(resource_policy)
        key = "\0".join((identity, principal_arn, action, resource, account, _freeze(context), policy_key))
        with self._lock:
            if identity not in self._loaded:
                raise KeyError(f"no identity policies loaded for {identity!r}")
            hit = self._cache.get(key)
            if hit is not None:
                return hit
            answer = self._ask({"op": "judge", "identity": identity, "principal": principal_arn, "action": action,
                                "resource": resource, "account": account, "context": dict(context),
                                "resourcePolicy": resource_policy})
            decision = Decision(str(answer.get("result")), tuple(answer.get("deniedBy") or ()), answer.get("errors"))
            self._cache[key] = decision
            return decision

    def close(self) -> None:
        if self._proc.poll() is None:
            assert self._proc.stdin is not None
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()

    def __enter__(self) -> Evaluator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
