"""The witness rule's two error rates on digits, measured in this process (no stack): honest updates refused, and
poisoned updates (the honest change sign-flipped and scaled, under the norm bound) attested.

Each setting trains `--participants` participants for `--rounds` rounds of FedAvg on their own part of the training
set (`iid` or `dirichlet:0.5`, as `fed demo --split` gives them), with the demo's digits settings. Every round a
witness judges (1) the honest updates, with `participant.witness_eval.RoundWitness.evaluate`, the code a witness runs,
and (2) the same round with one participant's update replaced by `global - scale x (trained - global)`, for each
scale. Only honest updates are aggregated, so the run is the run without an attacker. Prints, per setting, the
cosine and leave-one-out loss ratio distributions of honest and poisoned updates and both error rates at the
configured thresholds. Not a test: nothing here asserts.

    .venv/bin/python benchmarks/witness_errors.py [--rounds 20] [--participants 5] [--scales 1,2,5]
        [--local-epochs N] [--learning-rate LR] [--victim-share 0.1]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from fed.demo import DEMO_TASKS  # noqa: E402
from participant.splits import partition  # noqa: E402
from participant.tasks import digits_meta  # noqa: E402
from participant.tasks.digits import Digits  # noqa: E402
from participant.tensors import save_model_file  # noqa: E402
from participant.witness_eval import Check, RoundWitness  # noqa: E402
from shared.config import RunConfig  # noqa: E402

SPLITS = {"iid": None, "dirichlet:0.5": 0.5}


def config(args: argparse.Namespace) -> RunConfig:
    training = {k: v for k, v in (("local_epochs", args.local_epochs), ("learning_rate", args.learning_rate))
                if v is not None}
    return RunConfig(run_id="bench-witness", **{**DEMO_TASKS["digits"].settings, **training,
                                                "witness_tolerance": args.tolerance,
                                                "witness_min_cosine": args.min_cosine})


def judge(task: Digits, cfg: RunConfig, workdir: Path, base: dict[str, torch.Tensor], base_path: Path,
          updates: dict[str, dict[str, torch.Tensor]], samples: dict[str, int]) -> RoundWitness:
    """One witness's verdicts on a round of updates (every one verified)."""
    w = RoundWitness(0, "", workdir)
    for pid, tensors in updates.items():
        path = save_model_file(tensors, workdir / f"{pid}.safetensors")
        w.checks[pid] = Check(pid, pid, samples[pid], "", path)
    model = task.build_model(0)
    model.load_state_dict(base)
    global_loss = task.evaluate(model, torch.device("cpu"))["test_loss"]
    w.evaluate(task, torch.device("cpu"), cfg.seed, base_path, global_loss, cfg.witness_tolerance, list(updates),
               min_cosine=cfg.witness_min_cosine)
    return w


def relative(w: RoundWitness) -> dict[str, float]:
    """Each update's leave-one-out loss ratio over the median of the others' ratios."""
    ratios = {p: w.aggregate_loss / v.loss_without for p, v in w.verdicts.items() if v.loss_without}
    return {p: r / statistics.median(x for q, x in ratios.items() if q != p) for p, r in ratios.items()}


def run_setting(split: str, args: argparse.Namespace, out: dict[str, Any]) -> None:
    task, cfg = Digits(), config(args)
    labels = task._data[1].numpy()
    parts = partition(labels, args.participants, SPLITS[split], seed=digits_meta.SPLIT_SEED)
    pids = [f"p{i}" for i in range(args.participants)]
    model = task.build_model(cfg.seed)
    honest_stats: list[tuple[float, float, float]] = []  # (cosine, loss ratio, relative) of every honest update
    poisoned_stats: dict[float, list[tuple[float, float, float]]] = {s: [] for s in args.scales}
    false_refusals = judged = 0
    evaluation_seconds: list[float] = []
    detected = {s: 0 for s in args.scales}
    accuracy = 0.0
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            base = {n: t.detach().clone() for n, t in model.state_dict().items()}
            base_path = save_model_file(base, Path(tmp) / "global.safetensors")
            trained: dict[str, dict[str, torch.Tensor]] = {}
            for i, pid in enumerate(pids):
                local = task.build_model(cfg.seed)
                local.load_state_dict(base)
                task.train(local, parts[i].tolist(), cfg, torch.device("cpu"), seed=1000 * r + i)
                trained[pid] = {n: t.detach().clone() for n, t in local.state_dict().items()}
            samples = {pid: len(parts[i]) for i, pid in enumerate(pids)}
            w = judge(task, cfg, Path(tmp) / f"h{r}", base, base_path, trained, samples)
            evaluation_seconds.append(w.evaluation_seconds)
            for pid, v in w.verdicts.items():
                judged += 1
                false_refusals += not v.attested
                ratio = w.aggregate_loss / v.loss_without if v.loss_without else float("nan")
                honest_stats.append((w.cosines.get(pid, float("nan")), ratio, relative(w).get(pid, float("nan"))))
            victim = pids[r % len(pids)]
            honest_change, poisoned_samples = trained[victim], dict(samples)
            if args.victim_share < 1:  # as a throughput-sized plan gives a host that reports itself slow
                few = parts[pids.index(victim)][: max(1, int(args.victim_share * samples[victim]))].tolist()
                local = task.build_model(cfg.seed)
                local.load_state_dict(base)
                task.train(local, few, cfg, torch.device("cpu"), seed=1000 * r + 999)
                honest_change, poisoned_samples[victim] = local.state_dict(), len(few)
            for scale in args.scales:
                flipped = {n: base[n] - scale * (t - base[n]) if t.is_floating_point() else t
                           for n, t in honest_change.items()}
                p = judge(task, cfg, Path(tmp) / f"p{r}-{scale}", base, base_path, {**trained, victim: flipped},
                          poisoned_samples)
                v = p.verdicts[victim]
                detected[scale] += not v.attested
                ratio = p.aggregate_loss / v.loss_without if v.loss_without else float("nan")
                poisoned_stats[scale].append((p.cosines.get(victim, float("nan")), ratio,
                                              relative(p).get(victim, float("nan"))))
            total = sum(samples.values())
            model.load_state_dict({n: sum(trained[p][n] * (samples[p] / total) for p in pids)
                                   if base[n].is_floating_point() else base[n] for n in base})
            accuracy = task.evaluate(model, torch.device("cpu"))["test_accuracy"]
            refused = [pid for pid, v in w.verdicts.items() if not v.attested]
            cosines = " ".join(f"{w.cosines.get(p, float('nan')):.2f}" for p in pids)
            print(f"  {split} round {r}: accuracy {accuracy:.3f}; honest cosines {cosines}"
                  f"{'; refused ' + ', '.join(refused) if refused else ''}", flush=True)
    out[split] = dict(judged=judged, false_refusals=false_refusals, rounds=args.rounds, accuracy=accuracy,
                      detected={s: detected[s] for s in args.scales}, seconds=time.perf_counter() - started,
                      honest=honest_stats, poisoned=poisoned_stats,
                      evaluation=statistics.median(evaluation_seconds))


def spread(values: list[float]) -> str:
    values = sorted(v for v in values if v == v)
    if not values:
        return "-"
    q = statistics.quantiles(values, n=20) if len(values) > 1 else [values[0]] * 19
    return (f"min {values[0]:.3f}  p5 {q[0]:.3f}  median {statistics.median(values):.3f}  p95 {q[-1]:.3f}  "
            f"max {values[-1]:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--participants", type=int, default=5)
    parser.add_argument("--scales", type=lambda s: [float(x) for x in s.split(",")], default=[1.0, 2.0, 5.0])
    defaults = RunConfig(run_id="defaults")
    parser.add_argument("--tolerance", type=float, default=defaults.witness_tolerance)
    parser.add_argument("--min-cosine", type=float, default=defaults.witness_min_cosine)
    parser.add_argument("--only", choices=sorted(SPLITS))
    parser.add_argument("--victim-share", type=float, default=1.0,
                        help="the poisoned participant trains and reports this fraction of its samples (a small "
                             "throughput-sized share, e.g. 0.1)")
    parser.add_argument("--local-epochs", type=int, help="instead of the demo's (e.g. 20: fed demo --mixed-speeds)")
    parser.add_argument("--learning-rate", type=float, help="instead of the demo's")
    args = parser.parse_args()
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for split in SPLITS:
        if args.only in (None, split):
            run_setting(split, args, out)
    cfg = config(args)
    print(f"\nwitness_min_cosine {args.min_cosine:g}, witness_tolerance {args.tolerance:g}, "
          f"{args.participants} participants, {args.rounds} rounds, {cfg.local_epochs} local epochs at learning rate "
          f"{cfg.learning_rate:g}")
    for split, o in out.items():
        print(f"{split}: final accuracy {o['accuracy']:.3f} ({o['seconds']:.0f} s; a witness's judgement of a round: "
              f"median {o['evaluation']:.3f} s)")
        print(f"  honest:   {o['false_refusals']} of {o['judged']} refused "
              f"({o['false_refusals'] / max(1, o['judged']):.1%})")
        print(f"            cosine      {spread([c for c, _, _ in o['honest']])}")
        print(f"            loss ratio  {spread([r for _, r, _ in o['honest']])}")
        print(f"            relative    {spread([r for _, _, r in o['honest']])}")
        for scale, stats in o["poisoned"].items():
            print(f"  poisoned x{scale:g}: {o['detected'][scale]} of {o['rounds']} refused "
                  f"({o['detected'][scale] / max(1, o['rounds']):.0%})")
            print(f"            cosine      {spread([c for c, _, _ in stats])}")
            print(f"            loss ratio  {spread([r for _, r, _ in stats])}")
            print(f"            relative    {spread([r for _, _, r in stats])}")


if __name__ == "__main__":
    main()
