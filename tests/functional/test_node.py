"""A participant that is a node of two ranks (`participant.node`, gloo on this CPU): its update is the one a single
process makes from the same batches, whether the ranks hold whole copies (DDP) or shards (FSDP) of the model, and a
rank that dies mid-round is a crash of the participant."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from participant.node import Node, NodeFailed
from participant.task import load_task
from participant.tasks import digits_meta
from participant.tensors import save_model
from shared.config import RunConfig

pytestmark = pytest.mark.timeout(300)

SEED = 1234


@pytest.fixture()
def config() -> RunConfig:
    return RunConfig(run_id="node", task=digits_meta.TASK, batch_size=32, local_epochs=2, learning_rate=0.1)


@pytest.fixture(params=["ddp", "fsdp"])
def node(config: RunConfig, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Node]:
    node = Node(2, config.task, config.model_dump_json(), torch.device("cpu"), threads=1, parallel=request.param)
    node.log_dir = tmp_path
    yield node
    node.stop()
    if torch.distributed.is_initialized():  # (left as it was by a crash: the participant's process would exit)
        torch.distributed.destroy_process_group()


def _start(config: RunConfig, tmp_path: Path) -> tuple[Any, Any, Path]:
    task = load_task(config.task, config)
    model = task.build_model(config.seed)
    return task, model, save_model(model, tmp_path / "global.safetensors")


def _on_node(node: Node, config: RunConfig, tmp_path: Path, indices: list[int], kill_at: int = 0) -> dict[str, Any]:
    task, model, global_file = _start(config, tmp_path)
    killed: list[int] = []

    def progress(done: int, total: int) -> None:
        if kill_at and done == kill_at and not killed:  # the first attempt only: SIGKILL rank 1 mid-round
            killed.append(node.followers[0].pid)
            node.followers[0].kill()
            node.followers[0].wait()

    job = {"model": str(global_file), "indices": indices, "seed": SEED, "round": 0, "config": config.model_dump_json()}
    metrics = node.train(job, model, lambda ddp: task.train(ddp, indices, config, torch.device("cpu"), progress,
                                                            seed=SEED))
    return {"loss": metrics["loss"]} | {name: t.clone() for name, t in model.state_dict().items()}


def _alone(config: RunConfig, tmp_path: Path, indices: list[int]) -> dict[str, Any]:
    task, model, _ = _start(config, tmp_path)
    torch.manual_seed(SEED)
    metrics = task.train(model, indices, config, torch.device("cpu"), None, seed=SEED)
    return {"loss": metrics["loss"]} | {name: t.clone() for name, t in model.state_dict().items()}


def test_a_node_of_two_ranks_makes_the_update_one_process_makes(node: Node, config: RunConfig, tmp_path: Path) -> None:
    # Given 256 samples, 2 local epochs in batches of 32: 16 steps
    indices = list(range(256))

    # When one process trains them, and a node of two ranks trains them (each rank half of every batch)
    alone = _alone(config, tmp_path, indices)
    on_node = _on_node(node, config, tmp_path, indices)

    # Then the weights are the same, up to float rounding (the ranks average the halves' gradients), training moved
    # them, and the node reports the whole batches' loss (the ranks' mean), not rank 0's half
    initial = _start(config, tmp_path)[1].state_dict()
    assert on_node.pop("loss") == pytest.approx(alone.pop("loss"), rel=1e-5)
    for name, tensor in alone.items():
        torch.testing.assert_close(on_node[name], tensor, atol=1e-5, rtol=1e-4)
        assert not torch.equal(tensor, initial[name]) or name.endswith("bias")


def test_a_rank_killed_mid_round_is_a_crash_of_the_participant(node: Node, config: RunConfig,
                                                                tmp_path: Path) -> None:
    # Given a node training a round
    indices = list(range(256))

    # When rank 1 is killed after the round's third step
    # Then training stops with NodeFailed (a ParticipantError: the participant exits 1, to be started again) and no
    # rank is left running
    with pytest.raises(NodeFailed, match="lost a rank"):
        _on_node(node, config, tmp_path, indices, kill_at=3)
    assert node.followers == []


@pytest.mark.parametrize(("adapter", "parallel"), [("none", "ddp"), ("lora", "ddp"), ("none", "fsdp"),
                                                   ("lora", "fsdp")])
def test_a_hugging_face_model_trains_on_a_node_as_in_one_process(tmp_path: Path, adapter: str, parallel: str) -> None:
    from participant.tasks import hf_tiny
    from shared.config import HfOptions

    # Given the tiny Llama (whole, or LoRA adapters), two batches a step (DDP ranks average gradients at the second
    # only), and a node of two ranks, each holding the whole model (DDP) or half of it (FSDP, each decoder layer a
    # unit)
    model_dir = hf_tiny.build(tmp_path / "tiny", pretrain_steps=0)
    config = RunConfig(run_id="node", task="participant.tasks.hf:task", batch_size=8, learning_rate=3e-3,
                       hf=HfOptions(model=str(model_dir), adapter=adapter, tokens_per_step=2 * 8 * 128))
    node = Node(2, config.task, config.model_dump_json(), torch.device("cpu"), threads=1, parallel=parallel)
    node.log_dir = tmp_path
    try:
        # When both train the same 32 sequences
        indices = list(range(32))
        alone = _alone(config, tmp_path, indices)
        on_node = _on_node(node, config, tmp_path, indices)
    finally:
        node.stop()

    # Then the updates agree, and so do the losses
    assert on_node.pop("loss") == pytest.approx(alone.pop("loss"), rel=1e-4)
    assert set(on_node) == set(alone)
    for name, tensor in alone.items():
        torch.testing.assert_close(on_node[name], tensor, atol=1e-4, rtol=1e-3)
