"""What an aggregation strategy is: a *configure* half and an *aggregate* half, its math in pure numpy functions.

A round's global model is computed piece by piece of the output file (`shared.aggregate.PieceAggregator`), each
piece from the same byte range of every counted update. A strategy says two things:

- `configure(inputs, whole) -> Configured`, once per aggregator, before any piece: what it must know of the
  inputs as a whole — which of them are combined (`selected`) and one coefficient each (FedAvg's weights by sample
  count, clipping's scales). Most strategies know it from what ingest recorded of each update (its sample count,
  its distance from the global model); one that must look at the updates' values over the whole model (Krum's
  pairwise distances) says so (`reads_inputs`) and is handed `whole`, every input's float elements read a block
  at a time, a pre-pass that reads each input once more.
- how one piece's rows combine into its output: either a weighted sum of the selected inputs with their
  coefficients (`WeightedSum`: the aggregator's own streamed loop computes it, in float32 — float64 for F64 — the
  common case kept fast), or `RowWise.aggregate(rows, base, configured)`: float64 rows (selected inputs x
  elements of one tensor's part of a piece) to the output's values, coordinate-wise.

Tensors that are not floats (integer counters, flags) are not combined: they are taken from the first selected
input, whatever the strategy. Inputs are indexed in the aggregator's fixed order (sorted by participant), so
anyone recomputing a round gets the same selection and the same bytes.

A strategy is constructed from the run's configuration (`__init__(config)`), taking the parameters it needs (each
module types them by a Protocol of its own: this package never imports `shared.config`, which lists its names),
and refuses settings it cannot work with by raising ValueError (the configuration's validation constructs it);
it may add entries to the global's header (`metadata`); and it declares the state it would keep from round to
round (`state_slots`, like a server optimizer's slots) — none of the strategies here keeps any, and the
aggregator refuses one that declares some until such state is carried like the optimizer's.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol

import numpy as np


class Counted(Protocol):
    """What is known of a counted update before its bytes are read (`shared.aggregate.WeightedInput`)."""

    @property
    def participant(self) -> str: ...

    @property
    def samples(self) -> int: ...

    @property
    def norm(self) -> float: ...  # L2 distance from the round's global model, as measured at ingest (-1: unknown)


class WholeInputs(Protocol):
    """Every input's float elements over the whole model, for a configure half that must see them (a pre-pass)."""

    def blocks(self) -> Iterator[np.ndarray]:
        """The model's float elements in data order, a block at a time: float64 arrays of (inputs, elements), all
        inputs' values of the same elements, the inputs in the aggregator's order (all of them together about one
        digest piece in size)."""
        ...


@dataclass(frozen=True)
class Configured:
    """A configure half's answer: the inputs combined (indexes into the inputs, ascending) and one coefficient for
    each of them (a `WeightedSum`'s weights; a `RowWise` strategy's own, e.g. clipping scales)."""

    selected: tuple[int, ...]
    coefficients: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.selected or len(self.selected) != len(self.coefficients) or list(self.selected) != sorted(
                set(self.selected)):
            raise ValueError(f"a strategy selected {self.selected} with {len(self.coefficients)} coefficients: "
                             "one or more inputs, ascending, one coefficient each")


class AggregationStrategy(ABC):
    """One aggregation strategy (`shared.strategies.STRATEGIES` lists them by `name`, the run file's `strategy`)."""

    name: ClassVar[str]
    needs_base: ClassVar[bool] = False  # its aggregate half reads the round's global model
    reads_inputs: ClassVar[bool] = False  # its configure half reads every input whole before any piece
    state_slots: ClassVar[tuple[str, ...]] = ()  # state it keeps from round to round: none here

    def __init__(self, config: object) -> None:
        """The strategy with its parameters taken from `config`, the run's `shared.config.RunConfig` (a subclass
        types what it reads by a Protocol); ValueError: settings it cannot work with."""
        del config  # (a strategy without parameters reads nothing of it)

    def metadata(self, inputs: int) -> dict[str, str]:
        """Entries this strategy adds to the header of a global model made from `inputs` updates (none by
        default: the header then is exactly what every strategy writes)."""
        return {}

    @abstractmethod
    def configure(self, inputs: Sequence[Counted], whole: WholeInputs | None) -> Configured:
        """Which inputs are combined, with what coefficients (`whole`: given when `reads_inputs`)."""


class WeightedSum(AggregationStrategy):
    """Combines its selected inputs as sum_k c_k x_k, with `Configured.coefficients` as the c_k: computed by the
    aggregator's streamed loop (`PieceAggregator._fedavg`), in the accumulator's dtype."""


class RowWise(AggregationStrategy):
    """Combines one piece's rows coordinate-wise in float64 (`aggregate`)."""

    @abstractmethod
    def aggregate(self, rows: np.ndarray, base: np.ndarray | None, configured: Configured) -> np.ndarray:
        """The output values of elements whose inputs' values are `rows` (float64, selected inputs x elements);
        `base`: the round's global model's values of them (float64; None unless `needs_base`)."""


def everyone(inputs: Sequence[Counted]) -> tuple[int, ...]:
    return tuple(range(len(inputs)))


def by_samples(inputs: Sequence[Counted], selected: Sequence[int]) -> Configured:
    """`selected`, each weighted by its share of their sample counts (FedAvg's weights)."""
    total = sum(inputs[k].samples for k in selected)
    return Configured(tuple(selected), tuple(inputs[k].samples / total for k in selected))

