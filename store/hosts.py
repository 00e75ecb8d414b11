"""The host records in the run's table: hosts (invited, active, revoked), used nonces, request counters and the
credential endpoint's refusals (`shared.table_keys`). Every change a race could undo is one conditional write."""

from __future__ import annotations

import builtins
import math

from pynamodb.exceptions import DoesNotExist, PutError, UpdateError
from pynamodb.expressions.condition import Condition
from pynamodb.expressions.update import Action

from shared.hosts import RATE_WINDOW_SECONDS, REFUSAL_SECONDS, HostRecord, HostRefusal, HostStatus
from shared.limits import MAX_ID_CHARS, MAX_REASON_CHARS, bounded
from shared.table_keys import (
    HOST_PREFIX,
    HOST_REFUSAL_PREFIX,
    host_nonce_sk,
    host_rate_sk,
    host_refusal_sk,
    host_sk,
    run_pk,
)
from store.records import Models, condition_failed, host_record, host_refusal, models

__all__ = ["HostStore"]


class HostStore:
    """One run's host records (`pk`) through its item classes (`m`)."""

    def __init__(self, table: str, run_id: str, endpoint: str | None = None, region: str = "us-east-1") -> None:
        self.pk = run_pk(run_id)
        self.m: Models = models(table, endpoint, region)

    # --- hosts ----------------------------------------------------------------------------------------

    def invite(self, host: str, secret_hash: str, expires: float, now: float) -> bool:
        """Record an invite for `host` (only the secret's hash): False if the host is active, whose bound key an
        invite would replace (revoke it first). An invited or revoked host's record starts anew."""
        h = self.m.host
        item = h(self.pk, host_sk(host), pid=host, status=HostStatus.INVITED.value, secret_hash=secret_hash,
                 invite_expires=expires, invited_at=now)
        try:
            item.save(condition=h.pk.does_not_exist() | (h.status != HostStatus.ACTIVE.value))
        except PutError as exc:
            if condition_failed(exc):
                return False
            raise
        return True

    def get(self, host: str) -> HostRecord | None:
        try:
            return host_record(self.m.host.get(self.pk, host_sk(host), consistent_read=True))
        except DoesNotExist:
            return None

    def list(self) -> list[HostRecord]:
        items = self.m.host.query(self.pk, self.m.host.sk.startswith(HOST_PREFIX), consistent_read=True)
        return [host_record(i) for i in items]

    def redeem(self, host: str, secret_hash: str, public_key: str, now: float) -> bool:
        """Bind `public_key` to `host` if its invite, for that secret, is still out and unexpired: invited -> active
        in one conditional write, so of two racing redemptions one wins."""
        h = self.m.host
        condition = (h.status == HostStatus.INVITED.value) & (h.secret_hash == secret_hash) & (h.invite_expires > now)
        actions = [h.status.set(HostStatus.ACTIVE.value), h.public_key.set(public_key), h.redeemed_at.set(now)]
        return self._update(host, actions, condition)

    def note_credentials(self, host: str, now: float) -> None:
        h = self.m.host
        self._update(host, [h.last_credentials_at.set(now)], h.pk.exists())

    def revoke(self, host: str, reason: str, now: float) -> bool:
        """Refuse `host` from now on (its renewals; what else a revocation cuts is the caller's); False if unknown."""
        h = self.m.host
        actions = [h.status.set(HostStatus.REVOKED.value), h.revoked_at.set(now),
                   h.revoke_reason.set(bounded(reason, MAX_REASON_CHARS))]
        return self._update(host, actions, h.pk.exists())

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
        """Count one request of `scope` (a host id, or `shared.table_keys.ALL_HOSTS`) in this minute: True if it is
        within `limit`. One item per scope and minute however many arrive; a request over the limit adds to the
        item's `refused`."""
        minute = int(now // RATE_WINDOW_SECONDS)
        r = self.m.host_rate
        item = r(self.pk, host_rate_sk(scope, minute))
        expires = (minute + 2) * RATE_WINDOW_SECONDS
        try:
            item.update(actions=[r.n.add(1), r.expires_at.set(expires)], condition=r.n.does_not_exist() | (r.n < limit))
            return True
        except UpdateError as exc:
            if not condition_failed(exc):
                raise
        item.update(actions=[r.refused.add(1), r.expires_at.set(expires)])
        return False

    def requests_counted(self, scope: str, now: float) -> tuple[int, int]:
        """(allowed, refused) requests of `scope` in the minute of `now`."""
        try:
            item = self.m.host_rate.get(self.pk, host_rate_sk(scope, int(now // RATE_WINDOW_SECONDS)),
                                        consistent_read=True)
        except DoesNotExist:
            return 0, 0
        return int(item.n or 0), int(item.refused or 0)

    def record_refusal(self, host: str, reason: str, now: float) -> None:
        """Keep a refusal a week (one item each; two of one host at the very same instant keep one)."""
        host = bounded(host, MAX_ID_CHARS)
        self.m.host_refusal(self.pk, host_refusal_sk(now, host), pid=host, reason=bounded(reason, MAX_REASON_CHARS),
                            at=now, expires_at=math.ceil(now + REFUSAL_SECONDS)).save()

    def refusals(self, host: str | None = None) -> builtins.list[HostRefusal]:
        """The refusals kept (a week), oldest first; of `host` only, if given."""
        f = self.m.host_refusal
        items = f.query(self.pk, f.sk.startswith(HOST_REFUSAL_PREFIX), consistent_read=True)
        found = [host_refusal(i) for i in items]
        return [r for r in found if host is None or r.host == host]
