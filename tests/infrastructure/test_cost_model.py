"""The cost model: its shape, and the table docs/deploy.md shows is the one it computes."""

from __future__ import annotations

from pathlib import Path

from infra.cost_model import Assumptions, round_cost, table

REPO = Path(__file__).resolve().parents[2]


def test_requests_per_participant_follow_the_stated_assumptions() -> None:
    # Given the stated assumptions (120 s rounds, heartbeats every 15 s, polls every 2 s)
    a = Assumptions()
    cost = round_cost(10, a)
    # Then a participant makes 1 update PUT and 8 heartbeat PUTs, each one event and one ingest invocation
    assert cost.s3_puts == cost.events == cost.invocations == 1 + 120 / 15
    # And polls the run item 60 times; the S3 GETs are its global model plus what the coordinator reads
    assert a.polls == 60
    assert cost.s3_gets == 1 + cost.s3_puts + 1


def test_cost_per_participant_grows_with_the_run_item() -> None:
    # When there are more participants, the run item and the participant query grow
    small, large = round_cost(10), round_cost(1000)
    # Then requests per participant stay the same but read units and dollars per participant grow
    assert small.s3_puts == large.s3_puts
    assert large.read_units > 10 * small.read_units
    assert large.usd_per_participant > small.usd_per_participant


def test_docs_show_the_models_table() -> None:
    # Given the deploy guide, Then it contains exactly the table the model prints
    assert table() in (REPO / "docs" / "deploy.md").read_text()
