"""`make bench-rounds`: the Flower anchor's exact work through `fed demo`, with the figures the anchor was measured by.

The work (/work/shared/anchors/flower-work.md, `participant.tasks.flower_digits`): scikit-learn's digits, 1347
training and 450 test examples, 4 IID shards, participant i training its own shard i every round (one epoch, batch
32, SGD 0.05 with momentum 0.9, the batch order from `1000 * round + shard`), FedAvg by examples over all 4, 15
rounds, no witnesses. `fed demo --task flower` runs it (the local stack and 4 `fed-participant` processes); this
script runs the same demo in its own process (`fed.demo.run_demo`, what `fed demo` calls) with the local server
counting requests, then prints:

- each round's test accuracy beside the recipe's (run directly in torch), and its seconds (`ended - started` of the
  coordinator's round record: from the tick that started the round to the tick that aggregated it);
- the median round, the 15 rounds (round 0's start to round 14's end), launch to the first round and the total
  wall time, each beside the polling-era figures of the same work and Flower's, as ratios;
- the AWS requests the local server answered, split by who sent them (the participant processes, or this process and
  its shard workers: the coordinator's functions, the local dispatcher and the demo's observer) and by service and
  operation, per participant per round: over the whole run, and in the steady state (round 0's start to the last
  round's end, without joining, warmup and the participants' exit).

A benchmark, not a test: nothing is asserted about time. It exits 1 if the run fails, if it did not aggregate 15
rounds of all 4 updates, or if the accuracy is not the recipe's (0.9289 after 15 rounds). A round the coordinator did
not aggregate (participants dropped meanwhile: its model is carried over and trained again) is shown and warned about.

    .venv/bin/python benchmarks/rounds.py [--out reports/bench-rounds.json] [--timeout 600]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PARTICIPANTS = 4  # the anchor's (participant.tasks.flower_digits_meta.SHARDS)
STACK = "stack"  # this process and its helpers: coordinator functions, dispatcher, shard workers, the demo's observer
PARTICIPANT = "participants"

# The same work measured before (2026-11-23, the anchor document): the project while participants polled the run
# state, and Flower 1.41's deployment engine on the same machine kind.
POLLING_MEDIAN_ROUND = 0.58
POLLING_FIFTEEN_ROUNDS = 9.1
POLLING_LAUNCH_TO_FIRST_ROUND = 10.9
FLOWER_LAUNCH_TO_FIRST_ROUND = 8.0
FLOWER_FIFTEEN_ROUNDS = (208.0, 332.0)


# --- who sent a request -----------------------------------------------------------------------------------
# The local server (its own process) sees one connection per request, so looking each sender up in /proc would slow
# the run it measures. Instead every socket this process connects to the loopback server, and every one its helper
# processes connect (the shard workers are spawned: they run this module's top level again, and so this patch), leaves
# from a second loopback address; the participant processes connect from 127.0.0.1 as usual. The server then tells
# them apart by the client's address alone (it keeps each request's: the demo's report carries them). Nothing else about
# the requests changes.

LOOPBACK = "127.0.0.1"
STACK_SOURCE = "127.0.0.2"
_connect = socket.socket.connect


def _connect_from_stack_source(self: socket.socket, address: Any) -> None:
    if self.family == socket.AF_INET and isinstance(address, tuple) and address[0] == LOOPBACK:
        try:
            self.bind((STACK_SOURCE, 0))
        except OSError:  # already bound by its owner: leave it as it is
            pass
    _connect(self, address)


socket.socket.connect = _connect_from_stack_source  # type: ignore[method-assign,assignment]


def sender(address: str) -> str:
    return STACK if address == STACK_SOURCE else PARTICIPANT


def process_started_at() -> float:
    """This process's start as epoch seconds: the kernel's start time (clock ticks since boot, 10 ms) set against
    the boot-time clock now (Linux); where that cannot be read, now."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        started_after_boot = int(fields[19]) / os.sysconf("SC_CLK_TCK")
        return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - started_after_boot)
    except (OSError, IndexError, ValueError, AttributeError):
        return time.time()


# --- the run ------------------------------------------------------------------------------------------------


def ratio(value: float, reference: float) -> str:
    return f"{value / reference:.3f}x"


def print_requests(title: str, counts: Counter[tuple[str, str]], divisor: float) -> float:
    """Print `counts / divisor` by service and operation under `title`; return the total / divisor."""
    total = sum(counts.values()) / divisor
    print(f"{title}: {total:.2f}")
    for (svc, op), n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        print(f"    {svc:<9} {op:<28} {n / divisor:8.2f}")
    return total


def check(report: dict[str, Any], rounds: int) -> tuple[list[dict[str, Any]], list[str]]:
    """The aggregated rounds (the anchor's rounds: a round not aggregated, e.g. with participants dropped as silent,
    carries its model over and is trained again as the same Flower round), and what differs from the anchor."""
    rows = report["rounds"]
    done = [r for r in rows if r["aggregated"]]
    accuracies = [round(r["accuracy"], 4) for r in done]
    problems = [f"round {r['round']}: {r['accepted']} of {PARTICIPANTS} updates counted" for r in done
                if r["accepted"] != PARTICIPANTS or r["participants"] != PARTICIPANTS]
    if len(done) != rounds:
        problems.append(f"{len(done)} rounds aggregated, expected {rounds}")
    if accuracies != list(meta().RECIPE_ACCURACIES)[: len(accuracies)]:
        problems.append("the accuracies differ from the recipe's (run directly in torch)")
    final = round(report["final_accuracy"], 4)
    if final != meta().FLOWER_ACCURACY:
        problems.append(f"final accuracy {final:.4f}, not Flower's and the recipe's {meta().FLOWER_ACCURACY:.4f}")
    return done, problems


def meta() -> Any:
    from participant.tasks import flower_digits_meta

    return flower_digits_meta


def print_rounds(rows: list[dict[str, Any]], done: list[dict[str, Any]]) -> None:
    """One line per round: its Flower round, accuracy beside the recipe's, seconds (or why it was not aggregated)."""
    recipe = list(meta().RECIPE_ACCURACIES)
    print(f"\nbench-rounds: the Flower anchor's work through fed demo ({PARTICIPANTS} participants, {len(done)} "
          f"aggregated rounds of {meta().TASK}; local data: participant p<i+1> trains shard i)")
    print(f"{'round':>5}  {'flower':>6}  {'test acc':>8}  {'recipe':>8}  {'seconds':>7}")
    aggregated = 0
    for r in rows:
        secs = r["ended"] - r["started"]
        if not r["aggregated"]:
            why = ", ".join(f"{p} ({reason})" for p, reason in sorted(r["dropped"].items()))
            print(f"{r['round']:>5}  {'-':>6}  {'-':>8}  {'-':>8}  {secs:7.3f}  not aggregated ({r['accepted']} "
                  f"updates){'; dropped: ' + why if why else ''}: its Flower round is trained again")
            continue
        acc, want = round(r["accuracy"], 4), recipe[aggregated] if aggregated < len(recipe) else float("nan")
        aggregated += 1
        print(f"{r['round']:>5}  {aggregated:>6}  {acc:8.4f}  {want:8.4f}  {secs:7.3f}"
              f"{'' if acc == want else '  differs'}")
    if len(done) < len(rows):
        print(f"warning: {len(rows) - len(done)} round(s) not aggregated; the figures below include the time they "
              "took except the median round, which is over the aggregated rounds")


def print_times(report: dict[str, Any], done: list[dict[str, Any]], events: list[Any], launched: float,
                called: float, returned: float) -> dict[str, float]:
    """The run's times beside the polling era's and Flower's; the figures printed."""
    rows = report["rounds"]
    first, last = rows[0], done[-1]
    median = statistics.median(r["ended"] - r["started"] for r in done)
    all_rounds = last["ended"] - first["started"]
    to_first = first["started"] - launched
    to_first_global = first["ended"] - launched
    wall = returned - launched
    low, high = FLOWER_FIFTEEN_ROUNDS
    print(f"\nfinal test accuracy {round(report['final_accuracy'], 4):.4f} (Flower {meta().FLOWER_ACCURACY:.4f})")
    print("definitions: a round's seconds = ended - started of its round record (the tick that selected its "
          "trainers to the tick that aggregated it); launch = this process's start (the kernel's process start "
          "time: python and its imports, then fed demo's run_demo); first round = round 0's start in its record "
          "(every participant has joined, been admitted and fetched the initial model, and the tick selected the "
          "round's trainers); total wall = launch to run_demo's return (the participants have exited, the stack "
          "has stopped)")
    print(f"median round           {median:7.3f} s   polling era {POLLING_MEDIAN_ROUND} s: "
          f"{ratio(median, POLLING_MEDIAN_ROUND)}")
    print(f"{len(done)} rounds              {all_rounds:7.2f} s   (round 0's start to round {last['round']}'s end)  "
          f"polling era {POLLING_FIFTEEN_ROUNDS} s: {ratio(all_rounds, POLLING_FIFTEEN_ROUNDS)};  Flower "
          f"{low:.0f}-{high:.0f} s: {all_rounds / high:.3f}-{all_rounds / low:.3f}x")
    print(f"launch to first round  {to_first:7.2f} s   polling era {POLLING_LAUNCH_TO_FIRST_ROUND} s: "
          f"{ratio(to_first, POLLING_LAUNCH_TO_FIRST_ROUND)};  Flower {FLOWER_LAUNCH_TO_FIRST_ROUND:.0f} s: "
          f"{ratio(to_first, FLOWER_LAUNCH_TO_FIRST_ROUND)}")
    joins = [at for at, who, _, _, path in events if who == PARTICIPANT and "/join/" in path]
    first_sent = min((at for at, who, *_ in events if who == PARTICIPANT), default=float("nan"))
    print(f"  of which: python and imports before run_demo {called - launched:.2f} s; to the participants' first "
          f"request (a participant reads the run's configuration first) {first_sent - launched:.2f} s; to the last "
          f"join request (sent once torch, the task and its shard are loaded) "
          f"{max(joins, default=float('nan')) - launched:.2f} s; to round 0's start {to_first:.2f} s; to the first "
          f"global model (round 0 aggregated) {to_first_global:.2f} s")
    print(f"total wall             {wall:7.2f} s   Flower's whole run {low:.0f}-{high:.0f} s: "
          f"{wall / high:.3f}-{wall / low:.3f}x")
    return {"median_round": median, "rounds_seconds": all_rounds, "launch_to_first_round": to_first,
            "launch_to_first_global": to_first_global, "wall": wall}


def print_request_counts(report: dict[str, Any], done: list[dict[str, Any]], events: list[Any]
                         ) -> tuple[dict[str, Counter[tuple[str, str]]], dict[str, Counter[tuple[str, str]]],
                                    float, float]:
    """Every request the local server answered, by sender and phase; per participant per round. Returns the
    counts (whole run, steady state) and the two per-round figures."""
    first, last = report["rounds"][0], done[-1]
    served = sum(n for _, _, n in report.get("requests", []))
    whole: dict[str, Counter[tuple[str, str]]] = defaultdict(Counter)
    steady: dict[str, Counter[tuple[str, str]]] = defaultdict(Counter)
    phases: dict[str, Counter[str]] = defaultdict(Counter)
    for at, who, svc, op, _ in events:
        whole[who][(svc, op)] += 1
        phase = "join" if at < first["started"] else "rounds" if at <= last["ended"] else "exit"
        phases[who][phase] += 1
        if phase == "rounds":
            steady[who][(svc, op)] += 1
    print(f"\nAWS requests answered by the local server: {served} (its /_fed/requests counts), by sender:")
    for who, what in ((PARTICIPANT, f"the {PARTICIPANTS} participant processes"),
                      (STACK, "this process and its shard workers: coordinator functions, local dispatcher, the "
                       "demo's observer")):
        ph = phases[who]
        print(f"  {what}: {sum(ph.values())} (joining and warmup {ph['join']}, the rounds {ph['rounds']}, after "
              f"the last round {ph['exit']})")
    divisor = PARTICIPANTS * len(done)  # the anchor's rounds (a round not aggregated adds requests, not a round)
    per_round = print_requests(f"\nper participant per round, whole run (the participants' requests / "
                               f"{PARTICIPANTS} / {len(done)} rounds)", whole[PARTICIPANT], divisor)
    per_round_steady = print_requests(
        f"per participant per round, steady state (sent between round 0's start and round {last['round']}'s end, / "
        f"{PARTICIPANTS} / {len(done)})", steady[PARTICIPANT], divisor)
    print_requests("the coordinator side (this process: functions, local dispatcher, demo observer) per round, steady "
                   "state", steady[STACK], len(done))
    return whole, steady, per_round, per_round_steady


def main() -> int:
    launched = process_started_at()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="Also write the figures and the demo's report here.")
    parser.add_argument("--timeout", type=float, default=600.0, help="Give up on the run after this many seconds.")
    args = parser.parse_args()

    from rich.console import Console

    from fed.demo import DemoFailed, DemoOptions, run_demo

    rounds = meta().ROUNDS
    opts = DemoOptions(participants=PARTICIPANTS, task="flower", rounds=rounds, count_requests=True,
                       timeout=args.timeout)
    called = time.time()
    try:
        report = run_demo(opts, Console())
    except DemoFailed as exc:
        print(f"bench-rounds: the run failed: {exc}", file=sys.stderr)
        return 1
    returned = time.time()
    # every request the server answered: (epoch seconds, sender, service, operation, the path of an S3 PutObject)
    events = [(t, sender(address), svc, op, path) for t, address, svc, op, path in report.pop("request_events")]
    rows = report["rounds"]
    done, problems = check(report, rounds)
    print_rounds(rows, done)
    if not done:
        print("bench-rounds FAILED: no round was aggregated", file=sys.stderr)
        return 1
    times = print_times(report, done, events, launched, called, returned)
    whole, steady, per_round, per_round_steady = print_request_counts(report, done, events)
    if not whole[PARTICIPANT]:
        problems.append("no request was counted from a participant process")

    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        figures = {
            "accuracies": [round(r["accuracy"], 4) for r in done],
            "round_seconds": [r["ended"] - r["started"] for r in done], "median_round": times["median_round"],
            "rounds_seconds": times["rounds_seconds"], "rounds_recorded": len(rows),
            "launch_to_first_round": times["launch_to_first_round"],
            "launch_to_first_global": times["launch_to_first_global"], "wall": times["wall"],
            "requests_per_participant_round": per_round,
            "steady_requests_per_participant_round": per_round_steady,
            "participant_requests": {f"{s} {o}": n for (s, o), n in sorted(whole[PARTICIPANT].items())},
            "participant_requests_steady": {f"{s} {o}": n for (s, o), n in sorted(steady[PARTICIPANT].items())},
            "stack_requests_steady": {f"{s} {o}": n for (s, o), n in sorted(steady[STACK].items())},
            "problems": problems, "report": report,
        }
        args.out.write_text(json.dumps(figures, indent=1) + "\n")
        print(f"figures and the demo's report: {args.out}")
    if problems:
        print("bench-rounds FAILED: " + "; ".join(problems), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
