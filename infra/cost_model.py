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
from shared.messages import BILLED_CHUNK_BYTES

GIB = 1024**3


@dataclass(frozen=True)
class Prices:
    """USD, us-east-1 list prices (assumed; check the current ones before relying on a figure)."""

    s3_put_per_1k: float = 0.005  # S3 Standard PUT, COPY, POST, LIST
    s3_get_per_1k: float = 0.0004  # S3 Standard GET, SELECT (HEAD is billed as GET)
    ddb_read_per_m: float = 0.125  # DynamoDB on-demand read request unit
    ddb_write_per_m: float = 0.625  # DynamoDB on-demand write request unit
    lambda_per_m: float = 0.20  # Lambda requests
    sqs_per_m: float = 0.40  # SQS standard queue requests
    lambda_gb_second: float = 0.0000133334  # Lambda duration, arm64 (the functions' architecture), per GB-second
    # S3's events reach EventBridge as AWS-service events on the default bus, which EventBridge lists as free;
    # priced here like custom events as an upper bound.
    eventbridge_per_m: float = 1.00


@dataclass(frozen=True)
class Assumptions:
    """A steady 60 s round of a run whose participants listen for state changes on their own SQS queues (`store.push`).
    The per-operation counts are what the load test measured in its steady state (tests/e2e/test_load.py: the round
    between the first and the last, 1,000 simulated participants speaking the daemon's protocol, counted at the
    server by operation: 8.16 requests per participant per round in a 115 s round, 3.06 of them the participant's):
    a participant wakes on one pushed message carrying the round's roster, reads the global model once and uploads
    once; ingest reads the state item and the update once, writes the record and the round's count; the aggregation
    reads the update once (a small model: ranged reads of a large one are in `aggregation_cost`)."""

    round_seconds: float = 60.0  # wall time of a round, download to next global model (a minute: the steady state)
    # Silence after which a member is dropped: three rounds. Heartbeats go every liveness_timeout / 3, and none within
    # two intervals of an update upload (`RunConfig.heartbeat_after_update`), so a member uploading every round sends
    # none while its rounds are shorter than that (the load test: 0.00 a round in 57 s rounds).
    liveness_timeout: float = 180.0
    # Seconds a round's participant long-polls its queue in vain: one 20 s long poll per 20 s beyond the receive that
    # wakes it. Its training fills the round's start, and after its upload it waits without a request for most of
    # the rest (`participant.protocol.quiet_seconds`): the load test measured 0.15 long polls that ended with
    # nothing a participant-round at 1,000 (3 s), in rounds of 115 s.
    idle_seconds: float = 3.0
    # Pushed state changes a participant acts on in a round (the round's start; a run with witnesses: 2): each names a
    # new roster, which rides in the message while it stays within one billed chunk (below), else is one GET.
    pushes_per_round: int = 1
    # A roster's gzipped bytes per member, as a push carries it: 12 in the load test at 1,000 (its participants all
    # alike), 39 for a roster of 1,000 members whose speeds and times all differ; the larger is assumed. A roster of
    # up to ~1,600 members then rides in the push.
    roster_gzip_bytes_per_member: float = 40.0
    state_item_kb: float = 1.0  # the run item: the same size whatever the membership (test_state_layout.py)
    participant_item_kb: float = 0.3  # one P# item (pid, times, public key, info)
    update_item_kb: float = 0.4  # one U# item (digest, key, metrics, ...)
    # Commits that change the roster in a round (start, freeze, close, aggregation): one PUT each, shared.
    roster_changes_per_round: int = 4
    # Ticks that read the whole snapshot in a round (its start, its close ticked by the last update, the aggregation,
    # a scheduled one), shared by its participants; state commits a round, one a transaction with its summary.
    ticks_per_round: int = 4
    commits_per_round: int = 4

    @property
    def heartbeats(self) -> float:
        """Heartbeats a member sends in a round beside its update: none while an update covers the round (two
        intervals), then about one an interval."""
        every = self.liveness_timeout / 3
        covered = 2 * every
        return 0.0 if self.round_seconds <= covered else 1 + (self.round_seconds - covered) / every

    @property
    def receives(self) -> float:
        return 1 + self.idle_seconds / 20

    def roster_gets(self, members: int) -> float:
        """The roster GETs a member makes in a round: none while its roster rides in the push."""
        message = self.state_item_kb * 1024 + members * self.roster_gzip_bytes_per_member
        return 0.0 if message <= BILLED_CHUNK_BYTES else float(self.pushes_per_round)


@dataclass(frozen=True)
class RoundCost:
    participants: int
    s3_puts: float  # per participant per round
    s3_gets: float
    events: float
    invocations: float
    read_units: float
    write_units: float
    sqs_requests: float
    usd_per_participant: float

    @property
    def usd_per_round(self) -> float:
        return self.usd_per_participant * self.participants


def round_cost(participants: int, a: Assumptions = Assumptions(), p: Prices = Prices()) -> RoundCost:
    """Requests and dollars per participant per round, with every participant selected every round."""
    n = participants
    item = math.ceil(a.state_item_kb / 4)  # a strongly consistent GetItem of a small item: 1 unit per 4 KB
    uploads = 1 + a.heartbeats  # its update and its heartbeats; each is one S3 event and one ingest
    # Ingest of the update: GetItem of the run item (the participant's key is held by the warm function); writes: the
    # record and the round's count. Of a heartbeat: the participant item and the run item; one write (last_seen).
    ingest_reads = item + a.heartbeats * 2 * item
    ingest_writes = 2 + a.heartbeats
    # The round's ticks, shared by its participants: each reads the run item, every participant item and the
    # round's update items.
    snapshot = item + math.ceil(a.participant_item_kb * n / 4) + math.ceil(a.update_item_kb * n / 4)
    tick_reads = a.ticks_per_round * snapshot / n
    read_units = ingest_reads + tick_reads  # (the participant reads no item: the push carries the run item)
    write_units = ingest_writes + (a.commits_per_round + 1) * math.ceil(a.state_item_kb) / n
    s3_puts = uploads + a.roster_changes_per_round / n  # the coordinator's roster PUTs, shared by the members
    # The participant GETs the global model (and each pushed roster too big to ride along); ingest GETs each object
    # it validates; the aggregation GETs each update once (a small model; a large one's ranged reads are in
    # `aggregation_cost`).
    s3_gets = 1 + a.roster_gets(n) + uploads + 1
    # Its long polls, and SNS's deliveries to its queue (priced as SQS requests: an upper bound).
    sqs = a.receives + a.pushes_per_round
    usd = (
        s3_puts * p.s3_put_per_1k / 1e3
        + s3_gets * p.s3_get_per_1k / 1e3
        + read_units * p.ddb_read_per_m / 1e6
        + write_units * p.ddb_write_per_m / 1e6
        + uploads * p.lambda_per_m / 1e6
        + uploads * p.eventbridge_per_m / 1e6
        + sqs * p.sqs_per_m / 1e6
    )
    return RoundCost(n, s3_puts, s3_gets, uploads, uploads, read_units, write_units, sqs, usd)


# Update bytes one shard worker aggregates per second (FedAvg). `make bench` measured about 3.1–3.7 GB/s of update
# bytes on one core of the dev machine (PieceAggregator from files, K=1 on one core); a Lambda vCPU (1,769 MB) is
# assumed slower and its bytes come from S3 rather than the page cache, so 1.5 GB/s is taken as a conservative
# figure. Not measured on Lambda.
WORKER_UPDATE_BYTES_PER_SECOND = 1.5e9


def shard_polls(shard_seconds: float) -> int:
    """The tick's looks for one shard's outcome: backing off from 0.05 s to 1 s (`coordinator.shard_queue`), so
    about 5 in the first second and one a second after."""
    return 5 + math.ceil(shard_seconds)


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
    s3_puts: float  # PUT-class: UploadPart, CreateMultipartUpload, CompleteMultipartUpload, CopyObject, outcomes
    ingest_gets: float  # ingest's ranged reads of the global, for the round's updates
    usd_compute: float
    usd_requests: float  # S3 and SQS requests of the aggregation and the shard invocations (not ingest's reads)
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
    two small reads and each update's header length in one), uploads one part per piece and its outcome; the tick
    creates, completes and copies the staged upload, after authenticating the base global (one streamed GET and
    two header reads), sends the K tasks to the shard queue (each also received and deleted: 3 SQS requests) and
    looks for each outcome while the shards run (SHARD_POLLS GETs, about one a second).
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
        s3_gets = pieces * n + shards * (2 + n) + 3 + shards * shard_polls(shard_seconds)
        s3_puts = pieces + 3.0 + shards
    usd_compute = (worker_gbs + tick_gbs) * p.lambda_gb_second
    usd_requests = (s3_gets * p.s3_get_per_1k / 1e3 + s3_puts * p.s3_put_per_1k / 1e3
                    + shards * p.lambda_per_m / 1e6 + 3 * shards * p.sqs_per_m / 1e6)  # fmt: skip
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


@dataclass(frozen=True)
class IdleCost:
    """A month with nothing happening (the run finished, or paused with nothing pending), per GB kept."""

    requests_usd: float  # no tick fires (its schedule is off) and nobody uploads: no request at all
    s3_usd_per_gb: float = 0.023  # S3 Standard storage, per GB-month
    dynamodb_usd_per_gb: float = 0.25  # DynamoDB Standard table storage, per GB-month


def idle_cost() -> IdleCost:
    return IdleCost(requests_usd=0.0)


# The dropped path of ingest (`coordinator.intake.budget`): two DynamoDB UpdateItems (the failed conditional count,
# the dropped count) and nothing else. Measured 6.7 ms an object on in-process moto
# (tests/functional/test_upload_budget.py prints it); on Lambda each call is a network round trip: 30 ms assumed.
JUNK_INGEST_SECONDS = 0.030
JUNK_INGEST_MEMORY_MB = 1769  # [deploy.ingest] memory_mb's default


@dataclass(frozen=True)
class JunkCost:
    """What `objects` junk objects past their uploader's budget cost, split by who pays. The PUTs are the flooder's
    doing, but S3 bills requests to the bucket's owner (participants write with a role of the run's account): the
    account pays them too. Storage (the junk stays until the lifecycle rules expire it) is not counted."""

    objects: int
    usd_puts: float  # S3 PUTs
    usd_events: float  # EventBridge (S3's events are free on the default bus: an upper bound)
    usd_invocations: float  # Lambda requests
    usd_duration: float  # Lambda GB-seconds of the dropped path
    usd_writes: float  # DynamoDB: the failed conditional count and the dropped count, one write unit each

    @property
    def usd_ingest(self) -> float:
        """Everything but the PUTs: what the flood makes the coordinator spend."""
        return self.usd_events + self.usd_invocations + self.usd_duration + self.usd_writes

    @property
    def usd(self) -> float:
        return self.usd_puts + self.usd_ingest


def junk_cost(objects: int = 10_000, p: Prices = Prices()) -> JunkCost:
    gb_seconds = objects * JUNK_INGEST_SECONDS * JUNK_INGEST_MEMORY_MB / 1024
    return JunkCost(objects, usd_puts=objects * p.s3_put_per_1k / 1000,
                    usd_events=objects * p.eventbridge_per_m / 1e6, usd_invocations=objects * p.lambda_per_m / 1e6,
                    usd_duration=gb_seconds * p.lambda_gb_second, usd_writes=2 * objects * p.ddb_write_per_m / 1e6)


def junk_line(c: JunkCost | None = None) -> str:
    """The sentence docs/deploy.md shows."""
    c = c or junk_cost()
    return (f"{c.objects:,} junk objects past their uploader's budget cost ${c.usd:.4f}: ${c.usd_puts:.4f} of S3 "
            f"PUTs and ${c.usd_ingest:.4f} of ingest (events ${c.usd_events:.4f}, invocations "
            f"${c.usd_invocations:.4f}, {JUNK_INGEST_SECONDS * 1000:.0f} ms at {JUNK_INGEST_MEMORY_MB} MB each "
            f"${c.usd_duration:.4f}, two DynamoDB write units each ${c.usd_writes:.4f}).")


def table(sizes: tuple[int, ...] = (10, 100, 1000, 5000)) -> str:
    """The markdown table docs/deploy.md shows."""
    lines = [
        "| participants per round | S3 PUT | S3 GET | EventBridge events | Lambda invocations "
        "| DynamoDB read units | DynamoDB write units | SQS requests | USD per participant-round | USD per round "
        "| USD per 1,000 rounds |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n in sizes:
        c = round_cost(n)
        lines.append(
            f"| {n:,} | {c.s3_puts:.0f} | {c.s3_gets:.0f} | {c.events:.0f} | {c.invocations:.0f} "
            f"| {c.read_units:,.1f} | {c.write_units:,.1f} | {c.sqs_requests:.2f} | {c.usd_per_participant:.6f} "
            f"| {c.usd_per_round:.4f} | {c.usd_per_round * 1000:,.2f} |"
        )
    idle = idle_cost()
    lines.append(f"| idle, per month | 0 | 0 | 0 | 0 | 0 | 0 | 0 | — | {idle.requests_usd:.4f} of requests "
                 f"| storage only: S3 ${idle.s3_usd_per_gb}/GB, DynamoDB ${idle.dynamodb_usd_per_gb}/GB |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(table() + "\n\n" + aggregation_table() + "\n\n" + junk_line() + "\n")
