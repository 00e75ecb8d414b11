"""How a node finds its ranks and talks to them: torchrun's environment (`launched`), the JSON messages through the
group's store (`Channel`), and the choice between whole copies and shards of the model."""

from __future__ import annotations

import threading

import pytest
import torch
from typer.testing import CliRunner

from participant.cli import app
from participant.node import Channel, Launch, Node, launched, shard, tcp_store, training_bytes
from participant.protocol import ParticipantError

TORCHRUN = {"TORCHELASTIC_RUN_ID": "r", "RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "localhost", "MASTER_PORT": "29500", "TORCHELASTIC_RESTART_COUNT": "3"}


def test_outside_torchrun_a_process_is_no_launched_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in TORCHRUN:
        monkeypatch.delenv(name, raising=False)
    assert launched() is None
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "r")
    monkeypatch.setenv("WORLD_SIZE", "1")  # torchrun --nproc-per-node 1: a participant alone
    assert launched() is None


def test_torchrun_environment_names_the_rank_and_the_agent_store(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in TORCHRUN.items():
        monkeypatch.setenv(name, value)
    assert launched() == Launch(rank=1, size=2, host="localhost", port=29500, attempt=3)


def test_a_node_across_hosts_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in TORCHRUN.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    with pytest.raises(ParticipantError, match="a participant is one host"):
        launched()
    result = CliRunner().invoke(app, ["start", "--id", "p"])
    assert result.exit_code == 1 and "one host" in result.output


def test_gpus_other_than_torchruns_ranks_and_an_unknown_parallel_are_usage_errors(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in TORCHRUN.items():
        monkeypatch.setenv(name, value)
    result = CliRunner().invoke(app, ["start", "--gpus", "4"])
    assert result.exit_code == 2 and "torchrun started 2 ranks" in result.output
    result = CliRunner().invoke(app, ["start", "--parallel", "zero3"])
    assert result.exit_code == 2 and "use auto, ddp or fsdp" in result.output


def test_messages_arrive_in_order_as_json_and_old_ones_are_removed() -> None:
    # Given rank 0's store and a follower reaching it
    served = tcp_store("127.0.0.1", 0, serve=True)
    sender, receiver = Channel(served, "fed"), Channel(tcp_store("127.0.0.1", served.port), "fed")

    # When the follower waits before rank 0 sends (as it does between rounds), and then reads each of three more
    # (rank 0 sends the next once the ranks have trained the last together)
    got: list[object] = []
    waiting = threading.Thread(target=lambda: got.append(receiver.receive()))
    waiting.start()
    sender.send({"spec": "m:t", "round": 0})
    waiting.join(30)
    for message in ({"round": 1}, {"round": 2}, None):
        sender.send(message)
        got.append(receiver.receive())

    # Then it receives each once, in order, None last; and a message is dropped once the next but one is sent
    assert got == [{"spec": "m:t", "round": 0}, {"round": 1}, {"round": 2}, None]
    assert not served.check(["fed/0"]) and not served.check(["fed/1"]) and served.check(["fed/2", "fed/3"])


def test_auto_spreads_whole_copies_on_a_cpu_and_training_bytes_count_gradients_and_moments() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(10, 10), torch.nn.Linear(10, 2))
    model[1].requires_grad_(False)
    weights = sum(p.nbytes for p in model.parameters())
    trainable = sum(p.numel() for p in model[0].parameters())
    assert training_bytes(model) == weights + trainable * 4 + trainable * 8
    node = Node(2, "m:t", "{}", torch.device("cpu"), threads=1)
    assert node.parallel_for(model) == "ddp"
    assert Node(2, "m:t", "{}", torch.device("cpu"), threads=1, parallel="fsdp").parallel_for(model) == "fsdp"


def test_fsdp_units_are_the_blocks_of_the_outermost_module_lists() -> None:
    # Given a model with layers in a ModuleList, each holding a ModuleList of its own, in a group of one rank
    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.parts = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)])

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([Block(), Block()])
    model.head = torch.nn.Linear(4, 2)
    store = tcp_store("127.0.0.1", 0, serve=True)
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        shard(model, torch.device("cpu"))
        from torch.distributed.fsdp import FSDPModule

        # Then each layer and the root are units, and nothing inside a layer is one of its own
        units = {name for name, module in model.named_modules() if isinstance(module, FSDPModule)}
        assert units == {"", "layers.0", "layers.1"}
    finally:
        torch.distributed.destroy_process_group()


def test_under_torchrun_rank_0_ending_before_any_round_releases_the_waiting_followers(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Given torchrun's store (here served by the test) and rank 0's node, never started (no round was trained)
    served = tcp_store("127.0.0.1", 0, serve=True)
    for name, value in TORCHRUN.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("MASTER_PORT", str(served.port))
    node = Node(2, "m:t", "{}", torch.device("cpu"), threads=1)

    # When the daemon ends
    node.stop()

    # Then a follower waiting for its setup (the first message of torchrun's attempt 3) is told to exit
    assert Channel(tcp_store("127.0.0.1", served.port), "fed/3").receive() is None
