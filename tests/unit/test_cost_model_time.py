"""The cost model in time: a round's seconds and dollars phase by phase, its calibration against `make bench-big`,
the plan docs/deploy.md shows, and `fed plan`."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from fed.cli import app
from fed.plan import parse_bytes
from infra.cost_model import (
    BENCH_BIG_K2_SECONDS,
    BENCH_BIG_MODEL_BYTES,
    BENCH_BIG_UPDATES,
    COPY_PART_BYTES,
    COPY_STREAMS,
    COPY_THRESHOLD_BYTES,
    LAMBDA,
    LAMBDA_NETWORK_BYTES_PER_SECOND,
    TRANSFER_PART_BYTES,
    TimeAssumptions,
    aggregation_seconds,
    dev_machine,
    plan,
    plan_7b,
    round_time,
    wire_ratio_of,
)
from infra.settings import DeploySettings
from shared.compress import Encoding

REPO = Path(__file__).resolve().parents[2]
GB = 1e9


def test_the_phases_add_up_to_the_round() -> None:
    # Given a 7 B bf16 model, 8 participants, int8 both ways, K = 16
    r = round_time(14 * GB, 8, 16, wire_ratio_of("int8", 2), wire_ratio_of("int8", 2))
    # Then the round's seconds and dollars are its four phases'
    assert r.seconds == pytest.approx(sum(p.seconds for p in (r.upload, r.ingest, r.aggregation, r.download)))
    assert r.usd == pytest.approx(r.upload.usd + r.ingest.usd + r.aggregation.usd + r.download.usd)
    assert all(p.seconds > 0 and p.usd > 0 for p in r.phases.values())
    # And the download's dollars are mostly egress: 8 x ~7.1 GB at $0.09/GB
    assert r.download.usd == pytest.approx(8 * r.download_bytes / GB * 0.09, rel=0.01)
    # And with the hosts in the bucket's region there is no egress
    inside = round_time(14 * GB, 8, 16, r.upload_ratio, r.download_ratio, a=TimeAssumptions(egress_usd_per_gb=0))
    assert inside.download.usd < 0.01 < r.download.usd


def test_more_workers_shorten_aggregation_until_the_globals_write() -> None:
    # Given a 7 B bf16 model's int8 updates from 8 participants
    ratio = wire_ratio_of("int8", 2)
    runs = {k: aggregation_seconds(LAMBDA, 14 * GB, 8, k, ratio) for k in (1, 2, 4, 8, 16, 32, 64, 256, 1024)}
    # Then while Lambda's network bounds a shard, doubling K halves it
    assert "Lambda network throughput" in runs[1].limit
    assert runs[2].shard_seconds == pytest.approx(runs[1].shard_seconds / 2, rel=0.01)
    assert runs[1].shard_seconds == pytest.approx(14 * GB * (8 * ratio + 2) / LAMBDA_NETWORK_BYTES_PER_SECOND,
                                                  rel=0.01)
    seconds = [runs[k].seconds for k in sorted(runs) if k <= 256]
    assert seconds == sorted(seconds, reverse=True)
    # And no K beats the stated floor: the global's server-side copy (here in parts) plus the dispatch
    floor = 14 * GB / (COPY_STREAMS * 85e6) + 1.0
    assert all(r.seconds >= floor for r in runs.values())
    assert runs[256].seconds < floor + 5 and "the global's write" in runs[256].limit
    # And past it more workers cost time: their own header reads count against S3's GET rate a prefix
    assert runs[1024].seconds > runs[256].seconds
    assert runs[1024].shard_seconds == pytest.approx(runs[1024].worker_gets / 5_500)
    # And K beyond the fragment's pieces is no more workers
    assert round_time(20 * 1024**2, 2, 64, 1.0).workers == 3


def test_topk_shrinks_the_upload_more_than_thirty_fold() -> None:
    # Given topk's layout (82 of each 4096 elements: a 2-byte index and a 2- or 4-bit value each, one fp32 scale)
    assert wire_ratio_of("topk2", 4) == pytest.approx((82 * 2 + 21 + 4) / (4096 * 4))  # positions, codes, step
    # Then against an fp32 model's weights it sends over 30 x fewer bytes, and far fewer than int8
    fp32 = round_time(7 * 4 * GB, 8, 16, wire_ratio_of("weights", 4))
    for bits in (2, 4):
        topk = round_time(7 * 4 * GB, 8, 16, wire_ratio_of(f"topk{bits}", 4))
        assert topk.upload_bytes * 30 < fp32.upload_bytes
        assert topk.upload.seconds * 30 < fp32.upload.seconds
    assert wire_ratio_of("topk4", 2) < wire_ratio_of("int8", 2) / 10
    # And the encodings shared.compress knows are priced by its own wire_ratio: int8 is a byte and a scale per block
    assert wire_ratio_of(Encoding("int8", 256), 2) == pytest.approx((1 + 4 / 256) / 2)
    assert wire_ratio_of("bf16", 4) == pytest.approx(0.5)
    # And fragments divide the bytes of a round
    assert round_time(28 * GB, 8, 16, 1.0, fragments=4).upload_bytes == pytest.approx(fp32.upload_bytes / 4)


def test_the_7b_plan_meets_the_targets_or_names_its_limit() -> None:
    # Given a 7 B bf16 model and 8 participants on 1 Gbit/s links, the targets
    p = plan(14 * GB, 8, dtype_bytes=2, upload_bytes_per_second=125e6)
    # Then a candidate aggregates in 60 s at $0.05 a round: the fewest fragments that do, then the cheapest
    assert p.pick is not None and p.pick.meets(60, 0.05)
    assert p.pick.round.aggregation.seconds <= 60 and p.pick.round.usd <= 0.05
    assert all(c.round.fragments >= p.pick.round.fragments for c in p.candidates if c.meets(60, 0.05))
    # And a whole model a round (F = 1) cannot: egress alone is over the budget, and the verdict says so
    whole = plan(14 * GB, 8, fragments=(1,))
    assert whole.pick is None and "S3 egress" in whole.why_not
    # And an aggregation in 5 s is out of reach: the verdict names the limit that stops the fastest
    fast = plan(14 * GB, 8, fragments=(1,), target_seconds=5)
    assert fast.pick is None and "the global's write" in fast.why_not
    # And a model whose aggregation outlasts Lambda's 15 minutes is refused with that limit
    huge = round_time(2000 * GB, 8, 1, 1.0)
    assert "15-minute" in huge.over_lambda_timeout
    # And docs/deploy.md shows the plan the model prints
    assert plan_7b() in (REPO / "docs" / "deploy.md").read_text()


def test_the_model_predicts_bench_big_k2_from_its_k1_run() -> None:
    # Given the dev machine's rates derived from `make bench-big`'s K = 1 run and its global write alone
    dev = dev_machine()
    # Then the same model predicts the K = 2 run within its recorded range (6.2-7.3 s)
    k2 = aggregation_seconds(dev, BENCH_BIG_MODEL_BYTES, BENCH_BIG_UPDATES, 2, 1.0).seconds
    assert BENCH_BIG_K2_SECONDS[0] <= k2 <= BENCH_BIG_K2_SECONDS[1]
    # And on two cores a third and a fourth worker buy nothing
    k4 = aggregation_seconds(dev, BENCH_BIG_MODEL_BYTES, BENCH_BIG_UPDATES, 4, 1.0).seconds
    assert k4 == pytest.approx(k2)


def test_the_constants_are_the_code_they_describe() -> None:
    from participant.remote import PART_BYTES
    from store.blobs import COPY_CONFIG

    assert TRANSFER_PART_BYTES == PART_BYTES
    assert COPY_STREAMS == COPY_CONFIG.max_concurrency
    assert COPY_PART_BYTES == COPY_CONFIG.multipart_chunksize
    assert COPY_THRESHOLD_BYTES == COPY_CONFIG.multipart_threshold
    d, a = DeploySettings(), TimeAssumptions()
    assert (a.ingest_memory_mb, a.worker_memory_mb, a.tick_memory_mb) == (d.ingest.memory_mb, d.shard.memory_mb,
                                                                          d.tick.memory_mb)
    with pytest.raises(ValueError, match="10240"):
        TimeAssumptions(worker_memory_mb=20_000)


def test_sizes_in_every_form() -> None:
    assert parse_bytes("7e9") == 7e9
    assert parse_bytes("14GB") == parse_bytes("14 gb") == 14e9
    assert parse_bytes("1GiB") == 1024**3
    assert parse_bytes("0.5TB") == 5e11
    for bad in ("", "lots", "14 GX", "-3GB", "0"):
        with pytest.raises(Exception, match="bytes"):
            parse_bytes(bad)


def fed(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args), env={"COLUMNS": "200", "TERM": "dumb"})
    return result.exit_code, result.output


def test_fed_plan_help_says_what_each_input_means() -> None:
    code, out = fed("plan", "--help")
    assert code == 0, out
    for words in ("--model-bytes", "7 B bf16 model is 14GB", "--participants", "--dtype-bytes", "--upload-mbps",
                  "megabits per second", "--workers", "--encoding", "topk", "--fragments", "1/F of the model",
                  "--target-seconds", "--target-dollars", "data transfer"):
        assert words in out, words


def test_fed_plan_prints_the_phases_and_its_pick() -> None:
    # When the operator plans a 7 B bf16 model for 8 participants
    code, out = fed("plan", "--model-bytes", "14GB", "--participants", "8")
    # Then every phase's seconds and dollars are printed, and the pick
    assert code == 0, out
    assert "| upload s | ingest s | aggregation s | download s |" in out
    assert "Pick: topk" in out
    # And fixing F = 1 finds none and says why (exit status 1)
    code, out = fed("plan", "--model-bytes", "7e9", "--participants", "8", "--dtype-bytes", "2", "-F", "1")
    assert code == 1 and "No candidate meets the targets" in out and "S3 egress" in out
    # And a size it cannot read is refused with the forms it takes
    code, out = fed("plan", "--model-bytes", "big", "--participants", "8")
    assert code == 2 and "14GB" in out
