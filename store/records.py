"""DynamoDB items (pynamodb) of one run's table, and their conversion to the core's dataclasses.

The key layout is `shared/table_keys.py`. Every stored document carries `schema`.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from pynamodb.attributes import (
    BooleanAttribute,
    JSONAttribute,
    NumberAttribute,
    UnicodeAttribute,
    UnicodeSetAttribute,
    VersionAttribute,
)
from pynamodb.connection import Connection
from pynamodb.exceptions import PynamoDBException
from pynamodb.models import Model

from shared.hosts import HostRecord, HostRefusal, HostStatus, RefusalKind, Revocation
from shared.sizing import Share, Speed
from shared.state import Member, MemberStatus, ParticipantView, Phase, RoundSummary, RunState, UpdateView
from shared.table_keys import TTL_ATTRIBUTE
from store.views import ParticipantRecord, ProofRecord, RefusalRecord, UpdateRecord

SCHEMA = 1


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
    init_version = UnicodeAttribute(default="")  # the S3 version of the offer ingest checked: adoption reads that one
    public_key = UnicodeAttribute(default="")
    info = JSONAttribute(default=dict)
    last_sent = NumberAttribute(default=0)  # `sent_at` of the last join or heartbeat accepted (replays are older)
    heard_at = NumberAttribute(default=0)  # last signed message accepted after the registering join; 0: none
    # heard from only through the heartbeat its join request found (`coordinator.intake`): no tick saw it eligible
    unticked = BooleanAttribute(default=False)
    samples = NumberAttribute(default=0)  # local data mode: the sample count registered at join; 0: none
    # training progress from the latest heartbeat (`Heartbeat.progress`) and when it last moved; its measured rate
    progress = JSONAttribute(default=dict)
    progress_at = NumberAttribute(default=0)
    rate = NumberAttribute(default=0)


class OfferItem(_Item):
    """An initial-model offer checked against the key of its sender's join request, not yet registered."""

    digest = UnicodeAttribute()
    public_key = UnicodeAttribute()
    version_id = UnicodeAttribute(default="")  # the S3 version of the offer that was checked


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
    data_offset = NumberAttribute(default=-1)  # where the file's data section starts (-1: not recorded)
    received_at = NumberAttribute()
    metrics = JSONAttribute(default=dict)


class RoundItem(_Item):
    round = NumberAttribute()
    body = JSONAttribute()


class ProofItem(_Item):
    round = NumberAttribute()
    pid = UnicodeAttribute()
    etag = UnicodeAttribute(default="")
    body = UnicodeAttribute()  # the proof's JSON, as uploaded and validated; "" for a refused one
    received_at = NumberAttribute()
    refused = UnicodeAttribute(default="")  # why ingest refused the elected witness's signed proof; "": accepted


class HealthItem(_Item):
    round = NumberAttribute()
    pid = UnicodeAttribute()
    named = JSONAttribute()
    received_at = NumberAttribute()


class CounterItem(_Item):
    n = NumberAttribute(default=0)


class LeaseItem(_Item):
    holder = UnicodeAttribute()
    until = NumberAttribute()


class RefusalItem(_Item):
    key = UnicodeAttribute()
    etag = UnicodeAttribute(default="")
    reason = UnicodeAttribute()
    at = NumberAttribute()
    pid = UnicodeAttribute(default="")


class HostItem(_Item):
    """A host outside AWS (`shared.hosts.HostRecord`); times are epoch seconds, 0 for "not yet"."""

    pid = UnicodeAttribute()
    status = UnicodeAttribute()
    secret_hash = UnicodeAttribute(default="")  # the invite secret's SHA-256, never the secret
    invite_expires = NumberAttribute(default=0)
    invited_at = NumberAttribute(default=0)
    public_key = UnicodeAttribute(default="")
    redeemed_at = NumberAttribute(default=0)
    last_credentials_at = NumberAttribute(default=0)
    revoked_at = NumberAttribute(default=0)
    revoke_reason = UnicodeAttribute(default="")
    generation = NumberAttribute(default=1)
    upload_key = UnicodeAttribute(default="")
    registered_key = UnicodeAttribute(default="")
    retired_keys = UnicodeSetAttribute(null=True)


class HostRevocationItem(_Item):
    """A revoked generation of a host, kept while a session issued before its revocation could live."""

    pid = UnicodeAttribute()
    generation = NumberAttribute()
    at = NumberAttribute()
    expires_at = NumberAttribute(attr_name=TTL_ATTRIBUTE)


class HostNonceItem(_Item):
    """A renewal's nonce, used once; kept until no renewal carrying it could be accepted any more."""

    pid = UnicodeAttribute()
    expires_at = NumberAttribute(attr_name=TTL_ATTRIBUTE)


class HostRateItem(_Item):
    """Requests to the credential endpoint in one minute of one scope (`shared.table_keys.host_rate_sk`): `n`, all
    of them; those past the scope's limit were refused (counted here, not recorded one by one)."""

    n = NumberAttribute(default=0)
    expires_at = NumberAttribute(attr_name=TTL_ATTRIBUTE)


class UploadCountItem(_Item):
    """Objects one participant uploaded in one budget window (`store.budget`): `n` within the budget."""

    n = NumberAttribute(default=0)
    expires_at = NumberAttribute(attr_name=TTL_ATTRIBUTE)


class DroppedItem(_Item):
    """Objects of one participant dropped over its upload budget, counted here rather than recorded one by one."""

    pid = UnicodeAttribute(default="")
    n = NumberAttribute(default=0)
    last_at = NumberAttribute(default=0)


class HostRefusalItem(_Item):
    """The refusals of one kind naming one host (`shared.hosts.HostRefusal`): one item, however many."""

    pid = UnicodeAttribute()  # the invited host the requests named; shared.hosts.UNKNOWN_HOST for the rest
    kind = UnicodeAttribute()
    n = NumberAttribute(default=0)  # how many
    first_reason = UnicodeAttribute(default="")
    first_at = NumberAttribute(default=0)
    reason = UnicodeAttribute(default="")  # the latest
    at = NumberAttribute(default=0)
    expires_at = NumberAttribute(attr_name=TTL_ATTRIBUTE)


MAX_RETRY_ATTEMPTS = 8
MAX_POOL_CONNECTIONS = 32  # every item class's requests share them (a local dispatcher runs a dozen functions at once)


class Models:
    """The item classes bound to one table and endpoint, all sending through one pynamodb Connection.

    One, not one per class: pynamodb gives each class a Connection of its own, and each builds its botocore client
    the first time the class is used, loading botocore's description of DynamoDB anew — 50-250 ms each, 1.1 s of
    CPU for these ten measured here, spread over a Lambda's first invocations or a local run's admission."""

    def __init__(self, table: str, host: str | None, region: str) -> None:
        self.connection = Connection(region=region, host=host, max_retry_attempts=MAX_RETRY_ATTEMPTS,
                                     max_pool_connections=MAX_POOL_CONNECTIONS)
        # Its client is built now, before any thread shares it: pynamodb builds it on first use, unlocked, and then
        # registers a hook on it, which a thread already sending through that client could be iterating the hooks of.
        _ = self.connection.client
        self._schema_added = False
        self.run = self._bind(RunItem, table, host, region)
        self.participant = self._bind(ParticipantItem, table, host, region)
        self.update = self._bind(UpdateItem, table, host, region)
        self.offer = self._bind(OfferItem, table, host, region)
        self.round = self._bind(RoundItem, table, host, region)
        self.refusal = self._bind(RefusalItem, table, host, region)
        self.counter = self._bind(CounterItem, table, host, region)
        self.lease = self._bind(LeaseItem, table, host, region)
        self.proof = self._bind(ProofItem, table, host, region)
        self.health = self._bind(HealthItem, table, host, region)
        self.host = self._bind(HostItem, table, host, region)
        self.host_nonce = self._bind(HostNonceItem, table, host, region)
        self.host_rate = self._bind(HostRateItem, table, host, region)
        self.host_refusal = self._bind(HostRefusalItem, table, host, region)
        self.upload_count = self._bind(UploadCountItem, table, host, region)
        self.dropped = self._bind(DroppedItem, table, host, region)
        self.host_revocation = self._bind(HostRevocationItem, table, host, region)

    def _bind(self, cls: type[_Item], table: str, host: str | None, region: str) -> Any:
        meta = type("Meta", (), {"table_name": table, "host": host, "region": region,
                                 "max_retry_attempts": MAX_RETRY_ATTEMPTS})
        bound: type[_Item] = type(cls.__name__, (cls,), {"Meta": meta})
        table_connection = bound._get_connection()  # (its own Connection holds no client until it is used)
        if not self._schema_added:  # the same key schema for every class: registered once
            self.connection.add_meta_table(table_connection.get_meta_table())
            self._schema_added = True
        table_connection.connection = self.connection
        return bound


@cache
def models(table: str, host: str | None = None, region: str = "us-east-1") -> Models:
    return Models(table, host, region)


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
            p: {"status": m.status.value, "since": m.since, "reason": m.reason, "heard": m.heard}
            for p, m in sorted(state.members.items())
        },
        "selected": list(state.selected),
        "counted": list(state.counted),
        "counted_last": list(state.counted_last),
        "excluded": dict(state.excluded),
        "global_digest": state.global_digest,
        "optimizer_digest": state.optimizer_digest,
        "model_source": state.model_source,
        "witnesses": list(state.witnesses),
        "epoch_started": state.epoch_started,
        "health_round": state.health_round,
        "health": dict(state.health),
        "health_quorum": state.health_quorum,
        "strikes": dict(state.strikes),
        "strikes_needed": state.strikes_needed,
        "witness_strikes": dict(state.witness_strikes),
        "unseated": list(state.unseated),
        "pause_requested": state.pause_requested,
        # (6 significant digits: a measurement has fewer; keeps the item small with many participants)
        "speeds": {p: [float(f"{v.rate:.6g}"), float(f"{v.overhead:.6g}"), v.rounds]
                   for p, v in sorted(state.speeds.items())},
        "plan": [[share.pid, share.weight, share.steps] for share in state.plan],
        "late": list(state.late),
        "round_units": state.round_units,
    }


# What of the state grows with the membership: kept out of the state item (`store.rosters`), so that the item
# every participant polls has the same size whatever the number of members.
ROSTER_FIELDS = ("members", "selected", "counted", "counted_last", "excluded", "witnesses", "health", "strikes",
                 "witness_strikes", "unseated", "speeds", "plan", "late")
ROSTER = "roster"  # the state item's field naming its roster (a digest; "": every roster field empty)
# The state item's field recording the S3 version id of each object it names that is read back by a verified read
# (`store.blobs.Bucket.read_verified`), by its role: ROSTER, GLOBAL, OPTIMIZER (`store.table.named_objects`). Absent
# from items committed before it existed, and for an object whose version the committing process did not know.
VERSIONS = "versions"
GLOBAL, OPTIMIZER = "global", "optimizer"


def split_body(body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the state item's part, the roster) of a whole state body."""
    return ({k: v for k, v in body.items() if k not in ROSTER_FIELDS}, {k: body[k] for k in ROSTER_FIELDS})


def joined_body(head: dict[str, Any], roster: dict[str, Any]) -> dict[str, Any]:
    """The whole state body of a state item's part and its roster ({}: the empty one)."""
    return {**_EMPTY_ROSTER, **roster, **{k: v for k, v in head.items() if k not in (ROSTER, VERSIONS)}}


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
            p: Member(MemberStatus(m["status"]), float(m["since"]), m["reason"], float(m.get("heard", 0.0)))
            for p, m in body["members"].items()
        },
        selected=tuple(body["selected"]),
        counted=tuple(body["counted"]),
        counted_last=tuple(body.get("counted_last", ())),
        excluded=dict(body.get("excluded", {})),
        global_digest=body["global_digest"],
        optimizer_digest=body.get("optimizer_digest", ""),
        model_source=body["model_source"],
        witnesses=tuple(body.get("witnesses", ())),
        epoch_started=float(body.get("epoch_started", 0.0)),
        health_round=int(body.get("health_round", -1)),
        health={k: int(v) for k, v in body.get("health", {}).items()},
        health_quorum=int(body.get("health_quorum", 0)),
        strikes={k: int(v) for k, v in body.get("strikes", {}).items()},
        strikes_needed=int(body.get("strikes_needed", 1)),
        witness_strikes={k: int(v) for k, v in body.get("witness_strikes", {}).items()},
        unseated=tuple(body.get("unseated", ())),
        pause_requested=bool(body.get("pause_requested", False)),
        speeds={p: Speed(float(v[0]), float(v[1]), int(v[2])) for p, v in body.get("speeds", {}).items()},
        plan=tuple(Share(str(p), int(w), int(n)) for p, w, n in body.get("plan", ())),
        late=tuple(body.get("late", ())),
        round_units=float(body.get("round_units", 0.0)),
    )


_EMPTY_ROSTER = split_body(state_to_body(RunState("empty")))[1]  # a new run's: every roster field empty


def participant_view(item: ParticipantItem) -> ParticipantView:
    return participant_record(item).view()


def participant_record(item: ParticipantItem) -> ParticipantRecord:
    return ParticipantRecord(
        pid=item.pid,
        joined_at=float(item.joined_at),
        last_seen=float(item.last_seen),
        ready_epoch=int(item.ready_epoch),
        init_digest=item.init_digest,
        init_version=item.init_version,
        public_key=item.public_key,
        info=dict(item.info or {}),
        last_sent=float(item.last_sent or 0),
        heard_at=float(item.heard_at or 0),
        unticked=bool(item.unticked),
        samples=int(item.samples or 0),
        progress=progress_of(item.progress),
        progress_at=float(item.progress_at or 0),
        rate=float(item.rate or 0),
    )


def progress_of(raw: Any) -> tuple[int, int, int]:
    """(round, done, total) of a stored progress document; (-1, 0, 0) when there is none."""
    if not isinstance(raw, dict) or "round" not in raw:
        return (-1, 0, 0)
    return (int(raw["round"]), int(raw.get("done", 0)), int(raw.get("total", 0)))


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
        received_at=float(item.received_at),
        data_offset=int(item.data_offset if item.data_offset is not None else -1),
    )


def update_record(item: UpdateItem) -> UpdateRecord:
    return UpdateRecord(
        round=int(item.round),
        pid=item.pid,
        key=item.key,
        accepted=bool(item.accepted),
        reason=item.reason,
        samples=int(item.samples),
        digest=item.digest,
        size=int(item.size),
        etag=item.etag,
        version_id=item.version_id,
        norm=float(item.norm),
        received_at=float(item.received_at),
        data_offset=int(item.data_offset if item.data_offset is not None else -1),
        metrics={k: float(v) for k, v in (item.metrics or {}).items()},
    )


def proof_record(item: ProofItem) -> ProofRecord:
    return ProofRecord(
        round=int(item.round),
        pid=item.pid,
        etag=item.etag,
        body=item.body,
        received_at=float(item.received_at),
    )


def refusal_record(item: RefusalItem) -> RefusalRecord:
    return RefusalRecord(key=item.key, etag=item.etag, reason=item.reason, at=float(item.at), pid=item.pid)


def host_record(item: HostItem) -> HostRecord:
    return HostRecord(
        host=item.pid,
        status=HostStatus(item.status),
        secret_hash=item.secret_hash or "",
        invite_expires=float(item.invite_expires or 0),
        invited_at=float(item.invited_at or 0),
        public_key=item.public_key or "",
        redeemed_at=float(item.redeemed_at or 0),
        last_credentials_at=float(item.last_credentials_at or 0),
        revoked_at=float(item.revoked_at or 0),
        revoke_reason=item.revoke_reason or "",
        generation=int(item.generation or 1),
        upload_key=item.upload_key or "",
        registered_key=item.registered_key or "",
        retired_keys=tuple(sorted(item.retired_keys or ())),
    )


def host_revocation(item: HostRevocationItem) -> Revocation:
    return Revocation(host=item.pid, generation=int(item.generation), at=float(item.at))


def host_refusal(item: HostRefusalItem) -> HostRefusal:
    return HostRefusal(host=item.pid, reason=item.reason, at=float(item.at), kind=RefusalKind(item.kind),
                       count=int(item.n), first_reason=item.first_reason, first_at=float(item.first_at))


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
        "optimizer_digest": s.optimizer_digest,
        "witnesses": list(s.witnesses),
        "proofs": s.proofs,
        "quorum": s.quorum,
        "health": dict(s.health),
        "shares": dict(s.shares),
        "finished": dict(s.finished),
        "suspects": dict(s.suspects),
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
        optimizer_digest=b.get("optimizer_digest", ""),
        witnesses=tuple(b.get("witnesses", ())),
        proofs=int(b.get("proofs", 0)),
        quorum=int(b.get("quorum", 0)),
        health={k: int(v) for k, v in b.get("health", {}).items()},
        shares={k: int(v) for k, v in b.get("shares", {}).items()},
        finished={k: float(v) for k, v in b.get("finished", {}).items()},
        suspects={str(k): str(v) for k, v in b.get("suspects", {}).items()},
    )


CONDITION_FAILED = {"ConditionalCheckFailedException", "TransactionCanceledException"}


def condition_failed(exc: PynamoDBException) -> bool:
    """Whether a write failed on its condition (the only failure a caller here turns into an answer). Read from the
    cause's response: a failure with none (a read timeout, a refused connection) is no condition's, and pynamodb's
    own `cause_response_code` raises AttributeError there, hiding the timeout behind it."""
    response = getattr(exc.cause, "response", None) or {}
    return (response.get("Error") or {}).get("Code") in CONDITION_FAILED
