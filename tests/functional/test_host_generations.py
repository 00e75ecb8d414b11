"""A revoked invited host stays revoked, at ingest (issue 43): re-inviting its id is refused, and after `fed hosts
reinstate` only the new generation's upload key (bound at redemption) is let in; the revoked machine's key stays
refused whatever it signs."""

from __future__ import annotations

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from fed.hosts import HostsError, invite, reinstate, revoke
from shared.hosts import HostStatus, parse_invite, public_key_of, secret_hash
from shared.signing import Signer
from store.connection import Connection
from store.hosts import HostStore
from store.trace import OPERATOR, acting_as

URL = "https://abc.lambda-url.us-east-1.on.aws/"


def test_the_revoked_machines_key_stays_refused_and_only_the_new_generation_is_let_in(harness) -> None:  # type: ignore[no-untyped-def]
    run, res = harness.config.run_id, harness.res
    conn = Connection(run_id=run, bucket=res.bucket, table=res.table, endpoint=None, region="us-east-1",
                      participant_role=f"arn:aws:iam::123456789012:role/fed-{run}-participant",
                      credential_endpoint=URL)
    hosts = HostStore(res.table, run, None, "us-east-1")
    old = harness.signer("alice")

    def redeem(line: str, upload_key: str) -> None:
        secret = parse_invite(line).secret
        record = hosts.get("alice")
        assert record is not None and hosts.redeem("alice", secret_hash(secret),
                                                   public_key_of(Ed25519PrivateKey.generate()), upload_key,
                                                   record.invited_at)

    # Given alice invited, redeemed with her upload key, joined and heard from
    with acting_as(OPERATOR):
        redeem(invite(conn, "alice", 3600), old.public_key)
    harness.scheduled_tick()
    assert harness.join("alice")["accepted"]
    assert harness.heartbeat("alice")["accepted"]
    record = hosts.get("alice")
    assert record is not None and record.registered_key == old.public_key

    # When she is revoked and the operator invites her id again
    with acting_as(OPERATOR):
        revoke(conn, "alice", "stolen laptop")
        with pytest.raises(HostsError, match="fed hosts reinstate alice"):
            invite(conn, "alice", 3600)
    # Then the revoked machine's uploads are refused
    refused = harness.heartbeat("alice")
    assert not refused["accepted"] and "from a revoked host: stolen laptop" in refused["reason"]

    # When she is reinstated: nothing is let in before the new generation redeems its invite
    with acting_as(OPERATOR):
        line = reinstate(conn, "alice", 3600)
    refused = harness.heartbeat("alice")
    assert not refused["accepted"] and "generation 2 has not redeemed" in refused["reason"]
    # and once it has, the old key (still the registered one) is refused until the new generation's join
    new = Signer.generate()
    redeem(line, new.public_key)
    refused = harness.heartbeat("alice")
    assert not refused["accepted"] and "before the join of its generation 2" in refused["reason"]
    # and a join signed with the old key is refused: it is not the key this generation bound
    refused = harness.join("alice")
    assert not refused["accepted"] and "another key than the one host alice bound" in refused["reason"]

    # When the new generation joins with its new key
    harness.signers["alice"] = new
    joined = harness.join("alice")
    assert joined["accepted"] and "generation 2" in joined["reason"]
    # Then the participant is registered with the new key, and its uploads are let in
    assert harness.deps.store.participant("alice").public_key == new.public_key
    assert harness.heartbeat("alice")["accepted"]
    record = hosts.get("alice")
    assert record is not None and (record.status, record.generation) == (HostStatus.ACTIVE, 2)
    assert record.registered_key == new.public_key and old.public_key in record.retired_keys
    # and the revoked machine's key is refused still: its signature no longer matches the registered key
    harness.signers["alice"] = old
    refused = harness.heartbeat("alice")
    assert not refused["accepted"] and "does not match" in refused["reason"]
