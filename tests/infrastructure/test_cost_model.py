"""The cost model: its shape, and the table docs/deploy.md shows is the one it computes."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from infra.cost_model import (
    GIB,
    WORKER_UPDATE_BYTES_PER_SECOND,
    AggregationAssumptions,
    Assumptions,
    Prices,
    aggregation_cost,
    aggregation_table,
    idle_cost,
    round_cost,
    table,
)
from infra.settings import DeploySettings
from shared.config import RunConfig
from shared.digest import PIECE_BYTES

REPO = Path(__file__).resolve().parents[2]


def test_requests_per_participant_follow_the_stated_assumptions() -> None:
    # Given the stated assumptions (60 s rounds, a liveness timeout of three rounds, 20 s idle on the push queue)
    a = Assumptions()
    cost = round_cost(10, a)
    # Then a member uploading every round heartbeats never: one update PUT, one event and one ingest invocation,
    # and it shares the coordinator's 4 roster PUTs with the other 9
    assert a.heartbeats == 0
    assert cost.events == cost.invocations == 1
    assert cost.s3_puts == pytest.approx(1 + 4 / 10)
    # And it GETs the global model (the roster rides in the push); ingest and the aggregation GET its update once each
    assert cost.s3_gets == 1 + 0 + 1 + 1
    # And its queue: the receive that wakes it, the long polls that end with nothing (0.15), and SNS's delivery
    assert cost.sqs_requests == pytest.approx(1 + 0.15 + 1)
    # And heartbeats come back when rounds are longer than an update covers (two intervals), one an interval beyond
    assert Assumptions(round_seconds=40, liveness_timeout=60).heartbeats == 0
    assert Assumptions(round_seconds=120, liveness_timeout=60).heartbeats == 1 + (120 - 40) / 20


def test_a_participant_costs_the_same_whatever_the_membership() -> None:
    # When there are more participants, the run item stays the same size, and a round's few ticks (not one per
    # upload) read every participant item: shared by all, that is a constant per participant
    a = Assumptions()
    small, large = round_cost(10), round_cost(1000)
    # Then requests per participant stay the same and read units do not grow
    assert small.events == large.events and small.s3_gets == large.s3_gets
    assert math.ceil(a.state_item_kb / 4) == 1
    assert large.read_units == pytest.approx(small.read_units, abs=1.0)
    assert large.usd_per_participant <= small.usd_per_participant
    # And a 1,000-participant round costs at most two cents of requests
    assert large.usd_per_round <= 0.02


def test_a_roster_too_big_to_ride_in_the_push_is_one_get_a_push() -> None:
    # Given rosters of 40 bytes a member gzipped, pushed with a 1 KB state item in one 64 KiB billed chunk
    a = Assumptions()
    fits = int((64 * 1024 - 1024) / a.roster_gzip_bytes_per_member)
    # Then up to ~1,600 members a woken participant GETs no roster, beyond it one a push
    assert a.roster_gets(fits) == 0 and a.roster_gets(fits + 1) == a.pushes_per_round == 1
    assert round_cost(fits + 1).s3_gets == round_cost(fits).s3_gets + 1


def test_an_idle_month_requests_nothing() -> None:
    assert idle_cost().requests_usd == 0.0
    assert "| idle, per month | 0 | 0 | 0 | 0 | 0 | 0 | 0 |" in table()


def test_docs_show_the_models_tables() -> None:
    # Given the deploy guide, Then it contains exactly the tables the model prints
    text = (REPO / "docs" / "deploy.md").read_text()
    assert table() in text
    assert aggregation_table() in text


def test_the_aggregation_assumptions_are_the_deployed_defaults() -> None:
    # Given the aggregation assumptions, Then they are the defaults a run deploys with
    a = AggregationAssumptions()
    assert a.shard_bytes == RunConfig(run_id="abc").shard_bytes == 512 * 1024**2
    assert a.worker_memory_mb == DeploySettings().shard.memory_mb
    assert a.tick_memory_mb == DeploySettings().tick.memory_mb
    assert a.worker_bytes_per_second == WORKER_UPDATE_BYTES_PER_SECOND == 1.5e9


def test_a_1_gib_model_with_8_updates_takes_two_shard_workers() -> None:
    # Given a 1 GiB model and 8 updates (the 512 MiB default shard)
    c = aggregation_cost(GIB, 8)
    # Then it is 128 pieces in K = 2 shards, each aggregating 512 MiB x 8 updates at 1.5 GB/s
    assert c.pieces == 128 and c.shards == 2
    assert c.shard_seconds == pytest.approx(512 * 1024**2 * 8 / 1.5e9)
    # And the workers' GB-seconds are the update bytes over the throughput at 1769 MB, whatever K
    assert c.worker_gb_seconds == pytest.approx(GIB * 8 / 1.5e9 * 1769 / 1024)
    assert aggregation_cost(GIB, 8, AggregationAssumptions(shard_bytes=64 * 1024**2)).worker_gb_seconds == (
        pytest.approx(c.worker_gb_seconds)
    )
    # And S3 sees one ranged GET per update per piece (plus a few header reads per worker, the tick's
    # authentication of the base global and its looks for the two outcomes), one UploadPart per piece, Create,
    # Complete and Copy once, and the two outcomes
    assert c.s3_gets == 128 * 8 + 2 * (2 + 8) + 3 + 2 * (5 + math.ceil(c.shard_seconds))
    assert c.s3_puts == 128 + 3 + 2
    # And ingest read the global once per 8 MiB of each update
    assert c.ingest_gets == 128 * 8
    # And the dollars are what those figures cost at the assumed prices
    p = Prices()
    assert c.usd_compute == pytest.approx((c.worker_gb_seconds + c.tick_gb_seconds) * p.lambda_gb_second)
    assert c.usd_requests == pytest.approx(c.s3_gets * p.s3_get_per_1k / 1e3 + c.s3_puts * p.s3_put_per_1k / 1e3
                                           + 2 * p.lambda_per_m / 1e6 + 6 * p.sqs_per_m / 1e6)  # fmt: skip


def test_shards_follow_shard_bytes_and_a_one_piece_model_needs_no_worker() -> None:
    # Given models of one piece, of a bit more, and of many shards
    small, two, big = (
        aggregation_cost(PIECE_BYTES, 5),
        aggregation_cost(PIECE_BYTES + 1, 5),
        aggregation_cost(4 * GIB, 8),
    )
    # Then one piece is the tick's own PUT, and more is a multipart upload in ceil(model / shard_bytes) shards
    assert small.shards == 0 and small.worker_gb_seconds == 0 and small.s3_puts == 1
    assert two.pieces == 2 and two.shards == 1
    assert big.shards == math.ceil(4 * GIB / (512 * 1024**2)) == 8
    # And compute grows with model bytes x updates, the shard's duration only with shard bytes x updates
    assert big.worker_gb_seconds == pytest.approx(4 * aggregation_cost(GIB, 8).worker_gb_seconds)
    assert big.shard_seconds == pytest.approx(aggregation_cost(GIB, 8).shard_seconds)


def test_junk_past_the_budget_costs_the_account_its_ingest_and_the_page_says_so() -> None:
    from infra.cost_model import JUNK_INGEST_SECONDS, junk_cost, junk_line

    # Given 10,000 junk objects past their uploader's budget
    c = junk_cost(10_000)
    # Then each is a PUT, an event, an invocation of the dropped path's duration and two DynamoDB write units
    p = Prices()
    assert c.usd_puts == pytest.approx(10_000 * p.s3_put_per_1k / 1000)
    assert c.usd_writes == pytest.approx(2 * 10_000 * p.ddb_write_per_m / 1e6)
    assert c.usd_duration == pytest.approx(10_000 * JUNK_INGEST_SECONDS * 1769 / 1024 * p.lambda_gb_second)
    assert c.usd == pytest.approx(c.usd_puts + c.usd_events + c.usd_invocations + c.usd_duration + c.usd_writes)
    assert c.usd < 0.1
    # And docs/deploy.md shows the figure the model computes
    assert junk_line() in (REPO / "docs" / "deploy.md").read_text()
