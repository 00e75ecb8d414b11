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


def aggregate_file(
    manifest: Manifest, run_id: str, out_round: int, strategy: str, inputs: list[WeightedInput]
) -> bytes:
    """The bytes of the global model of `out_round` made from `inputs` (deterministic)."""
    if strategy != "fedavg":
        raise NotImplementedError(f"strategy {strategy!r} is not available yet")
    return encode(fedavg(manifest, inputs), global_metadata(run_id, out_round, inputs, strategy))
