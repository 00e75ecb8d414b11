"""The run's state in DynamoDB: load a snapshot, commit a tick, record what participants sent.

Optimistic concurrency: the state item carries a version; a commit is conditional on the version it
was computed from, and a lost race surfaces as one exception, `Conflict`, handled by the caller.
"""

from __future__ import annotations

from typing import Any

from pynamodb.connection import Connection
from pynamodb.exceptions import (
    DeleteError,
    DoesNotExist,
    PutError,
    TransactWriteError,
    UpdateError,
)
from pynamodb.transactions import TransactWrite

from shared import keys
from shared.hosts import HostRecord, HostStatus
from shared.state import ParticipantView, RoundSummary, RunState, Snapshot, heard_through_updates
from shared.table_keys import (
    PARTICIPANT_COUNT_SK,
    STATE_SK,
    host_sk,
    lease_sk,
    offer_sk,
    participant_sk,
    round_sk,
    run_pk,
)
from store.blobs import Bucket, s3_client
from store.budget import UploadBudgets
from store.connection import Connection as ConnectionInfo
from store.records import (
    GLOBAL,
    OPTIMIZER,
    ROSTER,
    VERSIONS,
    Models,
    condition_failed,
    host_record,
    models,
    participant_record,
    participant_view,
    split_body,
    state_to_body,
    summary_to_body,
)
from store.rosters import Rosters, state_of_item
from store.round_records import RoundRecords
from store.views import ParticipantRecord, ProofRecord, RefusalRecord, UpdateRecord

__all__ = [
    "Conflict",
    "ParticipantRecord",
    "ProofRecord",
    "RefusalRecord",
    "StateStore",
    "UpdateRecord",
]

class Conflict(Exception):
    """Another writer changed the record first; re-read and decide again."""


def named_objects(run_id: str, state: RunState, roster: str) -> dict[str, str]:
    """The objects a state names that are read back by a verified read, by their role in the item's `VERSIONS`
    field: its roster (`roster`: its digest), the global model its round trains from and the server optimizer
    state that round starts from."""
    named = {}
    if roster:
        named[ROSTER] = keys.roster_key(run_id, roster)
    if state.global_digest:
        named[GLOBAL] = keys.global_key(run_id, state.round, state.global_digest)
    if state.optimizer_digest:
        named[OPTIMIZER] = keys.optimizer_key(run_id, state.round, state.optimizer_digest)
    return named


class StateStore(RoundRecords, UploadBudgets):
    """The run's table: its state item (read, committed with a version condition), the aggregation leases, the
    participant records; the per-round records ingest keeps are `RoundRecords`', the upload budgets
    `UploadBudgets`'."""


    def __init__(self, table: str, run_id: str, bucket: Bucket, endpoint: str | None = None,
                 region: str = "us-east-1") -> None:
        """`bucket`: the run's bucket, where the state's per-member part lives (`store.rosters`)."""
        self.run_id = run_id
        self.pk = run_pk(run_id)
        self.m: Models = models(table, endpoint, region)
        self.rosters = Rosters(bucket, run_id)

    @classmethod
    def of(cls, connection: ConnectionInfo, bucket: Bucket | None = None) -> StateStore:
        """The store of the run a connection names (reading rosters through `bucket`, if the caller has one)."""
        bucket = bucket or Bucket(connection.bucket, s3_client(connection.endpoint, connection.region))
        return cls(connection.table, connection.run_id, bucket, connection.endpoint, connection.region)

    # --- the coordinator state ---------------------------------------------------------------------

    def read_state(self) -> RunState:
        """The committed state (strongly consistent); a fresh state if the run has not started."""
        try:
            item = self.m.run.get(self.pk, STATE_SK, consistent_read=True)
        except DoesNotExist:
            return RunState(self.run_id)
        return self.state_of(item.body, int(item.version))

    def load_snapshot(self) -> Snapshot:
        state = self.read_state()
        proofs, refused = self.proof_records(state.round) if state.witnesses else ({}, {})
        reports = self.health_reports(state.health_round) if state.health else {}
        updates = self.updates(state.round)
        participants = heard_through_updates(self.participants(), updates, state.members)
        return Snapshot(state, participants, updates, proofs, reports, refused_proofs=refused)

    def state_of(self, body: dict[str, Any], version: int, roster: bytes = b"") -> RunState:
        """The state a state item's body names (as read, or as pushed with its roster's bytes: `store.push`). The
        versions the item records are remembered by the bucket: the verified reads of this state's objects (its
        global model, its optimizer state) go straight to them."""
        state = state_of_item(body, version, self.rosters, roster)
        recorded = body.get(VERSIONS) or {}
        for role, key in named_objects(self.run_id, state, str(body.get(ROSTER, ""))).items():
            self.rosters.bucket.remember(key, str(recorded.get(role, "")))
        return state

    def item_body(self, state: RunState) -> dict[str, Any]:
        """The state item's body for `state`: its constant-size part, the digest of its roster (written), and the
        version id of each object it names whose version this process knows (wrote, authenticated, or read in the
        state it committed on)."""
        head, roster = split_body(state_to_body(state))
        name = self.rosters.write(roster)
        bucket = self.rosters.bucket
        versions = {role: version for role, key in named_objects(self.run_id, state, name).items()
                    if (version := bucket.known_version(key))}
        return {**head, ROSTER: name, **({VERSIONS: versions} if versions else {})}

    def item_and_roster(self, state: RunState) -> tuple[dict[str, Any], bytes]:
        """`item_body`, and the canonical bytes of the roster it names (b"": none)."""
        body = self.item_body(state)
        return body, self.rosters.held(body[ROSTER])

    def commit(self, state: RunState, expected_version: int, summaries: tuple[RoundSummary, ...] = ()) -> int:
        """Write `state` if the stored version is still `expected_version`; return the new version."""
        item = self.state_item(state, self.item_body(state))
        if expected_version:  # without a version, pynamodb's save requires that the item not exist yet
            item.version = expected_version
        try:
            if not summaries:
                item.save()
            else:
                with TransactWrite(connection=self._connection()) as tx:
                    tx.save(item)
                    for s in summaries:
                        tx.save(self.summary_item(s))
        except (PutError, TransactWriteError) as exc:
            if condition_failed(exc):
                raise Conflict(f"state changed since version {expected_version}") from None
            raise
        return expected_version + 1

    def state_item(self, state: RunState, body: dict[str, Any]) -> Any:
        """The state item for `state` with its `body` (`item_body`), unsaved."""
        return self.m.run(self.pk, STATE_SK, phase=state.phase.value, round=state.round, epoch=state.epoch, body=body)

    def summary_item(self, summary: RoundSummary) -> Any:
        """A closed round's summary item, unsaved."""
        return self.m.round(self.pk, round_sk(summary.round), round=summary.round, body=summary_to_body(summary))

    def new_participant_item(self, pid: str, at: float, public_key: str, info: dict[str, Any], sent_at: float,
                             samples: int) -> Any:
        """A newly registered participant's record, unsaved: joined and last seen `at`."""
        return self.m.participant(self.pk, participant_sk(pid), pid=pid, joined_at=at, last_seen=at,
                                  public_key=public_key, info=info, last_sent=sent_at, samples=samples)

    def claim(self, name: str, holder: str, until: float, now: float) -> bool:
        """Take the lease `name` for `holder` until `until` (one conditional write): True unless another holder
        has it and it has not expired by `now`."""
        lease = self.m.lease
        item = lease(self.pk, lease_sk(name), holder=holder, until=until)
        try:
            item.save(condition=lease.pk.does_not_exist() | (lease.until < now) | (lease.holder == holder))
        except PutError as exc:
            if condition_failed(exc):
                return False
            raise
        return True

    def release(self, name: str, holder: str) -> None:
        """Give the lease back, if `holder` still has it."""
        lease = self.m.lease
        try:
            lease(self.pk, lease_sk(name)).delete(condition=lease.holder == holder)
        except DeleteError as exc:
            if not condition_failed(exc):
                raise

    def _connection(self) -> Connection:
        """The item classes' one Connection (`store.records.Models`): transactions send through it too."""
        return self.m.connection

    # --- what ingest records -----------------------------------------------------------------------

    def participants(self) -> dict[str, ParticipantView]:
        items = self.m.participant.query(
            self.pk, self.m.participant.sk.startswith("P#"), consistent_read=True
        )
        return {i.pid: participant_view(i) for i in items}

    def participant_records(self) -> dict[str, ParticipantRecord]:
        """Every participant record, with everything stored (`participants` gives a tick's views)."""
        items = self.m.participant.query(
            self.pk, self.m.participant.sk.startswith("P#"), consistent_read=True
        )
        return {i.pid: participant_record(i) for i in items}

    def participant(self, pid: str) -> ParticipantRecord | None:
        try:
            item = self.m.participant.get(self.pk, participant_sk(pid), consistent_read=True)
        except DoesNotExist:
            return None
        return participant_record(item)

    def host(self, pid: str) -> HostRecord | None:
        """The invited host `pid` (`fed hosts`), or None if it is none: ingest refuses what its record does not let
        in (`shared.hosts.upload_refusal`). Read consistently, so a revocation holds from the next upload on."""
        try:
            return host_record(self.m.host.get(self.pk, host_sk(pid), consistent_read=True))
        except DoesNotExist:
            return None

    def note_host_join(self, pid: str, generation: int, upload_key: str) -> bool:
        """Record that `pid`'s participant record holds `upload_key`, the key bound to its host's `generation`
        (ingest lets that generation's other uploads in from then on); False if the host moved on meanwhile."""
        h = self.m.host
        condition = (h.generation == generation) & (h.upload_key == upload_key) & (h.status == HostStatus.ACTIVE.value)
        try:
            self.m.host(self.pk, host_sk(pid)).update(actions=[h.registered_key.set(upload_key)], condition=condition)
        except UpdateError as exc:
            if condition_failed(exc):
                return False
            raise
        return True

    def rekey_participant(self, pid: str, old_key: str, new_key: str) -> bool:
        """Register `new_key` for `pid` in place of `old_key` (a reinstated host's new generation): one conditional
        write, so of two racing joins one wins; the old key is refused from then on."""
        p = self.m.participant
        try:
            p(self.pk, participant_sk(pid)).update(actions=[p.public_key.set(new_key)],
                                                   condition=p.public_key == old_key)
        except UpdateError as exc:
            if condition_failed(exc):
                return False
            raise
        return True

    def create_participant(
        self, pid: str, at: float, public_key: str, info: dict[str, Any], limit: int, sent_at: float = 0.0,
        samples: int = 0,
    ) -> str:
        """Register a new participant: "created", "exists" (a racing duplicate), or "full" (limit reached).

        The record and the run's participant count change in one transaction, so fake joins cannot
        grow the table past `limit` participants.
        """
        item = self.new_participant_item(pid, at, public_key, info, sent_at, samples)
        counter = self.m.counter(self.pk, PARTICIPANT_COUNT_SK)
        n = self.m.counter.n
        try:
            with TransactWrite(connection=self._connection()) as tx:
                tx.save(item, condition=self.m.participant.pk.does_not_exist())
                tx.update(counter, actions=[n.add(1)], condition=n.does_not_exist() | (n < limit))
            return "created"
        except TransactWriteError as exc:
            if not condition_failed(exc):
                raise
        return "exists" if self.participant(pid) is not None else "full"

    def participant_count(self) -> int:
        """How many participants have registered (the count `create_participant` keeps)."""
        try:
            return int(self.m.counter.get(self.pk, PARTICIPANT_COUNT_SK, consistent_read=True).n)
        except DoesNotExist:
            return 0

    def touch(self, pid: str, at: float) -> bool:
        """Move last_seen (and heard_at) forward (never back: events arrive out of order); False if pid never joined."""
        p = self.m.participant
        try:
            self.m.participant(self.pk, participant_sk(pid)).update(
                actions=[p.last_seen.set(at), p.heard_at.set(at)], condition=p.pk.exists() & (p.last_seen < at)
            )
            return True
        except UpdateError as exc:
            if not condition_failed(exc):
                raise
        return self.participant(pid) is not None

    def accept_message(
        self, pid: str, sent_at: float, at: float, ready_epoch: int | None = None, info: dict[str, Any] | None = None,
        progress: dict[str, int] | None = None, progress_moved: bool = False, rate: float | None = None,
        unticked: bool = False,
    ) -> str:
        """Take a join request's or heartbeat's news if it was sent after the last one accepted from `pid`:
        "accepted", "duplicate" (that very message, delivered again), "stale" (an older message: a replay,
        or overtaken by a newer one) or "unknown" (pid never joined).

        One conditional write, so two deliveries of one message, or a replay racing the original, cannot
        both move `last_seen` forward. `unticked`: taken by a function that does not tick (`ParticipantRecord`)."""
        p = self.m.participant
        actions = [p.last_sent.set(sent_at), p.last_seen.set(at), p.heard_at.set(at), p.unticked.set(unticked)]
        if ready_epoch is not None:
            actions.append(p.ready_epoch.set(ready_epoch))
        if info is not None:
            actions.append(p.info.set(info))
        if progress is not None:
            actions.append(p.progress.set(progress))
            if progress_moved:
                actions.append(p.progress_at.set(at))
        if rate is not None:
            actions.append(p.rate.set(rate))
        try:
            self.m.participant(self.pk, participant_sk(pid)).update(
                actions=actions, condition=p.pk.exists() & (p.last_sent.does_not_exist() | (p.last_sent < sent_at))
            )
            return "accepted"
        except UpdateError as exc:
            if not condition_failed(exc):
                raise
        record = self.participant(pid)
        if record is None:
            return "unknown"
        return "duplicate" if record.last_sent == sent_at else "stale"

    def keep_offer(self, pid: str, digest: str, public_key: str, version_id: str = "") -> None:
        """Keep an initial-model offer whose sender's join is not registered yet (registering it takes the offer)."""
        self.m.offer(self.pk, offer_sk(pid), digest=digest, public_key=public_key, version_id=version_id).save()

    def kept_offer(self, pid: str, public_key: str) -> tuple[str, str]:
        """(digest, S3 version) of the offer kept for `pid` if it was checked against `public_key`; ("", "") if
        none."""
        try:
            item = self.m.offer.get(self.pk, offer_sk(pid), consistent_read=True)
        except DoesNotExist:
            return "", ""
        return (str(item.digest), str(item.version_id or "")) if item.public_key == public_key else ("", "")

    def set_init_offer(self, pid: str, digest: str, version_id: str = "") -> None:
        """Record `pid`'s initial-model offer (its digest, and the S3 version ingest checked); "": withdraw it."""
        p = self.m.participant
        self.m.participant(self.pk, participant_sk(pid)).update(
            actions=[p.init_digest.set(digest), p.init_version.set(version_id)], condition=p.pk.exists()
        )
