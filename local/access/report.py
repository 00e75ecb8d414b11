"""The access check's report over a test session: every denied call, and every granted action with the tests that
exercised it or the written reason it is granted all the same (`infra/unexercised_grants.toml`).

A grant nothing exercises and no reason explains is a finding: either a test is missing, or the role grants more
than the code uses.
"""

from __future__ import annotations

import tomllib
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from local.access.ledger import ALLOWED, MISSING_AS_403, UNJUDGED, CallKey, Denial
from local.access.model import AccessModel

REASONS = Path(__file__).resolve().parents[2] / "infra" / "unexercised_grants.toml"


@dataclass
class Report:
    grants: dict[str, set[str]]  # role -> actions its policies allow
    exercised: dict[tuple[str, str], set[str]] = field(default_factory=dict)  # (role, action) -> tests
    reasons: dict[tuple[str, str], str] = field(default_factory=dict)
    denials: list[Denial] = field(default_factory=list)
    expected: set[str] = field(default_factory=set)  # tests whose denials are what they test
    missing_as_403: dict[str, int] = field(default_factory=dict)  # role -> reads of missing keys answered 403
    unjudged: dict[str, int] = field(default_factory=dict)  # code path -> calls by no principal of the system
    calls: int = 0

    @property
    def unexpected_denials(self) -> list[Denial]:
        return [d for d in self.denials if d.test not in self.expected]

    @property
    def unexplained(self) -> list[tuple[str, str]]:
        """Granted, never exercised, and no reason given."""
        return sorted((role, action) for role, actions in self.grants.items() for action in actions
                      if (role, action) not in self.exercised and (role, action) not in self.reasons)

    @property
    def stale_reasons(self) -> list[tuple[str, str]]:
        """Reasons for actions no role grants any more."""
        return sorted(k for k in self.reasons if k[1] not in self.grants.get(k[0], set()))

    @property
    def ok(self) -> bool:
        return not self.unexpected_denials and not self.unexplained and not self.stale_reasons

    def render(self) -> str:
        unexpected = len(self.unexpected_denials)
        lines = ["# Access check", "",
                 f"{self.calls} AWS calls judged against the synthesized template's roles; {unexpected} denied "
                 f"unexpectedly, {len(self.denials) - unexpected} denied in tests of refusals.", ""]
        if self.unexpected_denials:
            lines += ["## Denied calls", ""]
            for d in self.unexpected_denials:
                lines.append(f"- {d.test}: {d.principal} {d.operation} {d.action} on {d.resource}: {d.why} "
                             f"(from {d.caller or 'unknown code'})")
            lines.append("")
        lines += ["## Granted actions", "", "| role | action | exercised by | or granted because |",
                  "|---|---|---|---|"]
        for role in sorted(self.grants):
            for action in sorted(self.grants[role]):
                tests = sorted(t for t in self.exercised.get((role, action), set()) if t) or \
                    sorted(self.exercised.get((role, action), set()))
                tests = [t or "(a process no test named)" for t in tests]
                shown = ", ".join(t.rsplit("::", 1)[-1] for t in tests[:3]) + (f" (+{len(tests) - 3})"
                                                                               if len(tests) > 3 else "")
                reason = self.reasons.get((role, action), "")
                mark = "" if tests or reason else " **unexplained**"
                lines.append(f"| {role} | {action} | {shown} | {reason}{mark} |")
        if self.stale_reasons:
            lines += ["", "## Reasons for actions no role grants", ""]
            lines += [f"- {role} {action}" for role, action in self.stale_reasons]
        if self.missing_as_403:
            lines += ["", "## Reads of missing keys answered 403 (no s3:ListBucket), as S3 answers them", ""]
            lines += [f"- {role}: {n}" for role, n in sorted(self.missing_as_403.items())]
        if self.unjudged:
            lines += ["", "## Calls by no principal of the system (tests looking at the stack, AWS's stand-ins)", ""]
            top = sorted(self.unjudged.items(), key=lambda kv: -kv[1])[:15]
            lines += [f"- {n} from {where or 'unknown code'}" for where, n in top]
        return "\n".join(lines) + "\n"


def load_reasons(path: Path = REASONS) -> dict[tuple[str, str], str]:
    data = tomllib.loads(path.read_text()) if path.is_file() else {}
    return {(row["role"], row["action"]): row["reason"] for row in data.get("grant", [])}


def build_report(models: Iterable[AccessModel], calls: Iterable[tuple[CallKey, int]], denials: Iterable[Denial],
                 expected: Iterable[str] = (), reasons: Mapping[tuple[str, str], str] | None = None) -> Report:
    grants: dict[str, set[str]] = defaultdict(set)
    for model in models:
        for role, principal in model.principals.items():
            grants[role] |= principal.granted_actions()
    report = Report(dict(grants), reasons=dict(load_reasons() if reasons is None else reasons),
                    denials=list(denials), expected=set(expected))
    exercised: dict[tuple[str, str], set[str]] = defaultdict(set)
    missing: dict[str, int] = defaultdict(int)
    unjudged: dict[str, int] = defaultdict(int)
    for key, count in calls:
        report.calls += count
        if key.outcome == ALLOWED:
            exercised[(key.role, key.action)].add(key.test)
        elif key.outcome == MISSING_AS_403:
            missing[key.role] += count
        elif key.outcome == UNJUDGED:
            unjudged[key.caller] += count
    report.exercised, report.missing_as_403, report.unjudged = dict(exercised), dict(missing), dict(unjudged)
    return report
