"""The Flower anchor's digits work, exactly (`/work/shared/anchors`-style side-by-side figures; `make bench-rounds`).

The recipe Flower 1.41 was measured on, so that a `fed demo` run of it can be compared figure for figure:

- data: `load_digits()`, `X / 16` as float32, `train_test_split(test_size=0.25, random_state=0, stratify=y)`:
  1347 training and 450 test examples; the training set cut into shards by
  `np.array_split(np.random.default_rng(0).permutation(1347), N)` (4 shards: 337, 337, 337, 336);
- model: 64 -> 64 -> 10 with ReLU, float32, the default initialisation right after `torch.manual_seed(0)` (the
  digits task's `build_model(0)` draws exactly those weights);
- each round, participant i: one pass over its own shard i, batch 32, cross-entropy, `SGD(lr=0.05, momentum=0.9)`
  created fresh, the batch order `torch.randperm(len(shard), generator=torch.Generator().manual_seed(1000 * round
  + i))` with Flower's round numbers (1, 2, ...), one torch thread;
- the server: FedAvg weighted by examples over all participants, every round; the global model evaluated on the 450
  test examples after each round (0.9289 after 15 rounds, as Flower measured).

Run it in local data mode (`data_mode = "local"`, work sizing `equal`, no witnesses): `fed-participant start --data
iid:I/N` holds shard I of N whatever its place in the round's selection, and registers its size as its sample count.
`fed demo --task flower --split iid` does all of that (participant p<I+1> gets `--data iid:I/N`).

Flower's round number: the daemon hands `train` the round's global model and a seed derived from the round's seed and
the participant's id, not the round number. The task numbers the distinct global models it trains from in the order
they come: the k-th is Flower's round k (Flower's round k trains from the global of k - 1 aggregated rounds). A round
the coordinator did not aggregate (too few updates) carries its global over, so the round after it trains from the
same model and keeps its number, as Flower's retried round would. That is the anchor's round as long as the
participant trains every aggregated round from the first, in one process (as in the anchor's run and the benchmark);
a participant restarted mid-run, or one left out of a round, would number the rounds differently and draw other batch
orders (its updates are still valid, they just no longer replay Flower's).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from functools import cached_property

import numpy as np
import torch
from torch import nn

from participant.splits import parse_split
from participant.task import Progress
from participant.tasks import flower_digits_meta as meta
from participant.tasks.digits import Digits
from participant.tasks.digits_data import load_digits_arrays, stratified_split
from shared.config import DataMode, RunConfig

log = logging.getLogger("participant")


def shards(parts: int = meta.SHARDS) -> list[np.ndarray]:
    """The anchor's shards of the training set, in its order (not sorted: the order fixes the batches)."""
    perm = np.random.default_rng(meta.SHARD_SEED).permutation(meta.TRAIN_SIZE)
    return [np.asarray(s, dtype=np.int64) for s in np.array_split(perm, parts)]


def batch_seed(flower_round: int, shard: int) -> int:
    """The seed of the generator that orders a round's batches: `1000 * round + shard`, Flower's rounds from 1."""
    return 1000 * flower_round + shard


def load_split() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(x_train, y_train, x_test, y_test) as the recipe makes them: float32 pixels / 16, int64 labels (the split is
    `train_test_split`'s, replayed without importing scikit-learn: participant.tasks.digits_data)."""
    data, target = load_digits_arrays()
    x = (data / 16.0).astype(np.float32)
    y = np.asarray(target, dtype=np.int64)
    train, test = stratified_split(y, test_size=0.25, seed=meta.SPLIT_STATE)
    x_train, x_test, y_train, y_test = x[train], x[test], y[train], y[test]
    if len(x_train) != meta.TRAIN_SIZE or len(x_test) != meta.TEST_SIZE:
        raise RuntimeError(f"the split has {len(x_train)} training and {len(x_test)} test examples, expected "
                           f"{meta.TRAIN_SIZE} and {meta.TEST_SIZE}")
    return x_train, y_train, x_test, y_test


class FlowerDigits(Digits):
    """The digits MLP trained as the Flower anchor trains it; `task` below is `participant.tasks.flower_digits:task`."""

    train_size = meta.TRAIN_SIZE

    def __init__(self) -> None:
        super().__init__(hidden=64, momentum=meta.MOMENTUM)
        self.shard: int | None = None  # which shard this participant holds (local_data); None: not loaded
        self.rounds: dict[str, int] = {}  # a global model's digest -> Flower's round number (from 1)

    @cached_property
    def _data(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return tuple(torch.from_numpy(a) for a in load_split())  # type: ignore[return-value]

    def local_data(self, spec: str) -> np.ndarray:
        """`iid:I/N`: shard I of the anchor's N shards (the anchor has 4), in the anchor's order."""
        split = parse_split(spec)
        if split.alpha is not None:
            raise ValueError(f"{spec}: the Flower anchor's shards are IID; give iid:I/N")
        self.shard = split.part
        own = shards(split.parts)[split.part]
        log.info("local data %s: the anchor's shard %d of %d, %d examples", spec, split.part, split.parts, len(own))
        return own

    def flower_round(self, model: nn.Module) -> int:
        """Flower's number of the round that trains from `model` (the round's global): the distinct global models
        in the order they come, from 1."""
        h = hashlib.sha256()
        for name, tensor in model.state_dict().items():
            h.update(name.encode())
            h.update(tensor.detach().cpu().contiguous().numpy().tobytes())
        return self.rounds.setdefault(h.hexdigest(), len(self.rounds) + 1)

    def _train(self, model: nn.Module, indices: Sequence[int], config: RunConfig, device: torch.device,
               progress: Progress | None, seed: int) -> dict[str, float]:
        """The digits task's training, with Flower's batch order for this shard and round instead of `seed`."""
        if self.shard is None or config.data_mode is not DataMode.LOCAL:
            raise ValueError("the Flower anchor's work trains each participant's own shard: run it with data_mode "
                             "= local and `fed-participant start --data iid:I/N`")
        flower_round = self.flower_round(model)
        metrics = super()._train(model, indices, config, device, progress, batch_seed(flower_round, self.shard))
        return {**metrics, "flower_round": float(flower_round)}


task = FlowerDigits()
