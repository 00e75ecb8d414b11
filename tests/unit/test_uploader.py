"""`shared.keys.uploader`: whose upload a key can be, read from the key as the participant role grants writes."""

from __future__ import annotations

import pytest

from shared import keys

RUN = "run-a"
P = f"runs/{RUN}/"


@pytest.mark.parametrize(("key", "pid"), [
    (keys.join_key(RUN, "alice"), "alice"),
    (keys.init_key(RUN, "alice"), "alice"),
    (keys.heartbeat_key(RUN, "alice"), "alice"),
    (keys.update_key(RUN, 3, "alice"), "alice"),
    (keys.witness_key(RUN, 3, "alice"), "alice"),
    (keys.health_key(RUN, 3, "alice"), "alice"),
    # junk the role's rounds/*/<own id> grants (IAM's `*` spans '/'): it need not parse to be alice's
    (f"{P}rounds/x/y/z/alice", "alice"),
    (f"{P}rounds//alice", "alice"),
    (f"{P}rounds/999999999/alice", "alice"),
    (f"{P}rounds/000001/-alice", "-alice"),  # a tag value no participant id is, but the role admits
])
def test_a_participant_writes_keys_ending_in_its_own_id(key: str, pid: str) -> None:
    assert keys.uploader(RUN, key) == pid


@pytest.mark.parametrize("key", [
    "runs/other-run/join/alice",  # another run's
    f"{P}rounds/alice",  # rounds/*/<id> needs a segment between
    f"{P}join/a/alice", f"{P}heartbeat/", f"{P}join/",  # join/, init/, heartbeat/ hold exactly an id
    f"{P}rounds/000001/global",  # a reserved name
    f"{P}rounds/000001/Global",
    f"{P}rounds/000001/global/" + "0" * 64,  # the coordinator's (digests are 64 characters: no tag is)
    f"{P}rounds/000001/staging/{'0' * 64}/000000",  # the coordinator's, though 000000 could be an id
    f"{P}rounds/000001/a.b", f"{P}rounds/000001/a@b", f"{P}rounds/000001/a b",  # no tag holds these
    f"{P}rounds/000001/" + "a" * 64,
    f"{P}roster/" + "0" * 64, f"{P}manifest.json", f"{P}checkpoints/000001/global",
])
def test_keys_no_participant_session_can_write_have_no_uploader(key: str) -> None:
    assert keys.uploader(RUN, key) is None
