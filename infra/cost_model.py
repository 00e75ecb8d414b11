"""What a round costs on AWS: requests per participant per round (`round_cost`), what aggregating a model of a
given size costs in shard workers' compute and S3 requests (`aggregation_cost`), and what one round takes in
seconds and dollars, data transfer included, phase by phase (`round_time`; `plan` picks K, encoding and fragments
for `fed plan`).

`python -m infra.cost_model` prints the two tables docs/deploy.md shows (a test keeps them equal). Every
number below is an assumption, stated where it is used; prices are us-east-1 list prices as assumed here,
not fetched.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

from shared.aggregate import STREAMS
from shared.compress import Encoding, wire_ratio
from shared.config import RunConfig
from shared.digest import PIECE_BYTES
from shared.messages import BILLED_CHUNK_BYTES
from shared.wire import Manifest, TensorSpec

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


# --- time: what one round takes, phase by phase, and what it costs with its data transfer -------------------------
#
# A round (one outer step; with Streaming DiLoCo's F fragments, the sync of one fragment) on its critical path:
# the last participant's upload, that update's ingest, the aggregation, and the participants' download of the
# result. Training is not counted. Every limit below is a named constant with its source; where AWS states no
# figure, the constant says it is an assumption and how it was chosen.

LAMBDA_MAX_MEMORY_MB = 10_240  # Lambda's largest memory setting (Lambda quotas: 128 MB to 10,240 MB)
LAMBDA_TIMEOUT_SECONDS = 900.0  # Lambda's longest invocation, 15 minutes (Lambda quotas)
# One Lambda instance's network throughput, in and out together. AWS documents none, and does not say it grows with
# memory. Assumed 75 MB/s (600 Mbit/s): third-party measurements of one function's S3 transfers report 400-700
# Mbit/s; the middle is taken, the same at any memory up to LAMBDA_MAX_MEMORY_MB. Not measured on Lambda.
LAMBDA_NETWORK_BYTES_PER_SECOND = 75e6
# Request rates S3 serves per partitioned prefix (S3 user guide, "Best practices design patterns: optimizing
# Amazon S3 performance"): at least 3,500 PUT/COPY/POST/DELETE and 5,500 GET/HEAD per second. A round's objects
# share one prefix (runs/<run>/rounds/<round>/), so the round's requests are held to these.
S3_PUT_PER_PREFIX_PER_SECOND = 3_500.0
S3_GET_PER_PREFIX_PER_SECOND = 5_500.0
# One request's throughput. AWS states none (it advises parallel connections and 8-16 MB byte ranges). Assumed 85 MB/s,
# the figure usually quoted for one S3 connection from EC2 in the same region: it bounds ingest's one streamed GET
# of an update and each part of the global's server-side copy.
S3_REQUEST_BYTES_PER_SECOND = 85e6
# A small request's latency: "for small requests (for example, less than 512 KB), median latencies are often in the
# tens of milliseconds" (the same S3 guide, "Timeouts and retries for latency-sensitive applications"); 30 ms taken.
S3_SMALL_REQUEST_SECONDS = 0.030
# S3 data transfer out to the internet, us-east-1 list price for the first 10 TB a month: $0.09 per GB (counted as
# 10^9 bytes: an upper bound if billed per 2^30). Ingress is free; hosts in the bucket's region pay none.
S3_EGRESS_USD_PER_GB = 0.09
# Parts of a participant's multipart upload and ranges of its download: 8 MiB (participant.remote.PART_BYTES;
# a test keeps them equal), each one request; objects under two parts go in one.
TRANSFER_PART_BYTES = 8 * 1024**2
# The global's server-side copy to its content address (store.blobs.COPY_CONFIG; a test keeps them equal): one
# CopyObject up to 5 GB, else parts of 512 MiB, 8 in flight at once.
COPY_STREAMS = 8
COPY_PART_BYTES = 512 * 1024**2
COPY_THRESHOLD_BYTES = 5 * 1000**3
# The shard queue's delivery to the workers and the tick's look for their outcomes (about one a second,
# `shard_polls`): assumed 1 s a round.
DISPATCH_SECONDS = 1.0

_FLOAT_TAG = {2: "BF16", 4: "F32", 8: "F64"}
TOPK_PERCENT = 2.0  # "topk2" / "topk4": the run file's default share of each chunk (RunConfig.topk_percent)


def wire_ratio_of(encoding: Encoding | str, dtype_bytes: int) -> float:
    """Bytes sent over bytes of the dense model, for a model of `dtype_bytes` floats: an `Encoding` through
    `shared.compress.wire_ratio` (any encoding it knows), or "full" (a whole global model), "topk2", "topk4"."""
    if encoding == "full":
        return 1.0
    if isinstance(encoding, str) and encoding in ("topk2", "topk4"):
        encoding = Encoding.topk(TOPK_PERCENT, int(encoding[4:]))
    if dtype_bytes not in _FLOAT_TAG:
        raise ValueError(f"dtype bytes must be one of {sorted(_FLOAT_TAG)}, got {dtype_bytes}")
    enc = encoding if isinstance(encoding, Encoding) else Encoding.parse(encoding)
    numel = 1 << 30  # (a whole number of every encoding's blocks: the ratio of a large model, headers aside)
    return wire_ratio(Manifest({"w": TensorSpec(_FLOAT_TAG[dtype_bytes], (numel,))}), enc)


@dataclass(frozen=True)
class Platform:
    """Where the aggregation runs: the rates `aggregation_seconds` uses."""

    name: str
    network_bytes_per_second: float  # one worker's reads and writes of S3
    worker_bytes_per_second: float  # update bytes (dense: as decoded) one worker sums per second
    copy_bytes_per_second: float  # the global's write: completing the staged upload and copying it
    request_seconds: float  # one small request's latency
    dispatch_seconds: float
    cores: int = 0  # workers that truly run at once (0: as many as K)


LAMBDA = Platform("AWS Lambda", LAMBDA_NETWORK_BYTES_PER_SECOND, WORKER_UPDATE_BYTES_PER_SECOND,
                  COPY_STREAMS * S3_REQUEST_BYTES_PER_SECOND, S3_SMALL_REQUEST_SECONDS, DISPATCH_SECONDS)

# `make bench-big` on the dev machine (benchmarks/README.md, 2026-12-02 rows, after issue 44): 1,070 MB of fp32,
# 2 participants' weights, moto's server on the same two cores. Aggregation (the tick's whole `write_aggregate`)
# 10.4-11.5 s with K = 1 and 6.2-7.3 s with K = 2, of which the global's write 1.5-1.8 s.
BENCH_BIG_MODEL_BYTES = 1_070_000_000
BENCH_BIG_UPDATES = 2
BENCH_BIG_K1_SECONDS = (10.4, 11.5)
BENCH_BIG_K2_SECONDS = (6.2, 7.3)
BENCH_BIG_WRITE_SECONDS = (1.5, 1.8)
BENCH_BIG_CORES = 2


def _middle(span: tuple[float, float]) -> float:
    return (span[0] + span[1]) / 2


def dev_machine() -> Platform:
    """The dev machine as `make bench-big` measured it, from the K = 1 run alone: its per-worker rate is the update
    bytes over the K = 1 aggregation less the global's write (local S3 is the same machine: no network limit).
    K = 2 is then a prediction (tests/unit/test_cost_model_time.py checks it against the recorded range)."""
    write = _middle(BENCH_BIG_WRITE_SECONDS)
    summing = _middle(BENCH_BIG_K1_SECONDS) - write
    return Platform("dev machine (make bench-big)", math.inf,
                    BENCH_BIG_MODEL_BYTES * BENCH_BIG_UPDATES / summing,
                    BENCH_BIG_MODEL_BYTES / write, 0.0, 0.0, cores=BENCH_BIG_CORES)


@dataclass(frozen=True)
class Aggregation:
    seconds: float  # the tick's whole aggregation: dispatch, the slowest shard, the global's write
    shard_seconds: float  # one shard worker's
    write_seconds: float
    worker_gets: float  # ranged GETs by all workers
    worker_puts: float  # UploadParts and outcomes
    limit: str  # what bounds the shard's time, in words


def aggregation_seconds(platform: Platform, fragment_bytes: float, updates: int, workers: int, up_ratio: float,
                        down_ratio: float = 1.0) -> Aggregation:
    """One aggregation of `updates` updates of a `fragment_bytes` model (or fragment) by `workers` shard workers.

    Each worker reads its 1/K of every update (as sent: `up_ratio` of the dense bytes) and of the base global, and
    writes its 1/K of the new global (and of the download delta, where downloads are compressed); it sums the dense
    bytes at the worker rate. Its time is the largest of: its bytes over the network rate, its sums over the
    worker rate, its ranged GETs' latency (one per piece per group of `STREAMS` inputs), and the round's requests
    over S3's per-prefix rates. With fewer cores than workers, the workers take turns.
    """
    if workers < 1 or updates < 1:
        raise ValueError("workers and updates must be at least 1")
    pieces = max(1, math.ceil(fragment_bytes / PIECE_BYTES))
    k = min(workers, pieces)
    share = fragment_bytes / k
    rounds_of_workers = math.ceil(k / platform.cores) if platform.cores else 1
    written = share * (1 + (down_ratio if down_ratio < 1 else 0.0))
    moved = share * updates * up_ratio + share + written
    gets = pieces * (updates + 1) + k * (2 + updates)
    puts = pieces * (2 if down_ratio < 1 else 1) + k
    candidates = {
        f"Lambda network throughput: {moved / 1e9:,.2f} GB a worker ({updates} updates x {up_ratio:.3g} of "
        f"{fragment_bytes / 1e9:,.2f} GB / K={k}, the base and the result) at "
        f"{platform.network_bytes_per_second / 1e6:,.0f} MB/s": moved / platform.network_bytes_per_second,
        f"worker compute: {share * updates / 1e9:,.2f} GB of decoded updates a worker at "
        f"{platform.worker_bytes_per_second / 1e9:.2f} GB/s": share * updates / platform.worker_bytes_per_second,
        f"S3 request latency: {math.ceil(pieces / k) * math.ceil(updates / STREAMS)} ranged GETs in turn a worker at "
        f"{platform.request_seconds * 1000:.0f} ms": math.ceil(pieces / k) * math.ceil(updates / STREAMS)
        * platform.request_seconds,
    }
    if platform.request_seconds:  # (S3's own limits; the local server has none)
        candidates[f"S3 GET rate: {gets:,} GETs at {S3_GET_PER_PREFIX_PER_SECOND:,.0f}/s a prefix"] = (
            gets / S3_GET_PER_PREFIX_PER_SECOND)
        candidates[f"S3 PUT rate: {puts:,} PUTs at {S3_PUT_PER_PREFIX_PER_SECOND:,.0f}/s a prefix"] = (
            puts / S3_PUT_PER_PREFIX_PER_SECOND)
    limit, shard = max(candidates.items(), key=lambda c: c[1])
    # the write: one CopyObject (one request's rate) up to the threshold, else parts in parallel
    one_request = fragment_bytes < COPY_THRESHOLD_BYTES and platform.request_seconds > 0
    copy_rate = platform.copy_bytes_per_second / (COPY_STREAMS if one_request else 1)
    write = fragment_bytes / copy_rate
    if write > shard * rounds_of_workers:
        limit = (f"the global's write: {fragment_bytes / 1e9:,.2f} GB copied to its content address "
                 f"{'in one CopyObject' if one_request else 'in parts'} at {copy_rate / 1e6:,.0f} MB/s")
    seconds = platform.dispatch_seconds + shard * rounds_of_workers + write
    return Aggregation(seconds, shard, write, gets, puts, limit)


@dataclass(frozen=True)
class TimeAssumptions:
    ingest_memory_mb: int = 1769  # [deploy.ingest] memory_mb default
    worker_memory_mb: int = 1769  # [deploy.shard] memory_mb default
    tick_memory_mb: int = 1769  # [deploy.tick] memory_mb default: the aggregating tick waits for its shards
    egress_usd_per_gb: float = S3_EGRESS_USD_PER_GB  # 0 where the hosts are in the bucket's region

    def __post_init__(self) -> None:
        for name in ("ingest_memory_mb", "worker_memory_mb", "tick_memory_mb"):
            if not 128 <= getattr(self, name) <= LAMBDA_MAX_MEMORY_MB:
                raise ValueError(f"{name} must be 128 to {LAMBDA_MAX_MEMORY_MB} MB (Lambda's range)")


@dataclass(frozen=True)
class Phase:
    seconds: float
    usd: float
    limit: str  # what bounds its time, in words


@dataclass(frozen=True)
class RoundTime:
    """One round on AWS, phase by phase: seconds on the critical path and dollars for the whole round."""

    model_bytes: float
    participants: int
    workers: int
    upload_ratio: float
    download_ratio: float
    fragments: int
    upload_bytes: float  # one participant's, per round
    download_bytes: float
    upload: Phase
    ingest: Phase
    aggregation: Phase
    download: Phase
    over_lambda_timeout: str  # "" or which invocation would run past LAMBDA_TIMEOUT_SECONDS

    @property
    def phases(self) -> dict[str, Phase]:
        return {"upload": self.upload, "ingest": self.ingest, "aggregation": self.aggregation,
                "download": self.download}

    @property
    def seconds(self) -> float:
        return sum(p.seconds for p in self.phases.values())

    @property
    def usd(self) -> float:
        return sum(p.usd for p in self.phases.values())


def _parts(nbytes: float) -> int:
    return 1 if nbytes < 2 * TRANSFER_PART_BYTES else math.ceil(nbytes / TRANSFER_PART_BYTES)


def round_time(model_bytes: float, participants: int, workers: int, upload_ratio: float, download_ratio: float = 1.0,
               fragments: int = 1, upload_bytes_per_second: float = 125e6,
               download_bytes_per_second: float | None = None, a: TimeAssumptions = TimeAssumptions(),
               p: Prices = Prices()) -> RoundTime:
    """Seconds and dollars of one round of `participants` updates of a `model_bytes` model, each sent at
    `upload_ratio` of the dense bytes (`wire_ratio_of`), fetched at `download_ratio` (1: the whole global), one
    fragment in `fragments` synced a round, aggregated by `workers` shard workers on Lambda; the participants
    upload and download at the given speeds (bytes/s; download defaults to upload)."""
    if model_bytes <= 0 or participants < 1 or workers < 1 or fragments < 1:
        raise ValueError("model bytes, participants, workers and fragments must be positive")
    if not (0 < upload_ratio <= 2 and 0 < download_ratio <= 2):
        raise ValueError("wire ratios are bytes sent over dense bytes: between 0 and 2")
    if upload_bytes_per_second <= 0 or (download_bytes_per_second or 1) <= 0:
        raise ValueError("upload and download speeds must be positive")
    down_speed = download_bytes_per_second or upload_bytes_per_second
    n, frag = participants, model_bytes / fragments
    up, down = frag * upload_ratio, frag * download_ratio
    pieces = max(1, math.ceil(frag / PIECE_BYTES))
    gb = 1e9

    # Upload: each participant over its own link, at once; the round's parts held to S3's PUT rate. Free ingress.
    up_parts = _parts(up)
    up_puts = n * (up_parts + (2 if up_parts > 1 else 0))  # parts, and Create/Complete of each multipart upload
    link, rate = up / upload_bytes_per_second, n * up_parts / S3_PUT_PER_PREFIX_PER_SECOND
    upload = Phase(max(link, rate), up_puts * p.s3_put_per_1k / 1e3,
                   f"participants' upload: {up / gb:,.3f} GB at {upload_bytes_per_second / 1e6:,.0f} MB/s"
                   if link >= rate else f"S3 PUT rate: {n * up_parts:,} parts at "
                   f"{S3_PUT_PER_PREFIX_PER_SECOND:,.0f}/s a prefix")

    # Ingest of the last update (the others ran while it uploaded): it streams the object in one GET, reads an
    # encoded update again decoded by range, and reads the whole global (fragment) by range as the reference.
    delta = upload_ratio < 1 or download_ratio < 1
    ingest_bytes = up * (2 if upload_ratio < 1 else 1) + frag
    net = min(LAMBDA_NETWORK_BYTES_PER_SECOND, S3_REQUEST_BYTES_PER_SECOND)
    ingest_s = max(ingest_bytes / net, frag / WORKER_UPDATE_BYTES_PER_SECOND)
    ingest_gets = n * (1 + pieces * (2 if delta else 1))
    ingest_usd = (n * ingest_s * a.ingest_memory_mb / 1024 * p.lambda_gb_second + ingest_gets * p.s3_get_per_1k / 1e3
                  + n * (p.lambda_per_m + p.eventbridge_per_m + 2 * p.ddb_write_per_m) / 1e6)
    ingest = Phase(ingest_s, ingest_usd, f"ingest's reads: {ingest_bytes / gb:,.2f} GB (the update, the global) at "
                   f"{net / 1e6:,.0f} MB/s")

    # Aggregation: K workers, the tick waiting for them; then the global's write.
    agg = aggregation_seconds(LAMBDA, frag, n, workers, upload_ratio, download_ratio)
    k = min(workers, pieces)
    copy_parts = 1 if frag < COPY_THRESHOLD_BYTES else math.ceil(frag / COPY_PART_BYTES)
    agg_usd = ((k * agg.shard_seconds * a.worker_memory_mb + agg.seconds * a.tick_memory_mb) / 1024
               * p.lambda_gb_second + agg.worker_gets * p.s3_get_per_1k / 1e3
               + (agg.worker_puts + 2 + copy_parts) * p.s3_put_per_1k / 1e3
               + k * (p.lambda_per_m + 3 * p.sqs_per_m) / 1e6)
    aggregation = Phase(agg.seconds, agg_usd, agg.limit)

    # Download: every participant at once over its own link; its ranged GETs held to S3's GET rate; egress billed.
    down_parts = _parts(down)
    link, rate = down / down_speed, n * down_parts / S3_GET_PER_PREFIX_PER_SECOND
    egress = n * down / gb * a.egress_usd_per_gb
    download = Phase(max(link, rate), n * down_parts * p.s3_get_per_1k / 1e3 + egress,
                     f"participants' download: {down / gb:,.3f} GB at {down_speed / 1e6:,.0f} MB/s"
                     if link >= rate else f"S3 GET rate: {n * down_parts:,} GETs at "
                     f"{S3_GET_PER_PREFIX_PER_SECOND:,.0f}/s a prefix")

    over = ""
    if agg.seconds > LAMBDA_TIMEOUT_SECONDS:
        over = f"Lambda's 15-minute limit: the aggregating tick would wait {agg.seconds:,.0f} s for its shards"
    elif ingest_s > LAMBDA_TIMEOUT_SECONDS:
        over = f"Lambda's 15-minute limit: one ingest would take {ingest_s:,.0f} s"
    return RoundTime(model_bytes, n, k, upload_ratio, download_ratio, fragments, up, down, upload, ingest,
                     aggregation, download, over)


# --- `fed plan`: which K, encoding and F meet a target ----------------------------------------------------------

PLAN_ENCODINGS = ("weights", "bf16", "int8", "topk2", "topk4")  # topk at 2 % of each chunk, 2- or 4-bit values
PLAN_DOWNLOADS = {"weights": "full", "bf16": "bf16", "int8": "int8", "topk2": "topk2", "topk4": "topk4"}
PLAN_WORKERS = (1, 2, 4, 8, 16, 32, 64)  # up to [deploy.shard] reserved_concurrency's default (SHARD_RESERVED)
PLAN_FRAGMENTS = (1, 2, 4, 8, 16)


@dataclass(frozen=True)
class Candidate:
    encoding: str  # what participants upload
    download: str  # what they fetch ("full": the whole global)
    round: RoundTime

    def meets(self, target_seconds: float, target_usd: float) -> bool:
        return (not self.round.over_lambda_timeout and self.round.aggregation.seconds <= target_seconds
                and self.round.usd <= target_usd)


@dataclass(frozen=True)
class Plan:
    candidates: list[Candidate]  # every one computed
    shown: list[Candidate]  # per (encoding, F): the cheapest K that meets the targets, else the fastest
    pick: Candidate | None  # the cheapest that meets them
    why_not: str  # where none does: which limit stops the closest


def _encoding_name(kind: str) -> str:
    return {"topk2": "topk 2-bit", "topk4": "topk 4-bit", "full": "full"}.get(kind, kind)


def plan(model_bytes: float, participants: int, dtype_bytes: int = 2, upload_bytes_per_second: float = 125e6,
         download_bytes_per_second: float | None = None, target_seconds: float = 60.0, target_usd: float = 0.05,
         workers: tuple[int, ...] = PLAN_WORKERS, encodings: tuple[str, ...] = PLAN_ENCODINGS,
         fragments: tuple[int, ...] = PLAN_FRAGMENTS, download: str | None = None,
         a: TimeAssumptions = TimeAssumptions()) -> Plan:
    """Every (K, encoding, F) candidate's round, and the one with the fewest fragments, then the lowest cost, whose
    aggregation takes at most `target_seconds` and whose round costs at most `target_usd`."""
    out = []
    for enc in encodings:
        down = download or PLAN_DOWNLOADS.get(enc, enc)
        up_ratio, down_ratio = wire_ratio_of(enc, dtype_bytes), wire_ratio_of(down, dtype_bytes)
        for f in fragments:
            for k in workers:
                r = round_time(model_bytes, participants, k, up_ratio, down_ratio, f, upload_bytes_per_second,
                               download_bytes_per_second, a)
                if r.workers == k:  # (more workers than pieces is the same candidate as fewer)
                    out.append(Candidate(enc, down, r))
    # More fragments always divide a round's bytes, but each parameter is then synced only every F rounds: the
    # pick is the fewest fragments that meet the targets, then the cheapest.
    fits = [c for c in out if c.meets(target_seconds, target_usd)]
    pick = min(fits, key=lambda c: (c.round.fragments, c.round.usd, c.round.seconds)) if fits else None
    shown = []
    for enc in encodings:
        for f in fragments:
            group = [c for c in out if c.encoding == enc and c.round.fragments == f]
            good = [c for c in group if c.meets(target_seconds, target_usd)]
            if group:
                shown.append(min(good, key=lambda c: c.round.usd) if good
                             else min(group, key=lambda c: (c.round.aggregation.seconds, c.round.usd)))
    return Plan(out, shown, pick, "" if pick else _why_not(out, target_seconds, target_usd))


def _why_not(candidates: list[Candidate], target_seconds: float, target_usd: float) -> str:
    fast = [c for c in candidates if c.round.aggregation.seconds <= target_seconds and not c.round.over_lambda_timeout]
    if not fast:
        best = min(candidates, key=lambda c: c.round.aggregation.seconds)
        if best.round.over_lambda_timeout:
            return best.round.over_lambda_timeout
        return (f"no candidate aggregates in {target_seconds:g} s: the fastest ({_encoding_name(best.encoding)}, "
                f"K={best.round.workers}, F={best.round.fragments}) takes {best.round.aggregation.seconds:,.1f} s, "
                f"bound by {best.round.aggregation.limit}")
    cheap = min(fast, key=lambda c: c.round.usd)
    name, phase = max(cheap.round.phases.items(), key=lambda item: item[1].usd)
    r = cheap.round
    cause = (f"S3 egress: {r.participants} participants x {r.download_bytes / 1e9:,.3f} GB at "
             f"${S3_EGRESS_USD_PER_GB}/GB" if name == "download" else f"its {name}")
    return (f"no candidate that aggregates in {target_seconds:g} s costs ${target_usd:g} a round: the cheapest "
            f"({_encoding_name(cheap.encoding)}, K={r.workers}, F={r.fragments}) costs ${r.usd:.4f}, most of it "
            f"{cause} (${phase.usd:.4f})")


def plan_table(p: Plan) -> str:
    """The markdown table `fed plan` prints, and its verdict."""
    lines = [
        "| upload / download | F | K | upload s | ingest s | aggregation s | download s | round s | upload $ "
        "| ingest $ | aggregation $ | download $ (egress) | round $ | what bounds aggregation |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for c in p.shown:
        r = c.round
        mark = " **pick**" if c is p.pick else ""
        lines.append(
            f"| {_encoding_name(c.encoding)} / {_encoding_name(c.download)}{mark} | {r.fragments} | {r.workers} "
            f"| {r.upload.seconds:,.1f} | {r.ingest.seconds:,.1f} | {r.aggregation.seconds:,.1f} "
            f"| {r.download.seconds:,.1f} | {r.seconds:,.1f} | {r.upload.usd:.4f} | {r.ingest.usd:.4f} "
            f"| {r.aggregation.usd:.4f} | {r.download.usd:.4f} | {r.usd:.4f} | {r.aggregation.limit} |"
        )
    if p.pick is not None:
        r = p.pick.round
        verdict = (f"Pick: {_encoding_name(p.pick.encoding)} up, {_encoding_name(p.pick.download)} down, "
                   f"F={r.fragments}, K={r.workers}: aggregation {r.aggregation.seconds:,.1f} s, ${r.usd:.4f} a round "
                   f"({r.seconds:,.1f} s upload to download, training aside).")
    else:
        verdict = f"No candidate meets the targets: {p.why_not}."
    return "\n".join(lines) + "\n\n" + verdict


def plan_7b() -> str:
    """The plan docs/deploy.md shows: a 7 B-parameter bf16 model, 8 participants on 1 Gbit/s links."""
    return plan_table(plan(14e9, 8, dtype_bytes=2, upload_bytes_per_second=125e6))


if __name__ == "__main__":
    sys.stdout.write(table() + "\n\n" + aggregation_table() + "\n\n" + junk_line() + "\n\n" + plan_7b() + "\n")
