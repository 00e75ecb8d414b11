"""The host's side of an invite (`participant.credentials`) against the credential endpoint served on loopback
(`local.credentials`, in-process moto): redeemed once, renewed by signed requests a third of a session before its
end, across restarts (and a restart that lost the record of its redemption), served to botocore as container
credentials, a temporary refusal (rate limit, stale clock) tried again with backoff while the session held serves on,
and a revocation ending it with the reason."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import boto3
import pytest

import participant.credentials
from local.credentials import LocalCredentialEndpoint
from participant.credentials import (
    REDEEMED_FILE,
    RETRY_FIRST,
    RETRY_MAX,
    CredentialServer,
    EndpointUnavailable,
    HostRefused,
    HostSession,
)
from shared.hosts import Invite, new_secret, secret_hash
from shared.messages import CredentialAnswer
from shared.naming import ENV_HOST_RATE
from shared.signing import Signer
from tests.functional.test_credential_endpoint import SECONDS, Endpoint, endpoint  # noqa: F401 - the fixture


@pytest.fixture
def url(endpoint: Endpoint) -> Iterator[str]:  # noqa: F811 - the fixture imported above
    endpoint.now = time.time()  # moto's sessions expire by the real clock
    served = LocalCredentialEndpoint().start()
    yield served.url
    served.stop()


class Clock:
    """The host's clock: the real one (moto's sessions expire by it), or one stopped at `stopped`, `ahead` seconds
    ahead."""

    def __init__(self, stopped: float | None = None) -> None:
        self.ahead = 0.0
        self.stopped = stopped

    def __call__(self) -> float:
        return (time.time() if self.stopped is None else self.stopped) + self.ahead


def test_a_host_redeems_once_then_renews_across_restarts(endpoint: Endpoint, url: str, tmp_path: Path) -> None:  # noqa: F811
    invite = Invite(url, "gpu-7", endpoint.invite("gpu-7"), int(endpoint.now) + 3600)
    clock = Clock()
    session = HostSession(invite, tmp_path / "host", clock)

    first = session.answer()
    assert session.renewals == 0 and (tmp_path / "host" / REDEEMED_FILE).exists()
    assert first.connection.run_id == "hosts-run" and first.credentials.AccessKeyId.startswith("ASIA")
    assert session.answer() is first  # most of its lifetime left: no request

    clock.ahead = SECONDS * 0.7  # a third of its lifetime left, or less: renewed
    assert session.answer().credentials.AccessKeyId != first.credentials.AccessKeyId and session.renewals == 1

    restarted = HostSession(invite, tmp_path / "host", clock)  # the same key, from its host directory
    restarted.answer()
    assert restarted.renewals == 1
    (tmp_path / "host" / REDEEMED_FILE).unlink()  # it died between redeeming and noting it: renewing still works
    HostSession(invite, tmp_path / "host", clock).answer()
    assert endpoint.reasons("gpu-7") == ["invite already redeemed"]
    # and the upload key it bound at redemption is the one the daemon signs with, kept across restarts
    record = endpoint.store.get("gpu-7")
    assert record is not None and record.upload_key == session.upload_key == restarted.upload_key
    assert Signer.load_or_create(session.upload_key_path).public_key == record.upload_key != record.public_key


def test_a_new_invite_of_the_same_host_binds_new_keys(endpoint: Endpoint, url: str, tmp_path: Path) -> None:  # noqa: F811
    # Given a host that redeemed an invite, then was revoked and reinstated (a new invite, in its next generation)
    first = HostSession(Invite(url, "gpu-9", endpoint.invite("gpu-9"), int(endpoint.now) + 3600), tmp_path / "host")
    first.answer()
    old = endpoint.store.get("gpu-9")
    assert old is not None
    endpoint.store.revoke("gpu-9", "reinstated below", endpoint.now)
    secret = new_secret()
    assert endpoint.store.reinstate("gpu-9", secret_hash(secret), endpoint.now + 3600, endpoint.now)
    # When the same machine starts with the new line
    second = HostSession(Invite(url, "gpu-9", secret, int(endpoint.now) + 3600), tmp_path / "host")
    second.answer()
    # Then it made and bound new keys: the old generation's are never bound again
    new = endpoint.store.get("gpu-9")
    assert new is not None and new.generation == 2
    assert {new.public_key, new.upload_key}.isdisjoint({old.public_key, old.upload_key})
    assert second.upload_key == new.upload_key != first.upload_key


def test_the_session_is_served_to_botocore_and_a_revocation_ends_it(endpoint: Endpoint, url: str,  # noqa: F811
                                                                   tmp_path: Path) -> None:
    invite = Invite(url, "gpu-8", endpoint.invite("gpu-8"), int(endpoint.now) + 3600)
    clock = Clock()
    session = HostSession(invite, tmp_path / "host", clock)
    refused: list[str] = []
    server = CredentialServer(session, on_refused=refused.append).start()
    try:
        served = boto3.Session().get_credentials()
        assert served is not None and served.get_frozen_credentials().access_key == \
            session.answer().credentials.AccessKeyId

        endpoint.store.revoke("gpu-8", "decommissioned", time.time())
        clock.ahead = SECONDS * 0.7
        with pytest.raises(HostRefused, match="host is revoked: decommissioned"):
            session.answer()
        status, body = server.body()
        assert status == 403 and "decommissioned" in body["message"] and refused and "decommissioned" in refused[0]
    finally:
        server.stop()


def test_a_host_whose_live_session_was_cut_learns_why_from_the_endpoint(endpoint: Endpoint, url: str,  # noqa: F811
                                                                       tmp_path: Path) -> None:
    # Given a host holding a session with most of its lifetime left
    session = HostSession(Invite(url, "gpu-6", endpoint.invite("gpu-6"), int(endpoint.now) + 3600), tmp_path / "host")
    session.answer()
    # While it is not refused, asking says so (and costs one renewal)
    assert session.refusal() == "" and session.renewals == 1
    # When it is revoked, IAM cuts its session before any renewal is due: the participant stops on a denial
    endpoint.store.revoke("gpu-6", "key leaked", time.time())
    # Then asking the endpoint gives the revocation's reason, kept from then on
    assert "host is revoked: key leaked" in session.refusal() and session.renewals == 1
    with pytest.raises(HostRefused, match="key leaked"):
        session.answer()


def test_a_temporary_refusal_keeps_the_session_and_is_tried_again_after_a_backoff(
        endpoint: Endpoint, url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    monkeypatch.setenv(ENV_HOST_RATE, "1")  # the redemption spends the host's minute
    invite = Invite(url, "gpu-9", endpoint.invite("gpu-9"), int(endpoint.now) + 3600)
    clock = Clock(stopped=time.time())  # stopped: the backoffs below are exact
    session = HostSession(invite, tmp_path / "host", clock, rng=random.Random(7))
    first = session.answer()

    clock.ahead = SECONDS * 0.7  # time to renew: answered 429, so the session held is kept
    assert session.answer() is first and session.renewals == 0 and not session.refused
    assert 0.5 * RETRY_FIRST <= session.retry_in() <= RETRY_FIRST
    assert session.answer() is first  # within the backoff: the endpoint is not asked
    assert endpoint.store.requests_counted("gpu-9", endpoint.now) == 2
    clock.ahead += RETRY_FIRST
    assert session.answer() is first and RETRY_FIRST <= session.retry_in() <= 2 * RETRY_FIRST  # doubled
    assert endpoint.store.requests_counted("gpu-9", endpoint.now) == 3

    endpoint.now += 60  # the endpoint's next minute
    clock.ahead += 2 * RETRY_FIRST
    assert session.answer().credentials.AccessKeyId != first.credentials.AccessKeyId
    assert session.renewals == 1 and session.retry_in() == 0

    clock.ahead += SECONDS + 400  # the host's clock runs far ahead: its renewals are stale, which is temporary too
    with pytest.raises(EndpointUnavailable, match="ahead of the endpoint's clock"):
        session.answer()  # (and the session it holds has expired by the host's clock)
    assert not session.refused and session.retry_in() > 0
    clock.ahead = SECONDS * 0.7 + 2 * RETRY_FIRST + 60 + 10  # its clock set right: renewed
    endpoint.now += 60
    session.answer()
    assert session.renewals == 2


def answer_until(expires: float) -> CredentialAnswer:
    return CredentialAnswer.model_validate({
        "credentials": {"AccessKeyId": "ASIA" + "A" * 16, "SecretAccessKey": "s", "SessionToken": "t",
                        "Expiration": datetime.fromtimestamp(expires, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")},
        "connection": {"run_id": "hosts-run", "bucket": "b", "table": "t", "region": "us-east-1",
                       "participant_role": "arn:aws:iam::123456789012:role/r"}})


def test_the_backoff_doubles_with_jitter_up_to_its_bound_and_only_a_definite_refusal_stops(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1_800_000_000.0]
    sent: list[float] = []
    outcome: list[Exception | CredentialAnswer] = [answer_until(now[0] + 3600)]

    def post(url: str, body: dict[str, Any], timeout: float = 30.0) -> CredentialAnswer:
        sent.append(now[0])
        result = outcome[0]
        if isinstance(result, Exception):
            raise result
        return result

    monkeypatch.setattr(participant.credentials, "post", post)
    invite = Invite("https://endpoint.example", "gpu-1", "A" * 43, int(now[0]) + 3600)
    session = HostSession(invite, tmp_path / "host", lambda: now[0], rng=random.Random(3))
    first = session.answer()
    outcome[0] = EndpointUnavailable("the credential endpoint answered 429: too many requests")
    now[0] += 2400  # a third of the session left: renewing, refused for now, again and again
    while now[0] < 1_800_000_000.0 + 3600:
        assert session.answer() is first  # the session held, while it is valid
        now[0] += session.retry_in() / 2
        assert session.answer() is first  # (not asked before its backoff)
        now[0] += session.retry_in()
    gaps = [b - a for a, b in zip(sent[1:], sent[2:], strict=False)]
    for i, gap in enumerate(gaps):
        ceiling = min(RETRY_MAX, RETRY_FIRST * 2 ** i)
        assert ceiling / 2 <= gap <= ceiling, (i, gap)
    assert len(sent) < 40 and max(gaps) > RETRY_MAX * 0.9  # bounded: about a minute apart, not hammering
    assert len(set(gaps)) == len(gaps)  # jittered
    with pytest.raises(EndpointUnavailable, match="next try in"):
        session.answer()  # expired, and the endpoint still refuses for now
    now[0] += session.retry_in()
    outcome[0] = answer_until(now[0] + 3600)
    assert session.answer() is outcome[0] and session.retry_in() == 0
    outcome[0] = HostRefused("the credential endpoint refused this host (403): host is revoked")
    now[0] += 2400
    with pytest.raises(HostRefused):
        session.answer()
    tries = len(sent)
    now[0] += 600
    with pytest.raises(HostRefused, match="revoked"):
        session.answer()
    assert len(sent) == tries  # refused for good: never asked again
