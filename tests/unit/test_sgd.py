"""participant.sgd.MomentumSGD steps exactly as torch.optim.SGD(lr, momentum) does, without importing torch's compiler
stack (torch._dynamo), which constructing a torch.optim optimizer does."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from participant.sgd import MomentumSGD

ROOT = Path(__file__).resolve().parents[2]


def model_and_data(seed: int) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    return model, torch.randn(96, 64), torch.randint(0, 10, (96,))


@pytest.mark.parametrize(("lr", "momentum"), [(0.05, 0.9), (0.1, 0.0), (0.3, 0.5)])
def test_its_steps_are_torch_optim_sgds_bit_for_bit(lr: float, momentum: float) -> None:
    # Given two copies of one model and the same batches
    ours, x, y = model_and_data(0)
    theirs, _, _ = model_and_data(0)
    opts = (MomentumSGD(ours.parameters(), lr=lr, momentum=momentum),
            torch.optim.SGD(theirs.parameters(), lr=lr, momentum=momentum))
    # When each trains 30 steps, one with ours and one with torch's
    for step in range(30):
        batch = slice(32 * (step % 3), 32 * (step % 3 + 1))
        for model, opt in zip((ours, theirs), opts, strict=True):
            opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(x[batch]), y[batch]).backward()
            opt.step()
    # Then every weight is the same, bit for bit
    for a, b in zip(ours.state_dict().values(), theirs.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_a_parameter_without_a_gradient_is_left_alone() -> None:
    layer = nn.Linear(2, 2)
    before = [p.detach().clone() for p in layer.parameters()]
    MomentumSGD(layer.parameters(), lr=0.1, momentum=0.9).step()
    assert all(torch.equal(a, b) for a, b in zip(before, layer.parameters(), strict=True))
    with pytest.raises(ValueError, match="must not be negative"):
        MomentumSGD(layer.parameters(), lr=-1.0)


def test_training_the_digits_tasks_never_imports_torch_dynamo() -> None:
    # When a process warms up as a participant of the digits tasks does and trains a round (the Flower anchor's task
    # trains the same way, with its own batch order)
    code = """
import sys, torch
from participant.tasks import flower_digits
from participant.tasks.digits import task
from participant.training import warm_up_autograd
from shared.config import RunConfig
assert not flower_digits.task.torch_optimizers
warm_up_autograd(torch.device("cpu"), task.torch_optimizers)
model = task.build_model(0)
task.train(model, range(200), RunConfig(run_id="run-1", learning_rate=0.05, batch_size=32), torch.device("cpu"))
print(sorted(m for m in sys.modules if m.startswith("torch._dynamo")))
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    # Then torch's compiler stack was not imported (constructing a torch.optim optimizer imports it)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"
