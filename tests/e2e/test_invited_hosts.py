"""Hosts that join with an invite line alone (issue 33): participant processes with no AWS credential in their
environment at all (no AWS_* variable, a HOME without .aws) redeem their invite at the local credential endpoint,
renew their short sessions by themselves through a run, and a revoked host is refused at once while the run goes
on without it; its id stays revoked, and a reinstated new generation of it trains (issue 43)."""

from __future__ import annotations

import os
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest
from botocore.exceptions import ClientError

from fed.demo.processes import participant_command
from fed.hosts import HostsError, invite, reinstate, revoke
from fed.localrun import store_for, wait_until
from local.access.ledger import ENV_LEDGER, read_denials
from local.stack import LocalStack
from participant.credentials import HostRefused, load_or_create_key, post
from shared.hosts import RENEW_PATH, sign_renewal
from shared.keys import config_key
from shared.messages import CredentialAnswer
from shared.state import Phase
from store.connection import Connection
from store.hosts import HostStore
from store.table import StateStore
from store.trace import OPERATOR, acting_as
from tests.e2e.harness import e2e_config

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

# A session lasts 5 s: renewed every ~3.3 s. The run's 20 rounds are two epochs with 8 s of cooldown between them, so
# the run lasts at least 8 s however fast its rounds are, and each host renews at least twice on the way
CREDENTIAL_SECONDS, ROUNDS, ROUNDS_PER_EPOCH, COOLDOWN = 5, 20, 10, 8.0
# In the revocation test a session lasts 15 s: renewed every ~10 s, so that a revocation just after a renewal leaves
# carol ~10 s of heartbeats (one every 2 s) before its next renewal is refused; the run outlasts all of it
REVOCATION_SECONDS, REVOCATION_ROUNDS = 15, 400
RENEWED = re.compile(r"credentials renewed")


class Hosts:
    """`fed-participant start --invite LINE` processes, each in an environment with no AWS credential at all."""

    def __init__(self, stack: LocalStack, workdir: Path) -> None:
        self.stack, self.workdir = stack, workdir
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.logs: dict[str, Path] = {}

    def environment(self, name: str) -> dict[str, str]:
        home = self.workdir / "homes" / name
        home.mkdir(parents=True, exist_ok=True)
        kept = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        return {**kept, "HOME": str(home), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}

    def start(self, name: str, line: str) -> None:
        env = self.environment(name)
        assert not any(k.startswith("AWS_") for k in env) and not (Path(env["HOME"]) / ".aws").exists()
        self.logs[name] = self.workdir / f"{name}.log"
        with self.logs[name].open("wb") as log:
            self.procs[name] = subprocess.Popen(
                [*participant_command(), "start", "--invite", line, "--device", "cpu", "--threads", "1",
                 "--poll-max", "0.5"], stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.workdir,
                start_new_session=True)

    def output(self, name: str) -> str:
        return self.logs[name].read_text(errors="replace")

    def running(self, name: str) -> bool:
        return self.procs[name].poll() is None

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()


@pytest.fixture
def stack(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[LocalStack]:
    seconds, rounds, per_epoch, cooldown = getattr(request, "param",
                                                   (CREDENTIAL_SECONDS, ROUNDS, ROUNDS_PER_EPOCH, COOLDOWN))
    config = e2e_config(run_id="hosts", min_clients=2, min_per_round=2, min_updates=2, total_rounds=rounds,
                        rounds_per_epoch=per_epoch, cooldown_time=cooldown)
    with LocalStack(config, tick_interval=0.5, log_file=tmp_path / "functions.log", log_level="INFO",
                    credential_seconds=seconds) as s:
        yield s


@pytest.fixture
def hosts(stack: LocalStack, tmp_path: Path) -> Iterator[Hosts]:
    h = Hosts(stack, tmp_path)
    yield h
    h.stop()


def as_operator_invite(conn: Connection, host: str) -> str:
    """`fed hosts invite`, judged as the operator's."""
    with acting_as(OPERATOR):
        return invite(conn, host, 3600)


def wait(predicate, timeout: float, what: str, hosts: Hosts) -> None:  # type: ignore[no-untyped-def]
    if not wait_until(predicate, timeout, interval=0.25):
        logs = "\n".join(f"--- {n}\n{hosts.output(n)[-3000:]}" for n in hosts.procs)
        pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}\n{logs}")


def test_hosts_with_nothing_but_an_invite_train_a_run_to_the_end_renewing_their_sessions(
    stack: LocalStack, hosts: Hosts
) -> None:
    # Given two invites, and two hosts with no AWS credential of their own
    conn = stack.connection
    for name in ("alice", "bob"):
        hosts.start(name, as_operator_invite(conn, name))

    # When they run
    store = store_for(conn)
    wait(lambda: store.read_state().phase is Phase.FINISHED, 240, "the run to finish", hosts)
    wait(lambda: not hosts.running("alice") and not hosts.running("bob"), 60, "the hosts to exit", hosts)

    # Then both trained every round and exited cleanly, with no refusal of anything they sent
    state = store.read_state()
    assert state.aggregated == stack.config.total_rounds
    rounds = store.rounds()
    assert all(set(r.counted) == {"alice", "bob"} for r in rounds), [(r.round, r.counted) for r in rounds]
    assert [hosts.procs[n].returncode for n in ("alice", "bob")] == [0, 0], hosts.output("alice")[-2000:]
    assert store.refusals() == []
    # and each renewed its session at least twice on the way (each renewal a signed request the endpoint accepted)
    for name in ("alice", "bob"):
        assert len(RENEWED.findall(hosts.output(name))) >= 2, hosts.output(name)[-3000:]
    records = {r.host: r for r in HostStore(conn.table, conn.run_id, conn.endpoint, conn.region).list()}
    assert {r.status.value for r in records.values()} == {"active"} and all(r.last_credentials_at for r in
                                                                            records.values())


@pytest.mark.access_denied_expected  # carol's calls once revoked, refused by the role's deny as IAM refuses them
@pytest.mark.parametrize("stack", [(REVOCATION_SECONDS, REVOCATION_ROUNDS, 0, 0.0)], indirect=True)
def test_a_revoked_host_is_refused_at_once_and_the_run_goes_on_without_it(stack: LocalStack, hosts: Hosts) -> None:
    # Given three invited hosts in a run that needs two
    conn = stack.connection
    for name in ("alice", "bob", "carol"):
        hosts.start(name, as_operator_invite(conn, name))
    store: StateStore = store_for(conn)
    host_store = HostStore(conn.table, conn.run_id, conn.endpoint, conn.region)
    wait(lambda: store.read_state().aggregated >= 1, 180, "a round to be aggregated", hosts)

    # When the operator revokes carol, just after carol renewed its session
    def last_renewal() -> float:
        record = host_store.get("carol")
        return record.last_credentials_at if record is not None else 0.0
    before = last_renewal()
    wait(lambda: last_renewal() > before, 2 * REVOCATION_SECONDS, "carol's next renewal", hosts)
    revoked_at = time.time()
    with acting_as(OPERATOR):
        done = revoke(conn, "carol", "key leaked")
    assert "refused" in done[0]

    # Then carol's next call is refused by the participant role's deny on its generation, as IAM refuses it (what
    # might still reach the bucket is refused by ingest: `tests/functional/test_host_generations.py`)
    def carol_denied() -> bool:
        return any(d.principal == "participant:carol" and "RevokedHosts (fed-host=carol.1)" in d.why
                   for d in read_denials(Path(os.environ[ENV_LEDGER]), since=revoked_at))
    wait(carol_denied, 60, "carol's next call to be denied", hosts)
    # and a renewal signed with carol's own key is refused, recorded with its reason
    key_file = next((hosts.workdir / "homes" / "carol").rglob("host-key.pem"))
    with pytest.raises(HostRefused, match="revoked"):
        post(conn.credential_endpoint + RENEW_PATH,
             sign_renewal(load_or_create_key(key_file), "carol", time.time()).model_dump(mode="json"))
    assert any(r.host == "carol" and "revoked" in r.reason and r.at >= revoked_at for r in host_store.refusals())

    # and carol, refused a renewal by its own session too, stops with the endpoint's reason
    wait(lambda: not hosts.running("carol"), 4 * REVOCATION_SECONDS, "carol to stop", hosts)
    assert hosts.procs["carol"].returncode == 1, hosts.output("carol")[-3000:]
    assert "revoked" in hosts.output("carol") and "key leaked" in hosts.output("carol")
    # and the run goes on without carol, alice's and bob's uploads unaffected
    then = store.read_state().aggregated
    wait(lambda: store.read_state().aggregated >= then + 3, 120, "three more rounds without carol", hosts)
    late = [r for r in store.rounds() if r.started >= revoked_at + 1]
    assert late and all("carol" not in r.counted and r.aggregated for r in late)
    assert not [r for r in store.refusals() if r.pid in {"alice", "bob"}]
    assert hosts.running("alice") and hosts.running("bob")


def s3_of(conn: Connection, answer: CredentialAnswer) -> object:
    c = answer.credentials
    return boto3.client("s3", endpoint_url=conn.endpoint, region_name=conn.region, aws_access_key_id=c.AccessKeyId,
                        aws_secret_access_key=c.SecretAccessKey, aws_session_token=c.SessionToken)


@pytest.mark.access_denied_expected  # the revoked generation's calls, refused by the role's deny as IAM refuses them
@pytest.mark.parametrize("stack", [(REVOCATION_SECONDS, REVOCATION_ROUNDS, 0, 0.0)], indirect=True)
def test_a_revoked_host_is_cut_within_one_call_stays_cut_and_its_reinstated_generation_trains(
    stack: LocalStack, hosts: Hosts
) -> None:
    # Given three invited hosts in a run that needs two, training
    conn = stack.connection
    for name in ("alice", "bob", "carol"):
        hosts.start(name, as_operator_invite(conn, name))
    store: StateStore = store_for(conn)
    wait(lambda: store.read_state().aggregated >= 1, 180, "a round to be aggregated", hosts)
    # and a live session of carol's machine, renewed with its own key (as the machine would, or one who stole it)
    key_file = next((hosts.workdir / "homes" / "carol").rglob("host-key.pem"))
    live = post(conn.credential_endpoint + RENEW_PATH,
                sign_renewal(load_or_create_key(key_file), "carol", time.time()).model_dump(mode="json"))
    s3 = s3_of(conn, live)
    s3.get_object(Bucket=conn.bucket, Key=config_key(conn.run_id))  # type: ignore[attr-defined]

    # When the operator revokes carol
    revoked_at = time.time()
    with acting_as(OPERATOR):
        revoke(conn, "carol", "key leaked")
    # Then the session's very next call is refused, as IAM refuses it (the role's deny on carol's generation)
    with pytest.raises(ClientError, match="AccessDenied"):
        s3.get_object(Bucket=conn.bucket, Key=config_key(conn.run_id))  # type: ignore[attr-defined]
    # and carol's machine, cut off, stops
    wait(lambda: not hosts.running("carol"), 4 * REVOCATION_SECONDS, "carol's machine to stop", hosts)

    # When the operator invites the id again, it is refused, naming the way back; and the session stays cut
    with acting_as(OPERATOR), pytest.raises(HostsError, match="fed hosts reinstate carol"):
        invite(conn, "carol", 3600)
    with pytest.raises(ClientError, match="AccessDenied"):
        s3.get_object(Bucket=conn.bucket, Key=config_key(conn.run_id))  # type: ignore[attr-defined]

    # When it is reinstated and a new machine redeems the new line
    with acting_as(OPERATOR):
        line = reinstate(conn, "carol", 3600)
    reinstated_at = time.time()
    hosts.start("carol-2", line)
    # Then the old session is still cut, and the old machine's key is refused by the endpoint
    with pytest.raises(ClientError, match="AccessDenied"):
        s3.get_object(Bucket=conn.bucket, Key=config_key(conn.run_id))  # type: ignore[attr-defined]
    with pytest.raises(HostRefused):
        post(conn.credential_endpoint + RENEW_PATH,
             sign_renewal(load_or_create_key(key_file), "carol", time.time()).model_dump(mode="json"))
    # and the new generation's join registers its own key
    hosts_store = HostStore(conn.table, conn.run_id, conn.endpoint, conn.region)

    def registered() -> bool:
        record = hosts_store.get("carol")
        return record is not None and record.generation == 2 and record.registered_key == record.upload_key != ""
    wait(registered, 60, "the reinstated carol's join to be registered", hosts)
    # and the new generation trains: members are fixed for an epoch, so carol comes back at the next one, which bob's
    # leaving brings about (alice alone is under the run's minimum of two)
    hosts.procs["bob"].terminate()

    def carol_counted_again() -> bool:
        return any("carol" in r.counted and r.started >= reinstated_at for r in store.rounds())
    wait(carol_counted_again, 120, "the reinstated carol to be counted in a round", hosts)
    assert not [r for r in store.refusals() if r.pid in {"alice", "bob"}]
    assert revoked_at < reinstated_at and hosts.running("carol-2")
