"""Krum and multi-Krum (Blanchard et al. 2017, "Machine Learning with Adversaries: Byzantine Tolerant Gradient
Descent"): the updates nearest the bulk of the others, averaged.

Of n updates, up to f of them Byzantine (`krum_byzantine`), each update i is scored by the sum of its squared L2
distances to its n - f - 2 nearest other updates; the m of lowest score are selected (`krum_selected`; 0: n - f,
multi-Krum's usual choice; 1: Krum itself), ties broken by input order (by participant), so anyone recomputing
the round selects the same ones. The global model is their weighted mean by sample count: FedAvg over the
selected updates, streamed by the aggregator like FedAvg itself (their integer tensors come from the first of
them). Distances between updates are distances between the uploaded weights: every update trained from the same
global model, so the global cancels and is not read. Only float tensors count.

Why a whole-model pre-pass. Every other strategy here is coordinate-wise once a few numbers per update are known
before any piece (its sample count; its distance from the global, which ingest measures as the update streams
in): a piece of the output is made from the same piece of the inputs alone. Krum's selection depends on the
distances *between* updates over the whole model, which no piece tells alone and which ingest, seeing one update
at a time, cannot measure. So the configure half reads every input whole, block by block (`WholeInputs`: all n
inputs' slices of a block together about one digest piece), adding each block's pairwise squared distances into
an n x n matrix: memory O(n^2 + one piece), compute O(n^2 x model). What it costs: every input is read once more
before the pieces are computed (then only the m selected are read), and a sharded aggregation pays it in every
shard worker (each computes the same selection itself, from the same bytes in the same order), as does
`fed verify`. The blocks' sums are added in a fixed order (blocks in data order, pairs by input), so the scores,
and with them the selection, are the same bits wherever they are computed.

Too few updates. Krum tells f Byzantine updates apart only when n > 2f + 2. A round with fewer (possible when
`min_updates` is below 2f + 3) is combined by FedAvg over all its n updates, and the global's header says so
(`fed.krum`), as it records f and m otherwise; set min_updates to at least 2f + 3 to make every round Krum's.
A run whose `max_participants` could never make such a round is refused at configuration, as is an m above
max_participants - f. At most n - f updates are selected (a larger m is lowered to it, and the header says so).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from shared.strategies.base import Configured, Counted, WeightedSum, WholeInputs, by_samples, everyone


def pairwise_squared_distances(rows: np.ndarray) -> np.ndarray:
    """The n x n squared L2 distances between the rows of `rows` (n x elements, float64), each pair's summed in
    one fixed order (numpy's pairwise sum over the pair's differences: no BLAS, whose order varies by machine)."""
    n = len(rows)
    out = np.zeros((n, n), np.float64)
    for i in range(n - 1):
        diff = rows[i + 1 :] - rows[i]
        d = np.square(diff, out=diff).sum(axis=1)
        out[i, i + 1 :] = d
        out[i + 1 :, i] = d
    return out


def krum_scores(distances: np.ndarray, neighbours: int) -> np.ndarray:
    """Each input's score: the sum of its squared distances to its `neighbours` nearest other inputs."""
    n = len(distances)
    others = distances[~np.eye(n, dtype=bool)].reshape(n, n - 1)
    return np.asarray(np.sort(others, axis=1)[:, :neighbours].sum(axis=1), np.float64)


def krum_select(scores: np.ndarray, m: int) -> tuple[int, ...]:
    """The `m` inputs of lowest score, ties to the earlier input, in input order."""
    return tuple(sorted(int(k) for k in np.argsort(scores, kind="stable")[:m]))


def krum_plan(n: int, f: int, m: int) -> tuple[int, int, str]:
    """For n updates, f Byzantine at most and m asked for (0: n - f): (the neighbours each score counts, how many
    are selected, the note for the global's header); 0 neighbours: too few updates, all combined by FedAvg."""
    if n < 2 * f + 3:
        return 0, n, (f"fallback: {n} update(s) are too few for f={f} (Krum needs 2f+3 = {2 * f + 3}): all "
                      f"combined by FedAvg")
    chosen = min(m or n - f, n - f)
    lowered = f" ({m} asked, at most n-f)" if m > n - f else ""
    return n - f - 2, chosen, f"f={f} m={chosen}{lowered} of n={n}"


class KrumSettings(Protocol):
    @property
    def krum_byzantine(self) -> int: ...

    @property
    def krum_selected(self) -> int: ...

    @property
    def max_participants(self) -> int: ...


class Krum(WeightedSum):
    name = "krum"
    reads_inputs = True

    def __init__(self, config: KrumSettings) -> None:
        f, m, most = config.krum_byzantine, config.krum_selected, config.max_participants
        if 2 * f + 3 > most:
            raise ValueError(f"strategy 'krum' with krum_byzantine = {f} needs rounds of at least 2f+3 = {2 * f + 3} "
                             f"updates, more than max_participants ({most}) allows: lower krum_byzantine")
        if m > most - f:
            raise ValueError(f"krum_selected ({m}) cannot exceed max_participants - krum_byzantine ({most - f}): "
                             "Krum selects at most n - f of a round's n updates")
        self.f, self.m = f, m

    def metadata(self, inputs: int) -> dict[str, str]:
        return {"fed.krum": krum_plan(inputs, self.f, self.m)[2]}

    def configure(self, inputs: Sequence[Counted], whole: WholeInputs | None) -> Configured:
        neighbours, m, _ = krum_plan(len(inputs), self.f, self.m)
        if neighbours == 0:
            return by_samples(inputs, everyone(inputs))
        assert whole is not None
        distances = np.zeros((len(inputs), len(inputs)), np.float64)
        for rows in whole.blocks():
            distances += pairwise_squared_distances(rows)
        return by_samples(inputs, krum_select(krum_scores(distances, neighbours), m))
