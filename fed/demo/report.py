"""What the demo reports: a row per recorded round (its counts, the global model's evaluation on the task's
held-out set, the sizing of the round's work, the bytes a participant downloads), as the console prints it and as
the report JSON carries it with the run's configuration and final figures; the plot of the rows."""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from rich.console import Console

from fed.demo.errors import DemoFailed
from fed.demo.options import DemoOptions
from fed.demo.tasks import reports_loss
from fed.evaluation import EvaluationFailed, Evaluator
from fed.plot import PlotUnavailable, RoundPoint, write_png
from participant.tasks import lm_meta
from shared import keys
from shared.config import RunConfig
from shared.delta import MAX_INDEX_BYTES, DeltaIndex
from shared.state import RoundSummary, RunState
from store.blobs import Bucket, NotFound


@dataclass
class RoundRow:
    round: int
    participants: int
    accepted: int
    refused: int
    loss: float | None
    accuracy: float
    seconds: float
    aggregated: bool
    dropped: dict[str, str]
    witnesses: int = 0  # valid witness proofs received
    elected: int = 0  # witnesses elected
    test_loss: float | None = None  # held-out loss and perplexity: reported for the LM task only
    perplexity: float | None = None
    upload_bytes: int = 0  # the round's accepted update objects, summed (what its participants sent up)
    download_bytes: int = 0  # what a participant holding the previous global downloads for this round's
    # throughput sizing: each participant's share of the round (fraction of the plan's weight), its training seconds
    # (as its update says) and its seconds from the round's start to its upload
    shares: dict[str, float] = field(default_factory=dict)
    train_seconds: dict[str, float] = field(default_factory=dict)
    finished: dict[str, float] = field(default_factory=dict)
    started: float = 0.0  # the round's start and end, epoch seconds, as the coordinator recorded them
    ended: float = 0.0

    def report(self) -> dict[str, Any]:
        row = {"round": self.round, "participants": self.participants, "accepted": self.accepted,
               "refused": self.refused, "loss": self.loss, "accuracy": self.accuracy,
               "seconds": round(self.seconds, 3), "aggregated": self.aggregated, "dropped": self.dropped,
               "witnesses": self.witnesses, "download_bytes": self.download_bytes,
               "upload_bytes": self.upload_bytes, "shares": self.shares,
               "train_seconds": self.train_seconds, "participant_seconds": self.finished,
               "started": self.started, "ended": self.ended}
        if self.test_loss is not None:
            row.update(test_loss=self.test_loss, test_perplexity=self.perplexity)
        return row


HEADER = (f"{'round':>5}  {'participants':>12}  {'accepted':>8}  {'refused':>7}  {'proofs':>6}  {'loss':>8}  "
          f"{'test acc':>8}  {'seconds':>7}")
# The LM task: the held-out loss and perplexity of each round's global model where digits shows test accuracy
LOSS_HEADER = (f"{'round':>5}  {'participants':>12}  {'accepted':>8}  {'refused':>7}  {'proofs':>6}  {'loss':>8}  "
               f"{'test loss':>9}  {'perplexity':>10}  {'seconds':>7}")


def format_row(r: RoundRow) -> str:
    loss = f"{r.loss:8.4f}" if r.loss is not None else f"{'-':>8}"
    note = "" if r.aggregated else "  not aggregated"
    if r.dropped:
        note += "  dropped: " + ", ".join(f"{p} ({why})" for p, why in sorted(r.dropped.items()))
    proofs = f"{r.witnesses}/{r.elected}" if r.elected else "-"
    if r.test_loss is not None:
        ppl = f"{r.perplexity:10.3f}" if r.perplexity is not None else f"{'-':>10}"
        held_out = f"{r.test_loss:9.4f}  {ppl}"
    else:
        held_out = f"{r.accuracy:8.4f}"
    return (f"{r.round:>5}  {r.participants:>12}  {r.accepted:>8}  {r.refused:>7}  {proofs:>6}  {loss}  "
            f"{held_out}  {r.seconds:7.2f}{note}")


def format_sizing(r: RoundRow) -> str:
    """One round's sizing: each participant's share and its training seconds."""
    parts = [f"{p} {100 * share:.0f}% {r.train_seconds[p]:.2f}s" if p in r.train_seconds else f"{p} {100 * share:.0f}%"
             for p, share in sorted(r.shares.items())]
    return "       share, training seconds: " + ", ".join(parts)


def download_bytes(bucket: Bucket, run_id: str, round_no: int, model_digest: str, delta: bool = True) -> int:
    """What a participant holding the previous round's global model downloads to get this one: the delta's index
    and pieces where the round wrote a delta (`download_encoding`; not looked for unless `delta`), else the whole
    model."""
    raw = None
    if delta:
        try:
            raw = bucket.get(keys.delta_key(run_id, round_no, model_digest), MAX_INDEX_BYTES).data
        except NotFound:
            pass
    if raw is None:
        head = bucket.head(keys.global_key(run_id, round_no, model_digest))
        return int(head["ContentLength"]) if head else 0
    index = DeltaIndex.decode(raw, model_digest)
    sizes = (bucket.head(keys.delta_key(run_id, round_no, d)) for d in index.pieces)
    return len(raw) + sum(int(h["ContentLength"]) for h in sizes if h)


def evaluate(evaluator: Evaluator, round_no: int, model_digest: str) -> dict[str, float]:
    """The task's metrics of a global model on its held-out set; DemoFailed if the evaluator fails."""
    try:
        return evaluator.evaluate(round_no, model_digest)
    except EvaluationFailed as exc:
        raise DemoFailed(str(exc)) from exc


def round_row(summary: RoundSummary, evaluator: Evaluator, by_loss: bool = False, store: Any = None,
              delta: bool = True) -> RoundRow:
    """A recorded round as the demo reports it: the coordinator's summary, the evaluation of the global model it
    made and, with the run's `store`, the bytes to download it (a delta where the run writes them: `delta`) and each
    participant's training seconds."""
    evaluation = evaluate(evaluator, summary.round + 1, summary.global_digest)
    weight = sum(summary.shares.values())
    row = RoundRow(summary.round, len(summary.selected), len(summary.counted), len(summary.refused), summary.loss,
                   evaluation["test_accuracy"], summary.seconds, summary.aggregated, dict(summary.dropped),
                   summary.proofs, len(summary.witnesses),
                   shares={p: round(w / weight, 4) for p, w in sorted(summary.shares.items())} if weight else {},
                   finished=dict(summary.finished), started=summary.started, ended=summary.ended)
    if summary.global_digest and store is not None:
        row.download_bytes = download_bytes(store.rosters.bucket, store.run_id, summary.round + 1,
                                            summary.global_digest, delta)
    if store is not None:
        recorded = store.round_updates(summary.round)
        for pid in summary.shares:
            rec = recorded.get(pid)
            if rec is not None and rec.accepted:
                row.upload_bytes += rec.size
                if "train_seconds" in rec.metrics:
                    row.train_seconds[pid] = round(rec.metrics["train_seconds"], 3)
    if by_loss:
        row.test_loss = evaluation[lm_meta.METRIC]
        row.perplexity = evaluation.get("test_perplexity", math.exp(min(row.test_loss, 700.0)))
    return row


def sizing_summary(rows: list[RoundRow], speeds: dict[str, float]) -> dict[str, Any]:
    """Per participant: its throttle, and its mean share and training seconds in the first round (equal shares,
    nothing measured yet) and in the rounds after it (sized by the measured throughput)."""

    def mean(values: list[float]) -> float | None:
        return round(sum(values) / len(values), 4) if values else None

    first, later = rows[:1], rows[1:]
    out: dict[str, Any] = {}
    for pid, throttle in sorted(speeds.items()):
        out[pid] = {
            "throttle": throttle,
            "share_first_round": mean([r.shares[pid] for r in first if pid in r.shares]),
            "share_sized_rounds": mean([r.shares[pid] for r in later if pid in r.shares]),
            "train_seconds_first_round": mean([r.train_seconds[pid] for r in first if pid in r.train_seconds]),
            "train_seconds_sized_rounds": mean([r.train_seconds[pid] for r in later if pid in r.train_seconds]),
            "seconds_sized_rounds": mean([r.finished[pid] for r in later if pid in r.finished]),
        }
    return out


class RequestCounts(Protocol):
    """The local server's request counter (local.server): what the report's requests are read from."""

    def snapshot(self) -> Counter[tuple[str, str]]: ...

    def events(self) -> list[tuple[float, str, str, str, str, float, str]]: ...


def demo_report(config: RunConfig, opts: DemoOptions, rows: list[RoundRow], final: RunState,
                final_eval: dict[str, float], wall: float, killed: list[str], speeds: dict[str, float],
                counted: RequestCounts | None, timeline: dict[str, Any] | None = None) -> dict[str, Any]:
    """The report JSON: the configuration, a row per round, the final model's figures, the wall time, who was
    killed and throttled; with counted requests, every request the local server answered (and the `timeline`:
    start-up's milestones and every function invocation); with mixed speeds, the
    sizing per participant; for a task reported by its loss, the final held-out loss and perplexity."""
    report: dict[str, Any] = {
        "config": config.to_json_dict(),
        "rounds": [r.report() for r in rows],
        "final_accuracy": final_eval["test_accuracy"],
        "wall_seconds": round(wall, 2),
        "participants": opts.participants,
        "split": opts.split,
        "killed": killed,
        "aggregated_rounds": final.aggregated,
        "work_sizing": config.work_sizing.value,
        "throttles": speeds,
    }
    if counted is not None:  # every request the local server answered, by service and operation
        report["requests"] = [[svc, op, n] for (svc, op), n in sorted(counted.snapshot().items())]
        # and each request: [epoch seconds, client address, service, operation, S3 object path, seconds served,
        # access key id]
        report["request_events"] = [list(e) for e in counted.events()]
        if timeline is not None and timeline["invocations"] is not None:
            # start-up's milestones, and each invocation: [function, object key, began, ended] (`local.dispatcher`)
            report["timeline"] = {"marks": timeline["marks"], "invocations": [list(s) for s in timeline["invocations"]]}
    if opts.mixed_speeds:
        report["sizing"] = sizing_summary(rows, speeds)
    if reports_loss(config.task):
        report.update(final_test_loss=final_eval["test_loss"], final_perplexity=final_eval["test_perplexity"])
    return report


def print_sizing(console: Console, summary: dict[str, Any]) -> None:
    """The mixed-speeds summary: each participant's share and training seconds, first round and sized rounds."""
    console.print("per participant (first round: equal shares; later rounds: sized by measured throughput):")
    for pid, row in summary.items():
        console.print(f"  {pid}: throttle {row['throttle']:g}, share {_pct(row['share_first_round'])} -> "
                      f"{_pct(row['share_sized_rounds'])}, training {_secs(row['train_seconds_first_round'])}"
                      f" -> {_secs(row['train_seconds_sized_rounds'])} a round")


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def _secs(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}s"


def write_report(report: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")


def plot_rounds(rows: list[RoundRow], path: Path, title: str, by_loss: bool, console: Console) -> None:
    """A PNG of the rows' curves (held-out loss for a task reported by its loss, else accuracy); where no plot can
    be drawn, a line that says why: the run itself succeeded."""
    points = [RoundPoint(r.round, r.loss, r.accuracy, r.seconds, r.aggregated, r.test_loss) for r in rows]
    try:
        write_png(points, path, title, metric="test_loss" if by_loss else "accuracy")
    except PlotUnavailable as exc:
        console.print(f"[yellow]no plot:[/] {exc}")


def headline(final_eval: dict[str, float], by_loss: bool) -> str:
    """The final model's figures as the closing line says them."""
    if by_loss:
        return (f"final held-out loss {final_eval['test_loss']:.4f} (perplexity "
                f"{final_eval['test_perplexity']:.2f}, next-token accuracy {final_eval['test_accuracy']:.4f})")
    return f"final test accuracy {final_eval['test_accuracy']:.4f}"
