"""One synthesized stack for the whole session (synthesis takes seconds), from a small run file."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION", "20")

import pytest  # noqa: E402
from aws_cdk import App  # noqa: E402
from aws_cdk.assertions import Template  # noqa: E402

from infra.app import build_app  # noqa: E402
from infra.settings import DeploySettings, load_deploy  # noqa: E402
from infra.stack import FedRunStack  # noqa: E402
from shared.config import RunConfig  # noqa: E402

REPO = Path(__file__).resolve().parents[2]

TEST_RUN = """
[run]
run_id = "infra-test"
min_clients = 3
min_per_round = 2
min_updates = 2
max_round_train_time = 120
liveness_timeout = 40

[deploy]
log_retention_days = 14
table_deletion_protection = false
round_objects_expire_days = 12
stuck_round_multiple = 2.5
alarm_email = "oncall@example.com"

[deploy.tick]
memory_mb = 1024
timeout_seconds = 120

[deploy.ingest]
memory_mb = 2048
timeout_seconds = 240
ephemeral_storage_mb = 2048

[deploy.shard]
memory_mb = 3008
timeout_seconds = 600
"""


@dataclass(frozen=True)
class Synth:
    app: App
    stack: FedRunStack
    template: Template
    config: RunConfig
    settings: DeploySettings

    @property
    def resources(self) -> dict[str, dict[str, Any]]:
        return self.template.to_json()["Resources"]

    def of_type(self, kind: str) -> dict[str, dict[str, Any]]:
        return {k: v for k, v in self.resources.items() if v["Type"] == kind}

    def logical_id(self, construct: Any) -> str:
        return self.stack.resolve(self.stack.get_logical_id(construct.node.default_child))


def cdk_json_context() -> dict[str, Any]:
    """The feature flags and defaults `cdk synth` runs with, so the tests synthesize the same stack."""
    return json.loads((REPO / "cdk.json").read_text())["context"]


@pytest.fixture(scope="session")
def run_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("run") / "run.toml"
    path.write_text(TEST_RUN)
    return path


@pytest.fixture(scope="session")
def synth(run_file: Path) -> Synth:
    app, stack = build_app(App(context={**cdk_json_context(), "config": str(run_file)}))
    config, settings = load_deploy(run_file)
    return Synth(app, stack, Template.from_stack(stack), config, settings)
