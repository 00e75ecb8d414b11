"""Shard outcomes, as the deployed aggregation reads them: the tick hands each shard to the shard queue and acts on
the outcome a shard worker leaves at `keys.shard_result_key` (`coordinator.shard_queue.queue_runner`). Whoever else
writes that key cannot make the round leave an honest update out: an outcome that does not answer the task the tick
handed out is ignored (the tick waits on for the worker's), a verdict that an input is unreadable is acted on only
where the coordinator finds that input's recorded version gone, and a participant whose id is shaped like the key's
last segment may not write it at all.

A consumer thread stands in for Lambda's SQS event source (one message per invocation of `functions.shard.handler`,
as the shard function's role); a hook on it acts for the attacker before the worker runs the task, and waits until
the waiting tick has looked at what the attacker wrote, so the tick sees it whatever the threads' timing."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import boto3
import numpy as np
import pytest
from botocore.exceptions import ClientError

from coordinator import shard_queue
from coordinator.aggregation import OutcomeRefused, ReportedCorrupt, from_outcome
from coordinator.shard_queue import result_key
from coordinator.verify import verify_run
from functions import shard
from functions.settings import forget_warm_state
from local.access import shared_ledger
from local.access.ledger import read_denials
from local.context import LocalContext
from shared import keys
from shared.digest import PIECE_BYTES
from shared.messages import (
    PieceDone,
    ShardCorrupt,
    ShardDone,
    ShardInput,
    ShardOutcome,
    ShardTask,
    parse_message,
    shard_task_digest,
)
from shared.naming import ENV_SHARD_RUNNER, ENV_SHARD_WAIT, shard_queue_name
from store.trace import acting_as, function, participant
from tests.conftest import ledger_dir
from tests.functional.conftest import Harness
from tests.functional.test_large_models import big_model

MB = 1024 * 1024
LOOKED_WITHIN = 120.0  # seconds the attacker's hook waits for the tick to look at its key (a bound, not a pace)


class ShardWorkers:
    """The shard function fed by the shard queue, in a thread: each message is one invocation of the handler as the
    shard role; `before(task)` runs first (the attacker's move) on every task it is given."""

    def __init__(self, url: str, before: Callable[[ShardTask], None]) -> None:
        self.sqs, self.url, self.before = boto3.client("sqs", region_name="us-east-1"), url, before
        self.stop, self.errors = threading.Event(), list[BaseException]()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            got = self.sqs.receive_message(QueueUrl=self.url, MaxNumberOfMessages=1, WaitTimeSeconds=1)
            for message in got.get("Messages", []):
                try:
                    self.before(parse_message(ShardTask, message["Body"]))
                    with acting_as(function("shard")):
                        shard.handler({"Records": [{"body": message["Body"]}]}, LocalContext())
                except BaseException as exc:  # noqa: BLE001 (reported by the test, not lost in the thread)
                    self.errors.append(exc)
                self.sqs.delete_message(QueueUrl=self.url, ReceiptHandle=message["ReceiptHandle"])

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=30)


class Attacker:
    """Acts once, on the first task of the shard starting at piece 0 it sees, then holds the worker back until the
    waiting tick has read that shard's outcome key at least once (so what it wrote is what the tick reads first)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, act: Callable[[ShardTask], None]) -> None:
        self.act, self.target = act, ""
        self.acted, self.looked = threading.Event(), threading.Event()
        real = shard_queue._outcome

        def watched(*args: Any, **kwargs: Any) -> Any:
            try:
                return real(*args, **kwargs)
            finally:
                if self.acted.is_set() and args[1] == self.target:
                    self.looked.set()

        monkeypatch.setattr(shard_queue, "_outcome", watched)

    def __call__(self, task: ShardTask) -> None:
        if task.first != 0 or self.acted.is_set():
            return
        self.target = result_key(task_run(task), task)
        self.act(task)
        self.acted.set()
        assert self.looked.wait(LOOKED_WITHIN), "the tick never looked at the shard's outcome key"


def task_run(task: ShardTask) -> str:
    return keys.parse_key(task.staging).run_id


@pytest.fixture
def sharded(harness_factory, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., tuple[Harness, str]]]:  # type: ignore[no-untyped-def]
    """A run of three whose model is three pieces, aggregated one piece a shard by queue-fed shard workers."""

    def build(pids: list[str], min_updates: int = 3) -> tuple[Harness, str]:
        h = harness_factory(min_clients=3, min_per_round=3, min_updates=min_updates, total_rounds=2, dataset_size=60,
                            max_update_bytes=64 * MB, shard_bytes=PIECE_BYTES)
        url = boto3.client("sqs", region_name="us-east-1").create_queue(
            QueueName=shard_queue_name(h.config.run_id))["QueueUrl"]
        monkeypatch.setenv(ENV_SHARD_RUNNER, f"queue:{url}")
        monkeypatch.setenv(ENV_SHARD_WAIT, "600")
        forget_warm_state()  # (a warm function keeps its runner: this one must use this test's queue and bucket)
        return h, url

    yield build
    forget_warm_state()


def start_round(h: Harness, pids: list[str]) -> None:
    """Everyone joined, round 0 open; the first two updates in (the third closes the round)."""
    h.scheduled_tick()
    for pid in pids:
        h.join_alive(pid)
    h.offer(pids[0], big_model(0, np.dtype(np.float32), megabytes=16))
    assert h.state().round == 0 and sorted(h.state().selected) == sorted(pids), h.state()
    for i, pid in enumerate(pids[:-1]):
        assert h.upload(pid, big_model(i + 1, np.dtype(np.float32), megabytes=16), samples=20)["accepted"]


def close_round(h: Harness, pids: list[str]) -> dict[str, Any]:
    return h.upload(pids[-1], big_model(len(pids), np.dtype(np.float32), megabytes=16), samples=20)


def assert_aggregated_with_everyone(h: Harness, pids: list[str]) -> None:
    state = h.state()
    assert state.round == 1 and state.aggregated == 1, state
    (summary,) = h.deps.store.rounds()
    assert sorted(summary.counted) == sorted(pids) and not summary.refused, summary
    assert all(check.ok for check in verify_run(h.deps))


PIDS = ["alice", "bob", "carol"]


def alice_unreadable(task: ShardTask, bound_to: ShardTask) -> bytes:
    """An outcome in the worker's format saying alice's update (as `task` records it) could not be read, naming
    `bound_to` as the task it answers."""
    (alice,) = (i for i in task.inputs if i.participant == "alice")
    return ShardOutcome(task=shard_task_digest(bound_to), upload_id=bound_to.upload_id, corrupt=ShardCorrupt(
        participant="alice", digest=alice.digest, version_id=alice.version_id, missing=True,
        message="could not read it")).model_dump_json().encode()


def unbound(task: ShardTask) -> bytes:
    # the outcome as workers wrote it before outcomes named their task: trusted for its upload id alone
    return json.dumps({"upload_id": task.upload_id, "outcome": {"corrupt": {
        "message": "could not read it", "participant": "alice", "missing": True}}}).encode()


def for_another_task(task: ShardTask) -> bytes:
    # this upload's id, but another task's digest (the same job with another piece range)
    return alice_unreadable(task, task.model_copy(update={"stop": task.stop + 1}))


def for_an_earlier_upload(task: ShardTask) -> bytes:
    # a well-formed outcome of an earlier attempt at the same job (another upload of the same staging key)
    return alice_unreadable(task, task.model_copy(update={"upload_id": task.upload_id + "-earlier"}))


@pytest.mark.parametrize("forged", [unbound, for_another_task, for_an_earlier_upload])
def test_an_outcome_that_does_not_answer_the_task_leaves_nobody_out(
    sharded: Any, monkeypatch: pytest.MonkeyPatch, forged: Callable[[ShardTask], bytes]
) -> None:
    # Given a round of three aggregated by queue-fed shard workers
    h, url = sharded(PIDS)
    start_round(h, PIDS)

    def forge(task: ShardTask) -> None:
        # an outcome written under the shard's key before the worker's, by a principal that may write it (a stale
        # or faulty shard worker), reporting alice's honest update unreadable, but not for the task handed out
        with acting_as(function("shard")):
            h.deps.bucket.put(result_key(h.config.run_id, task), forged(task))

    attacker = Attacker(monkeypatch, forge)
    workers = ShardWorkers(url, attacker)
    try:
        # When the last update closes the round, and the forged outcome is the first the tick reads for a shard
        close_round(h, PIDS)
    finally:
        workers.close()
    assert attacker.acted.is_set() and not workers.errors, workers.errors
    # Then the round is aggregated with every update, alice's included, and anyone can recompute it
    assert_aggregated_with_everyone(h, PIDS)


def test_a_verdict_the_coordinator_cannot_confirm_leaves_nobody_out(sharded: Any,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a round of three aggregated by queue-fed shard workers
    h, url = sharded(PIDS)
    start_round(h, PIDS)

    def forge(task: ShardTask) -> None:
        # an outcome that answers the very task handed out (its writer read the task: a faulty shard worker),
        # reporting alice's update, as recorded, unreadable, while her recorded version is in the bucket
        with acting_as(function("shard")):
            h.deps.bucket.put(result_key(h.config.run_id, task), alice_unreadable(task, task))

    attacker = Attacker(monkeypatch, forge)
    workers = ShardWorkers(url, attacker)
    try:
        # When the last update closes the round, the tick reads that verdict, finds alice's version in the bucket,
        # and does not act on it: the aggregation is not done, and the tick fails (to be retried)
        with pytest.raises(OutcomeRefused, match="nobody is left out on a worker's word"):
            close_round(h, PIDS)
        assert h.state().aggregated == 0 and not h.state().excluded
        # and the schedule's next tick aggregates the round afresh, under a new upload the verdict does not answer
        h.scheduled_tick()
    finally:
        workers.close()
    assert attacker.acted.is_set()
    # Then the round is aggregated with every update, alice's included, and anyone can recompute it
    assert_aggregated_with_everyone(h, PIDS)


def test_an_input_a_worker_cannot_read_and_the_coordinator_confirms_is_left_out(sharded: Any) -> None:
    # Given a round of three aggregated by queue-fed shard workers, in which alice's recorded update version is gone
    # from the bucket by the time the round closes (every read of it fails)
    h, url = sharded(PIDS, min_updates=2)
    start_round(h, PIDS)
    recorded = h.deps.store.update_record(0, "alice")
    assert recorded is not None and recorded.accepted
    h.s3.delete_object(Bucket=h.res.bucket, Key=keys.update_key(h.config.run_id, 0, "alice"),
                       VersionId=recorded.version_id)
    workers = ShardWorkers(url, lambda task: None)
    try:
        # When the last update closes the round, and the workers report alice's update unreadable
        close_round(h, PIDS)
    finally:
        workers.close()
    assert not workers.errors, workers.errors
    # Then the coordinator confirms it (her version is gone), and the round is aggregated from the other two
    state = h.state()
    assert state.round == 1 and state.aggregated == 1, state
    (summary,) = h.deps.store.rounds()
    assert sorted(summary.counted) == ["bob", "carol"]
    assert "unreadable as recorded" in summary.refused["alice"], summary.refused
    assert all(check.ok for check in verify_run(h.deps))


def a_task() -> ShardTask:
    inputs = [ShardInput(participant=p, samples=10, digest=f"{i:064x}", version_id=f"v{i}") for i, p in
              enumerate(PIDS)]
    return ShardTask(round=0, base_digest="f" * 64, base_version="b", base_size=100, inputs=inputs,
                     staging=keys.staging_key("run-x", 1, "e" * 64), upload_id="u", first=2, stop=4)


def test_an_outcome_is_acted_on_only_for_its_task_and_as_the_task_names_its_inputs() -> None:
    task = a_task()
    pieces = [PieceDone(index=i, etag="e", hash="0" * 64) for i in (2, 3)]
    answer = ShardOutcome(task=shard_task_digest(task), upload_id="u", done=ShardDone(pieces=pieces))
    assert from_outcome(answer.model_dump_json(), task) == answer.done
    # the same outcome for another task (any field of it), or in another format, is refused
    for other in (task.model_copy(update={"first": 1}), task.model_copy(update={"upload_id": "w"}),
                  task.model_copy(update={"inputs": task.inputs[:2]}),
                  task.model_copy(update={"inputs": [task.inputs[0].model_copy(update={"version_id": "v9"}),
                                                     *task.inputs[1:]]})):
        with pytest.raises(OutcomeRefused):
            from_outcome(answer, other)
    with pytest.raises(OutcomeRefused, match="no shard outcome"):
        from_outcome(json.dumps({"upload_id": "u", "outcome": {"done": answer.done.model_dump()}}), task)
    # pieces outside the task's range are refused
    stray = answer.model_copy(update={"done": ShardDone(pieces=[PieceDone(index=5, etag="e", hash="0" * 64)])})
    with pytest.raises(OutcomeRefused, match="reports pieces"):
        from_outcome(stray, task)
    # a verdict naming an input other than as the task records it is refused; one naming it as recorded is the
    # worker's word, for the tick to confirm
    verdict = ShardCorrupt(participant="bob", digest=f"{1:064x}", version_id="v1", missing=True, message="gone")
    with pytest.raises(ReportedCorrupt) as reported:
        from_outcome(answer.model_copy(update={"done": None, "corrupt": verdict}), task)
    assert reported.value.participant == "bob"
    for wrong in ({"version_id": "v0"}, {"digest": "0" * 64}, {"participant": "mallory"}):
        forged = answer.model_copy(update={"done": None, "corrupt": verdict.model_copy(update=wrong)})
        with pytest.raises(OutcomeRefused, match="does not hold"):
            from_outcome(forged, task)


@pytest.mark.access_denied_expected  # participant 000000's writes below the shard's staging key, refused
def test_a_participant_whose_id_names_a_shard_outcome_may_not_write_it(sharded: Any) -> None:
    # Given a round of three, one of them "000000", whose id is also the last segment of the outcome key of the
    # shard starting at piece 0 (IAM's `*` in its own-updates grant rounds/*/000000 spans '/': it reaches the key).
    # No id reaches any other key the coordinator writes below a round: those end in 64 hex digits (a global model,
    # an optimizer or delta file, a staged upload), and an id is at most 63 characters.
    assert not keys.PARTICIPANT_ID_PATTERN.fullmatch("0" * 64)
    pids = ["000000", "alice", "bob"]
    h, url = sharded(pids)
    start_round(h, pids)
    refused: list[str] = []
    s3 = boto3.client("s3", region_name="us-east-1")

    def as_participant_000000(task: ShardTask) -> None:
        if task.first != 0 or refused:
            return
        outcome = result_key(h.config.run_id, task)
        assert outcome.endswith("/000000")
        forged = alice_unreadable(task, task)  # (the strongest forgery: it answers the task)
        attempts: list[Callable[[], object]] = [
            lambda: s3.put_object(Bucket=h.res.bucket, Key=outcome, Body=forged),
            lambda: s3.create_multipart_upload(Bucket=h.res.bucket, Key=outcome),
            lambda: s3.put_object(Bucket=h.res.bucket, Key=task.staging, Body=b"x"),
            lambda: s3.abort_multipart_upload(Bucket=h.res.bucket, Key=task.staging, UploadId=task.upload_id),
        ]
        with acting_as(participant("000000")):
            for attempt in attempts:
                with pytest.raises(ClientError) as caught:
                    attempt()
                refused.append(caught.value.response["Error"]["Code"])

    began = time.time()
    workers = ShardWorkers(url, as_participant_000000)
    try:
        # When it tries to write the outcome (and the staged upload beside it) as itself while the round aggregates
        close_round(h, pids)
    finally:
        workers.close()
    assert not workers.errors, workers.errors
    # Then every attempt is refused as IAM refuses it
    assert refused == ["AccessDenied"] * 4
    # And the round is aggregated with every update, alice's included
    assert_aggregated_with_everyone(h, pids)
    # And nothing else in the run was refused
    ledger = shared_ledger()
    if ledger is not None:
        ledger.flush()
    node = os.environ["PYTEST_CURRENT_TEST"].rsplit(" (", 1)[0]
    denied = [d for d in read_denials(ledger_dir(), since=began) if d.test == node]
    assert denied and {d.principal for d in denied} == {"participant:000000"}, denied
