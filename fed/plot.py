"""Training curves as a PNG: loss, test accuracy (or held-out loss) and seconds per round (`fed status --plot`,
`fed demo --plot`).

matplotlib comes with the `local` extra; it is imported only when a plot is asked for.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.state import RoundSummary


class PlotUnavailable(RuntimeError):
    """A plot was asked for and cannot be drawn (no matplotlib, or no rounds yet)."""


@dataclass(frozen=True)
class RoundPoint:
    round: int
    loss: float | None  # mean training loss the participants reported
    accuracy: float | None  # test accuracy (the run's records, or the demo's own evaluation)
    seconds: float
    aggregated: bool
    test_loss: float | None = None  # held-out loss of the round's global model (the demo's LM task)


def points_from_summaries(rounds: Iterable[RoundSummary]) -> list[RoundPoint]:
    ordered = sorted(rounds, key=lambda r: r.round)
    return [RoundPoint(r.round, r.loss, r.accuracy, r.seconds, r.aggregated) for r in ordered]


# What the middle panel can show: a RoundPoint field and its label
METRICS = {"accuracy": "test accuracy", "test_loss": "held-out loss"}


def write_png(points: Sequence[RoundPoint], path: Path, title: str, metric: str = "accuracy") -> Path:
    """Draw loss, `metric` (test accuracy, or the held-out loss) and round time against the round number; rounds
    that were not aggregated are marked."""
    if metric not in METRICS:
        raise ValueError(f"metric must be one of {', '.join(METRICS)}, not {metric!r}")
    if not points:
        raise PlotUnavailable("no finished rounds to plot yet")
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError as exc:
        raise PlotUnavailable("plotting needs matplotlib: pip install 'fedcoord[local]'") from exc

    fig, (loss_ax, acc_ax, time_ax) = plt.subplots(3, 1, figsize=(7, 8), sharex=True)
    try:
        _curve(loss_ax, points, "loss", "training loss")
        _curve(acc_ax, points, metric, METRICS[metric])
        if metric == "test_loss":  # the same curve read as perplexity (exp of the loss) on the right
            perplexity = acc_ax.secondary_yaxis("right", functions=(_exp, _log))
            perplexity.set_ylabel("perplexity")
        _curve(time_ax, points, "seconds", "seconds")
        skipped = [p.round for p in points if not p.aggregated]
        for ax in (loss_ax, acc_ax, time_ax):
            for r in skipped:
                ax.axvline(r, color="tab:red", alpha=0.25, linewidth=4)
            ax.grid(alpha=0.3)
        time_ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # rounds are whole numbers
        time_ax.set_xlabel("round" + ("   (red: not aggregated)" if skipped else ""))
        fig.suptitle(title)
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)
    return path


def _exp(x: Any) -> Any:
    import numpy as np

    return np.exp(np.minimum(x, 700.0))


def _log(x: Any) -> Any:
    import numpy as np

    return np.log(np.maximum(x, 1e-300))


def _curve(ax: object, points: Sequence[RoundPoint], field: str, label: str) -> None:
    xs = [p.round for p in points if getattr(p, field) is not None]
    ys = [getattr(p, field) for p in points if getattr(p, field) is not None]
    ax.plot(xs, ys, marker="o", markersize=3)  # type: ignore[attr-defined]
    ax.set_ylabel(label)  # type: ignore[attr-defined]
