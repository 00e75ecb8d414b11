"""Aggregation strategies over model files: pure numpy, streaming where the math allows.

FedAvg holds one accumulator (float64) and one update at a time: memory is O(model), not
O(participants x model). Inputs are taken in a fixed order (sorted by participant) so anyone
recomputing a round from the bucket gets the same bytes and the same digest.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from shared.config import RunConfig, Strategy
from shared.wire import DTYPES, FLOAT_TAGS, SCHEMA_VERSION, Manifest, encode

Loader = Callable[[], dict[str, np.ndarray]]


@dataclass(frozen=True)
class WeightedInput:
    participant: str
    samples: int
    digest: str
    load: Loader


class FedAvg:
    """Sample-weighted mean of float tensors; other tensors are taken from the first input."""

    def __init__(self, manifest: Manifest) -> None:
        self.manifest = manifest
        self.sums = {n: np.zeros(s.shape, np.float64) for n, s in manifest.tensors.items() if s.dtype in FLOAT_TAGS}
        self.others: dict[str, np.ndarray] = {}
        self.weight = 0

    def add(self, arrays: dict[str, np.ndarray], samples: int) -> None:
        if samples <= 0:
            raise ValueError("an update's sample count must be positive")
        for name, acc in self.sums.items():
            acc += np.asarray(arrays[name], dtype=np.float64) * samples
        for name in self.manifest.tensors:
            if name not in self.sums and name not in self.others:
                self.others[name] = np.array(arrays[name])
        self.weight += samples

    def result(self) -> dict[str, np.ndarray]:
        if self.weight == 0:
            raise ValueError("nothing to aggregate")
        out = dict(self.others)
        for name, acc in self.sums.items():
            out[name] = (acc / self.weight).astype(DTYPES[self.manifest.tensors[name].dtype][0])
        return out


def fedavg(manifest: Manifest, inputs: Iterable[WeightedInput]) -> dict[str, np.ndarray]:
    acc = FedAvg(manifest)
    for item in sorted(inputs, key=lambda i: i.participant):
        acc.add(item.load(), item.samples)
    return acc.result()


# --- robust strategies: they ignore claimed sample counts and hold every update of the round ----------


def _stacked(manifest: Manifest, inputs: list[WeightedInput]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Float tensors stacked along a new first axis (one row per update), and the other tensors."""
    loaded = [i.load() for i in sorted(inputs, key=lambda i: i.participant)]
    floats = {n for n, spec in manifest.tensors.items() if spec.dtype in FLOAT_TAGS}
    stacks = {n: np.stack([np.asarray(a[n], np.float64) for a in loaded]) for n in floats}
    others = {n: np.array(loaded[0][n]) for n in manifest.tensors if n not in floats}
    return stacks, others


def _cast(manifest: Manifest, values: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {n: v.astype(DTYPES[manifest.tensors[n].dtype][0]) for n, v in values.items()}


def median(manifest: Manifest, inputs: list[WeightedInput]) -> dict[str, np.ndarray]:
    """Coordinate-wise median of the updates."""
    stacks, others = _stacked(manifest, inputs)
    return _cast(manifest, {**others, **{n: np.median(s, axis=0) for n, s in stacks.items()}})


def trimmed_mean(manifest: Manifest, inputs: list[WeightedInput], trim_fraction: float) -> dict[str, np.ndarray]:
    """Coordinate-wise mean after dropping the floor(trim_fraction * n) largest and smallest values."""
    stacks, others = _stacked(manifest, inputs)
    n = len(inputs)
    k = min(int(trim_fraction * n), (n - 1) // 2)
    out = {name: np.sort(s, axis=0)[k : n - k].mean(axis=0) for name, s in stacks.items()}
    return _cast(manifest, {**others, **out})


def clipped_fedavg(
    manifest: Manifest, inputs: list[WeightedInput], reference: dict[str, np.ndarray], clip_norm: float
) -> dict[str, np.ndarray]:
    """Mean of the updates' deltas from the round's global model, each clipped to an L2 norm bound.

    The bound is `clip_norm`, or the median of the round's delta norms when it is 0; the mean is
    unweighted, so an inflated sample count buys nothing.
    """
    stacks, others = _stacked(manifest, inputs)
    deltas = {n: s - np.asarray(reference[n], np.float64) for n, s in stacks.items()}
    norms = np.sqrt(sum((d.reshape(len(inputs), -1) ** 2).sum(axis=1) for d in deltas.values()))
    bound = clip_norm or float(np.median(norms))
    scale = np.minimum(1.0, bound / np.maximum(norms, 1e-12))
    out = {}
    for name, d in deltas.items():
        shape = (len(inputs),) + (1,) * (d.ndim - 1)
        out[name] = np.asarray(reference[name], np.float64) + (d * scale.reshape(shape)).mean(axis=0)
    return _cast(manifest, {**others, **out})


def global_metadata(run_id: str, round_no: int, inputs: Iterable[WeightedInput], strategy: str) -> dict[str, str]:
    """Provenance in the global file's header: which updates, with what weights, made it."""
    listed = [[i.participant, i.samples, i.digest] for i in sorted(inputs, key=lambda i: i.participant)]
    return {
        "fed.schema": SCHEMA_VERSION,
        "fed.run": run_id,
        "fed.round": str(round_no),
        "fed.kind": "global",
        "fed.strategy": strategy,
        "fed.inputs": json.dumps(listed),
    }


def combine(
    config: RunConfig, manifest: Manifest, inputs: list[WeightedInput], reference: Loader
) -> dict[str, np.ndarray]:
    """The run's configured strategy applied to a round's counted updates."""
    if not inputs:
        raise ValueError("nothing to aggregate")
    if config.strategy is Strategy.FEDAVG:
        return fedavg(manifest, inputs)
    if config.strategy is Strategy.MEDIAN:
        return median(manifest, inputs)
    if config.strategy is Strategy.TRIMMED_MEAN:
        return trimmed_mean(manifest, inputs, config.trim_fraction)
    return clipped_fedavg(manifest, inputs, reference(), config.clip_norm)


def aggregate_file(
    config: RunConfig, manifest: Manifest, out_round: int, inputs: list[WeightedInput], reference: Loader
) -> bytes:
    """The bytes of the global model of `out_round` made from `inputs` (deterministic)."""
    arrays = combine(config, manifest, inputs, reference)
    return encode(arrays, global_metadata(config.run_id, out_round, inputs, config.strategy.value))
