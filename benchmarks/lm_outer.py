"""The LM task's rounds simulated in process, to compare outer (server) optimizers before a real run.

Each round every worker trains the round's global model with the task's own `train` (fresh AdamW, one pass over its
quarter of a random partition of the training chunks unless --steps), each update is sent in its encoding (--encodings:
`shared.compress`'s own code, each worker keeping its error feedback from round to round as a participant does) and
decoded, the updates are averaged, and the outer rule
(`shared.server_opt.ServerStep`, the coordinator's code; FedAvg: the average is the next model) makes the next global
model; the held-out loss is evaluated after each round. No stack, no files: what `make bench-learning`'s LM rows do
through `fed demo`, minus the protocol, so a grid of settings fits in minutes. Configurations run two at a time.

    .venv/bin/python benchmarks/lm_outer.py [--rounds 4] [--workers 4] [--seeds 0 1]
        [--inner-lr 0.0015 0.003] [--outer diloco:0.7:0.9 diloco:1.0:0.5 ...]
        [--encodings weights int8/256 topk/2/4096/82 ...]

Prints, per configuration, the held-out loss after each round and the mean final loss over the seeds.
"""

from __future__ import annotations

import argparse
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


@dataclass(frozen=True)
class Setting:
    outer: str  # "fedavg", or "diloco:<lr>:<momentum>"
    inner_lr: float
    seed: int
    encoding: str = "weights"  # shared.compress.Encoding's text: weights, bf16, int8/256, topk/BITS/CHUNK/KEEP

    @property
    def label(self) -> str:
        sent = "" if self.encoding == "weights" else f", {self.encoding}"
        if self.outer == "fedavg":
            return "FedAvg" + sent
        _, lr, momentum = self.outer.split(":")
        return f"DiLoCo lr {lr} mu {momentum}{sent}"


def simulate(s: Setting, rounds: int, workers: int, steps: int) -> list[float]:
    import numpy as np
    import torch

    from participant.tasks.lm import task
    from shared.compress import Encoding, decode_arrays, encode_delta
    from shared.config import RunConfig, ServerOptimizer
    from shared.server_opt import ServerStep

    torch.set_num_threads(1)
    config = RunConfig(run_id="sim", learning_rate=s.inner_lr, batch_size=16, local_epochs=1, local_steps=steps)
    step = None
    if s.outer != "fedavg":
        _, lr, momentum = s.outer.split(":")
        step = ServerStep(ServerOptimizer("diloco"), float(lr), float(momentum), 0.99, 1e-3)
    model = task.build_model(0)
    names = list(model.state_dict())

    def flat(m: torch.nn.Module) -> np.ndarray:
        return torch.cat([m.state_dict()[n].reshape(-1).float() for n in names]).numpy().copy()

    def load(vec: np.ndarray) -> torch.nn.Module:
        m = task.build_model(0)
        sd, at = m.state_dict(), 0
        for n in names:
            t = sd[n]
            t.copy_(torch.from_numpy(vec[at:at + t.numel()]).view_as(t))
            at += t.numel()
        return m

    def sent(w: int, trained: np.ndarray, base: np.ndarray) -> np.ndarray:
        """What the coordinator decodes of worker w's update in the encoding (w's error feedback kept)."""
        if not encoding.is_delta:
            return trained
        encoded, residuals[w] = encode_delta({"x": trained}, {"x": base}, encoding, residuals.get(w))
        return decode_arrays(encoded, {"x": base}, encoding)["x"]

    encoding = Encoding.parse(s.encoding)
    residuals: dict[int, dict[str, np.ndarray]] = {}
    x = flat(model)
    state = {"m": np.zeros_like(x)}  # the outer momentum (unused by FedAvg)
    share = task.train_size // workers
    losses = []
    for r in range(rounds):
        order = torch.randperm(task.train_size, generator=torch.Generator().manual_seed(1000 * s.seed + r)).tolist()
        updates = []
        for w in range(workers):
            m = load(x)
            task.train(m, order[w * share:(w + 1) * share], config, torch.device("cpu"),
                       seed=10_000 * s.seed + 100 * r + w)
            updates.append(sent(w, flat(m), x))
        average = np.asarray(np.mean(updates, axis=0, dtype=np.float64), np.float32)
        x = average if step is None else step.apply(x, average, state)
        losses.append(task.evaluate(load(x), torch.device("cpu"))["test_loss"])
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=0, help="inner steps a round (0: one pass over the share)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--inner-lr", type=float, nargs="+", default=[0.0015])
    parser.add_argument("--outer", nargs="+", default=["fedavg", "diloco:0.7:0.9", "diloco:1.0:0.5"])
    parser.add_argument("--encodings", nargs="+", default=["weights"], help="how updates are sent (each worker "
                        "keeps its error feedback): weights, bf16, int8/BLOCK, topk/BITS/CHUNK/KEEP")
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args()
    settings = [Setting(o, lr, seed, e) for lr in args.inner_lr for o in args.outer for e in args.encodings
                for seed in args.seeds]
    with ProcessPoolExecutor(args.jobs) as pool:
        futures = {s: pool.submit(simulate, s, args.rounds, args.workers, args.steps) for s in settings}
        results = {s: f.result() for s, f in futures.items()}
    print(f"\nLM task, {args.workers} workers x {args.rounds} rounds "
          f"({args.steps or 'one pass'} inner AdamW steps a round), held-out loss after each round:")
    print("| outer | inner lr | seed | " + " | ".join(f"round {r}" for r in range(args.rounds)) + " |")
    print("|---|---|---|" + "---|" * args.rounds)
    for s, losses in results.items():
        print(f"| {s.label} | {s.inner_lr:g} | {s.seed} | " + " | ".join(f"{v:.4f}" for v in losses) + " |")
    print("\nmean final held-out loss over the seeds:")
    for lr in args.inner_lr:
        for outer in args.outer:
            for e in args.encodings:
                finals = [results[Setting(outer, lr, seed, e)][-1] for seed in args.seeds]
                print(f"  {Setting(outer, lr, 0, e).label:<22} inner lr {lr:g}: {sum(finals) / len(finals):.4f}")


if __name__ == "__main__":
    main()
