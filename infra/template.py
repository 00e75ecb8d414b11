"""The CloudFormation template `cdk synth` makes for a run, as JSON, without building the Lambda asset.

The access check (`local.access`) judges every AWS call the system makes against the roles in this template, so
it must be the template `cdk deploy` would send: the same app (`infra.app.build_app`), the same context as cdk.json
(feature flags), cdk-nag's checks included. Only the functions' code is an empty stand-in directory, which changes
no permission.

    python -m infra.template --run-id RUN [--witness-nodes N] --out template.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import tomllib
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def synthesize(run_toml: str, workdir: Path) -> dict[str, Any]:
    """The template of the run file `run_toml` (its text), synthesized in `workdir`."""
    from aws_cdk import App

    from infra.app import build_app

    run_file = workdir / "run.toml"
    run_file.write_text(run_toml)
    asset = workdir / "asset-standin"
    asset.mkdir(exist_ok=True)
    (asset / "README").write_text("stands in for the functions' code: the access check needs the roles only\n")
    context = json.loads((REPO / "cdk.json").read_text())["context"]
    context["config"] = str(run_file)
    context["aws:cdk:enable-path-metadata"] = True  # construct paths name the resources for the access check
    app = App(outdir=str(workdir / "cdk.out"), context=context)
    _, stack = build_app(app, asset_dir=asset)
    assembly = app.synth()
    template: dict[str, Any] = assembly.get_stack_by_name(stack.stack_name).template
    return template


def run_file_text(run_id: str, witness_nodes: int) -> str:
    return f'[run]\nrun_id = "{run_id}"\nwitness_nodes = {witness_nodes}\n'


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--witness-nodes", type=int, default=0)
    parser.add_argument("--config", type=Path, help="a run file to synthesize instead (its [run] and [deploy])")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.config is not None:
        text = args.config.read_text()
        tomllib.loads(text)
    else:
        text = run_file_text(args.run_id, args.witness_nodes)
    with tempfile.TemporaryDirectory(prefix="fed-template-") as tmp:
        template = synthesize(text, Path(tmp))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    partial = args.out.with_suffix(".partial")
    partial.write_text(json.dumps(template, indent=1, sort_keys=True))
    partial.replace(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
