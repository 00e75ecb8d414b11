"""fed demo's evaluator (fed/evaluation.py): a helper process, forked from the zygote or spawned, evaluates a
round's global model from the run's bucket with the task, as the task evaluates it in this process; a model whose
bytes are not the recorded digest, or a task that cannot load, is an error the demo reports; the helper exits
when the demo stops it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest
import torch

from fed import zygote as zygote_module
from fed.demo import Participants
from fed.evaluation import EvaluationFailed, Evaluator
from local.server import LocalServer
from participant.task import load_task
from participant.tensors import model_bytes
from shared import keys
from shared.config import RunConfig
from shared.wire import digest
from store.connection import Connection

TASK = "participant.tasks.digits:task"


def evaluator_of(procs: Participants, config: RunConfig, connection: Path, log: Path) -> Evaluator:
    return Evaluator(config, connection, log, lambda args, log: procs.start_helper("fed.evaluation", args, log))


@pytest.fixture()
def run(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[tuple[RunConfig, Path, bytes]]:
    """A bucket on a local server holding round 3's global model (a trained-once digits MLP), and its connection
    file; yields the run's config, that file and the model's bytes."""
    for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                        "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(name, value)
    config = RunConfig(run_id="evaluate", task=TASK, seed=3)
    model = load_task(TASK).build_model(config.seed)
    data = model_bytes(model)
    with LocalServer() as server:
        s3 = boto3.client("s3", endpoint_url=server.endpoint, region_name="us-east-1")
        s3.create_bucket(Bucket="fed-evaluate")
        s3.put_object(Bucket="fed-evaluate", Key=keys.global_key(config.run_id, 3, digest(data)), Body=data)
        connection = tmp_path / "connection.json"
        Connection(config.run_id, "fed-evaluate", "unused", endpoint=server.endpoint).save(connection)
        yield config, connection, data


@pytest.mark.parametrize("forked", [True, False])
def test_the_helper_evaluates_a_global_model_from_the_bucket_as_the_task_does(
        run: tuple[RunConfig, Path, bytes], tmp_path: Path, forked: bool) -> None:
    config, connection, data = run
    if forked and not zygote_module.supported():
        pytest.skip("forking needs Linux")
    procs = Participants(connection, tmp_path, forked=forked)
    evaluator = evaluator_of(procs, config, connection, tmp_path / "evaluator.log")
    try:
        # When the demo asks for round 3's model, by its digest
        metrics = evaluator.evaluate(3, digest(data))
        # Then the helper's figures are the task's own on that model
        task = load_task(TASK)
        expected = task.evaluate(task.build_model(config.seed), torch.device("cpu"))
        assert metrics == pytest.approx(expected) and "test_accuracy" in metrics
        assert isinstance(evaluator.process, zygote_module.Forked) == forked
        # And a digest the bucket holds no model of is an error, not a figure
        with pytest.raises(EvaluationFailed, match="NotFound|not found|NoSuchKey"):
            evaluator.evaluate(3, "0" * 64)
    finally:
        evaluator.stop()
        procs.stop()
    assert evaluator.process.poll() == 0  # it ended when the demo closed the socket


def test_bytes_that_are_not_the_recorded_model_are_refused(run: tuple[RunConfig, Path, bytes], tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    config, connection, data = run
    # Given another model stored under round 3's recorded digest
    conn = Connection.load(connection)
    s3 = boto3.client("s3", endpoint_url=conn.endpoint, region_name="us-east-1")
    other = model_bytes(load_task(TASK).build_model(config.seed + 1))
    s3.put_object(Bucket=conn.bucket, Key=keys.global_key(config.run_id, 3, digest(data)), Body=other)
    procs = Participants(connection, tmp_path)
    evaluator = evaluator_of(procs, config, connection, tmp_path / "evaluator.log")
    try:
        with pytest.raises(EvaluationFailed, match="does not match the digest"):
            evaluator.evaluate(3, digest(data))
    finally:
        evaluator.stop()
        procs.stop()


def test_a_task_that_cannot_load_is_reported_with_every_request(run: tuple[RunConfig, Path, bytes],
                                                                tmp_path: Path) -> None:
    config, connection, data = run
    procs = Participants(connection, tmp_path)
    evaluator = evaluator_of(procs, config.model_copy(update={"task": "participant.tasks.nothing:task"}), connection,
                             tmp_path / "evaluator.log")
    try:
        with pytest.raises(EvaluationFailed, match="cannot evaluate with task 'participant.tasks.nothing:task'"):
            evaluator.evaluate(3, digest(data))
    finally:
        evaluator.stop()
        procs.stop()
