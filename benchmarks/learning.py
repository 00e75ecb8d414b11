"""`make bench-learning`: what the server optimizers and data modes do to learning, each row a real run.

Every federated row is `fed demo` (the local stack and participant processes) with its own configuration;
the centralized row trains the same model with the same optimizer for the same total epochs on the whole
training set, in this process. Prints one table (final and best test accuracy or held-out loss, rounds to
0.95, bytes up and down per round, wall seconds) and writes each run's report JSON and PNG curves under
--out. Not a test: nothing here asserts; the targets are printed beside the figures.

Then the update encodings under DiLoCo's outer steps, side by side at the same tokens (issue 45): fp32 weights,
int8, topk at 2 and at 4 bits (and with topk downloads), Streaming DiLoCo with F = 4 (bf16 and topk), on the LM task
and on the tiny Hugging Face model (built from a config here, nothing downloaded), each a real `fed demo` run with
the same participants, rounds and inner steps. Their bytes are the sizes the participants' logs give for each file
they uploaded and fetched, not computed ones.

    .venv/bin/python benchmarks/learning.py [--rounds 15] [--participants 8] [--only digits|lm|encodings]
        [--enc-rounds 16] [--enc-steps 5] [--topk-percent 2] [--out DIR]
"""

from __future__ import annotations

import argparse
import io
import json
import re
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rich.console import Console  # noqa: E402

from fed.demo import DemoOptions, demo_config, run_demo  # noqa: E402
from shared.compress import Encoding, encode_delta  # noqa: E402
from shared.config import DataMode, ServerOptimizer  # noqa: E402

DIGITS_OPTIMIZERS = [(ServerOptimizer("none"), "FedAvg"), (ServerOptimizer("fedavgm"), "FedAvgM"),
                     (ServerOptimizer("fedadam"), "FedAdam")]
SPLITS = ["iid", "dirichlet:0.5"]
COMPRESSED = ["bf16", "int8"]  # update encodings compared with plain weights (FedAvg)


@dataclass
class Row:
    task: str
    setting: str
    optimizer: str
    final: float
    best: float
    to_target: str  # rounds until 0.95 accuracy (digits); "-" for the LM
    up_bytes: int  # uploaded per round, all participants
    down_bytes: int  # downloaded per participant per round (holding the previous global): the global or its delta
    wall: float
    metric: str = "accuracy"
    encoding: str = "weights"
    downloads: str = "full"


@dataclass
class OuterRow:
    """One run of DiLoCo with an update encoding: what each participant moved per outer step, and the loss."""

    task: str
    label: str
    encoding: str  # shared.compress.Encoding's text: weights, int8/256, topk/BITS/CHUNK/KEEP
    up: int  # bytes uploaded per participant per outer step (the update files, as the participants' logs give them)
    down: int  # bytes fetched per participant per outer step (the global model after an outer step, or its delta)
    peak: int  # the largest single transfer of a sync: one update up or one global (or delta) down
    final: float  # held-out loss of the final global model
    wall: float
    transfers: int  # uploads and downloads the figures come from


# The rows of the encodings' table: (label, the run's settings beyond DiLoCo's). Streaming DiLoCo syncs one of F
# fragments a round; a fragment travels as its delta, so "alone" is its closest to fp32 (bf16).
DILOCO_ENCODINGS: list[tuple[str, dict[str, Any]]] = [
    ("fp32", {"update_encoding": "weights"}),
    ("int8", {"update_encoding": "int8"}),
    ("topk 2-bit", {"update_encoding": "topk", "topk_bits": 2}),
    ("topk 4-bit", {"update_encoding": "topk", "topk_bits": 4}),
    ("topk 2-bit, topk down", {"update_encoding": "topk", "topk_bits": 2, "download_encoding": "topk"}),
    ("streaming F=4, bf16", {"update_encoding": "bf16", "fragments": 4}),
    ("streaming F=4, topk 2-bit", {"update_encoding": "topk", "topk_bits": 2, "fragments": 4}),
]
UPLOADED = re.compile(r"round (\d+): update uploaded \((\d+) bytes")
DOWNLOADED = re.compile(r"round (\d+): global model downloaded \((\d+) bytes")
TOPK_UP_TARGET = 30.0  # x fewer bytes up per outer step than fp32 (issue 45)
STREAMING_PEAK_TARGET = 3.5  # x lower peak bytes per sync than DiLoCo's (fp32), F = 4
LOSS_TARGET = 0.01  # final held-out loss at most 1 % above fp32 DiLoCo's


def transfers(logs: Path) -> tuple[list[int], list[int]]:
    """Every update upload's bytes, and every download's of a global model made by an outer step (not round 0's
    initial model), from the participants' logs (p1.log, p2.log, ...: the evaluator's is not a participant's)."""
    up: list[int] = []
    down: list[int] = []
    for log in sorted(logs.glob("p[0-9]*.log")):
        text = log.read_text(errors="replace")
        up += [int(m[2]) for m in UPLOADED.finditer(text)]
        down += [int(m[2]) for m in DOWNLOADED.finditer(text) if int(m[1]) > 0]
    return up, down


def diloco_encoding(task: str, label: str, args: argparse.Namespace, out: Path, **settings: Any) -> OuterRow:
    """A real `fed demo` run of DiLoCo with `settings` (the encoding), at the encodings' table's shared settings."""
    outer_lr, momentum = (float(v) for v in args.diloco.split(":"))
    name = f"{task}-diloco-{label.replace(' ', '-')}"
    run_id = re.sub(r"[^a-z0-9-]+", "-", f"learn-{name}")[:40].strip("-")
    task_settings: dict[str, Any] = {"learning_rate": args.lm_lr} if task == "lm" else {}
    config = demo_config(args.enc_participants, args.enc_rounds, run_id=run_id, task=task, witness_nodes=0,
                         server_optimizer=ServerOptimizer("diloco"), server_lr=outer_lr, server_momentum=momentum,
                         local_steps=args.enc_steps, work_sizing="equal", topk_percent=args.topk_percent,
                         topk_chunk=args.topk_chunk, **task_settings, **settings)
    workdir = out / name
    shutil.rmtree(workdir, ignore_errors=True)
    opts = DemoOptions(participants=args.enc_participants, config=config, report=out / f"{name}.json",
                       plot=out / f"{name}.png", timeout=900, workdir=workdir)
    started = time.monotonic()
    report = run_demo(opts, Console(file=io.StringIO()))
    wall = time.monotonic() - started
    up, down = transfers(workdir / "logs")
    if not up or not down:
        raise SystemExit(f"{name}: no transfers in the participants' logs under {workdir / 'logs'}")
    return OuterRow(task, label, str(config.encoding), round(sum(up) / len(up)), round(sum(down) / len(down)),
                    max(up + down), report["final_test_loss"], wall, len(up) + len(down))


def print_outer(rows: list[OuterRow], args: argparse.Namespace) -> None:
    """The encodings' table, and the targets met or missed against each task's fp32 row."""
    print(f"\nDiLoCo (outer lr:momentum {args.diloco}) by update encoding: {args.enc_participants} participants x "
          f"{args.enc_rounds} outer steps of {args.enc_steps} inner AdamW steps (LM lr {args.lm_lr:g}, HF the "
          f"task's), the same tokens in every row; topk {args.topk_percent:g} % of each chunk of {args.topk_chunk}, "
          "error feedback on; bytes from the participants' logs; this machine, one run each")
    print("| task | updates | encoding | up B/participant/step | down B/participant/step | peak B/sync "
          "| final held-out loss | s | up vs fp32 | loss vs fp32 |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        base = next((b for b in rows if b.task == r.task and b.label == "fp32"), None)
        ratio = f"{base.up / r.up:.1f}x" if base else "-"
        loss = f"{(r.final / base.final - 1) * 100:+.2f} %" if base else "-"
        print(f"| {r.task} | {r.label} | {r.encoding} | {r.up:,} | {r.down:,} | {r.peak:,} | {r.final:.4f} | "
              f"{r.wall:.0f} | {ratio} | {loss} |")
    for r in rows:
        base = next((b for b in rows if b.task == r.task and b.label == "fp32"), None)
        if base is None or r is base:
            continue
        change = r.final / base.final - 1
        loss = (f"final loss {change * 100:+.2f} % vs fp32 DiLoCo (target within {LOSS_TARGET * 100:g} %: "
                f"{'met' if change <= LOSS_TARGET else 'missed'})")
        if r.label.startswith("streaming"):
            lower = base.peak / r.peak
            print(f"{r.task} {r.label}: peak bytes per sync {lower:.2f}x lower than DiLoCo's (target >= "
                  f"{STREAMING_PEAK_TARGET:g}x: {'met' if lower >= STREAMING_PEAK_TARGET else 'missed'}); {loss}")
        elif r.label.startswith("topk"):
            fewer = base.up / r.up
            print(f"{r.task} {r.label}: {fewer:.1f}x fewer bytes up than fp32 (target >= {TOPK_UP_TARGET:g}x: "
                  f"{'met' if fewer >= TOPK_UP_TARGET else 'missed'}); {loss}")


def rounds_to(accuracies: list[float], target: float = 0.95) -> str:
    return next((str(i + 1) for i, a in enumerate(accuracies) if a >= target), f">{len(accuracies)}")


def federated(task: str, setting: str, optimizer: ServerOptimizer, label: str, args: argparse.Namespace,
              out: Path, **overrides: Any) -> Row:
    name = f"{task}-{setting.replace(':', '')}-{optimizer.value}"
    participants = args.participants if task == "digits" else args.lm_participants
    rounds = args.rounds if task == "digits" else args.lm_rounds
    local: dict[str, Any] = {"data_mode": DataMode.LOCAL, "dataset_size": 0} if setting != "assigned" else {}
    if task == "digits":  # the centralized row's SGD settings too
        local |= {"local_epochs": args.local_epochs, "batch_size": args.batch_size}
    encoding = str(overrides.get("update_encoding", "weights"))
    downloads = str(overrides.get("download_encoding", "full"))
    if encoding != "weights":
        name += f"-{encoding}"
    if downloads != "full":
        name += f"-down-{downloads}"
    run_id = re.sub(r"[^a-z0-9-]+", "-", f"learn-{name}")[:40].strip("-")
    config = demo_config(participants, rounds, run_id=run_id, task=task,
                         witness_nodes=0, server_optimizer=optimizer, **local, **overrides)
    opts = DemoOptions(participants=participants, config=config, report=out / f"{name}.json",
                       plot=out / f"{name}.png", split=None if setting == "assigned" else setting, timeout=3600)
    started = time.monotonic()
    report = run_demo(opts, Console(file=io.StringIO()))
    wall = time.monotonic() - started
    _, up = _sizes(task, config.encoding)
    rows = [r for r in report["rounds"] if r["aggregated"]]
    down = round(sum(r["download_bytes"] for r in rows) / max(1, len(rows)))  # measured in the bucket, each round
    if task == "lm":
        losses = [r["test_loss"] for r in rows]
        return Row(task, setting, label, report["final_test_loss"], min(losses), "-", up * participants, down,
                   wall, metric="held-out loss", encoding=encoding, downloads=downloads)
    accuracies = [r["accuracy"] for r in rows]
    return Row(task, setting, label, report["final_accuracy"], max(accuracies), rounds_to(accuracies),
               up * participants, down, wall, encoding=encoding, downloads=downloads)


def _sizes(task: str, encoding: Encoding) -> tuple[int, int]:
    """Bytes of the task's model file (what each participant downloads per round) and of one update in
    `encoding` (what each uploads: the same file's tensors encoded, metadata aside)."""
    from participant.compressed import native
    from participant.task import load_task
    from shared import wire

    model = load_task(demo_config(1, task=task).task).build_model(0)
    arrays = {n: native(t) for n, t in model.state_dict().items()}
    encoded, _ = encode_delta({n: a.copy() for n, a in arrays.items()}, arrays, encoding)
    return len(wire.encode(arrays)), len(wire.encode(encoded, encoding.metadata()))


def centralized(args: argparse.Namespace) -> Row:
    """The same MLP and SGD settings as the federated digits rows, 2 epochs per 'round', on all the data."""
    import torch

    from participant.tasks.digits import task

    torch.set_num_threads(1)
    config = demo_config(args.participants, args.rounds, task="digits", local_epochs=args.local_epochs,
                         batch_size=args.batch_size)
    model = task.build_model(0)
    started = time.monotonic()
    accuracies = []
    for r in range(args.rounds):
        task.train(model, range(task.train_size), config, torch.device("cpu"), seed=r)
        accuracies.append(task.evaluate(model, torch.device("cpu"))["test_accuracy"])
    return Row("digits", "centralized", f"SGD, {config.local_epochs} epochs/round", accuracies[-1], max(accuracies),
               rounds_to(accuracies), 0, 0, time.monotonic() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--participants", type=int, default=8)
    parser.add_argument("--local-epochs", type=int, default=5, help="digits: local epochs a round (and the "
                        "centralized row's epochs per round)")
    parser.add_argument("--batch-size", type=int, default=16, help="digits: SGD batch size (every row)")
    parser.add_argument("--lm-rounds", type=int, default=4)
    parser.add_argument("--lm-participants", type=int, default=4)
    parser.add_argument("--lm-steps", type=int, default=0, help="H inner steps a round (0: one pass, the demo's)")
    parser.add_argument("--lm-lr", type=float, default=0.0015, help="LM: inner AdamW learning rate (every row; "
                        "a held-out loss within 0.3 %% of the best lr for FedAvg and DiLoCo alike over "
                        "0.00075-0.006 in benchmarks/lm_outer.py's simulation, where the demo's 0.003 is too high "
                        "for both)")
    parser.add_argument("--diloco", default="1.0:0.5", help="LM: DiLoCo's outer learning rate and Nesterov momentum, "
                        "LR:MOMENTUM (the paper's 0.7:0.9 is for hundreds of rounds of H = 500 steps; over 4 rounds "
                        "of one pass its momentum overshoots: benchmarks/lm_outer.py)")
    parser.add_argument("--only", choices=["digits", "lm", "encodings"])
    parser.add_argument("--enc-tasks", nargs="+", choices=["lm", "hf"], default=["lm", "hf"],
                        help="encodings: the tasks of the DiLoCo-by-encoding rows")
    parser.add_argument("--enc-rows", nargs="+", help="encodings: only the rows of these labels (e.g. fp32 "
                        "'topk 2-bit'; the ratios need fp32's)")
    parser.add_argument("--enc-participants", type=int, default=2, help="encodings: participants of every row")
    parser.add_argument("--enc-rounds", type=int, default=16, help="encodings: DiLoCo's outer steps")
    parser.add_argument("--enc-steps", type=int, default=5, help="encodings: H inner steps per outer step")
    parser.add_argument("--topk-percent", type=float, default=2.0, help="encodings: topk's share of each chunk")
    parser.add_argument("--topk-chunk", type=int, default=4096, help="encodings: topk's elements per chunk")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out" / "learning")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[Row] = []

    def done(row: Row) -> None:
        rows.append(row)
        print(f"  {row.task} {row.setting} {row.optimizer}: final {row.final:.4f} best {row.best:.4f} "
              f"({row.wall:.0f} s)", flush=True)

    if args.only in (None, "digits"):
        done(centralized(args))
        for split in SPLITS:
            for optimizer, label in DIGITS_OPTIMIZERS:
                done(federated("digits", split, optimizer, label, args, args.out))
        for encoding in COMPRESSED:
            done(federated("digits", "iid", ServerOptimizer("none"), "FedAvg", args, args.out,
                           update_encoding=encoding))
        done(federated("digits", "iid", ServerOptimizer("none"), "FedAvg", args, args.out, update_encoding="int8",
                       download_encoding="int8"))
    if args.only in (None, "lm"):
        # DiLoCo's setting: H inner AdamW steps a round, outer Nesterov momentum; FedAvg takes the same steps
        lm: dict[str, Any] = {"local_steps": args.lm_steps, "learning_rate": args.lm_lr}
        outer_lr, momentum = (float(v) for v in args.diloco.split(":"))
        done(federated("lm", "assigned", ServerOptimizer("none"), "FedAvg", args, args.out, **lm))
        done(federated("lm", "assigned", ServerOptimizer("diloco"), "DiLoCo", args, args.out, server_lr=outer_lr,
                       server_momentum=momentum, **lm))
        for encoding in COMPRESSED:
            done(federated("lm", "assigned", ServerOptimizer("none"), "FedAvg", args, args.out,
                           update_encoding=encoding, **lm))
        done(federated("lm", "assigned", ServerOptimizer("none"), "FedAvg", args, args.out, update_encoding="int8",
                       download_encoding="int8", **lm))
    outer: list[OuterRow] = []
    if args.only in (None, "encodings"):
        for task in args.enc_tasks:
            for label, settings in DILOCO_ENCODINGS:
                if args.enc_rows and label not in args.enc_rows:
                    continue
                outer.append(diloco_encoding(task, label, args, args.out, **settings))
                r = outer[-1]
                print(f"  {task} DiLoCo {label}: final {r.final:.4f}, up {r.up:,} B ({r.wall:.0f} s)", flush=True)
    if rows:
        print_table(rows, args)
        (args.out / "table.json").write_text(json.dumps([r.__dict__ for r in rows], indent=1) + "\n")
    if outer:
        print_outer(outer, args)
        (args.out / "encodings.json").write_text(json.dumps([r.__dict__ for r in outer], indent=1) + "\n")


def print_table(rows: list[Row], args: argparse.Namespace) -> None:
    print(f"\nlearning: digits {args.participants} participants x {args.rounds} rounds (local data mode, "
          f"{args.local_epochs} local epochs of batch {args.batch_size}), "
          f"LM {args.lm_participants} participants x {args.lm_rounds} rounds (inner AdamW lr {args.lm_lr:g}; DiLoCo "
          f"outer lr:momentum {args.diloco}); this machine, one run each")
    print("| task | data | optimizer | updates | downloads | final | best | rounds to 0.95 | up B/round "
          "| down B/participant/round | s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r.task} | {r.setting} | {r.optimizer} | {r.encoding} | {r.downloads} | {r.final:.4f} | "
              f"{r.best:.4f} | {r.to_target} | {r.up_bytes:,} | {r.down_bytes:,} | {r.wall:.0f} |")
    for task, unit in (("digits", "accuracy"), ("lm", "held-out loss")):
        plain = next((r for r in rows if r.task == task and r.optimizer == "FedAvg" and r.encoding == "weights"
                      and r.setting in ("iid", "assigned")), None)
        for r in rows:
            if plain is not None and r.task == task and r.downloads != "full":
                print(f"{task} {r.downloads} downloads: {plain.down_bytes / r.down_bytes:.2f}x fewer bytes down per "
                      f"participant than the full global ({r.down_bytes:,} vs {plain.down_bytes:,})")
            if plain is not None and r.task == task and r.encoding != "weights" and r.downloads == "full":
                change = (f"{(r.final - plain.final) * 100:+.2f} points" if task == "digits"
                          else f"{(r.final / plain.final - 1) * 100:+.2f} %")
                print(f"{task} {r.encoding} updates: {plain.up_bytes / r.up_bytes:.2f}x fewer bytes up than weights, "
                      f"final {unit} {change} (target for int8: >= 3.5x, within "
                      f"{'0.5 point' if task == 'digits' else '2 %'})")
    base = next((r for r in rows if r.setting == "centralized"), None)
    if base is not None:
        for split in SPLITS:
            best = max((r for r in rows if r.setting == split), key=lambda r: r.final, default=None)
            if best is not None:
                target = 1.0 if split == "iid" else 3.0
                gap = (base.final - best.final) * 100
                print(f"{split}: best server optimizer {best.optimizer} {best.final:.4f}, {gap:+.2f} points below "
                      f"centralized {base.final:.4f} (target: within {target:.0f})")
    lm = {r.optimizer: r for r in rows if r.task == "lm" and r.encoding == "weights"}
    if len(lm) == 2:
        print(f"LM at equal rounds and bytes: FedAvg held-out loss {lm['FedAvg'].final:.4f}, DiLoCo "
              f"{lm['DiLoCo'].final:.4f} (target: DiLoCo lower)")


if __name__ == "__main__":
    main()
