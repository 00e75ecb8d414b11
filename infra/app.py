"""The CDK app: `cdk synth|deploy -c config=runs/<name>.toml [-c stack=NAME]`.

Synthesis needs no AWS account or credentials: the stack is environment-agnostic. The AwsSolutions
checks of cdk-nag run on every synthesis and any unacknowledged finding fails it.
"""

from __future__ import annotations

import sys
from pathlib import Path

from aws_cdk import App

from infra.nag import add_checks
from infra.settings import load_deploy, stack_name_for
from infra.stack import FedRunStack
from shared.config import ConfigError


def build_app(app: App | None = None, asset_dir: Path | None = None) -> tuple[App, FedRunStack]:
    app = app or App()
    path = app.node.try_get_context("config")
    if not path:
        raise ConfigError("no run configuration: pass -c config=runs/<name>.toml")
    config, settings = load_deploy(path)
    name = stack_name_for(config, settings, app.node.try_get_context("stack"))
    stack = FedRunStack(app, name, config=config, settings=settings, asset_dir=asset_dir)
    add_checks(app)
    return app, stack


def main() -> int:
    try:
        app, _ = build_app()
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    app.synth()
    return 0


if __name__ == "__main__":
    sys.exit(main())
