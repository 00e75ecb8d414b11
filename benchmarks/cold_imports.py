"""Cold starts: the wall time of importing each Lambda handler, and of `fed --help` and `fed-participant --help`, each
in a fresh interpreter, beside `python -c pass`.

Each target runs `--runs` times (default 5), one fresh process each, in turn (round-robin, so a burst of load on the
machine spreads over all of them): a handler is `python -c "import functions.<name>"` (every functions/<name>.py
with a module-level `handler`: what Lambda's init imports), a CLI is its console script in the venv with `--help`.
Prints, per target, the median, min and max seconds and the median against its target (0.5 s for a handler, 1 s
for a CLI's help) as a ratio; then, for the handler with the highest median, the packages that cost most by self
import time (`python -X importtime`, summed per top-level package, median of `--runs` runs). Not a test: nothing
here asserts (tests/unit/test_cold_imports.py guards *what* each imports).

    .venv/bin/python benchmarks/cold_imports.py [--runs 5] [--top 10]
"""

from __future__ import annotations

import argparse
import ast
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HANDLER_TARGET_S = 0.5
CLI_TARGET_S = 1.0


def handler_modules() -> list[str]:
    """functions.<name> for every functions/<name>.py that binds `handler` at module level (read, not imported)."""
    found = []
    for path in sorted((ROOT / "functions").glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            names = ([node.name] if isinstance(node, ast.FunctionDef) else
                     [t.id for t in node.targets if isinstance(t, ast.Name)] if isinstance(node, ast.Assign) else [])
            if "handler" in names:
                found.append(f"functions.{path.stem}")
                break
    return found


def cli_command(script: str, module: str) -> list[str]:
    """The console script beside this interpreter (what an operator runs), or its app called the same way."""
    installed = Path(sys.executable).parent / script
    if installed.exists():
        return [str(installed), "--help"]
    return [sys.executable, "-c", f"from {module} import app; app(['--help'], prog_name='{script}')"]


def run_once(command: list[str]) -> float:
    began = time.perf_counter()
    subprocess.run(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    return time.perf_counter() - began


def package_self_times(module: str) -> dict[str, float]:
    """Seconds of self import time per top-level package for one cold `import module` (`-X importtime`)."""
    out = subprocess.run([sys.executable, "-X", "importtime", "-c", f"import {module}"], cwd=ROOT,
                         capture_output=True, text=True, check=True)
    totals: dict[str, float] = defaultdict(float)
    for line in out.stderr.splitlines():
        if not line.startswith("import time:") or "self [us]" in line:
            continue
        self_us, _, name = line[len("import time:"):].split("|")
        totals[name.strip().split(".")[0]] += int(self_us) / 1e6
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5, help="fresh processes per target (default 5)")
    parser.add_argument("--top", type=int, default=10, help="packages to list for the heaviest handler (default 10)")
    args = parser.parse_args()

    targets: list[tuple[str, list[str], float | None]] = [("python -c pass", [sys.executable, "-c", "pass"], None)]
    targets += [(f"import {m}", [sys.executable, "-c", f"import {m}"], HANDLER_TARGET_S) for m in handler_modules()]
    targets += [("fed --help", cli_command("fed", "fed.cli"), CLI_TARGET_S),
                ("fed-participant --help", cli_command("fed-participant", "participant.cli"), CLI_TARGET_S)]

    times: dict[str, list[float]] = {label: [] for label, _, _ in targets}
    for _ in range(args.runs):
        for label, command, _ in targets:
            times[label].append(run_once(command))

    print(f"cold runs: {args.runs} fresh processes each, {os.cpu_count()} CPUs, Python {sys.version.split()[0]}")
    print(f"{'target':<32} {'median s':>9} {'min s':>7} {'max s':>7} {'target s':>9} {'median/target':>14}")
    for label, _, target in targets:
        t = times[label]
        median = statistics.median(t)
        ratio = f"{median / target:.2f}" if target else "(baseline)"
        print(f"{label:<32} {median:>9.3f} {min(t):>7.3f} {max(t):>7.3f} "
              f"{(f'{target:.1f}' if target else '-'):>9} {ratio:>14}")

    handlers = [(label, statistics.median(times[label])) for label, _, target in targets
                if target == HANDLER_TARGET_S]
    heaviest = max(handlers, key=lambda h: h[1])[0].removeprefix("import ")
    runs = [package_self_times(heaviest) for _ in range(args.runs)]
    packages = {p for r in runs for p in r}
    medians = sorted(((statistics.median(r.get(p, 0.0) for r in runs), p) for p in packages), reverse=True)
    total = statistics.median(sum(r.values()) for r in runs)
    print(f"\n{heaviest} (the heaviest handler): top {args.top} top-level packages by self import time "
          f"(median of {args.runs} runs of -X importtime; all imports: {total:.3f} s)")
    for seconds, package in medians[:args.top]:
        print(f"  {package:<28} {seconds:>7.3f} s")


if __name__ == "__main__":
    main()
