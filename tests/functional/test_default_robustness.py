"""Two hostile members of five under the defaults as written (no witnesses): the real digits task trains the honest
updates, the real aggregation (`shared.aggregate.aggregate_round`, the run's default strategy) combines each round,
and the attackers send what the wire format and ingest's bounds admit: their honest change sign-flipped and scaled
(under `norm_outlier_factor`, 10 x the median distance), claiming `max_sample_ratio` (4) x the median sample count.
Final digits accuracy stays within 2 points of five honest members'."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fed.demo import DEMO_TASKS
from participant.splits import partition
from participant.tasks import digits_meta
from participant.tasks.digits import Digits
from shared import wire
from shared.aggregate import ArraySource, WeightedInput, aggregate_round
from shared.config import RunConfig

CPU = torch.device("cpu")
# the demo's training settings (local epochs, batch, learning rate); every other key, the strategy included, at its
# default
TRAINING = {k: v for k, v in DEMO_TASKS["digits"].settings.items() if k in ("local_epochs", "batch_size",
                                                                           "learning_rate")}
MEMBERS, ATTACKERS, ROUNDS = 5, 2, 20


def distance(update: dict[str, np.ndarray], base: dict[str, np.ndarray]) -> float:
    return float(np.sqrt(sum(((update[k].astype(np.float64) - base[k]) ** 2).sum() for k in base)))


def final_accuracy(attackers: int, scale: float) -> float:
    """Digits test accuracy after ROUNDS rounds of MEMBERS members (IID parts), the first `attackers` hostile."""
    torch.manual_seed(0)
    task = Digits()
    config = RunConfig(run_id="defaults", **TRAINING)
    assert config.witness_nodes == 0  # (the defaults as written)
    model = task.build_model(config.seed)
    parts = partition(task._data[1].numpy(), MEMBERS, None, seed=digits_meta.SPLIT_SEED)
    for r in range(ROUNDS):
        base = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
        updates, samples = {}, {}
        for i, part in enumerate(parts):
            local = task.build_model(config.seed)
            local.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in base.items()})
            task.train(local, part.tolist(), config, CPU, seed=1000 * r + i)
            updates[f"p{i}"] = {k: v.detach().numpy().copy() for k, v in local.state_dict().items()}
            samples[f"p{i}"] = len(part)
        bound = 0.95 * config.norm_outlier_factor * float(np.median([distance(u, base) for u in updates.values()]))
        for i in range(attackers):
            pid = f"p{i}"
            s = min(scale, bound / distance(updates[pid], base))  # as far as ingest's norm bound lets it
            updates[pid] = {k: (base[k] - s * (updates[pid][k] - base[k])).astype(np.float32) for k in base}
            samples[pid] = int(config.max_sample_ratio * np.median([samples[p] for p in samples if p != pid]))
        norms = {pid: distance(u, base) for pid, u in updates.items()}
        # (what ingest admits: no update over norm_outlier_factor x the round's median distance)
        assert max(norms.values()) < config.norm_outlier_factor * float(np.median(list(norms.values())))
        manifest = wire.Manifest(wire.parse_header(wire.encode(base)).tensors)
        inputs = [WeightedInput(pid, samples[pid], "0" * 64, ArraySource(manifest, updates[pid]), norms[pid])
                  for pid in sorted(updates)]
        arrays, _ = wire.decode(aggregate_round(config, manifest, r + 1, inputs, ArraySource(manifest, base)).model)
        model.load_state_dict({k: torch.from_numpy(np.array(arrays[k])) for k in base})
    return float(task.evaluate(model, CPU)["test_accuracy"])


@pytest.fixture(scope="module")
def honest_accuracy() -> float:
    return final_accuracy(0, 0.0)


@pytest.mark.parametrize("scale", [1.0, 9.0])
def test_two_hostile_members_of_five_cost_at_most_two_points_under_the_defaults(
        honest_accuracy: float, scale: float) -> None:
    # Given five honest members' final accuracy under the defaults
    assert honest_accuracy >= 0.95
    # When two of the five flip their changes, scaled, and claim four times the median sample count
    attacked = final_accuracy(ATTACKERS, scale)
    # Then the run ends within 2 points of it
    assert attacked >= honest_accuracy - 0.02, (scale, attacked, honest_accuracy)
