"""The layers hold at run time too: the CDK app synthesizes where the AWS SDKs and pynamodb are absent.

import-linter checks the imports statically (`make lint`); this runs `cdk synth`'s code path in a fresh
interpreter in which importing pynamodb, boto3, botocore, torch or moto fails, as on a machine that
installed only the `infra` extra.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.infrastructure.conftest import REPO, TEST_RUN

BLOCKER = """
import importlib.abc, sys
BLOCKED = {"pynamodb", "boto3", "botocore", "torch", "moto"}
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name} is not installed here")
        return None
sys.meta_path.insert(0, Block())
"""

SYNTH = """
import json, sys
from pathlib import Path
from aws_cdk import App
from infra.app import build_app
run_file, outdir, asset_dir = sys.argv[1:4]
context = json.loads(Path("cdk.json").read_text())["context"]
app, stack = build_app(App(context={**context, "config": run_file}, outdir=outdir), asset_dir=Path(asset_dir))
assembly = app.synth()
print(len(assembly.stacks), sorted(m for m in sys.modules if m.split(".")[0] in {"pynamodb", "boto3", "torch"}))
"""


def test_the_cdk_app_synthesizes_without_pynamodb_boto3_or_torch(tmp_path: Path) -> None:
    # Given a run file, an empty asset directory (no Lambda bundling) and an interpreter without the SDKs
    run_file = tmp_path / "run.toml"
    run_file.write_text(TEST_RUN)
    assets = tmp_path / "asset"
    assets.mkdir()
    (assets / "placeholder.py").write_text("")
    env = {**os.environ, "JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION": "20"}
    # When the app is synthesized
    done = subprocess.run(
        [sys.executable, "-c", BLOCKER + SYNTH, str(run_file), str(tmp_path / "out"), str(assets)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )
    # Then it succeeds, one stack, and none of the blocked packages was needed
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "1 []"
