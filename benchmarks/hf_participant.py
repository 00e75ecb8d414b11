"""`make bench-hf`: the Hugging Face task inside the participant against the same training loop run bare.

Both rows train the same model on the same sequences (the help text, `sequence_length` 128, batches of 16) with the
same code (`participant.tasks.hf.HfTask.train`), on this host's device (bf16 autocast on CUDA):

- bare: the loop alone, in this process, one round's sequences (one torch thread on a CPU, as each participant);
- participant: `fed demo --task hf --participants 1` for --rounds rounds, the local stack and a real participant
  process: tokens per second of its training (the round's tokens / the training seconds its update reports), and
  the seconds its downloads of the global model and uploads of its update took (its log).

Prints the ratio participant / bare (the goal: the participant's loop loses at most 5 % of tokens/s) and the
update's bytes. Sizes: `tiny` (the demo's 0.2 M-parameter Llama; for a CPU) or `0.5b` (a ~0.5 B-parameter Llama from
a config, not pre-trained; for a GPU host: `--size 0.5b`). Not a test: nothing here asserts.

    .venv/bin/python benchmarks/hf_participant.py [--size tiny|0.5b] [--rounds 3] [--adapter none|lora]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rich.console import Console  # noqa: E402

from fed.demo import DemoOptions, demo_config, run_demo  # noqa: E402

SIZES: dict[str, dict[str, Any]] = {
    "tiny": {},  # hf_tiny's defaults: vocab 1,024, width 64, 2 layers, 4 heads, pre-trained
    "0.5b": {"vocab": 8192, "width": 1536, "layers": 20, "heads": 12, "pretrain_steps": 0},  # ~0.5 B parameters
}


def model_dir(size: str, cache: Path) -> Path:
    from participant.tasks import hf_tiny

    return hf_tiny.build(cache / f"bench-{size}", **SIZES[size])


def bare(config: Any, rounds: int) -> tuple[float, int]:
    """Tokens per second of the task's training loop alone over `rounds` rounds' sequences, and the parameters."""
    import torch

    from participant.task import load_task, mixed_precision
    from participant.training import resolve_device

    device = resolve_device("auto")
    if device.type == "cpu":
        torch.set_num_threads(1)  # (each demo participant trains with one thread)
    task: Any = load_task(config.task, config)
    model = task.build_model(config.seed)
    indices = list(range(task.train_size))
    task.train(model, indices[: config.batch_size * 2], config, device, seed=0, round_no=0)  # warm up the device
    rates = []
    for r in range(rounds):
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        with mixed_precision(device):
            task.train(model, indices, config, device, seed=r, round_no=r)
        if device.type == "cuda":
            torch.cuda.synchronize()
        rates.append(len(indices) * config.hf.sequence_length / (time.perf_counter() - started))
    return statistics.median(rates), sum(p.numel() for p in model.parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--adapter", choices=["none", "lora"], default="none")
    parser.add_argument("--out", type=Path, default=Path("reports/bench-hf"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    source = model_dir(args.size, Path(tempfile.gettempdir()) / "fed-bench-models")
    config = demo_config(1, args.rounds, task="hf", model=str(source), adapter=args.adapter, run_id="bench-hf")
    bare_rate, parameters = bare(config, args.rounds)

    report_file, workdir = args.out / f"{args.size}-{args.adapter}.json", args.out / f"{args.size}-{args.adapter}"
    shutil.rmtree(workdir, ignore_errors=True)
    run_demo(DemoOptions(participants=1, rounds=args.rounds, task="hf", model=str(source), adapter=args.adapter,
                         report=report_file, timeout=3600, workdir=workdir), Console(quiet=True))
    report = json.loads(report_file.read_text())
    tokens = config.dataset_size * config.hf.sequence_length
    rows = report["rounds"]
    rate = statistics.median(tokens / r["train_seconds"]["p1"] for r in rows if "p1" in r["train_seconds"])
    log = (workdir / "logs" / "p1.log").read_text()
    down = [float(s) for s in re.findall(r"global model downloaded \(\d+ bytes, ([\d.]+)s\)", log)]
    up = [float(s) for s in re.findall(r"update uploaded \(\d+ bytes, \d+ samples, ([\d.]+)s\)", log)]
    print(f"model {args.size} ({parameters / 1e6:.1f} M parameters, adapter {args.adapter}), {args.rounds} rounds of "
          f"{tokens:,} tokens")
    print(f"  bare loop:    {bare_rate:12,.0f} tokens/s")
    print(f"  participant:  {rate:12,.0f} tokens/s   ratio {rate / bare_rate:.3f} (goal >= 0.95)")
    print(f"  download of the global model: median {statistics.median(down):.2f} s over {len(down)}; upload of the "
          f"update ({rows[-1]['upload_bytes']:,} bytes): median {statistics.median(up):.2f} s over {len(up)}")


if __name__ == "__main__":
    main()
