"""The Flower anchor's work (participant.tasks.flower_digits): its data, its shards, and rounds that replay a direct
torch implementation of the recipe (/work/shared/anchors/flower-work.md) through the daemon's share of a round and the
coordinator's FedAvg."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from fed.demo.options import DemoOptions, resolve_config, with_task_split
from fed.demo.tasks import demo_config
from participant.decide import Train
from participant.task import Task, load_task
from participant.tasks import flower_digits_meta as meta
from participant.tasks.flower_digits import FlowerDigits, batch_seed, load_split, shards
from participant.tensors import load_into, model_bytes
from participant.training import Workload, round_work, train_seed
from shared.aggregate import ArraySource, WeightedInput, aggregate_file
from shared.config import DataMode, WorkSizing
from shared.selection import round_seed
from shared.sizing import make_plan
from shared.wire import Manifest, parse_header

CPU = torch.device("cpu")
PIDS = [f"p{i + 1}" for i in range(meta.SHARDS)]  # as `fed demo` names them: p<i+1> gets --data iid:i/N
ROUNDS = 15


def recipe(rounds: int) -> tuple[list[float], list[list[dict[str, torch.Tensor]]]]:
    """The anchor's recipe, written directly in torch and numpy as Flower's client and server run it: each round's
    test accuracy, and every round's four trained models."""
    torch.set_num_threads(1)
    x_train, y_train, x_test, y_test = (torch.from_numpy(a) for a in load_split())
    parts = np.array_split(np.random.default_rng(0).permutation(len(x_train)), 4)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    accuracies, trained = [], []
    for server_round in range(1, rounds + 1):
        start = {k: v.clone() for k, v in model.state_dict().items()}
        outs, counts = [], []
        for shard, part in enumerate(parts):
            local = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
            local.load_state_dict(start)
            xs, ys = x_train[part], y_train[part]
            order = torch.randperm(len(xs), generator=torch.Generator().manual_seed(1000 * server_round + shard))
            opt = torch.optim.SGD(local.parameters(), lr=0.05, momentum=0.9)
            for b in range(0, len(xs), 32):
                batch = order[b : b + 32]
                opt.zero_grad()
                nn.functional.cross_entropy(local(xs[batch]), ys[batch]).backward()
                opt.step()
            outs.append({k: v.detach().clone() for k, v in local.state_dict().items()})
            counts.append(len(part))
        trained.append(outs)
        total = sum(counts)
        with torch.no_grad():
            model.load_state_dict({k: sum(o[k] * (n / total) for o, n in zip(outs, counts, strict=True))
                                   for k in start})
            accuracies.append(float((model(x_test).argmax(1) == y_test).float().mean()))
    return accuracies, trained


@pytest.fixture(scope="module")
def direct() -> tuple[list[float], list[list[dict[str, torch.Tensor]]]]:
    return recipe(ROUNDS)


def test_the_task_loads_and_its_data_is_the_recipes() -> None:
    task = load_task(meta.TASK)
    assert isinstance(task, Task) and isinstance(task, FlowerDigits)
    x_train, y_train, x_test, y_test = task._data  # type: ignore[attr-defined]
    assert task.train_size == len(x_train) == meta.TRAIN_SIZE == 1347 and len(x_test) == meta.TEST_SIZE == 450
    assert x_train.dtype == torch.float32 and float(x_train.max()) == 1.0
    parts = shards()
    assert [len(p) for p in parts] == [337, 337, 337, 336]
    assert sorted(np.concatenate(parts).tolist()) == list(range(meta.TRAIN_SIZE))


def test_participant_i_holds_shard_i_in_the_recipes_order() -> None:
    for i in range(meta.SHARDS):
        own = FlowerDigits().local_data(f"iid:{i}/{meta.SHARDS}")
        np.testing.assert_array_equal(own, shards()[i])  # not sorted: the order fixes the batches
    with pytest.raises(ValueError, match="IID"):
        FlowerDigits().local_data("dirichlet:0.5:0/4")


def test_training_without_its_own_shard_is_refused() -> None:
    task = FlowerDigits()
    config = demo_config(4, task="digits")  # assigned data
    with pytest.raises(ValueError, match="data_mode = local"):
        task.train(task.build_model(0), [0, 1, 2], config, CPU, seed=1)


def test_the_initial_model_is_torch_manual_seed_0s() -> None:
    torch.manual_seed(0)
    expected = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)).state_dict()
    got = FlowerDigits().build_model(0).state_dict()
    assert all(torch.equal(expected[k], got[k]) for k in expected)


def test_distinct_global_models_are_flowers_rounds_in_order() -> None:
    """A round trains from the global model of the rounds aggregated before it: the k-th distinct one is Flower's
    round k; a round that was not aggregated carries its model over, and the round after it keeps its number."""
    task = FlowerDigits()
    models = [task.build_model(seed) for seed in (0, 1, 2)]
    assert [task.flower_round(models[i]) for i in (0, 1, 1, 2, 0)] == [1, 2, 2, 3, 1]
    assert batch_seed(3, 2) == 3002


def test_rounds_through_the_task_and_fedavg_replay_the_recipe(direct: tuple[list[float], list]) -> None:
    """Each participant's share of each round (the daemon's round_work under the demo's flower config) trained by the
    task gives bit for bit the recipe's model (checked in the first round, where both start from the same initial
    model); the coordinator's FedAvg (float64 accumulation) of the four gives the
    recipe's test accuracy to 4 decimals every round, 0.9289 after 15."""
    accuracies, trained = direct
    opts = with_task_split(DemoOptions(participants=4, task="flower"))  # what `fed demo --task flower` runs
    assert opts.split == "iid"  # participant p<i+1> starts with --data iid:i/4
    config = resolve_config(opts)
    assert config.data_mode is DataMode.LOCAL and config.dataset_size == 0
    assert config.work_sizing is WorkSizing.EQUAL and config.witness_nodes == 0
    assert (config.local_epochs, config.batch_size, config.learning_rate) == (1, 32, 0.05)
    assert config.total_rounds == ROUNDS
    tasks = [FlowerDigits() for _ in PIDS]  # one process each
    works = [Workload(meta.TASK, config, t, CPU, own=t.local_data(f"iid:{i}/{len(PIDS)}")) for i, t in enumerate(tasks)]
    global_bytes = model_bytes(tasks[0].build_model(config.seed))
    manifest = Manifest.of(parse_header(global_bytes))
    evaluator = FlowerDigits()
    for r in range(ROUNDS):
        seed = round_seed(config.seed, 1, r)
        plan = make_plan(PIDS[::-1], {}, steps=config.local_steps, sized=False, max_ratio=config.max_speed_ratio)
        action = Train(round=r, epoch=1, seed=seed, selected=tuple(PIDS[::-1]), digest="", plan=plan)
        inputs = []
        for i, (pid, task, work) in enumerate(zip(PIDS, tasks, works, strict=True)):
            mine = round_work(work, action, pid)
            assert mine.claim == len(shards()[i]) and mine.steps == 0
            model = load_into(task.build_model(config.seed), global_bytes)
            metrics = task.train(model, mine.indices, config, CPU, seed=train_seed(seed, pid))
            assert metrics["flower_round"] == r + 1
            state = model.state_dict()
            if r == 0:  # from the same initial model: the same floats as the recipe's client
                assert all(torch.equal(state[k], trained[r][i][k]) for k in state), f"round {r}, {pid}"
            arrays = {k: v.numpy() for k, v in state.items()}
            inputs.append(WeightedInput(pid, mine.claim, "", ArraySource(manifest, arrays)))
        global_bytes = aggregate_file(config, manifest, r + 1, inputs, None)
        got = evaluator.evaluate(load_into(evaluator.build_model(0), global_bytes), CPU)
        assert round(got["test_accuracy"], 4) == round(accuracies[r], 4), f"round {r}"
    assert [round(a, 4) for a in accuracies] == list(meta.RECIPE_ACCURACIES)
    assert round(accuracies[-1], 4) == meta.FLOWER_ACCURACY
