"""The host records in the run's table: hosts (invited, active, revoked), used nonces, request counters and the
credential endpoint's refusals (`shared.table_keys`). Every change a race could undo is one conditional write."""

from __future__ import annotations

import builtins
import math

from pynamodb.exceptions import DoesNotExist, PutError, UpdateError
from pynamodb.expressions.condition import Condition
from pynamodb.expressions.update import Action

from shared.hosts import (
    DENY_SECONDS,
    RATE_WINDOW_SECONDS,
    REFUSAL_SECONDS,
    HostRecord,
    HostRefusal,
    HostStatus,
    RefusalKind,
    Revocation,
)
from shared.limits import MAX_ID_CHARS, MAX_REASON_CHARS, bounded
from shared.table_keys import (
    HOST_PREFIX,
    HOST_REFUSAL_PREFIX,
    HOST_REVOCATION_PREFIX,
    host_nonce_sk,
    host_rate_sk,
    host_refusal_sk,
    host_revocation_sk,
    host_sk,
    run_pk,
)
from store.records import Models, condition_failed, host_record, host_refusal, host_revocation, models

__all__ = ["HostStore"]


class HostStore:
    """One run's host records (`pk`) through its item classes (`m`)."""

    def __init__(self, table: str, run_id: str, endpoint: str | None = None, region: str = "us-east-1") -> None:
        self.pk = run_pk(run_id)
        self.m: Models = models(table, endpoint, region)

    # --- hosts ----------------------------------------------------------------------------------------

    def invite(self, host: str, secret_hash: str, expires: float, now: float) -> bool:
        """Record an invite for `host` (only the secret's hash): a new host's first generation, or a new secret for
        an invite not yet redeemed (its generation kept). False if the host is active, whose bound keys an invite
        would replace, or revoked: a revoked host comes back only by `reinstate`."""
        h = self.m.host
        item = h(self.pk, host_sk(host), pid=host, status=HostStatus.INVITED.value, secret_hash=secret_hash,
                 invite_expires=expires, invited_at=now, generation=1)
        try:
            item.save(condition=h.pk.does_not_exist())
            return True
        except PutError as exc:
            if not condition_failed(exc):
                raise
        actions = [h.secret_hash.set(secret_hash), h.invite_expires.set(expires), h.invited_at.set(now)]
        return self._update(host, actions, h.status == HostStatus.INVITED.value)

    def reinstate(self, host: str, secret_hash: str, expires: float, now: float) -> HostRecord | None:
        """Start the next generation of revoked `host`: invited again under a new secret, its bound keys retired
        (never bound again) and nothing of the revoked generation kept that a request could use. The record as it
        is now, or None if `host` is not revoked (unknown, or a racing change came first)."""
        record = self.get(host)
        if record is None or record.status is not HostStatus.REVOKED:
            return None
        h = self.m.host
        retired = {k for k in (record.public_key, record.upload_key) if k}
        actions = [h.status.set(HostStatus.INVITED.value), h.generation.set(record.generation + 1),
                   h.secret_hash.set(secret_hash), h.invite_expires.set(expires), h.invited_at.set(now),
                   h.public_key.set(""), h.upload_key.set(""), h.redeemed_at.set(0), h.last_credentials_at.set(0),
                   h.revoked_at.set(0), h.revoke_reason.set("")]
        if retired:
            actions.append(h.retired_keys.add(retired))
        condition = (h.status == HostStatus.REVOKED.value) & (h.generation == record.generation)
        return self.get(host) if self._update(host, actions, condition) else None

    def get(self, host: str) -> HostRecord | None:
        try:
            return host_record(self.m.host.get(self.pk, host_sk(host), consistent_read=True))
        except DoesNotExist:
            return None

    def list(self) -> list[HostRecord]:
        items = self.m.host.query(self.pk, self.m.host.sk.startswith(HOST_PREFIX), consistent_read=True)
        return [host_record(i) for i in items]

    def redeem(self, host: str, secret_hash: str, public_key: str, upload_key: str, now: float) -> bool:
        """Bind `public_key` (the host key) and `upload_key` to `host` if its invite, for that secret, is still out
        and unexpired: invited -> active in one conditional write, so of two racing redemptions one wins."""
        h = self.m.host
        condition = (h.status == HostStatus.INVITED.value) & (h.secret_hash == secret_hash) & (h.invite_expires > now)
        actions = [h.status.set(HostStatus.ACTIVE.value), h.public_key.set(public_key), h.upload_key.set(upload_key),
                   h.redeemed_at.set(now)]
        return self._update(host, actions, condition)

    def note_credentials(self, host: str, now: float) -> None:
        h = self.m.host
        self._update(host, [h.last_credentials_at.set(now)], h.pk.exists())

    def revoke(self, host: str, reason: str, now: float) -> HostRecord | None:
        """Refuse `host`'s current generation from now on (its renewals; what else a revocation cuts is the
        caller's), and keep the revocation (`revocations`) while a session issued before it could live. The record
        as it is now, or None if `host` is unknown. Revoking a revoked host again records its revocation again (the
        deny on its sessions is then kept from the later time)."""
        record = self.get(host)
        if record is None:
            return None
        h = self.m.host
        actions = [h.status.set(HostStatus.REVOKED.value), h.revoked_at.set(now),
                   h.revoke_reason.set(bounded(reason, MAX_REASON_CHARS))]
        if not self._update(host, actions, h.generation == record.generation):
            return self.revoke(host, reason, now)  # a reinstatement came first: revoke the generation it started
        self.m.host_revocation(self.pk, host_revocation_sk(host, record.generation), pid=host,
                               generation=record.generation, at=now,
                               expires_at=math.ceil(now + DENY_SECONDS)).save()
        return self.get(host)

    def revocations(self, now: float) -> builtins.list[Revocation]:
        """The generations revoked less than DENY_SECONDS before `now` (the table's TTL deletes older ones, lazily)."""
        r = self.m.host_revocation
        items = r.query(self.pk, r.sk.startswith(HOST_REVOCATION_PREFIX), consistent_read=True)
        return [host_revocation(i) for i in items if now - float(i.at) < DENY_SECONDS]

    def _update(self, host: str, actions: builtins.list[Action], condition: Condition) -> bool:
        try:
            self.m.host(self.pk, host_sk(host)).update(actions=actions, condition=condition)
        except UpdateError as exc:
            if condition_failed(exc):
                return False
            raise
        return True

    # --- what the endpoint keeps of requests ------------------------------------------------------------

    def use_nonce(self, host: str, nonce: str, now: float, keep_seconds: float) -> bool:
        """Record `nonce` as used by `host`: False if it already was (a replay)."""
        item = self.m.host_nonce(self.pk, host_nonce_sk(host, nonce), pid=host,
                                 expires_at=math.ceil(now + keep_seconds))
        try:
            item.save(condition=self.m.host_nonce.pk.does_not_exist())
        except PutError as exc:
            if condition_failed(exc):
                return False
            raise
        return True

    def count_request(self, scope: str, now: float, limit: int) -> bool:
        """Count one request of `scope` (a host id, `shared.table_keys.ALL_HOSTS` or `UNVERIFIED`) in this minute:
        True if it is within `limit`. One item per scope and minute however many arrive, one write per request (an
        ADD, whose new value says whether it was within the limit)."""
        minute = int(now // RATE_WINDOW_SECONDS)
        r = self.m.host_rate
        item = r(self.pk, host_rate_sk(scope, minute))
        item.update(actions=[r.n.add(1), r.expires_at.set((minute + 2) * RATE_WINDOW_SECONDS)])
        return int(item.n) <= limit

    def requests_counted(self, scope: str, now: float) -> int:
        """The requests of `scope` counted in the minute of `now` (past the scope's limit, they were refused)."""
        try:
            item = self.m.host_rate.get(self.pk, host_rate_sk(scope, int(now // RATE_WINDOW_SECONDS)),
                                        consistent_read=True)
        except DoesNotExist:
            return 0
        return int(item.n or 0)

    def record_refusal(self, host: str, kind: RefusalKind, reason: str, now: float) -> None:
        """Keep a refusal in the one item of its host and kind (one write: the count, the first, the latest), a
        week after the latest. `host` must be an invited host or UNKNOWN_HOST, so that the items stay O(hosts)."""
        f = self.m.host_refusal
        host, reason = bounded(host, MAX_ID_CHARS), bounded(reason, MAX_REASON_CHARS)
        f(self.pk, host_refusal_sk(host, kind.value)).update(actions=[
            f.pid.set(host), f.kind.set(kind.value), f.n.add(1),
            f.first_reason.set(f.first_reason | reason), f.first_at.set(f.first_at | now),
            f.reason.set(reason), f.at.set(now), f.expires_at.set(math.ceil(now + REFUSAL_SECONDS))])

    def refusals(self, host: str | None = None) -> builtins.list[HostRefusal]:
        """The refusals kept, one per host and kind, the latest last; of `host` only, if given (one query either
        way, of O(hosts) items whatever was sent)."""
        f = self.m.host_refusal
        prefix = HOST_REFUSAL_PREFIX if host is None else host_refusal_sk(host, "")
        found = [host_refusal(i) for i in f.query(self.pk, f.sk.startswith(prefix), consistent_read=True)]
        return sorted(found, key=lambda r: (r.at, r.host, r.kind))
