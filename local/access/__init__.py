"""The access check: every AWS request of the local stack judged as IAM would judge it on AWS.

    template (`cdk synth`'s, `infra.template`)  ->  model (who may do what, bound to this run's resources)
    request  ->  requests.parse (actions, ARNs, condition keys)  ->  evaluator (iam-simulate)  ->  allowed or 403
                                                                                 ->  ledger (the session's report)

`control_for` builds the check for one run; the local server (`local.server`) and in-process moto
(`control.install_in_process`) apply it. FED_ACCESS_CHECK chooses: "enforce" (refuse what IAM would refuse, the
default where the evaluator and the CDK app can run), "record" (judge and record, refuse nothing), "off".
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from local.access.control import AccessControl, control_for, shared_evaluator, shared_ledger
from local.access.evaluator import available
from local.access.model import LOCAL_ACCOUNT, AccessModel, Binding, build_model
from shared.naming import join_queue_name, local_bucket_name, shard_queue_name, state_topic_name, table_name

if TYPE_CHECKING:
    from shared.config import RunConfig

ENV_CHECK = "FED_ACCESS_CHECK"
ENFORCE, RECORD, OFF = "enforce", "record", "off"
REPO = Path(__file__).resolve().parents[2]
CACHE = REPO / "build" / "access"
# The run id the template is synthesized for; a run's own id takes its place (the policies differ by run id only
# in the names and prefixes that hold it, and by whether witnessing is on).
PLACEHOLDER = "runidplaceholder0"
_INPUTS = ("infra", "shared")


class AccessCheckUnavailable(RuntimeError):
    """The check cannot run here: no Node, no simulator, or no CDK to synthesize the template with."""


def mode() -> str:
    value = os.environ.get(ENV_CHECK, ENFORCE).strip().lower() or ENFORCE
    if value not in (ENFORCE, RECORD, OFF):
        raise ValueError(f"{ENV_CHECK} must be {ENFORCE}, {RECORD} or {OFF}, not {value!r}")
    return value


def unavailable() -> str | None:
    """None if the check can run here, else why not."""
    missing = available()
    if missing:
        return missing
    if importlib.util.find_spec("aws_cdk") is None:  # (not imported here: that starts the jsii runtime)
        return "aws-cdk-lib is not installed (pip install '.[infra]')"
    return None


def _inputs_digest() -> str:
    h = hashlib.sha256()
    for package in _INPUTS:
        for path in sorted((REPO / package).rglob("*.py")):
            h.update(path.relative_to(REPO).as_posix().encode())
            h.update(path.read_bytes())
    for name in ("cdk.json", "package-lock.json", "pyproject.toml"):
        h.update((REPO / name).read_bytes())
    return h.hexdigest()[:16]


@cache
def placeholder_template(witnessing: bool) -> str:
    """The synthesized template (JSON text) for the placeholder run, cached on disk by what it is made of."""
    path = CACHE / f"template-{_inputs_digest()}-w{int(witnessing)}.json"
    if not path.is_file():
        proc = subprocess.run(
            [sys.executable, "-m", "infra.template", "--run-id", PLACEHOLDER, "--witness-nodes", str(int(witnessing)),
             "--out", str(path)],
            cwd=REPO, capture_output=True, text=True,
            env={**os.environ, "JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION": "20"},
        )
        if proc.returncode != 0:
            raise AccessCheckUnavailable(f"synthesizing the template failed:\n{proc.stderr[-3000:]}")
    return path.read_text()


def template_for(config: RunConfig) -> dict[str, Any]:
    text = placeholder_template(config.witness_nodes > 0)
    return json.loads(text.replace(PLACEHOLDER, config.run_id))  # type: ignore[no-any-return]


def local_binding(run_id: str, region: str, endpoint: str | None, account: str = LOCAL_ACCOUNT) -> Binding:
    """The names the local stack gives the stack's resources (`local.resources`)."""
    bucket = local_bucket_name(run_id)
    names = {
        "Bucket": bucket,
        "AccessLogs": f"{bucket}-access-logs",
        "Table": table_name(run_id),
        "Topic": state_topic_name(run_id),
        "JoinQueue": join_queue_name(run_id),
        "ShardQueue": shard_queue_name(run_id),
        "DeadLetters": f"fed-{run_id}-dead-letters",
    }
    return Binding(account, region, f"fed-{run_id}", names, endpoint_host=endpoint or "")


def model_for(config: RunConfig, region: str = "us-east-1", endpoint: str | None = None) -> AccessModel:
    return build_model(template_for(config), local_binding(config.run_id, region, endpoint))


class _Checked(Protocol):
    def enable_access(self, model: AccessModel, enforce: bool) -> None: ...


@dataclass(frozen=True)
class CheckState:
    """How the access check runs for a local stack: `mode` (enforce, record or off) and a line saying so."""

    mode: str
    line: str

    @property
    def on(self) -> bool:
        return self.mode != OFF

    def __str__(self) -> str:
        return self.line


def enable_on(server: _Checked, config: RunConfig, region: str, endpoint: str | None) -> CheckState:
    """Judge every request `server` serves for this run, as FED_ACCESS_CHECK says.

    Unset, the check enforces where it can run and is off (with the reason) where it cannot; set to "enforce" or
    "record", a check that cannot run is an error."""
    chosen = mode()
    if chosen == OFF:
        return CheckState(OFF, f"access check off ({ENV_CHECK}=off)")
    missing = unavailable()
    if missing:
        if os.environ.get(ENV_CHECK):
            raise AccessCheckUnavailable(f"{ENV_CHECK}={chosen}, but {missing}")
        return CheckState(OFF, f"access check off: {missing}")
    server.enable_access(model_for(config, region, endpoint), enforce=chosen == ENFORCE)
    verb = "refused as IAM would refuse them" if chosen == ENFORCE else "judged and recorded, none refused"
    return CheckState(chosen, f"access check on: every AWS call is judged against the roles `cdk deploy` creates "
                              f"({verb})")


__all__ = ["AccessCheckUnavailable", "AccessControl", "AccessModel", "CheckState", "ENFORCE", "OFF", "RECORD",
           "control_for", "enable_on", "mode", "model_for", "shared_evaluator", "shared_ledger", "unavailable"]
