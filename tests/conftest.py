"""The access check over every test (`local.access`): each AWS call the system makes is judged against the role
that makes it on AWS, in the template `cdk synth` produces, and refused as IAM would refuse it.

A denied call fails the test that made it (naming the call, the principal, the code path and what is missing),
unless the test is marked `access_denied_expected` (it tests a refusal). With `--access-report PATH` (`make test`),
the session ends by writing the report (every granted action with a test that exercised it, or the written reason
in infra/unexercised_grants.toml) and fails if any grant is unexplained.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

from local.access import ENV_CHECK
from local.access.ledger import ENV_LEDGER, read_calls, read_denials
from store import trace

_EXPECTED: set[str] = set()

# Property tests draw the same examples on every run (a CI run must not find a new one by chance and fail); run
# with `--hypothesis-seed=N` (or HYPOTHESIS_PROFILE=explore) to search further.
settings.register_profile("ci", derandomize=True, database=None)
settings.register_profile("explore")
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--access-report", metavar="PATH", default=None,
                     help="write the access check's report here and fail on grants nothing exercises or explains")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "access_denied_expected: the test makes calls IAM refuses, on purpose")
    if not os.environ.get(ENV_LEDGER):
        os.environ[ENV_LEDGER] = tempfile.mkdtemp(prefix="fed-access-")
    os.environ.setdefault(ENV_CHECK, "enforce")
    os.environ[trace.ENV_TRACE] = "1"
    trace.install()


def ledger_dir() -> Path:
    return Path(os.environ[ENV_LEDGER])


@pytest.fixture(autouse=True)
def _no_denied_calls(request: pytest.FixtureRequest) -> Iterator[None]:
    began = time.time()
    yield
    node = request.node.nodeid
    if request.node.get_closest_marker("access_denied_expected"):
        _EXPECTED.add(node)
        return
    denied = [d for d in read_denials(ledger_dir(), since=began) if d.test == node]
    if denied:
        lines = [f"{d.principal} {d.operation}: {d.action} on {d.resource}: {d.why}\n    from {d.caller or '?'}"
                 for d in denied[:10]]
        pytest.fail(f"{len(denied)} AWS call(s) the deployed roles would refuse:\n" + "\n".join(lines),
                    pytrace=False)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    path = session.config.getoption("--access-report")
    if not path:
        return
    from local.access import model_for, shared_ledger
    from local.access.report import build_report
    from shared.config import RunConfig

    ledger = shared_ledger()
    if ledger is not None:
        ledger.flush()  # this process's (in-process moto); the servers' were flushed when they stopped
    models = [model_for(RunConfig(run_id="report-run", witness_nodes=w)) for w in (0, 2)]
    report = build_report(models, read_calls(ledger_dir()), read_denials(ledger_dir()), _EXPECTED)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report.render())
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    summary = (f"access check: {report.calls} calls, {len(report.unexpected_denials)} denied, "
               f"{len(report.unexplained)} granted action(s) neither exercised nor explained, "
               f"{len(report.stale_reasons)} stale reason(s); report in {out}")
    if reporter is not None:
        reporter.write_line(summary)
    if not report.ok and session.exitstatus == 0:
        for role, action in report.unexplained:
            if reporter is not None:
                reporter.write_line(f"  unexplained grant: {role} {action}")
        session.exitstatus = 1
