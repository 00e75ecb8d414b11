"""What ingest records per round and object in the run's table, once each: updates (and each round's count of
them), witness proofs, health reports, refusals, and the closed rounds' summaries. Every record is created once,
conditionally (a duplicate event finds it there), so ingest is idempotent.
"""

from __future__ import annotations

from typing import Any

from pynamodb.exceptions import DoesNotExist, PutError

from shared.limits import MAX_ID_CHARS, MAX_KEY_CHARS, MAX_REASON_CHARS, bounded
from shared.state import RoundSummary, UpdateView
from shared.table_keys import health_sk, proof_sk, refusal_sk, round_sk, update_count_sk, update_sk
from shared.witness import Proof
from store.records import (
    Models,
    condition_failed,
    proof_record,
    refusal_record,
    summary_from_body,
    update_record,
    update_view,
)
from store.views import ProofRecord, RefusalRecord, UpdateRecord


class RoundRecords:
    """The per-round records of one run (`pk`) through its item classes (`m`), mixed into `store.table.StateStore`."""

    pk: str
    m: Models

    def updates(self, round_no: int) -> dict[str, UpdateView]:
        items = self.m.update.query(
            self.pk, self.m.update.sk.startswith(update_sk(round_no)), consistent_read=True
        )
        return {i.pid: update_view(i) for i in items}

    def record_update(self, rec: UpdateRecord) -> bool:
        """Record an update once; False if one is already recorded for this round and participant."""
        item = self.m.update(
            self.pk,
            update_sk(rec.round, rec.pid),
            round=rec.round,
            pid=rec.pid,
            accepted=rec.accepted,
            reason=bounded(rec.reason, MAX_REASON_CHARS),
            samples=rec.samples,
            digest=rec.digest,
            size=rec.size,
            key=bounded(rec.key, MAX_KEY_CHARS),
            etag=bounded(rec.etag, MAX_ID_CHARS),
            version_id=rec.version_id,  # read back to aggregate: never cut (S3 version ids are short)
            norm=rec.norm,
            data_offset=rec.data_offset,
            received_at=rec.received_at,
            metrics=rec.metrics,
        )
        return self._create(item)

    def count_update(self, round_no: int) -> int:
        """One more update recorded in `round_no` (call once per record created): the round's count so far. One
        write instead of a read of every record: ingest ticks only when the count reaches the selection."""
        n = self.m.counter.n
        item = self.m.counter(self.pk, update_count_sk(round_no))
        item.update(actions=[n.add(1)])
        return int(item.n)

    def update_record(self, round_no: int, pid: str) -> UpdateRecord | None:
        try:
            item = self.m.update.get(self.pk, update_sk(round_no, pid), consistent_read=True)
        except DoesNotExist:
            return None
        return update_record(item)

    def round_updates(self, round_no: int) -> dict[str, UpdateRecord]:
        """Every update record of one round, by participant (one query)."""
        items = self.m.update.query(self.pk, self.m.update.sk.startswith(update_sk(round_no)), consistent_read=True)
        return {rec.pid: rec for rec in map(update_record, items)}

    def all_updates(self) -> list[UpdateRecord]:
        """Every update record of the run, every round."""
        items = self.m.update.query(self.pk, self.m.update.sk.startswith("U#"), consistent_read=True)
        return [update_record(i) for i in items]

    def record_refusal(self, key: str, etag: str, reason: str, at: float, pid: str = "") -> bool:
        """Record an object refused before it could be tied to a round slot; once per (key, etag)."""
        item = self.m.refusal(
            self.pk, refusal_sk(key, etag), key=bounded(key, MAX_KEY_CHARS), etag=bounded(etag, MAX_ID_CHARS),
            reason=bounded(reason, MAX_REASON_CHARS), at=at, pid=bounded(pid, MAX_ID_CHARS),
        )
        return self._create(item)

    def record_proof(self, round_no: int, pid: str, body: str, etag: str, at: float, refused: str = "") -> bool:
        """Record a witness's proof once, or (`refused`: why) that the one it sent was refused: its seat's proof
        either way; False if this witness's proof for the round is already in."""
        item = self.m.proof(self.pk, proof_sk(round_no, pid), round=round_no, pid=pid, etag=etag, body=body,
                            received_at=at, refused=refused)
        return self._create(item)

    def proof_record(self, round_no: int, pid: str) -> ProofRecord | None:
        try:
            item = self.m.proof.get(self.pk, proof_sk(round_no, pid), consistent_read=True)
        except DoesNotExist:
            return None
        return proof_record(item)

    def proofs(self, round_no: int) -> dict[str, Proof]:
        return self.proof_records(round_no)[0]

    def proof_records(self, round_no: int) -> tuple[dict[str, Proof], dict[str, str]]:
        """The round's accepted proofs by witness, and why each refused one was refused."""
        items = self.m.proof.query(self.pk, self.m.proof.sk.startswith(proof_sk(round_no)), consistent_read=True)
        accepted, refused = {}, {}
        for i in items:
            if i.refused:
                refused[i.pid] = i.refused
            else:
                accepted[i.pid] = Proof.from_json(i.body)
        return accepted, refused

    def record_health_report(self, round_no: int, pid: str, named: list[str], at: float) -> bool:
        item = self.m.health(self.pk, health_sk(round_no, pid), round=round_no, pid=pid, named=named, received_at=at)
        return self._create(item)

    def health_reports(self, round_no: int) -> dict[str, tuple[str, ...]]:
        items = self.m.health.query(self.pk, self.m.health.sk.startswith(health_sk(round_no)), consistent_read=True)
        return {i.pid: tuple(i.named) for i in items}

    def _create(self, item: Any) -> bool:
        """Put a record that must not exist yet; False if it does (a duplicate delivery got there first)."""
        try:
            item.save(condition=type(item).pk.does_not_exist())
            return True
        except PutError as exc:
            if condition_failed(exc):
                return False
            raise

    def refusals(self) -> list[RefusalRecord]:
        items = self.m.refusal.query(self.pk, self.m.refusal.sk.startswith("X#"), consistent_read=True)
        return [refusal_record(i) for i in items]

    def rounds(self) -> list[RoundSummary]:
        items = self.m.round.query(self.pk, self.m.round.sk.startswith("R#"), consistent_read=True)
        return [summary_from_body(i.body) for i in items]

    def round_summary(self, round_no: int) -> RoundSummary | None:
        """A closed round's summary (one GetItem); None if it is not recorded."""
        try:
            item = self.m.round.get(self.pk, round_sk(round_no), consistent_read=True)
        except DoesNotExist:
            return None
        return summary_from_body(item.body)
