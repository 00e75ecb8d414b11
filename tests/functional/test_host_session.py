"""The host's side of an invite (`participant.credentials`) against the credential endpoint served on loopback
(`local.credentials`, in-process moto): redeemed once, renewed by signed requests a third of a session before its
end, across restarts (and a restart that lost the record of its redemption), served to botocore as container
credentials, and a revocation ending it with the reason."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest

from local.credentials import LocalCredentialEndpoint
from participant.credentials import REDEEMED_FILE, CredentialServer, HostRefused, HostSession
from shared.hosts import Invite
from tests.functional.test_credential_endpoint import SECONDS, Endpoint, endpoint  # noqa: F401 - the fixture


@pytest.fixture
def url(endpoint: Endpoint) -> Iterator[str]:  # noqa: F811 - the fixture imported above
    endpoint.now = time.time()  # moto's sessions expire by the real clock
    served = LocalCredentialEndpoint().start()
    yield served.url
    served.stop()


class Clock:
    def __init__(self) -> None:
        self.ahead = 0.0

    def __call__(self) -> float:
        return time.time() + self.ahead


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
