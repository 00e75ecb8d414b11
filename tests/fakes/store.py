"""An in-memory state store: `FakeStateStore` is the real `store.table.StateStore` over a dict of items.

Its item classes are the real ones (`store.records`), bound to that dict instead of a table: each item is kept as
DynamoDB would hold it (`Model.serialize`), and read back by the real `get`s and `query`s of `StateStore`, so every
view a tick or ingest reads (snapshot, participants, updates, proofs, health reports, rounds) is derived by the real
code from the real record types. What is faked is each conditional write, with DynamoDB's outcome: a commit on a
stale version raises `Conflict`, a record is created once (`False` on a duplicate), a participant joins once and
only below the limit, a message is taken only if sent after the last one, a lease is taken only if free, expired
or already the holder's. Each write is atomic (one lock), as DynamoDB's are.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

from pynamodb.exceptions import DoesNotExist, UpdateError
from pynamodb.expressions.condition import BeginsWith

from shared.config import UPLOAD_WINDOW_SECONDS
from shared.state import RoundSummary, RunState
from shared.table_keys import (
    PARTICIPANT_COUNT_SK,
    STATE_SK,
    dropped_sk,
    lease_sk,
    offer_sk,
    participant_sk,
    run_pk,
    update_count_sk,
    upload_count_sk,
)
from store import records
from store.blobs import Bucket
from store.rosters import Rosters
from store.table import Conflict, StateStore

Rows = dict[str, dict[str, Any]]  # sort key -> the item's attributes, serialized as DynamoDB holds them


def bound(cls: type[Any], rows: Rows, lock: threading.RLock) -> Any:
    """`cls` reading its items from `rows`: the `get` and `query` the real store makes (a begins_with on the sort
    key, in sort-key order). Anything else, a `save` or `update` say, finds no table and fails loudly."""

    def get(klass: Any, hash_key: str, range_key: str, consistent_read: bool = False) -> Any:
        with lock:
            raw = rows.get(range_key)
        if raw is None:
            raise DoesNotExist()
        return klass.from_raw_data(raw)

    def query(klass: Any, hash_key: str, range_key_condition: Any, consistent_read: bool = False) -> Iterator[Any]:
        assert isinstance(range_key_condition, BeginsWith), range_key_condition
        prefix = range_key_condition.values[1].value["S"]
        with lock:
            found = sorted((sk, raw) for sk, raw in rows.items() if sk.startswith(prefix))
        return iter([klass.from_raw_data(raw) for _, raw in found])

    return type(cls.__name__, (cls,), {"get": classmethod(get), "query": classmethod(query)})


class FakeStateStore(StateStore):
    def __init__(self, run_id: str, bucket: Bucket) -> None:
        self.run_id = run_id
        self.pk = run_pk(run_id)
        self.rows: Rows = {}
        self._lock = threading.RLock()
        self.m = SimpleNamespace(**{name: bound(cls, self.rows, self._lock) for name, cls in (
            ("run", records.RunItem), ("participant", records.ParticipantItem), ("update", records.UpdateItem),
            ("offer", records.OfferItem), ("round", records.RoundItem), ("refusal", records.RefusalItem),
            ("counter", records.CounterItem), ("lease", records.LeaseItem), ("proof", records.ProofItem),
            ("health", records.HealthItem), ("host", records.HostItem), ("upload_count", records.UploadCountItem),
            ("dropped", records.DroppedItem))})
        self.rosters = Rosters(bucket, run_id)

    # --- the table's items ----------------------------------------------------------------------------------

    def _get(self, cls: Any, sk: str) -> Any:
        try:
            return cls.get(self.pk, sk)
        except DoesNotExist:
            return None

    def _put(self, item: Any, **changes: Any) -> None:
        for name, value in changes.items():
            setattr(item, name, value)
        self.rows[item.sk] = item.serialize()

    # --- the conditional writes -----------------------------------------------------------------------------

    def commit(self, state: RunState, expected_version: int, summaries: tuple[RoundSummary, ...] = ()) -> int:
        body = self.item_body(state)  # (its roster is written before the conditional write, as the real one does)
        with self._lock:
            item = self._get(self.m.run, STATE_SK)
            if (item.version if item is not None else 0) != expected_version:
                raise Conflict(f"state changed since version {expected_version}")
            item = self.state_item(state, body)
            item.version = expected_version + 1
            self._put(item)
            for s in summaries:
                self._put(self.summary_item(s))
        return expected_version + 1

    def claim(self, name: str, holder: str, until: float, now: float) -> bool:
        with self._lock:
            lease = self._get(self.m.lease, lease_sk(name))
            if lease is not None and not (lease.until < now or lease.holder == holder):
                return False
            self._put(self.m.lease(self.pk, lease_sk(name), holder=holder, until=until))
            return True

    def release(self, name: str, holder: str) -> None:
        with self._lock:
            lease = self._get(self.m.lease, lease_sk(name))
            if lease is not None and lease.holder == holder:
                del self.rows[lease_sk(name)]

    def _create(self, item: Any) -> bool:
        with self._lock:
            if item.sk in self.rows:
                return False
            self._put(item)
            return True

    def create_participant(
        self, pid: str, at: float, public_key: str, info: dict[str, Any], limit: int, sent_at: float = 0.0,
        samples: int = 0,
    ) -> str:
        with self._lock:
            if self._get(self.m.participant, participant_sk(pid)) is not None:
                return "exists"
            counter = self._get(self.m.counter, PARTICIPANT_COUNT_SK)
            if counter is not None and counter.n >= limit:
                return "full"
            self._put(self.new_participant_item(pid, at, public_key, info, sent_at, samples))
            self._put(self.m.counter(self.pk, PARTICIPANT_COUNT_SK, n=(counter.n if counter else 0) + 1))
            return "created"

    def touch(self, pid: str, at: float) -> bool:
        with self._lock:
            item = self._get(self.m.participant, participant_sk(pid))
            if item is not None and item.last_seen < at:
                self._put(item, last_seen=at, heard_at=at)
            return item is not None

    def accept_message(
        self, pid: str, sent_at: float, at: float, ready_epoch: int | None = None, info: dict[str, Any] | None = None,
        progress: dict[str, int] | None = None, progress_moved: bool = False, rate: float | None = None,
        unticked: bool = False,
    ) -> str:
        with self._lock:
            item = self._get(self.m.participant, participant_sk(pid))
            if item is None:
                return "unknown"
            if not item.last_sent < sent_at:
                return "duplicate" if item.last_sent == sent_at else "stale"
            given = {"ready_epoch": ready_epoch, "info": info, "progress": progress, "rate": rate}
            moved = {"progress_at": at} if progress is not None and progress_moved else {}
            self._put(item, last_sent=sent_at, last_seen=at, heard_at=at, unticked=unticked, **moved,
                      **{name: value for name, value in given.items() if value is not None})
            return "accepted"

    def keep_offer(self, pid: str, digest: str, public_key: str, version_id: str = "") -> None:
        with self._lock:
            self._put(self.m.offer(self.pk, offer_sk(pid), digest=digest, public_key=public_key, version_id=version_id))

    def set_init_offer(self, pid: str, digest: str, version_id: str = "") -> None:
        with self._lock:
            item = self._get(self.m.participant, participant_sk(pid))
            if item is None:
                raise UpdateError(f"no participant {pid} to record an offer for")
            self._put(item, init_digest=digest, init_version=version_id)

    def count_upload(self, pid: str, at: float, budget: int) -> bool:
        window = int(at // UPLOAD_WINDOW_SECONDS)
        with self._lock:
            item = self._get(self.m.upload_count, upload_count_sk(window, pid))
            item = item or self.m.upload_count(self.pk, upload_count_sk(window, pid))
            if item.n < budget:
                self._put(item, n=item.n + 1, expires_at=(window + 2) * UPLOAD_WINDOW_SECONDS)
                return True
            dropped = self._get(self.m.dropped, dropped_sk(pid)) or self.m.dropped(self.pk, dropped_sk(pid), pid=pid)
            self._put(dropped, n=dropped.n + 1, last_at=math.ceil(at))
            return False

    def count_update(self, round_no: int) -> int:
        with self._lock:
            item = self._get(self.m.counter, update_count_sk(round_no))
            item = item or self.m.counter(self.pk, update_count_sk(round_no))
            self._put(item, n=item.n + 1)
            return int(item.n)
