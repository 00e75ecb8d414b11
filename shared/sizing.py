"""Work sized by measured throughput: who trains how much of a round, and when the round should be over.

Every selected participant gets a share of the round's work in proportion to its measured throughput, so that
all are predicted to finish together (a host four times slower trains a quarter as much). The tick computes the
round's *plan* once, at round start, from the smoothed estimates it keeps in the run state (`Speed`), and records
it in the state: an ordered tuple of (participant, weight, steps) in integers. Every process reads the same plan
and cuts the same slices from it with integer arithmetic (`split`, `shared.selection.assignment`), so nobody
recomputes floats.

The rule (docs/protocol.md, *Work sized by throughput*):

- a participant's rate r is its smoothed training throughput (samples per second: what its share had it train over
  the `train_seconds` its update reports, smoothed exponentially); one without an estimate counts at the fleet's
  median rate (1.0 when nobody has one);
  rates are clamped to [median / max_speed_ratio, median x max_share_ratio], so no claim buys more than a fair
  share (a host that claims to be fast is sized at most max_share_ratio x the median, however fast it claims);
- what a measurement may claim is bounded by what the coordinator observes (`observed_rate`): the training time
  an update reports is taken within [what its arrival allows, the interval from round start to its arrival], and
  an estimate grows at most RATE_GROWTH x a round, so a sudden jump in claimed speed is trusted only gradually;
- integer weights w = round(1000 x r / median), at least 1; the round's N samples are split by largest remainders
  of N x w / sum(w) (ties by plan order), every participant getting at least one when there are enough;
- the predicted finish of participant i is overhead_i + units_i / r_i (overhead: the seconds of a round that do not
  grow with its share: download, evaluation, upload, measured by the coordinator); the round's deadline is the
  latest predicted finish x deadline_margin, within [min_round_train_time, max_round_train_time].

Pure: integers and floats only, no I/O.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

WEIGHT_SCALE = 1000  # a participant at the median rate weighs this much
MAX_RATE = 1e9  # samples per second: anything above is not a measurement
MIN_RATE = 1e-6
RATE_GROWTH = 2.0  # an estimate at most doubles from one round's measurement to the next
OBSERVED_FLOOR = 0.1  # a reported training time is taken as at least this share of the observed interval
OVERHEAD_ALLOWANCE = 2.0  # ... and as at least that interval less this x the fleet's median overhead


@dataclass(frozen=True)
class Speed:
    """The coordinator's smoothed estimate of one participant: training samples per second, and the seconds of a
    round that do not depend on its share (download, evaluation, upload)."""

    rate: float
    overhead: float = 0.0
    rounds: int = 1  # measurements folded in


@dataclass(frozen=True)
class Share:
    """One participant's part of a round: its `weight` (assigned data mode: the round's N samples are split by the
    plan's weights, `split`) and `steps` (optimizer steps it takes; 0: the run's local_epochs passes over its
    samples)."""

    pid: str
    weight: int = 1
    steps: int = 0


WorkPlan = tuple[Share, ...]


def clamp_rate(value: float) -> float:
    """A reported rate as a number the coordinator uses: finite, within [MIN_RATE, MAX_RATE]."""
    if not math.isfinite(value):
        return MIN_RATE if value < 0 or math.isnan(value) else MAX_RATE
    return min(MAX_RATE, max(MIN_RATE, value))


def observed_seconds(claimed: float, elapsed: float, fleet_overhead: float | None) -> float:
    """The training seconds a measurement is taken at: the time the update reports, but not much shorter than the
    interval the coordinator observed from round start to its arrival (`elapsed`) less the seconds a round costs
    beyond training (twice the fleet's median overhead, `fleet_overhead`), and at least a tenth of the interval.
    A participant that reports `train_seconds = 1e-6` is measured at the rate its arrival shows, not at a billion
    samples a second. A report longer than the interval is kept: it can only make its
    sender look slower (a smaller share, which witnesses judge at the median weight too). Without an observed
    interval (0), the report as it is."""
    if not elapsed > 0 or not math.isfinite(elapsed):
        return claimed
    floor = OBSERVED_FLOOR * elapsed
    if fleet_overhead is not None and math.isfinite(fleet_overhead):
        floor = max(floor, elapsed - OVERHEAD_ALLOWANCE * fleet_overhead)
    return max(floor, claimed) if math.isfinite(claimed) else elapsed


def median_overhead(speeds: Iterable[Speed]) -> float | None:
    overheads = [s.overhead for s in speeds]
    return statistics.median(overheads) if overheads else None


def smoothed(old: Speed | None, rate: float, overhead: float, alpha: float, ceiling: float | None = None) -> Speed:
    """Fold one round's measurement into the estimate (exponential smoothing; the first measurement is taken
    as it is). A measurement is believed at most RATE_GROWTH x the old estimate (or x `ceiling`, the fleet's
    median rate, for a first one), so a claimed jump in speed is trusted over several rounds, not at once."""
    rate, overhead = clamp_rate(rate), min(max(0.0, overhead), 1e7) if math.isfinite(overhead) else 0.0
    if old is None:
        return Speed(min(rate, RATE_GROWTH * ceiling) if ceiling is not None else rate, overhead, 1)
    rate = min(rate, RATE_GROWTH * old.rate)
    return Speed(alpha * rate + (1 - alpha) * old.rate, alpha * overhead + (1 - alpha) * old.overhead,
                 min(old.rounds + 1, 1_000_000))


def median_rate(speeds: Iterable[Speed]) -> float:
    rates = [s.rate for s in speeds]
    return statistics.median(rates) if rates else 1.0


def rates(order: Sequence[str], speeds: Mapping[str, Speed], max_ratio: float,
          max_share: float | None = None) -> dict[str, float]:
    """Each participant's rate for planning: its estimate (the fleet median without one), clamped around the
    median of the participants planned for: down to median / `max_ratio`, up to median x `max_share` (a fair
    share: what a rate buys is more of the round's data, and so more of its FedAvg weight; None: `max_ratio`)."""
    known = [speeds[p] for p in order if p in speeds]
    median = median_rate(known) if known else median_rate(speeds.values())
    low, high = median / max_ratio, median * (max_ratio if max_share is None else min(max_ratio, max_share))
    return {p: min(high, max(low, speeds[p].rate)) if p in speeds else median for p in order}


def weights(order: Sequence[str], speeds: Mapping[str, Speed], max_ratio: float,
            max_share: float | None = None) -> tuple[int, ...]:
    """Integer weights in plan order: WEIGHT_SCALE at the median rate, at least 1."""
    r = rates(order, speeds, max_ratio, max_share)
    if not r:
        return ()
    median = statistics.median(r.values())
    return tuple(max(1, round(WEIGHT_SCALE * r[p] / median)) for p in order)


def split(total: int, w: Sequence[int]) -> tuple[int, ...]:
    """`total` units split by integer weights `w` (largest remainders, ties by position): sums to `total`, each part
    within one unit of its exact share, except that every part is at least 1 when total >= len(w) (taken from the
    largest). Integer arithmetic only: the same in every process."""
    n = len(w)
    if n == 0:
        return ()
    if any(x <= 0 for x in w):
        raise ValueError("weights must be positive")
    weight = sum(w)
    parts = [total * x // weight for x in w]
    remainders = sorted(range(n), key=lambda i: (-(total * w[i] % weight), i))
    for i in remainders[: total - sum(parts)]:
        parts[i] += 1
    if total >= n:  # nobody planned for goes without: a unit from the largest part (ties: the first)
        for i in range(n):
            if parts[i] == 0:
                largest = max(range(n), key=lambda j: (parts[j], -j))
                parts[largest] -= 1
                parts[i] = 1
    return tuple(parts)


def bounds(plan: WorkPlan, total: int, pid: str) -> tuple[int, int]:
    """The contiguous [start, end) of `pid`'s part when `total` samples are split by the plan's weights; (0, 0) if
    it has no share."""
    start = 0
    for share, part in zip(plan, split(total, [s.weight for s in plan]), strict=True):
        if share.pid == pid:
            return start, start + part
        start += part
    return 0, 0


def share_of(plan: WorkPlan, pid: str) -> Share | None:
    return next((s for s in plan if s.pid == pid), None)


def make_plan(order: Sequence[str], speeds: Mapping[str, Speed], *, steps: int | Mapping[str, int], sized: bool,
              max_ratio: float, max_share: float | None = None) -> WorkPlan:
    """The round's plan. `steps`: the optimizer steps one participant takes by default (local_steps; 0: passes over
    its samples), split by the weights; or in local data mode each participant's own default (its passes over its
    own data, in steps), scaled by its weight against the median weight (a host four times slower than the median
    takes a quarter of its steps; at equal speeds nothing changes). Unsized (`sized` False): equal weights and
    everyone its default steps, as before throughput sizing."""
    n = len(order)
    if n == 0:
        return ()
    w = weights(order, speeds, max_ratio, max_share) if sized else (1,) * n
    if isinstance(steps, Mapping):  # local data mode: each its own passes, scaled by its speed against the median
        default = tuple(int(steps.get(p, 0)) for p in order)
        middle = sorted(w)[(n - 1) // 2]
        stepped = tuple(max(1, (2 * d * x + middle) // (2 * middle)) if sized and d else d
                        for d, x in zip(default, w, strict=True))
    elif sized and steps:  # the round's local_steps x participants, split by the weights
        stepped = split(int(steps) * n, w)
    else:
        stepped = (int(steps),) * n
    return tuple(Share(p, w[i], stepped[i]) for i, p in enumerate(order))


def fedavg_weights(claims: Mapping[str, int], max_share: float) -> dict[str, int]:
    """Each counted update's FedAvg weight: the samples it claims (already bounded by its assignment, or by its
    registered data), capped at `max_share` x the round's median claim (of two, the smaller: the mean of two is
    half the larger's), so that no claim, however it got past admission, weighs more than a fair share. Integers:
    the tick, `fed verify` and every witness compute the same weights from the same records."""
    if not claims or not math.isfinite(max_share):
        return dict(claims)
    middle = min(claims.values()) if len(claims) == 2 else statistics.median(claims.values())
    cap = max(1, math.floor(max_share * middle))
    return {pid: min(n, cap) for pid, n in claims.items()}


def fraction(plan: WorkPlan, pid: str) -> float:
    """`pid`'s fraction of the plan's weight (0 if it has no share)."""
    total = sum(s.weight for s in plan)
    share = share_of(plan, pid)
    return share.weight / total if share is not None and total else 0.0


def units(plan: WorkPlan, share: Share, batch_size: int, round_units: float) -> float:
    """Samples a share has its participant train (what its time grows with): steps x batch, or its fraction of the
    round's `round_units` (every sample of the round times the passes, as measured from the last round)."""
    if share.steps:
        return float(share.steps * batch_size)
    return fraction(plan, share.pid) * round_units


def predicted_seconds(plan: WorkPlan, speeds: Mapping[str, Speed], batch_size: int, round_units: float,
                      max_ratio: float, max_share: float | None = None) -> dict[str, float]:
    """Each planned participant's predicted round time: overhead + units / rate (only with an estimate, and only
    once the round's size in units is known)."""
    r = rates([s.pid for s in plan], speeds, max_ratio, max_share)
    return {s.pid: speeds[s.pid].overhead + units(plan, s, batch_size, round_units) / r[s.pid]
            for s in plan if s.pid in speeds and (s.steps or round_units > 0)}


def deadline_seconds(predicted: Mapping[str, float], planned: int, margin: float, floor: float,
                     ceiling: float) -> float:
    """The round's time limit: the latest predicted finish x margin, within [floor, ceiling]; the ceiling when
    sizing of deadlines is off (margin 0) or some planned participant has no estimate yet."""
    if margin <= 0 or not predicted or len(predicted) < planned:
        return ceiling
    return min(ceiling, max(floor, margin * max(predicted.values())))
