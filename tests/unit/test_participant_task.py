"""The task plug-in and the built-in digits task."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from participant.task import Task, TaskError, load_task, local_batches
from participant.tasks import digits_meta
from participant.tasks.digits import Digits
from shared.config import RunConfig
from shared.selection import assignment, round_seed, select

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def digits() -> Digits:
    return load_task(digits_meta.TASK)  # type: ignore[return-value]


def test_the_default_task_loads_and_fits_the_protocol(digits: Digits) -> None:
    assert isinstance(digits, Task)
    assert RunConfig(run_id="a-run").task == digits_meta.TASK


def test_split_sizes_match_the_torch_free_constants(digits: Digits) -> None:
    x_train, y_train, x_test, y_test = digits._data
    assert digits.train_size == digits_meta.TRAIN_SIZE == len(x_train) == len(y_train) == 1437
    assert len(x_test) == digits_meta.TEST_SIZE == 360
    assert float(x_train.max()) <= 1.0 and float(x_train.min()) >= 0.0
    # every class is in the test set, and no test image is also a training image
    assert set(y_test.tolist()) == set(range(10))
    train_rows = {tuple(r) for r in x_train.numpy().round(4).tolist()}
    overlap = sum(tuple(r) in train_rows for r in x_test.numpy().round(4).tolist())
    assert overlap < 5  # digits has a handful of duplicate images; the split itself is disjoint


def test_build_model_is_reproducible_and_leaves_the_global_rng_alone(digits: Digits) -> None:
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    a, b, c = digits.build_model(7), digits.build_model(7), digits.build_model(8)
    assert torch.equal(torch.random.get_rng_state(), before)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    for name, ta in sa.items():
        tb, tc = sb[name], sc[name]
        assert torch.equal(ta, tb), name
        assert not torch.equal(ta, tc), name
        assert ta.dtype == torch.float32


def test_training_a_shard_improves_test_accuracy(digits: Digits) -> None:
    # Given one participant's share of a 4-way round, and the demo's settings
    config = RunConfig(run_id="t-run", learning_rate=0.1, local_epochs=2, batch_size=16)
    seed = round_seed(0, 1, 0)
    selected = select(seed, ["p1", "p2", "p3", "p4"], 1.0, 4)
    indices = assignment(seed, digits.train_size, selected, "p1")
    model = digits.build_model(0)
    before = digits.evaluate(model, CPU)
    steps: list[tuple[int, int]] = []
    # When it trains its shard
    torch.manual_seed(1)
    metrics = digits.train(model, indices, config, CPU, lambda done, total: steps.append((done, total)))
    after = digits.evaluate(model, CPU)
    # Then the loss is reported, progress was reported to the end, and accuracy rose well above chance
    assert 0 < metrics["loss"] < 2.5
    assert steps[-1][0] == steps[-1][1] == 2 * int(np.ceil(len(indices) / 16))
    assert before["test_accuracy"] < 0.3
    assert after["test_accuracy"] > 0.7 and after["test_loss"] < before["test_loss"]


def test_training_is_deterministic_given_the_seed_whatever_the_global_rng(digits: Digits) -> None:
    config = RunConfig(run_id="t-run", learning_rate=0.1, local_epochs=1, batch_size=16)
    indices = np.arange(0, 200)
    results = []
    for global_seed in (1, 2):
        model = digits.build_model(0)
        torch.manual_seed(global_seed)  # another thread may be using the global RNG meanwhile
        digits.train(model, indices, config, CPU, seed=42)
        results.append(model.state_dict())
    other = digits.build_model(0)
    digits.train(other, indices, config, CPU, seed=43)
    for name in results[0]:
        assert torch.equal(results[0][name], results[1][name])
    assert not torch.equal(results[0]["0.weight"], other.state_dict()["0.weight"])


def test_training_refuses_indices_outside_the_data_set(digits: Digits) -> None:
    config = RunConfig(run_id="t-run")
    with pytest.raises(ValueError, match="indices"):
        digits.train(digits.build_model(0), [0, digits.train_size], config, CPU)
    with pytest.raises(ValueError, match="no samples"):
        digits.train(digits.build_model(0), [], config, CPU)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("participant.tasks.digits", "expected 'module:object'"),
        ("no_such_module_xyz:task", "cannot import module"),
        ("participant.tasks.digits:nope", "has no attribute 'nope'"),
        ("participant.tasks.digits_meta:TASK", "lacks"),
    ],
)
def test_load_task_errors_say_what_is_wrong(spec: str, message: str) -> None:
    with pytest.raises(TaskError, match=message):
        load_task(spec)


def test_load_task_calls_a_class_or_factory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_tasks_mod.py").write_text(textwrap.dedent("""
        from participant.tasks.digits import Digits

        class Wide(Digits):
            def __init__(self):
                super().__init__(hidden=128)

        def factory():
            return Digits(hidden=32)

        def broken():
            raise RuntimeError("no GPU here")
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_task("my_tasks_mod:Wide").hidden == 128  # type: ignore[attr-defined]
    assert load_task("my_tasks_mod:factory").hidden == 32  # type: ignore[attr-defined]
    with pytest.raises(TaskError, match="no GPU here"):
        load_task("my_tasks_mod:broken")
    sys.modules.pop("my_tasks_mod", None)


def positions(config: RunConfig, count: int, seed: int = 7) -> tuple[int, list[list[int]]]:
    total, batches = local_batches(count, config, torch.Generator().manual_seed(seed))
    return total, [b.tolist() for b in batches]


def test_local_epochs_go_through_the_data_that_many_times_in_new_orders() -> None:
    total, batches = positions(RunConfig(run_id="r-1", batch_size=4, local_epochs=2), 10)
    assert total == len(batches) == 6
    first, second = sum(batches[:3], []), sum(batches[3:], [])
    assert sorted(first) == sorted(second) == list(range(10)) and first != second


def test_local_steps_take_exactly_h_batches_cycling_through_the_data() -> None:
    total, batches = positions(RunConfig(run_id="r-1", batch_size=4, local_steps=7), 10)
    assert total == len(batches) == 7
    assert sorted(sum(batches[:3], [])) == list(range(10))  # a whole pass, then the next in another order
    assert all(0 < len(b) <= 4 for b in batches)
    assert positions(RunConfig(run_id="r-1", batch_size=4, local_steps=7), 10) == (total, batches)


def test_the_digits_task_trains_h_steps_when_local_steps_is_set(digits: Digits) -> None:
    config = RunConfig(run_id="r-1", batch_size=16, local_steps=5)
    calls: list[tuple[int, int]] = []
    digits.train(digits.build_model(0), range(100), config, torch.device("cpu"), lambda d, t: calls.append((d, t)))
    assert calls == [(d, 5) for d in range(1, 6)]
