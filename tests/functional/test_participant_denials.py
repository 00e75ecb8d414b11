"""A participant whose credentials may not read what the run says exists says so, instead of waiting forever.

S3 answers a caller that may not list the bucket (every participant) 403 for a missing key: so a 403 alone cannot
tell "not there yet" from "not yours to read". What can: the run itself. Once the run has started, its config is
there; a global model the state names was written before the state named it. Such an object answering 403 for
DENIED_PATIENCE is a denial (`participant.remote.DeniedRead`, naming `fed-participant check`); the participant's own
missing key stays "missing". The denial here is IAM's own: the run's real roles (`local.access`, from the synthesized
template) with one explicit Deny added to the participant role, as a misconfigured deployment would have.
"""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from local import access
from local.access.control import install_in_process
from local.access.model import PARTICIPANT, AccessModel
from participant.decide import Fetch
from participant.journal import Journal, JournalKeeper
from participant.remote import DENIED_PATIENCE, DeniedRead, Remote, Retrier
from participant.tasks.digits import task as digits
from participant.tensors import specs_of
from participant.training import Training, Workload
from participant.ui import Reporter
from shared import keys
from shared.signing import Signer
from store.blobs import NotFound
from store.connection import Connection
from store.trace import acting_as, participant
from tests.functional.conftest import MODEL, Harness

pytestmark = pytest.mark.access_denied_expected  # the point: a read IAM refuses


def with_participant_denied(model: AccessModel, bucket: str, object_keys: list[str]) -> AccessModel:
    """`model` with an explicit Deny of s3:GetObject on `object_keys` in the participant role."""
    role = model.principals[PARTICIPANT]
    deny = {"Version": "2012-10-17", "Statement": [{
        "Effect": "Deny", "Action": "s3:GetObject", "Resource": [f"arn:aws:s3:::{bucket}/{k}" for k in object_keys]}]}
    denied = dataclasses.replace(role, policies={**role.policies, "TestDeniesReads": deny})
    return dataclasses.replace(model, principals={**model.principals, PARTICIPANT: denied})


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def remote_of(h: Harness, pid: str, clock: Clock) -> Remote:
    conn = Connection(run_id=h.config.run_id, bucket=h.res.bucket, table=f"fed-{h.config.run_id}-state")
    return Remote(conn, pid, Retrier(threading.Event(), first_delay=0.01, max_delay=0.02), h.signer(pid), clock)


def started_run_with_round_1(h: Harness) -> None:
    h.start(["alice", "bob"])
    for pid in ("alice", "bob"):
        h.upload(pid, {k: v + 1 for k, v in MODEL.items()}, samples=10)
    h.scheduled_tick()
    assert h.state().round == 1


def test_a_config_the_role_may_not_read_is_reported_after_the_wait_not_awaited_forever(
        harness_factory: Any) -> None:
    # Given a started run (its config published), and a participant role that may not read the config
    h: Harness = harness_factory()
    started_run_with_round_1(h)
    config_key = keys.config_key(h.config.run_id)
    install_in_process(access.control_for(with_participant_denied(access.model_for(h.config), h.res.bucket,
                                                                  [config_key])))
    clock = Clock()
    remote = remote_of(h, "alice", clock)
    with acting_as(participant("alice")):
        # When it reads the config: within the wait, a 403 is "not there yet"
        assert remote.read_config() is None
        clock.now += DENIED_PATIENCE - 1
        assert remote.read_config() is None
        # Then past the wait, with the run started, it is a denial said plainly
        clock.now += 1
        with pytest.raises(DeniedRead, match=r"run config .*403 AccessDenied.* for 60 s.*fed-participant check"):
            remote.read_config()
        # And its own key, missing, is still just missing (no denial, however long)
        clock.now += 10 * DENIED_PATIENCE
        assert remote.update_stored(7) is False


def test_before_the_run_starts_a_403_on_the_config_is_awaited(harness_factory: Any) -> None:
    # Given a run not yet ticked (no config, no state), read by a participant that may read it
    h: Harness = harness_factory()
    clock = Clock()
    remote = remote_of(h, "alice", clock)
    with acting_as(participant("alice")):
        # When the config answers 403 (S3's answer to a participant for a missing key) for long
        assert remote.read_config() is None
        clock.now += 10 * DENIED_PATIENCE
        # Then the participant keeps waiting: nothing says the config should be there
        assert remote.read_config() is None
    # And once the coordinator ticks, the config is read
    h.scheduled_tick()
    with acting_as(participant("alice")):
        config = remote.read_config()
    assert config is not None and config.run_id == h.config.run_id


def test_a_global_model_the_role_may_not_read_stops_the_participant_with_the_reason(
        harness_factory: Any, tmp_path: Path) -> None:
    # Given round 1's global model, named by the state, which the participant role may not read
    h: Harness = harness_factory()
    started_run_with_round_1(h)
    state = h.state()
    global_key = keys.global_key(h.config.run_id, 1, state.global_digest)
    assert h.s3.head_object(Bucket=h.res.bucket, Key=global_key)  # (it is there)
    install_in_process(access.control_for(with_participant_denied(access.model_for(h.config), h.res.bucket,
                                                                  [global_key])))
    clock = Clock()
    remote = remote_of(h, "alice", clock)
    training = Training(remote, JournalKeeper(Journal(h.config.run_id, "alice")), Reporter(bars=False),
                        threading.Event(), lambda _: None, tmp_path / "cache", h.config.run_id, "alice")
    work = Workload("participant.tasks.digits:task", h.config, digits, torch.device("cpu"),
                    specs_of(digits.build_model(0)))
    with acting_as(participant("alice")):
        # When it fetches the model: within the wait it retries, as for a model not there yet
        assert training.fetch_file(work, Fetch(1, state.global_digest)) is None
        # Then past it, the fetch stops with the denial, naming the model and what to check
        clock.now += DENIED_PATIENCE
        with pytest.raises(DeniedRead, match=r"global model of round 1 .*fed-participant check"):
            training.fetch_file(work, Fetch(1, state.global_digest))
    assert not any(tmp_path.glob("cache/*.safetensors"))


def test_a_not_found_that_is_no_403_is_never_a_denial() -> None:
    # Given a participant's view of a run, and an object the run says exists answering 404 (a caller that may list)
    clock = Clock()
    conn = Connection(run_id="denials", bucket="fed-denials", table="fed-denials-state", region="us-east-1")
    remote = Remote(conn, "alice", Retrier(threading.Event()), Signer.generate(), clock)
    # When that lasts far past the wait, it is never taken as a denial
    for _ in range(3):
        remote.must_exist("runs/denials/000001/global", NotFound("runs/denials/000001/global"), "the global model")
        clock.now += 10 * DENIED_PATIENCE
    # But a 403 is, once it lasted the wait
    remote.must_exist("runs/denials/000001/global", NotFound("k", denied=True), "the global model")
    clock.now += DENIED_PATIENCE
    with pytest.raises(DeniedRead):
        remote.must_exist("runs/denials/000001/global", NotFound("k", denied=True), "the global model")
