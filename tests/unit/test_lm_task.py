"""The built-in byte-level language-model task (participant.tasks.lm) and its torch-free facts (lm_meta)."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from participant.task import Task, load_task
from participant.tasks import lm_meta
from participant.tasks.lm import ByteLM, lm_task
from shared.config import RunConfig

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def lm() -> ByteLM:
    return load_task(lm_meta.TASK)  # type: ignore[return-value]


@pytest.fixture(scope="module")
def tiny() -> ByteLM:
    """A small model of the same task, for the tests that train."""
    return lm_task(d_model=32, n_layers=2, n_heads=2, context=32, eval_sequences=16)


def test_the_task_loads_and_fits_the_protocol(lm: ByteLM) -> None:
    assert isinstance(lm, Task)
    assert lm.train_size == lm_meta.TRAIN_SIZE
    for spec in ("participant.tasks.lm:small", "participant.tasks.lm:medium", "participant.tasks.lm:large",
                 "participant.tasks.lm:lm_task"):
        assert isinstance(load_task(spec), Task), spec


def test_the_default_has_about_a_million_parameters(lm: ByteLM) -> None:
    count = sum(p.numel() for p in lm.build_model(0).parameters())
    assert count == lm.parameter_count()
    assert 800_000 <= count <= 1_500_000
    assert load_task("participant.tasks.lm:large").parameter_count() >= 100_000_000  # type: ignore[attr-defined]


def test_train_size_is_known_without_torch() -> None:
    # lm_meta computes the split in an interpreter where importing torch fails
    code = ("import sys; sys.modules['torch'] = None\n"
            "from participant.tasks import lm_meta\n"
            "print(lm_meta.TRAIN_SIZE, lm_meta.TEST_SIZE, lm_meta.split_sizes(32)[0])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert [int(v) for v in out] == [lm_meta.TRAIN_SIZE, lm_meta.TEST_SIZE, lm_meta.split_sizes(32)[0]]


def test_the_split_is_deterministic_and_disjoint(lm: ByteLM) -> None:
    train, test = lm._data
    chunks = len(lm_meta.corpus()) // (lm_meta.CONTEXT + 1)
    assert train.shape == (lm_meta.TRAIN_SIZE, lm_meta.CONTEXT + 1) and train.dtype == torch.uint8
    assert lm_meta.TRAIN_SIZE + lm_meta.TEST_SIZE == chunks and lm_meta.TEST_SIZE == chunks // 10
    assert test.shape == (64, lm_meta.CONTEXT + 1)  # the default evaluates a fixed subset of the held-out chunks
    width = lm_meta.CONTEXT + 1
    assert bytes(train[0].tolist()) == lm_meta.corpus()[:width]
    assert bytes(train[-1].tolist()) == lm_meta.corpus()[(lm_meta.TRAIN_SIZE - 1) * width : lm_meta.TRAIN_SIZE * width]
    whole = lm_task(eval_sequences=0)._data[1]
    assert whole.shape[0] == lm_meta.TEST_SIZE
    assert bytes(whole[0].tolist()) == lm_meta.corpus()[lm_meta.TRAIN_SIZE * width : (lm_meta.TRAIN_SIZE + 1) * width]


def test_the_model_maps_bytes_to_next_byte_logits(lm: ByteLM) -> None:
    model = lm.build_model(0)
    tokens = torch.randint(0, 256, (3, lm_meta.CONTEXT))
    assert model(tokens).shape == (3, lm_meta.CONTEXT, 256)
    assert model(tokens[:, :10]).shape == (3, 10, 256)
    with pytest.raises(ValueError, match="context"):
        model(torch.zeros(1, lm_meta.CONTEXT + 1, dtype=torch.long))


def test_attention_is_causal(lm: ByteLM) -> None:
    model = lm.build_model(0).eval()
    a = torch.randint(0, 256, (1, 20))
    b = a.clone()
    b[0, 15:] = (b[0, 15:] + 1) % 256  # change the future only
    with torch.no_grad():
        assert torch.allclose(model(a)[0, :15], model(b)[0, :15], atol=1e-5)
        assert not torch.allclose(model(a)[0, 15:], model(b)[0, 15:])


def test_build_model_is_reproducible_and_leaves_the_global_rng_alone(lm: ByteLM) -> None:
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    a, b, c = lm.build_model(7).state_dict(), lm.build_model(7).state_dict(), lm.build_model(8).state_dict()
    assert torch.equal(torch.random.get_rng_state(), before)
    for name, ta in a.items():
        assert ta.dtype == torch.float32, name
        assert torch.equal(ta, b[name]), name
    assert not torch.equal(a["tok.weight"], c["tok.weight"])
    assert len({t.untyped_storage().data_ptr() for t in a.values()}) == len(a)  # untied: no shared tensors


def test_evaluate_reports_loss_perplexity_and_accuracy(lm: ByteLM) -> None:
    result = lm.evaluate(lm.build_model(0), CPU)
    assert set(result) == {"test_loss", "test_perplexity", "test_accuracy"}
    assert result["test_loss"] == pytest.approx(math.log(256), rel=0.02)  # an untrained model: about uniform
    assert result["test_perplexity"] == pytest.approx(math.exp(result["test_loss"]))
    assert 0.0 <= result["test_accuracy"] < 0.05
    assert lm.evaluate(lm.build_model(0), CPU) == result  # the same subset every time


def test_training_lowers_the_held_out_loss(tiny: ByteLM) -> None:
    config = RunConfig(run_id="t-run", learning_rate=3e-3, local_epochs=1, batch_size=16)
    model = tiny.build_model(0)
    before = tiny.evaluate(model, CPU)
    steps: list[tuple[int, int]] = []
    indices = list(range(400))
    metrics = tiny.train(model, indices, config, CPU, lambda done, total: steps.append((done, total)), seed=1)
    after = tiny.evaluate(model, CPU)
    assert set(metrics) >= {"loss"} and 0 < metrics["loss"] < math.log(256) + 0.1
    assert steps[-1][0] == steps[-1][1] == 400 // 16
    assert after["test_loss"] < before["test_loss"] - 1.0


def test_training_is_deterministic_given_the_seed_whatever_the_global_rng(tiny: ByteLM) -> None:
    config = RunConfig(run_id="t-run", learning_rate=3e-3, local_epochs=2, batch_size=8)
    indices = list(range(10, 58))
    results = []
    for global_seed in (1, 2):
        model = tiny.build_model(0)
        torch.manual_seed(global_seed)
        metrics = tiny.train(model, indices, config, CPU, seed=42)
        results.append((model.state_dict(), metrics))
    other = tiny.build_model(0)
    tiny.train(other, indices, config, CPU, seed=43)
    assert results[0][1] == results[1][1]
    for name in results[0][0]:
        assert torch.equal(results[0][0][name], results[1][0][name]), name
    assert not torch.equal(results[0][0]["tok.weight"], other.state_dict()["tok.weight"])


def test_training_refuses_indices_outside_the_data_set(tiny: ByteLM) -> None:
    config = RunConfig(run_id="t-run")
    with pytest.raises(ValueError, match="indices"):
        tiny.train(tiny.build_model(0), [0, tiny.train_size], config, CPU)
    with pytest.raises(ValueError, match="no samples"):
        tiny.train(tiny.build_model(0), [], config, CPU)


def test_a_size_that_does_not_fit_is_refused() -> None:
    with pytest.raises(ValueError, match="multiple of n_heads"):
        lm_task(d_model=100, n_heads=3)


# --- `fed demo --task lm` (no stack: the settings, the rows, the plot, the help) -------------------------------


def test_the_demo_config_selects_the_lm_task_and_leaves_digits_as_it_was() -> None:
    from fed.demo import demo_config
    from participant.tasks import digits_meta

    lm_config = demo_config(4, task="lm")
    assert (lm_config.task, lm_config.dataset_size) == (lm_meta.TASK, lm_meta.TRAIN_SIZE)
    assert lm_config.total_rounds == 4 and lm_config.local_epochs == 1 and lm_config.learning_rate == 3e-3
    assert demo_config(2, 2, task="lm").total_rounds == 2
    digits = demo_config(4)
    assert (digits.task, digits.dataset_size, digits.total_rounds) == (digits_meta.TASK, digits_meta.TRAIN_SIZE, 20)
    assert (digits.local_epochs, digits.batch_size, digits.learning_rate) == (2, 32, 0.1)
    assert (digits.max_round_train_time, digits.liveness_timeout) == (30.0, 10.0)


def test_an_lm_round_shows_its_held_out_loss_and_a_digits_round_its_accuracy() -> None:
    from fed.demo.report import HEADER, LOSS_HEADER, RoundRow, format_row
    from fed.demo.tasks import reports_loss

    assert reports_loss("participant.tasks.lm:large") and not reports_loss("participant.tasks.digits:task")
    digits = RoundRow(0, 4, 4, 0, 0.5, 0.9123, 1.5, True, {})
    assert "test acc" in HEADER and format_row(digits).split()[6] == "0.9123"
    assert "test_loss" not in digits.report()
    lm = RoundRow(0, 4, 4, 0, 3.41, 0.36, 49.7, True, {}, 2, 2, test_loss=2.7775, perplexity=16.078)
    assert "test loss" in LOSS_HEADER and "perplexity" in LOSS_HEADER
    assert format_row(lm).split()[6:8] == ["2.7775", "16.078"]
    assert lm.report()["test_loss"] == 2.7775 and lm.report()["test_perplexity"] == 16.078


def test_the_demo_plot_can_show_the_held_out_loss(tmp_path: Path) -> None:
    from fed.plot import RoundPoint, write_png

    points = [RoundPoint(r, 3.0 - r / 10, 0.3, 10.0, True, 2.8 - r / 10) for r in range(3)]
    path = write_png(points, tmp_path / "lm.png", "lm", metric="test_loss")
    assert path.stat().st_size > 0
    with pytest.raises(ValueError, match="metric"):
        write_png(points, tmp_path / "x.png", "lm", metric="nope")


def test_fed_demo_help_explains_the_task_option() -> None:
    from typer.testing import CliRunner

    from fed.cli import app

    result = CliRunner().invoke(app, ["demo", "--help"], env={"COLUMNS": "200", "TERM": "dumb"})
    assert result.exit_code == 0
    assert "--task" in result.output and "lm" in result.output and "held-out loss" in result.output
    bad = CliRunner().invoke(app, ["demo", "--task", "nope"])
    assert bad.exit_code == 2 and "unknown --task" in bad.output
