"""Operator commands against a run, local or deployed: `fed run pause|resume|restore` and `fed verify`.

They call the same functions the coordinator's handlers use (`coordinator.operations`,
`coordinator.verify`) with a `coordinator.deps.Deps` built from the connection (a local connection
file, or a deployed stack's outputs) and the run's configuration as its first tick published it
(`runs/<run>/config.json`): so they need no copy of the run file, and cannot disagree with it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from coordinator.deps import Deps
from coordinator.verify import RoundCheck
from shared import keys
from shared.config import RunConfig
from shared.naming import tick_rule_name
from store.blobs import Bucket, NotFound, s3_client
from store.connection import Connection
from store.push import StateTopic
from store.schedule import Schedule
from store.table import StateStore


class OperateError(RuntimeError):
    """Something the operator must fix first; the message says what."""


def deps_for(conn: Connection) -> Deps:
    """The run's config and stores, as the functions see them, from a connection."""
    bucket = Bucket(conn.bucket, s3_client(conn.endpoint, conn.region))
    try:
        blob = bucket.get(keys.config_key(conn.run_id))
    except NotFound:
        raise OperateError(
            f"run {conn.run_id} has not published its configuration ({keys.config_key(conn.run_id)}): the "
            "coordinator writes it on its first tick; has the stack started?"
        ) from None
    config = RunConfig.model_validate_json(blob.data)
    if config.run_id != conn.run_id:
        raise OperateError(f"the bucket's config is for run {config.run_id!r}, the connection for {conn.run_id!r}")
    return Deps(config, StateStore(conn.table, conn.run_id, bucket, conn.endpoint, conn.region), bucket,
                schedule=Schedule.connect(tick_rule_name(conn.run_id), conn.endpoint, conn.region),
                topic=StateTopic.connect(conn.state_topic, conn.endpoint, conn.region))


@dataclass(frozen=True)
class VerifyLine:
    round: int
    recorded: str
    recomputed: str
    stored: str
    ok: bool
    problem: str
    expired: bool = False  # cannot be recomputed any more (its objects are gone); `passes` if nothing contradicts
    passes: bool = False
    optimizer: str = ""  # the server optimizer state recorded after the round ("": none)

    @classmethod
    def of(cls, check: RoundCheck) -> VerifyLine:
        problem = check.problem
        if not problem and not check.ok:
            parts = []
            if check.recomputed != check.expected:
                parts.append("recomputed differs from recorded")
            if check.stored != check.expected:
                parts.append("stored object differs from recorded")
            if check.optimizer_recomputed != check.optimizer_expected:
                parts.append("recomputed optimizer state differs from recorded")
            if check.optimizer_stored != check.optimizer_expected:
                parts.append(f"stored optimizer state differs from recorded ({check.optimizer_stored[:60]})")
            problem = "; ".join(parts)
        return cls(check.round, check.expected, check.recomputed, check.stored, check.ok, problem, check.expired,
                   check.passes, check.optimizer_expected)

    def to_json(self) -> dict[str, object]:
        return {"round": self.round, "recorded": self.recorded, "recomputed": self.recomputed,
                "stored": self.stored, "ok": self.ok, "problem": self.problem, "expired": self.expired,
                "passes": self.passes, "optimizer_state": self.optimizer}


@dataclass(frozen=True)
class Ticked:
    """What the coordinator's tick reported: committed, phase, epoch, round (the tick function's own summary)."""

    committed: bool
    phase: str
    epoch: int
    round: int


def tick_now(conn: Connection, deps: Deps) -> Ticked | None:
    """Have the coordinator tick now, as the coordinator: on AWS by invoking the tick function (the operator never
    holds the coordinator's rights), locally by running the tick in this process as the tick function's role (the
    local stack's stand-in for Lambda runs handlers where it is). None when there is nothing to invoke (a stack
    without the output): the next scheduled tick carries the request out."""
    if conn.endpoint:
        from coordinator.service import run_tick
        from store.trace import acting_as, function

        with acting_as(function("tick")):
            result = run_tick(deps)
        s = result.state
        return Ticked(result.committed, s.phase.value, s.epoch, s.round)
    if not conn.tick_function:
        return None
    import boto3

    client = boto3.client("lambda", region_name=conn.region)
    resp = client.invoke(FunctionName=conn.tick_function, InvocationType="RequestResponse",
                         Payload=json.dumps({"source": "fed.operator", "detail-type": "operator request"}).encode())
    payload = json.loads(resp["Payload"].read() or b"{}")
    if resp.get("FunctionError"):
        raise OperateError(f"the tick function failed: {str(payload)[:500]}")
    return Ticked(bool(payload.get("committed")), str(payload.get("phase", "?")), int(payload.get("epoch", 0)),
                  int(payload.get("round", 0)))

