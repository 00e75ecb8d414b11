"""What a round costs on AWS in requests, from request counts per participant per round (compute excluded).

`python -m infra.cost_model` prints the table docs/deploy.md shows (a test keeps the two equal). Every
number below is an assumption, stated where it is used; prices are us-east-1 list prices as assumed here,
not fetched.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Prices:
    """USD, us-east-1 list prices (assumed; check the current ones before relying on a figure)."""

    s3_put_per_1k: float = 0.005  # S3 Standard PUT, COPY, POST, LIST
    s3_get_per_1k: float = 0.0004  # S3 Standard GET, SELECT (HEAD is billed as GET)
    ddb_read_per_m: float = 0.125  # DynamoDB on-demand read request unit
    ddb_write_per_m: float = 0.625  # DynamoDB on-demand write request unit
    lambda_per_m: float = 0.20  # Lambda requests (duration, i.e. compute, excluded)
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
    # The participant GETs the global model; ingest GETs each object it validates; aggregation GETs the update.
    s3_gets = 1 + uploads + 1
    usd = (
        s3_puts * p.s3_put_per_1k / 1e3
        + s3_gets * p.s3_get_per_1k / 1e3
        + read_units * p.ddb_read_per_m / 1e6
        + write_units * p.ddb_write_per_m / 1e6
        + uploads * p.lambda_per_m / 1e6
        + uploads * p.eventbridge_per_m / 1e6
    )
    return RoundCost(n, s3_puts, s3_gets, uploads, uploads, read_units, write_units, usd)


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
    sys.stdout.write(table() + "\n")
