"""What a round costs on AWS: requests per participant per round (`round_cost`), and what aggregating a model of a
given size costs in shard workers' compute and S3 requests (`aggregation_cost`).

`python -m infra.cost_model` prints the two tables docs/deploy.md shows (a test keeps them equal). Every
number below is an assumption, stated where it is used; prices are us-east-1 list prices as assumed here,
not fetched.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

from shared.config import RunConfig
from shared.digest import PIECE_BYTES

GIB = 1024**3


@dataclass(frozen=True)
class Prices:
    """USD, us-east-1 list prices (assumed; check the current ones before relying on a figure)."""

    s3_put_per_1k: float = 0.005  # S3 Standard PUT, COPY, POST, LIST
    s3_get_per_1k: float = 0.0004  # S3 Standard GET, SELECT (HEAD is billed as GET)
    ddb_read_per_m: float = 0.125  # DynamoDB on-demand read request unit
    ddb_write_per_m: float = 0.625  # DynamoDB on-demand write request unit
    lambda_per_m: float = 0.20  # Lambda requests
    lambda_gb_second: float = 0.0000166667  # Lambda duration, x86, per GB-second (first 6 billion a month)
    # S3's events reach EventBridge as AWS-service events on the default bus, which EventBridge lists as free;
    # priced here like custom events as an upper bound.
    eventbridge_per_m: float = 1.00


@dataclass(frozen=True)
class Assumptions:
    round_seconds: float = 120.0  # wall time of a round, download to next global model
    liveness_timeout: float = 60.0  # heartbeats every liveness_timeout / 4 (run default)
    poll_seconds: float = 2.0  # participant polls the run item every ~2 s (backoff caps at 2 s): an upper bound
    state_item_kb: float = 1.0  # the run item (phase, deadlines, ...) without members
    state_kb_per_member: float = 0.11  # members, selected and counted lists grow the run item per participant
    participant_item_kb: float = 0.3  # one P# item (pid, times, public key, info)
    update_item_kb: float = 0.4  # one U# item (digest, key, metrics, ...)
    # One state commit per accepted update plus a few phase changes; one of them is a transaction (2x units).
    extra_commits_per_round: int = 3

    @property
    def heartbeats(self) -> float:
        return self.round_seconds / (self.liveness_timeout / 4)

    @property
    def polls(self) -> float:
        return self.round_seconds / self.poll_seconds


@dataclass(frozen=True)
class RoundCost:
    participants: int
    s3_puts: float  # per participant per round
    s3_gets: float
    events: float
    invocations: float
    read_units: float
    write_units: float
    usd_per_participant: float

    @property
    def usd_per_round(self) -> float:
        return self.usd_per_participant * self.participants


def round_cost(participants: int, a: Assumptions = Assumptions(), p: Prices = Prices()) -> RoundCost:
    """Requests and dollars per participant per round, with every participant selected every round."""
    n = participants
    state_kb = a.state_item_kb + a.state_kb_per_member * n
    read_state = math.ceil(state_kb / 4)  # strongly consistent GetItem: 1 unit per 4 KB
    uploads = 1 + a.heartbeats  # its update and its heartbeats; each is one S3 event and one ingest
    # A tick: GetItem of the run item, Query of all participant items, Query of the round's updates (on
    # average half of them are in); ingest first reads the run item once more.
    tick_reads = read_state + math.ceil(a.participant_item_kb * n / 4) + max(1, math.ceil(a.update_item_kb * n / 8))
    read_units = a.polls * read_state + uploads * (read_state + tick_reads)
    commits = (n + a.extra_commits_per_round + 1) / n  # per participant; the +1 is the transaction's 2nd write
    write_units = uploads * 1 + commits * math.ceil(state_kb)  # conditional PutItem of <= 1 KB, then commits
    s3_puts = uploads
    # The participant GETs the global model; ingest GETs each object it validates. (Aggregation reads the updates
    # by 8 MiB ranges, and ingest reads the global by range to measure an update's distance: both grow with the
    # model, so they are in `aggregation_cost`, not here.)
    s3_gets = 1 + uploads
    usd = (
        s3_puts * p.s3_put_per_1k / 1e3
        + s3_gets * p.s3_get_per_1k / 1e3
        + read_units * p.ddb_read_per_m / 1e6
        + write_units * p.ddb_write_per_m / 1e6
        + uploads * p.lambda_per_m / 1e6
        + uploads * p.eventbridge_per_m / 1e6
    )
    return RoundCost(n, s3_puts, s3_gets, uploads, uploads, read_units, write_units, usd)


# Update bytes one shard worker aggregates per second (FedAvg). `make bench` measured about 2.7 GB/s of update
# bytes on one core of the dev machine (PieceAggregator from files, K=1 on one core); a Lambda vCPU (1,769 MB) is
# assumed slower and its bytes come from S3 rather than the page cache, so 1.5 GB/s is taken as a conservative
# figure. Not measured on Lambda.
WORKER_UPDATE_BYTES_PER_SECOND = 1.5e9


@dataclass(frozen=True)
class AggregationAssumptions:
    worker_bytes_per_second: float = WORKER_UPDATE_BYTES_PER_SECOND
    worker_memory_mb: int = 1769  # [deploy.shard] memory_mb default: one full vCPU, what the throughput assumes
    tick_memory_mb: int = 1769  # the tick (or ingest) that aggregates waits for its shards at this size
    shard_bytes: int = RunConfig.model_fields["shard_bytes"].default  # [run] shard_bytes default, 512 MiB


@dataclass(frozen=True)
class AggregationCost:
    """One round's aggregation (FedAvg) of `updates` updates of a `model_bytes` model, plus ingest's ranged reads
    of the global model (one per 8 MiB of each update: its distance from the global)."""

    model_bytes: int
    updates: int
    pieces: int  # 8 MiB pieces of the global model: one part of the staged upload each
    shards: int  # K: shard-worker invocations (0: a one-piece model is computed and PUT by the tick itself)
    shard_seconds: float  # one shard's duration (they run at once): what must stay well under the timeout
    worker_gb_seconds: float  # all K workers together
    tick_gb_seconds: float  # the aggregating tick, waiting for its shards
    s3_gets: float
    s3_puts: float  # PUT-class: UploadPart, CreateMultipartUpload, CompleteMultipartUpload, CopyObject
    ingest_gets: float  # ingest's ranged reads of the global, for the round's updates
    usd_compute: float
    usd_requests: float  # S3 requests of the aggregation and the shard invocations (not ingest's reads)
    usd_ingest_gets: float

    @property
    def usd(self) -> float:
        return self.usd_compute + self.usd_requests


def aggregation_cost(
    model_bytes: int, updates: int, a: AggregationAssumptions = AggregationAssumptions(), p: Prices = Prices()
) -> AggregationCost:
    """Compute and requests of one round's aggregation in shard workers, as `coordinator.aggregation` does it.

    K = ceil(pieces / pieces per shard) workers each aggregate (model bytes / K) x updates bytes at the worker
    throughput; every worker reads one range of every update per piece (plus, once, the base global's header in
    two small reads and each update's header length in one), uploads one part per piece; the tick creates,
    completes and copies the staged upload, after authenticating the base global (one streamed GET and two
    header reads).
    """
    n = updates
    pieces = max(1, math.ceil(model_bytes / PIECE_BYTES))
    ingest_gets = n * pieces
    if pieces == 1:  # the tick computes the one piece itself and PUTs it: no shard workers, no multipart upload
        shards, shard_seconds, worker_gbs, tick_gbs = 0, 0.0, 0.0, 0.0
        s3_gets, s3_puts = n * (1 + 1) + 3, 1.0
    else:
        per_shard = max(1, a.shard_bytes // PIECE_BYTES)
        shards = math.ceil(pieces / per_shard)
        total_seconds = model_bytes * n / a.worker_bytes_per_second
        shard_seconds = min(per_shard * PIECE_BYTES, model_bytes) * n / a.worker_bytes_per_second
        worker_gbs = total_seconds * a.worker_memory_mb / 1024
        tick_gbs = shard_seconds * a.tick_memory_mb / 1024
        s3_gets = pieces * n + shards * (2 + n) + 3
        s3_puts = pieces + 3.0
    usd_compute = (worker_gbs + tick_gbs) * p.lambda_gb_second
    usd_requests = (s3_gets * p.s3_get_per_1k / 1e3 + s3_puts * p.s3_put_per_1k / 1e3
                    + shards * p.lambda_per_m / 1e6)  # fmt: skip
    return AggregationCost(
        model_bytes,
        n,
        pieces,
        shards,
        shard_seconds,
        worker_gbs,
        tick_gbs,
        s3_gets,
        s3_puts,
        ingest_gets,
        usd_compute,
        usd_requests,
        ingest_gets * p.s3_get_per_1k / 1e3,
    )


# Models up to 4 GiB in the table; the figures grow linearly with model bytes x updates beyond that.
AGGREGATION_ROWS = ((100 * 1024**2, 10), (GIB, 8), (GIB, 100), (4 * GIB, 8), (4 * GIB, 100))


def _size(model_bytes: int) -> str:
    return f"{model_bytes / GIB:g} GiB" if model_bytes >= GIB else f"{model_bytes / 1024**2:g} MiB"


def aggregation_table(rows: tuple[tuple[int, int], ...] = AGGREGATION_ROWS) -> str:
    """The markdown table of aggregation costs docs/deploy.md shows."""
    lines = [
        "| model | updates | pieces | K shards | one shard (s) | shard GB-s | tick GB-s | S3 GET | S3 PUT "
        "| USD compute | USD requests | USD per round | ingest's ranged GETs (USD) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for model_bytes, n in rows:
        c = aggregation_cost(model_bytes, n)
        lines.append(
            f"| {_size(model_bytes)} | {n:,} | {c.pieces:,} | {c.shards:,} | {c.shard_seconds:,.1f} "
            f"| {c.worker_gb_seconds:,.1f} | {c.tick_gb_seconds:,.1f} | {c.s3_gets:,.0f} | {c.s3_puts:,.0f} "
            f"| {c.usd_compute:.5f} | {c.usd_requests:.5f} | {c.usd:.4f} "
            f"| {c.ingest_gets:,.0f} ({c.usd_ingest_gets:.4f}) |"
        )
    return "\n".join(lines)


def table(sizes: tuple[int, ...] = (10, 100, 1000)) -> str:
    """The markdown table docs/deploy.md shows."""
    lines = [
        "| participants per round | S3 PUT | S3 GET | EventBridge events | Lambda invocations "
        "| DynamoDB read units | DynamoDB write units | USD per participant-round | USD per round "
        "| USD per 1,000 rounds |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n in sizes:
        c = round_cost(n)
        lines.append(
            f"| {n:,} | {c.s3_puts:.0f} | {c.s3_gets:.0f} | {c.events:.0f} | {c.invocations:.0f} "
            f"| {c.read_units:,.0f} | {c.write_units:,.1f} | {c.usd_per_participant:.6f} "
            f"| {c.usd_per_round:.4f} | {c.usd_per_round * 1000:,.2f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(table() + "\n\n" + aggregation_table() + "\n")
