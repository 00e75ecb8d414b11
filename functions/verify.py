"""Recompute every round's global model from the bucket and compare digests (`fed verify`).

Invariant 2 of the design: the global model of round r+1 is the run's strategy applied to exactly the
counted updates of round r, so anyone can recompute it from the bucket and match its digest. This
reads the round summaries (which updates counted), the update records (which object version and
digest was accepted), and recomputes with the same code path the tick uses.
"""

from __future__ import annotations

from dataclasses import dataclass

from functions.coordinator import aggregate_round
from functions.settings import Deps
from shared import keys
from shared.blobs import NotFound
from shared.state import Aggregate, AggregateInput
from shared.wire import digest


@dataclass(frozen=True)
class RoundCheck:
    round: int
    expected: str  # digest recorded for the round's aggregate
    recomputed: str
    stored: str  # digest of the object now at <round+1>/global
    problem: str = ""

    @property
    def ok(self) -> bool:
        return not self.problem and self.expected == self.recomputed == self.stored


def verify_run(deps: Deps) -> list[RoundCheck]:
    run_id = deps.config.run_id
    records = {(int(u.round), u.pid): u for u in deps.store.all_updates()}
    checks = []
    for summary in sorted(deps.store.rounds(), key=lambda s: s.round):
        if not summary.aggregated:
            continue
        try:
            inputs = []
            for pid in summary.counted:
                rec = records.get((summary.round, pid))
                if rec is None or not rec.accepted:
                    raise LookupError(f"no accepted update record for {pid}")
                inputs.append(AggregateInput(pid, int(rec.samples), rec.digest, rec.version_id))
            recomputed = digest(aggregate_round(deps, Aggregate(summary.round, tuple(inputs))))
            stored = digest(deps.bucket.get(keys.global_key(run_id, summary.round + 1, summary.global_digest)).data)
            checks.append(RoundCheck(summary.round, summary.global_digest, recomputed, stored))
        except (LookupError, NotFound, RuntimeError, ValueError) as exc:
            checks.append(RoundCheck(summary.round, summary.global_digest, "", "", f"{type(exc).__name__}: {exc}"))
    return checks
