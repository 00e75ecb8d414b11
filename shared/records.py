"""DynamoDB items (pynamodb) of one run's table, and their conversion to the core's dataclasses.

One table per run, keys `pk` / `sk`:
    RUN#<run>  STATE                    the coordinator state (owned by the tick; versioned)
    RUN#<run>  P#<participant>          join and liveness facts (owned by ingest)
    RUN#<run>  U#<round>#<participant>  one update: accepted with its weight, or refused with a reason
    RUN#<run>  R#<round>                a finished round's summary (metrics history)
    RUN#<run>  W#<round>#<witness>      a witness proof (validated)
    RUN#<run>  H#<round>#<reporter>     a health report naming peers believed unhealthy
    RUN#<run>  COUNT#participants       how many participants have joined (bounded by max_participants)
    RUN#<run>  X#<hash of key, etag>    an object refused outside any round slot, with the reason
Every stored document carries `schema`.
"""

from __future__ import annotations

import hashlib
from functools import cache
from typing import Any

from pynamodb.attributes import (
    BooleanAttribute,
    JSONAttribute,
    NumberAttribute,
    UnicodeAttribute,
    VersionAttribute,
)
from pynamodb.models import Model

from shared.keys import ROUND_DIGITS
from shared.state import Member, MemberStatus, ParticipantView, Phase, RoundSummary, RunState, UpdateView

SCHEMA = 1


def run_pk(run_id: str) -> str:
    return f"RUN#{run_id}"


STATE_SK = "STATE"


def participant_sk(pid: str) -> str:
    return f"P#{pid}"


def update_sk(round_no: int, pid: str = "") -> str:
    return f"U#{round_no:0{ROUND_DIGITS}d}#{pid}"


def round_sk(round_no: int) -> str:
    return f"R#{round_no:0{ROUND_DIGITS}d}"


def proof_sk(round_no: int, pid: str = "") -> str:
    return f"W#{round_no:0{ROUND_DIGITS}d}#{pid}"


def health_sk(round_no: int, pid: str = "") -> str:
    return f"H#{round_no:0{ROUND_DIGITS}d}#{pid}"


def refusal_sk(key: str, etag: str) -> str:
    return "X#" + hashlib.sha256(f"{key}\n{etag}".encode()).hexdigest()[:40]


class _Item(Model):
    pk = UnicodeAttribute(hash_key=True)
    sk = UnicodeAttribute(range_key=True)
    schema = NumberAttribute(default=SCHEMA)


class RunItem(_Item):
    version = VersionAttribute()
    phase = UnicodeAttribute()
    round = NumberAttribute()
    epoch = NumberAttribute()
    body = JSONAttribute()


class ParticipantItem(_Item):
    pid = UnicodeAttribute()
    joined_at = NumberAttribute()
    last_seen = NumberAttribute()
    ready_epoch = NumberAttribute(default=0)
    init_digest = UnicodeAttribute(default="")
    public_key = UnicodeAttribute(default="")
    info = JSONAttribute(default=dict)


class UpdateItem(_Item):
    round = NumberAttribute()
    pid = UnicodeAttribute()
    accepted = BooleanAttribute()
    reason = UnicodeAttribute(default="")
    samples = NumberAttribute(default=0)
    digest = UnicodeAttribute(default="")
    size = NumberAttribute(default=0)
    key = UnicodeAttribute()
    etag = UnicodeAttribute(default="")
    version_id = UnicodeAttribute(default="")
    norm = NumberAttribute(default=-1.0)
    received_at = NumberAttribute()
    metrics = JSONAttribute(default=dict)


class RoundItem(_Item):
    round = NumberAttribute()
    body = JSONAttribute()


class ProofItem(_Item):
    round = NumberAttribute()
    pid = UnicodeAttribute()
    etag = UnicodeAttribute(default="")
    body = UnicodeAttribute()  # the proof's JSON, as uploaded and validated
    received_at = NumberAttribute()


class HealthItem(_Item):
    round = NumberAttribute()
    pid = UnicodeAttribute()
    named = JSONAttribute()
    received_at = NumberAttribute()


class CounterItem(_Item):
    n = NumberAttribute(default=0)


PARTICIPANT_COUNT_SK = "COUNT#participants"


class RefusalItem(_Item):
    key = UnicodeAttribute()
    etag = UnicodeAttribute(default="")
    reason = UnicodeAttribute()
    at = NumberAttribute()
    pid = UnicodeAttribute(default="")


class Models:
    """The item classes bound to one table and endpoint."""

    def __init__(self, table: str, host: str | None, region: str) -> None:
        self.run = _bind(RunItem, table, host, region)
        self.participant = _bind(ParticipantItem, table, host, region)
        self.update = _bind(UpdateItem, table, host, region)
        self.round = _bind(RoundItem, table, host, region)
        self.refusal = _bind(RefusalItem, table, host, region)
        self.counter = _bind(CounterItem, table, host, region)
        self.proof = _bind(ProofItem, table, host, region)
        self.health = _bind(HealthItem, table, host, region)


@cache
def models(table: str, host: str | None = None, region: str = "us-east-1") -> Models:
    return Models(table, host, region)


def _bind(cls: type[_Item], table: str, host: str | None, region: str) -> Any:
    meta = type("Meta", (), {"table_name": table, "host": host, "region": region, "max_retry_attempts": 8})
    return type(cls.__name__, (cls,), {"Meta": meta})


# --- conversions ---------------------------------------------------------------------------------------


def state_to_body(state: RunState) -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        "run_id": state.run_id,
        "phase": state.phase.value,
        "epoch": state.epoch,
        "round": state.round,
        "aggregated": state.aggregated,
        "seed": state.seed,
        "phase_started": state.phase_started,
        "deadline": state.deadline,
        "round_started": state.round_started,
        "rounds_in_epoch": state.rounds_in_epoch,
        "members": {
            p: {"status": m.status.value, "since": m.since, "reason": m.reason}
            for p, m in sorted(state.members.items())
        },
        "selected": list(state.selected),
        "counted": list(state.counted),
        "excluded": dict(state.excluded),
        "global_digest": state.global_digest,
        "model_source": state.model_source,
        "witnesses": list(state.witnesses),
        "epoch_started": state.epoch_started,
        "health_round": state.health_round,
        "health": dict(state.health),
        "health_quorum": state.health_quorum,
        "pause_requested": state.pause_requested,
    }


def state_from_body(body: dict[str, Any], version: int) -> RunState:
    return RunState(
        run_id=body["run_id"],
        version=version,
        phase=Phase(body["phase"]),
        epoch=int(body["epoch"]),
        round=int(body["round"]),
        aggregated=int(body["aggregated"]),
        seed=body["seed"],
        phase_started=float(body["phase_started"]),
        deadline=float(body["deadline"]),
        round_started=float(body["round_started"]),
        rounds_in_epoch=int(body["rounds_in_epoch"]),
        members={
            p: Member(MemberStatus(m["status"]), float(m["since"]), m["reason"]) for p, m in body["members"].items()
        },
        selected=tuple(body["selected"]),
        counted=tuple(body["counted"]),
        excluded=dict(body.get("excluded", {})),
        global_digest=body["global_digest"],
        model_source=body["model_source"],
        witnesses=tuple(body.get("witnesses", ())),
        epoch_started=float(body.get("epoch_started", 0.0)),
        health_round=int(body.get("health_round", -1)),
        health={k: int(v) for k, v in body.get("health", {}).items()},
        health_quorum=int(body.get("health_quorum", 0)),
        pause_requested=bool(body.get("pause_requested", False)),
    )


def participant_view(item: ParticipantItem) -> ParticipantView:
    return ParticipantView(
        pid=item.pid,
        joined_at=float(item.joined_at),
        last_seen=float(item.last_seen),
        ready_epoch=int(item.ready_epoch),
        init_digest=item.init_digest,
    )


def update_view(item: UpdateItem) -> UpdateView:
    return UpdateView(
        pid=item.pid,
        round=int(item.round),
        accepted=bool(item.accepted),
        samples=int(item.samples),
        digest=item.digest,
        reason=item.reason,
        metrics={k: float(v) for k, v in (item.metrics or {}).items()},
        version_id=item.version_id,
        norm=float(item.norm),
    )


def summary_to_body(s: RoundSummary) -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        "round": s.round,
        "epoch": s.epoch,
        "selected": list(s.selected),
        "counted": list(s.counted),
        "refused": dict(s.refused),
        "dropped": dict(s.dropped),
        "samples": s.samples,
        "loss": s.loss,
        "accuracy": s.accuracy,
        "started": s.started,
        "ended": s.ended,
        "aggregated": s.aggregated,
        "global_digest": s.global_digest,
        "witnesses": list(s.witnesses),
        "proofs": s.proofs,
        "quorum": s.quorum,
        "health": dict(s.health),
    }


def summary_from_body(b: dict[str, Any]) -> RoundSummary:
    return RoundSummary(
        round=int(b["round"]),
        epoch=int(b["epoch"]),
        selected=tuple(b["selected"]),
        counted=tuple(b["counted"]),
        refused=dict(b["refused"]),
        dropped=dict(b["dropped"]),
        samples=int(b["samples"]),
        loss=b["loss"],
        accuracy=b["accuracy"],
        started=float(b["started"]),
        ended=float(b["ended"]),
        aggregated=bool(b["aggregated"]),
        global_digest=b.get("global_digest", ""),
        witnesses=tuple(b.get("witnesses", ())),
        proofs=int(b.get("proofs", 0)),
        quorum=int(b.get("quorum", 0)),
        health={k: int(v) for k, v in b.get("health", {}).items()},
    )
