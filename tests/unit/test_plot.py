"""The training-curve PNG of `fed status --plot` and `fed demo --plot`."""

from __future__ import annotations

from pathlib import Path

import matplotlib.image
import numpy as np
import pytest

from fed.plot import PlotUnavailable, RoundPoint, points_from_summaries, write_png
from shared.state import RoundSummary


def summary(round_no: int, aggregated: bool = True) -> RoundSummary:
    return RoundSummary(round=round_no, epoch=1, selected=("a",), counted=("a",) if aggregated else (), refused={},
                        dropped={}, samples=10, loss=1.0 / (round_no + 1) if aggregated else None,
                        accuracy=0.5 + 0.1 * round_no if aggregated else None, started=10.0 * round_no,
                        ended=10.0 * round_no + 2.5, aggregated=aggregated)


def test_points_follow_the_round_order_and_keep_missing_metrics_missing() -> None:
    points = points_from_summaries([summary(2), summary(0), summary(1, aggregated=False)])
    assert [p.round for p in points] == [0, 1, 2]
    assert points[1] == RoundPoint(1, None, None, 2.5, False)
    assert points[2].accuracy == pytest.approx(0.7)


def test_the_png_is_drawn_with_a_round_that_was_not_aggregated(tmp_path: Path) -> None:
    path = write_png(points_from_summaries([summary(0), summary(1, aggregated=False), summary(2)]),
                     tmp_path / "sub" / "curves.png", "a run")
    image = matplotlib.image.imread(path)
    assert image.shape[:2] == (800, 700)
    assert float(np.std(image[..., :3])) > 0.05  # something was drawn, not a blank canvas


def test_no_rounds_is_a_clear_error_and_writes_nothing(tmp_path: Path) -> None:
    with pytest.raises(PlotUnavailable, match="no finished rounds"):
        write_png([], tmp_path / "curves.png", "a run")
    assert not (tmp_path / "curves.png").exists()
