"""Recompute every round's global model from the bucket and compare digests (`fed verify`).

Invariant 2 of the design: the global model of round r+1 is the run's strategy (and server optimizer) applied
to exactly the counted updates of round r, so anyone can recompute it from the bucket and match its digest —
and the optimizer state the step leaves, likewise. This
reads the round summaries (which updates counted), the update records (which object version and
digest was accepted), and recomputes with the same code path the tick uses.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from coordinator.aggregation import base_source, state_source, weighted_inputs
from coordinator.deps import Deps
from coordinator.model_files import read_global
from coordinator.optimizer_state import state_files
from shared import keys
from shared.aggregate import aggregate_digest, round_plan
from shared.server_opt import ServerStep
from shared.sizing import fedavg_weights
from shared.state import Aggregate, AggregateInput
from store.blobs import NotFound
from store.ranges import CorruptInput


@dataclass(frozen=True)
class RoundCheck:
    round: int
    expected: str  # digest recorded for the round's aggregate
    recomputed: str
    stored: str  # digest of the object now at <round+1>/global
    problem: str = ""
    expired: bool = False  # the round's objects are gone: it cannot be recomputed (`stored`: its checkpoint)
    optimizer_expected: str = ""  # the server optimizer state recorded after the round ("": none)
    optimizer_recomputed: str = ""
    optimizer_stored: str = ""  # the digest of the index now stored, if it and every piece it lists are intact

    @property
    def ok(self) -> bool:
        return (not self.problem and self.expected == self.recomputed == self.stored
                and self.optimizer_expected == self.optimizer_recomputed == self.optimizer_stored)

    @property
    def passes(self) -> bool:
        """Matches, or cannot be recomputed any more and nothing that is left contradicts the record."""
        return self.ok or (self.expired and self.stored in ("", self.expected))


EXPIRED = ("its update or global objects are gone from the bucket, so it cannot be recomputed: round objects "
           "expire after [deploy] round_objects_expire_days (30 by default; a deleted object looks the same). "
           "Checkpoints (checkpoints/<round>/global) do not expire")


def verify_run(deps: Deps) -> list[RoundCheck]:
    run_id = deps.config.run_id
    records = {(int(u.round), u.pid): u for u in deps.store.all_updates()}
    checks = []
    summaries = sorted(deps.store.rounds(), key=lambda s: s.round)
    trained_from = {s.round + 1: s.global_digest for s in summaries}  # the global each round started from
    state_from = {s.round + 1: s.optimizer_digest for s in summaries}  # and the optimizer state
    for summary in summaries:
        if not summary.aggregated:
            continue
        try:
            counted = []
            for pid in summary.counted:
                rec = records.get((summary.round, pid))
                if rec is None or not rec.accepted:
                    raise LookupError(f"no accepted update record for {pid}")
                counted.append(rec)
            weights = fedavg_weights({r.pid: int(r.samples) for r in counted}, deps.config.max_share_ratio)
            inputs = [AggregateInput(r.pid, weights[r.pid], r.digest, r.version_id, float(r.norm)) for r in counted]
            base = trained_from.get(summary.round) or _base_without_summary(deps, summary.round)
            state = (state_from[summary.round] if summary.round in state_from
                     else _state_without_summary(deps, summary.round))
            recomputed, recomputed_state = _recompute(deps, Aggregate(summary.round, tuple(inputs), base, state))
            stored = _stored_digest(deps, keys.global_key(run_id, summary.round + 1, summary.global_digest))
            stored_state = _stored_state(deps, summary.round + 1, summary.optimizer_digest)
            checks.append(RoundCheck(summary.round, summary.global_digest, recomputed, stored,
                                     optimizer_expected=summary.optimizer_digest,
                                     optimizer_recomputed=recomputed_state, optimizer_stored=stored_state))
        except CorruptInput as exc:
            if not exc.missing:
                checks.append(RoundCheck(summary.round, summary.global_digest, "", "", f"{type(exc).__name__}: {exc}"))
                continue
            kept = _checkpointed(deps, summary.round + 1)
            problem = EXPIRED + (f"; its checkpoint {'matches' if kept == summary.global_digest else 'DIFFERS'}"
                                 if kept else "; no checkpoint keeps its global model")
            checks.append(RoundCheck(summary.round, summary.global_digest, "", kept, problem, expired=True))
        except (LookupError, NotFound, RuntimeError, ValueError) as exc:
            checks.append(RoundCheck(summary.round, summary.global_digest, "", "", f"{type(exc).__name__}: {exc}"))
    return checks


def _recompute(deps: Deps, effect: Aggregate) -> tuple[str, str]:
    """The digests of the global model and optimizer state `effect` makes, computed piece by piece (memory:
    about two pieces)."""
    base = read_global(deps, effect.round, effect.base_digest)
    inputs = weighted_inputs(deps, effect.round, base, effect.inputs)
    plan = round_plan(deps.config, base.manifest, effect.round + 1, inputs)
    state = state_source(deps, effect.round, effect.optimizer_digest, plan)
    return aggregate_digest(deps.config, base.manifest, effect.round + 1, inputs, base_source(deps, base), state)


def _stored_state(deps: Deps, round_no: int, recorded: str) -> str:
    """The recorded state's digest if its index and every piece file it lists are stored intact (their current
    versions), else what differs."""
    if not recorded:
        return ""
    files = state_files(deps, round_no, recorded)
    for file_digest in files:
        now = _stored_digest(deps, keys.optimizer_key(deps.config.run_id, round_no, file_digest))
        if now != file_digest:
            return f"file {file_digest[:16]} now holds {now[:16]}"
    return recorded


def _stored_digest(deps: Deps, key: str) -> str:
    return deps.bucket.digest_of(key)[0]


def _checkpointed(deps: Deps, round_no: int) -> str:
    """The digest of the checkpoint kept of the global model round `round_no` trains from, or ""."""
    try:
        return _stored_digest(deps, keys.checkpoint_global_key(deps.config.run_id, round_no))
    except NotFound:
        return ""


def _state_without_summary(deps: Deps, round_no: int) -> str:
    """The optimizer state a round started from when no earlier round is recorded: none at the run's start,
    else the one the checkpoint `fed run restore` started from kept."""
    if round_no == 0 or ServerStep.of(deps.config) is None:
        return ""
    try:
        body = json.loads(deps.bucket.get(keys.checkpoint_state_key(deps.config.run_id, round_no)).data)
    except NotFound:
        raise LookupError(f"which optimizer state round {round_no} started from is not recorded") from None
    return str(body.get("optimizer_digest", ""))


def _base_without_summary(deps: Deps, round_no: int) -> str:
    """The model a round trained from when no earlier round is recorded (the run's first round, or the first
    after `fed run restore`): the one global model stored for it, or the adopted initial model."""
    stored = deps.bucket.keys(keys.global_prefix(deps.config.run_id, round_no))
    if len(stored) == 1:
        return stored[0].rsplit("/", 1)[1]
    state = deps.store.read_state()
    source = deps.store.participant(state.model_source) if state.model_source else None
    if round_no == 0 and source is not None and source.init_digest:
        return source.init_digest
    raise LookupError(f"which global model round {round_no} trained from is not recorded")
