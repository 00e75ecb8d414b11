"""The run's server optimizer over a round's pseudo-gradient, and the layout of its state: pure numpy, no I/O.

A round's pseudo-gradient is `g = x - a`: the global model the round trained from minus the strategy's
aggregate of its updates (what FedAvg would make the next global). The server optimizer turns it into the
next global model with its own state (Reddi et al., "Adaptive Federated Optimization"; Douillard et al.,
DiLoCo), element by element, in float32 — each optimizer one module of `shared.optimizers`, which declares its
slots and its rule:

    fedavgm   m = beta m + g                                      x' = x - lr m
    diloco    m = mu m + g                                        x' = x - lr (g + mu m)   (Nesterov)
    fedadam   m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2     x' = x - lr m / (sqrt(v) + tau)
    fedyogi   m as fedadam;           v = v - (1 - b2) g^2 sign(v - g^2)   x' as fedadam

State starts at zero. It is the size of the model's float tensors (float32 whatever the model's dtype): one
value per slot (`m`, `v`) for each of the model's float elements, taken in data order (tensors in the canonical
layout's order, each element by element). It is addressed by that element index alone, which depends on the
tensors and never on the header, whose length changes with who was counted in a round.

It is written in the pieces of the global model that made it: the worker computing piece i writes one state
file, a canonical safetensors file holding one flat float32 tensor per slot over that piece's float elements.
The state as a whole is named by its *index*: canonical JSON listing every piece file's digest and how many
elements it holds, in order (and the global model it goes with); the index's digest is the state's digest,
recorded in the run state and each round's summary, so the state is authenticated exactly like the global model.
A later round reads the elements of each of its own pieces from whichever files hold them (`gather`): one, or
two where its pieces do not fall where the files do (its header is longer or shorter).

With topk downloads (`shared.delta`) the state has one more slot, `feedback`: the coordinator's error feedback,
what the download delta has not yet sent of the change the rounds asked for (in float32 per float element).
topk sends about 2 % of each round's change, so dropping the rest, as bf16 and int8 downloads drop their small
rounding, would lose most of every step; the feedback is added to the next round's change instead. It is kept,
authenticated, checkpointed and verified like any optimizer slot — also without a server optimizer, whose step
is then the identity (the aggregate is the target) with this one slot.
"""

from __future__ import annotations

import bisect
import itertools
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from shared.config import RunConfig, ServerOptimizer
from shared.keys import DIGEST_PATTERN
from shared.optimizers import OPTIMIZERS, ServerOptimizerRule
from shared.wire import WireError, decode, encode

INDEX_SCHEMA = 2  # 2: each piece file's element count is listed (1 assumed the pieces of the reading round)
MAX_INDEX_BYTES = 4 * 1024 * 1024  # ~60,000 pieces: a 480 GB model
FEEDBACK = "feedback"  # the slot of the coordinator's error feedback (topk downloads)


class StateError(ValueError):
    """An optimizer state file or index that does not fit the run."""


@dataclass(frozen=True)
class ServerStep:
    """The run's optimizer (`shared.optimizers`, by name) with its hyperparameters."""

    kind: ServerOptimizer
    lr: float
    momentum: float
    beta2: float
    tau: float
    feedback: bool = False  # the state also holds the coordinator's error feedback (FEEDBACK: topk downloads)

    @classmethod
    def of(cls, config: RunConfig) -> ServerStep | None:
        """The run's server optimizer and the state it keeps; None when the aggregate is the next global as it is
        and no state is kept."""
        feedback = config.download.kind == "topk"
        if OPTIMIZERS[config.server_optimizer].identity and not feedback:
            return None
        return cls(config.server_optimizer, config.server_step, config.server_momentum, config.server_beta2,
                   config.server_tau, feedback)

    @property
    def rule(self) -> type[ServerOptimizerRule]:
        return OPTIMIZERS[self.kind]

    @property
    def slots(self) -> tuple[str, ...]:
        """Its persisted state."""
        return self.rule.slots + ((FEEDBACK,) if self.feedback else ())

    def apply(self, x: np.ndarray, aggregate: np.ndarray, state: Mapping[str, np.ndarray]) -> np.ndarray:
        """The next global values for elements `x` (float32), updating `state`'s slices in place."""
        return self.rule.update(x, aggregate, state, self)


def new_state(slots: Sequence[str], count: int) -> dict[str, np.ndarray]:
    """The state of `count` elements before the first round: zeros."""
    return {slot: np.zeros(count, np.float32) for slot in slots}


def encode_piece(step: ServerStep, index: int, state: Mapping[str, np.ndarray]) -> bytes:
    return encode(dict(state), {"fed.kind": "optimizer-state", "fed.optimizer": step.kind.value,
                                "fed.piece": str(index)})


def decode_piece(step: ServerStep, index: int, data: bytes, count: int) -> dict[str, np.ndarray]:
    """A state piece file's slots (writable copies), checked against what piece `index` must hold."""
    try:
        arrays, header = decode(data)
    except WireError as exc:
        raise StateError(f"optimizer state piece {index}: {exc}") from None
    meta = header.metadata
    if meta.get("fed.optimizer") != step.kind.value or meta.get("fed.piece") != str(index):
        raise StateError(f"optimizer state piece {index} is of {meta.get('fed.optimizer')!r} piece "
                         f"{meta.get('fed.piece')!r}, not of {step.kind.value!r} piece {index}")
    if set(arrays) != set(step.slots) or any(a.dtype != np.float32 or a.shape != (count,) for a in arrays.values()):
        raise StateError(f"optimizer state piece {index} does not hold {step.slots} of {count} float32 elements")
    return {slot: arrays[slot].copy() for slot in step.slots}


def encode_index(step: ServerStep, round_no: int, global_digest: str, pieces: Sequence[str],
                 counts: Sequence[int]) -> bytes:
    """The state's index (canonical JSON): its digest is the state's digest. `counts[i]`: the float elements
    piece file i holds."""
    if len(pieces) != len(counts):
        raise ValueError(f"{len(pieces)} state pieces but {len(counts)} counts")
    body = {"schema": INDEX_SCHEMA, "kind": "optimizer-state", "optimizer": step.kind.value, "round": round_no,
            "global": global_digest, "pieces": list(pieces), "counts": [int(c) for c in counts]}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def decode_index(step: ServerStep, data: bytes, floats: int) -> list[tuple[str, int]]:
    """(digest, element count) of each piece file an index lists, in order, checked against the run's optimizer
    and the model: together they hold exactly its `floats` float elements."""
    body, listed = _index(data)
    if body.get("optimizer") != step.kind.value:
        raise StateError(f"optimizer state is of {str(body.get('optimizer'))[:40]!r}, the run uses "
                         f"{step.kind.value!r}")
    counts = body.get("counts")
    if body.get("schema") != INDEX_SCHEMA or not isinstance(counts, list) or len(counts) != len(listed) or not all(
            isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in counts):
        raise StateError(f"optimizer state index of schema {str(body.get('schema'))[:10]!r} does not list each "
                         f"piece's element count (schema {INDEX_SCHEMA})")
    if sum(counts) != floats:
        raise StateError(f"optimizer state index's pieces hold {sum(counts)} elements, the model has {floats}")
    return list(zip(listed, counts, strict=True))


def gather(slots: Sequence[str], counts: Sequence[int], first: int, count: int,
           load: Callable[[int], Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """The state of float elements [first, first + count), from piece files holding `counts[j]` elements each in
    order (`load(j)`: piece file j's slots): the files that hold them, one or more."""
    out = new_state(slots, count)
    if count == 0:
        return out
    starts = list(itertools.accumulate(counts, initial=0))
    if first < 0 or first + count > starts[-1]:
        raise StateError(f"optimizer state elements {first}-{first + count} are past its {starts[-1]}")
    j = bisect.bisect_right(starts, first) - 1
    at = 0
    while at < count:
        while counts[j] == 0:
            j += 1
        lo = first + at - starts[j]
        take = min(counts[j] - lo, count - at)
        piece = load(j)
        for slot in slots:
            out[slot][at : at + take] = piece[slot][lo : lo + take]
        at += take
        j += 1
    return out


def index_pieces(data: bytes) -> list[str]:
    """The piece digests an index lists, checked for shape only (copying a state needs no more)."""
    return _index(data)[1]


def _index(data: bytes) -> tuple[dict[str, Any], list[str]]:
    try:
        body = json.loads(data)
        listed = body["pieces"]
    except (ValueError, KeyError, TypeError):
        raise StateError("optimizer state index is not the JSON the coordinator writes") from None
    if not isinstance(listed, list) or not all(isinstance(d, str) and DIGEST_PATTERN.fullmatch(d) for d in listed):
        raise StateError("optimizer state index lists something other than piece digests")
    return body, listed
