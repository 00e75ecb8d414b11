"""`make bench-rounds`: the Flower anchor's exact work through `fed demo`, with the figures the anchor was measured by,
where the time goes, and each figure beside the last recorded one.

The work (/work/shared/anchors/flower-work.md, `participant.tasks.flower_digits`): scikit-learn's digits, 1347
training and 450 test examples, 4 IID shards, participant i training its own shard i every round (one epoch, batch
32, SGD 0.05 with momentum 0.9, the batch order from `1000 * round + shard`), FedAvg by examples over all 4, 15
rounds, no witnesses. `fed demo --task flower` runs it (the local stack and 4 `fed-participant` processes); this
script runs the same demo in its own process (`fed.demo.run_demo`, what `fed demo` calls) with the local server
keeping every request and the dispatcher every invocation, then prints:

- each round's test accuracy beside the recipe's (run directly in torch), and its seconds (`ended - started` of the
  coordinator's round record: from the tick that started the round to the tick that closed it);
- the start-up, phase by phase on its critical path: imports, the stack's start, the participants' start (the
  zygote's imports, then the forks), their joins, the admission (the commit that starts the epoch), the first fetch
  of the initial model and the tick that starts round 0;
- a round, step by step (median over the steady rounds, seconds from the round's start): the tick's commit and push
  (it aggregates the round before), the participants' fetch of the global, their uploads, the delivery of each
  upload's event and its ingest, the last ingest (with the tick that closes the round), and what the local server
  spent answering the round's requests;
- the median round, the 15 rounds, launch to the first round and the whole run, beside Flower's (a run of the same
  work in this session with `--flower FILE`, else the last recorded Flower run, else the anchor document's) with the
  issue's targets, and beside the last recorded figures (benchmarks/rounds_recorded.json) as ratios;
- the AWS requests per round in the steady state by caller: the participants, each coordinator function, the shard
  workers, the event delivery (EventBridge and Lambda's pollers: the local dispatcher) and the demo's observer
  (not part of the system: it watches the run to print it).

A benchmark, not a test: nothing is asserted about time. It exits 1 if the run fails, if it did not aggregate 15
rounds of all 4 updates, or if the accuracy is not the recipe's (0.9289 after 15 rounds). A round the coordinator did
not aggregate (participants dropped meanwhile: its model is carried over and trained again) is shown and warned about.

    .venv/bin/python benchmarks/rounds.py [--out reports/bench-rounds.json] [--flower flower.json] [--record]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import sys
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PARTICIPANTS = 4  # the anchor's (participant.tasks.flower_digits_meta.SHARDS)
PARTICIPANT, STACK, SHARD_WORKERS = "participants", "stack", "shard workers"  # who sent a request, by address
EVALUATOR = "the demo's evaluator"  # (a helper forked from the zygote, as the participants are, with its own key)
RECORDED = ROOT / "benchmarks" / "rounds_recorded.json"  # the last recorded figures (`--record` writes them)

# The same work measured before (2026-11-23, the anchor document): the project while participants polled the run
# state, and Flower 1.41's deployment engine on the same machine kind (its fastest figures of several days). A Flower
# run in the same session (`--flower`) replaces them.
POLLING = {"median_round": 0.58, "rounds_seconds": 9.1, "launch_to_first_round": 10.9}
FLOWER_ANCHOR = {"median_round": 12.6, "rounds_seconds": 208.0, "launch_to_first_round": 8.0}
# The targets, as fractions of Flower's figure (issue 44)
TARGETS = {"wall": 0.03, "launch_to_first_round": 0.25, "median_round": 0.01}


# --- who sent a request -----------------------------------------------------------------------------------
# The local server (its own process) sees one connection per request, so looking each sender up in /proc would slow
# the run it measures. Instead every socket this process connects to the loopback server leaves from a second
# loopback address, and every one its shard workers connect (spawned: they run this module's top level again, and so
# this patch) from a third; the participant processes connect from 127.0.0.1 as usual. The server tells them apart
# by the client's address alone, and the participants from the demo's evaluator (forked from the same zygote) by
# the access key that signed the request (participant-<id>: `participant.cli.use_local_credentials`). Within this
# process, a botocore hook notes who made each call: the coordinator
# function acting (`store.trace.acting_as`, which the local stack sets around each invocation), else the thread's
# role. Nothing about the requests changes.

LOOPBACK = "127.0.0.1"
STACK_SOURCE = "127.0.0.2"
SHARD_SOURCE = "127.0.0.3"
_MAIN_PID = "FED_BENCH_ROUNDS_PID"
os.environ.setdefault(_MAIN_PID, str(os.getpid()))  # (inherited by the spawned shard workers)
_SOURCE = STACK_SOURCE if os.environ[_MAIN_PID] == str(os.getpid()) else SHARD_SOURCE
_connect = socket.socket.connect


def _connect_from_own_source(self: socket.socket, address: Any) -> None:
    if self.family == socket.AF_INET and isinstance(address, tuple) and address[0] == LOOPBACK:
        try:
            self.bind((_SOURCE, 0))
        except OSError:  # already bound by its owner: leave it as it is
            pass
    _connect(self, address)


socket.socket.connect = _connect_from_own_source  # type: ignore[method-assign,assignment]


def sender(address: str, access_key: str) -> str:
    if address in (STACK_SOURCE, SHARD_SOURCE):
        return STACK if address == STACK_SOURCE else SHARD_WORKERS
    return PARTICIPANT if access_key.startswith("participant-") else EVALUATOR


OBSERVER = "the demo's observer"
DELIVERY = "event delivery (EventBridge, Lambda's queue pollers: the dispatcher)"
AGGREGATION_READS = "function (the aggregation's input reads)"
_DELIVERY_OPS = {("sqs", "ReceiveMessage"), ("sqs", "DeleteMessage"), ("sqs", "ChangeMessageVisibility"),
                 ("eventbridge", "DescribeRule")}
_calls: list[tuple[float, str, str, str]] = []  # (epoch seconds, caller, service, operation) of this process


def caller(service: str, operation: str) -> str:
    """Who in this process makes a call: the event delivery's own calls (polling, deleting, the schedule), else the
    function acting, else the thread's role."""
    if (service, operation) in _DELIVERY_OPS:
        return DELIVERY
    from store.trace import current_principal

    principal = current_principal()
    if principal:
        return principal
    name = threading.current_thread().name
    if name == "MainThread":
        return OBSERVER
    if name.startswith(("open", "read-ahead")):
        return AGGREGATION_READS
    return f"thread {name.rstrip('_0123456789')}"


def _note_call(event_name: str = "", **_kwargs: Any) -> None:
    _, service, operation = event_name.split(".", 2)
    _calls.append((time.time(), caller(service, operation), service, operation))


if _SOURCE == STACK_SOURCE:  # (before any botocore session exists: each copies the built-in handlers)
    import botocore.handlers

    botocore.handlers.BUILTIN_HANDLERS.append(("before-call.*.*", _note_call))


class CpuSampler:
    """CPU seconds, sampled every 0.5 s, of this process (all its threads: the functions, the dispatcher and the
    observer, under one interpreter lock) and of every process it started, by kind (Linux `/proc`): how much CPU a
    round costs on this machine's cores, and where."""

    TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    def __init__(self) -> None:
        self.samples: list[tuple[float, dict[str, float]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)
        self._kinds: dict[int, str] = {}
        self._gone: dict[str, float] = defaultdict(float)  # CPU of processes that exited, by kind
        self._last: dict[int, tuple[str, float]] = {}

    def _run(self) -> None:
        while not self._stop.wait(0.5):  # (each look reads every process's /proc entry: not too often)
            self.samples.append((time.time(), self.read()))

    def _kind(self, pid: int) -> str:
        if pid not in self._kinds:
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                cmd = ""
            self._kinds[pid] = ("the local server" if "local.server" in cmd else
                                "participants and the demo's evaluator (forked from the zygote)" if "fed.zygote" in cmd
                                else "the shard workers" if "multiprocessing" in cmd else "other")
        return self._kinds[pid]

    def read(self) -> dict[str, float]:
        """CPU seconds so far by kind: this process, and its descendants (the exited ones' last reading kept)."""
        stats: dict[int, tuple[int, float]] = {}
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                stats[int(entry.name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / self.TICK)
        me = os.getpid()
        mine, frontier = {me}, [me]
        while frontier:
            parent = frontier.pop()
            for pid, (ppid, _) in stats.items():
                if ppid == parent and pid not in mine:
                    mine.add(pid)
                    frontier.append(pid)
        for pid in list(self._last):
            if pid not in mine:
                kind, cpu = self._last.pop(pid)
                self._gone[kind] += cpu
        totals = defaultdict(float, self._gone)
        for pid in mine:
            kind = "this process" if pid == me else self._kind(pid)
            if pid != me and kind == "other":
                continue  # (the zygote itself, idle once it forked; this sampler's own reads)
            self._last[pid] = (kind, stats[pid][1])
            totals[kind] += stats[pid][1]
        return dict(totals)

    def __enter__(self) -> CpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def between(self, start: float, end: float) -> dict[str, float]:
        """CPU seconds used between two moments (to the nearest samples), by kind."""
        inside = [cpu for t, cpu in self.samples if start <= t <= end]
        if len(inside) < 2:
            return {}
        return {kind: inside[-1].get(kind, 0.0) - inside[0].get(kind, 0.0) for kind in inside[-1]}


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


def meta() -> Any:
    from participant.tasks import flower_digits_meta

    return flower_digits_meta


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


# --- where the time goes ----------------------------------------------------------------------------------
# A request event: (epoch seconds, sender, service, operation, S3 object path, seconds the server took)
Event = tuple[float, str, str, str, str, float]
Span = tuple[str, str, float, float]  # an invocation: function, object key, began, ended (`local.dispatcher`)


def _first(events: list[Event], after: float, who: str, service: str, operation: str = "", path: str = "",
           before: float = float("inf")) -> float:
    """When the first matching request after `after` (and before `before`) arrived; nan if none."""
    return min((t for t, w, s, o, p, _ in events if after <= t < before and w == who and s == service
                and (not operation or o == operation) and path in p), default=float("nan"))


def startup_phases(report: dict[str, Any], events: list[Event], launched: float, called: float
                   ) -> list[tuple[str, float]]:
    """The start-up's critical path, phase by phase: (what ended the phase, when: seconds from launch)."""
    marks = report["timeline"]["marks"]
    round0 = report["rounds"][0]["started"]
    from_participants = [e for e in events if e[1] == PARTICIPANT]
    first_request = min((e[0] for e in from_participants), default=float("nan"))
    joins = [e[0] for e in from_participants if e[3] == "PutObject" and "/join/" in e[4]]
    last_join = max(joins, default=float("nan"))
    # the admission: the first commit pushed to the participants after the last join (the epoch's start)
    admitted = _first(events, last_join, STACK, "sns")
    fetches = [e[0] for e in from_participants if e[3] == "GetObject" and "/global/" in e[4] and e[0] < round0]
    phases = [
        ("python and this script's imports (launch to run_demo)", called),
        ("the local stack started: server process, resources, dispatcher", marks["stack_started"]),
        ("the participants forked, once the zygote's imports are done", marks["participants_started"]),
        ("the participants' first request (each reads the run's configuration)", first_request),
        ("the last join request (sent once the task and its shard are loaded)", last_join),
        ("the admission pushed (the commit that starts the epoch)", admitted),
        ("the last participant's fetch of the initial model", max(fetches, default=float("nan"))),
        ("round 0 started (every participant ready: the tick selected its trainers)", round0),
    ]
    return [(what, at - launched) for what, at in phases]


def ending_phases(report: dict[str, Any], done: list[dict[str, Any]], launched: float, returned: float
                  ) -> list[tuple[str, float]]:
    """After the last round, phase by phase: (what ended the phase, seconds from launch)."""
    marks = report["timeline"]["marks"]
    phases = [("the last round closed", done[-1]["ended"]),
              ("the demo saw the run finished", marks["finished_seen"]),
              ("the final model evaluated (the evaluator helper)", marks["final_evaluated"]),
              ("every participant exited", marks["participants_exited"]),
              ("run_demo returned: the helpers, participants and the stack stopped", returned)]
    return [(what, at - launched) for what, at in phases]


def print_phases(title: str, phases: list[tuple[str, float]]) -> None:
    print(f"\n{title} (seconds from launch: this phase ends / took):")
    before = 0.0
    for what, at in phases:
        print(f"  {at:7.2f}  {at - before:+6.2f}  {what}")
        before = at if at == at else before  # (nan: a milestone not seen)


def round_steps(done: list[dict[str, Any]], events: list[Event], spans: list[Span]) -> dict[str, list[float]]:
    """Each step of each steady round (all but round 0), seconds from the round's start."""
    steps: dict[str, list[float]] = defaultdict(list)
    ingests = [s for s in spans if s[0].endswith("ingest") and "/rounds/" in s[1]]
    for r in done[1:]:
        start, end, n = r["started"], r["ended"], r["round"]
        tag = f"/rounds/{n:06d}/"
        pushed = _first(events, start, STACK, "sns", before=end)
        fetched = [e[0] for e in events if start <= e[0] <= end and e[1] == PARTICIPANT and e[3] == "GetObject"
                   and tag + "global/" in e[4]]
        uploaded = {e[4].rsplit("/", 1)[-1]: e[0] for e in events if e[1] == PARTICIPANT and e[3] == "PutObject"
                    and tag in e[4] and "/global/" not in e[4]}
        mine = sorted((s for s in ingests if tag in s[1] and s[1].rsplit("/", 1)[-1] in uploaded), key=lambda s: s[2])
        steps["the tick's commit and push (it aggregates the round before)"].append(pushed - start)
        if fetched:
            steps["participants' fetch of the global: the first"].append(min(fetched) - start)
            steps["participants' fetch of the global: the last"].append(max(fetched) - start)
        if uploaded:
            steps["their uploads: the first"].append(min(uploaded.values()) - start)
            steps["their uploads: the last"].append(max(uploaded.values()) - start)
        for s in mine:
            steps["an upload's event delivered (upload to its ingest's start), each"].append(
                s[2] - uploaded[s[1].rsplit("/", 1)[-1]])
        for s in mine[:-1]:
            steps["an ingest invocation (but the round's last), each"].append(s[3] - s[2])
        if mine:
            steps["the last ingest begins"].append(mine[-1][2] - start)
            steps["the last ingest's invocation: ingest and the tick that closes the round"].append(
                mine[-1][3] - mine[-1][2])
        steps["the round closes (the tick's decision: the record's end)"].append(end - start)
        steps["the local server answering the round's requests (sum of seconds, long polls left out)"].append(
            sum(e[5] for e in events if start <= e[0] <= end and e[3] != "ReceiveMessage"))
    return steps


def print_round_steps(steps: dict[str, list[float]]) -> None:
    rounds = len(steps.get("the round closes (the tick's decision: the record's end)", []))
    print(f"\na round, step by step (median over the {rounds} steady rounds; seconds from the round's start, or each "
          "step's own):")
    for what, values in steps.items():
        print(f"  {statistics.median(values):7.3f}  {what}  (min {min(values):.3f}, max {max(values):.3f})")


# --- the figures against Flower's and the last recorded ----------------------------------------------------


def times(report: dict[str, Any], done: list[dict[str, Any]], launched: float, returned: float
          ) -> dict[str, float]:
    rows = report["rounds"]
    first, last = rows[0], done[-1]
    return {"median_round": statistics.median(r["ended"] - r["started"] for r in done),
            "rounds_seconds": last["ended"] - first["started"],
            "launch_to_first_round": first["started"] - launched,
            "launch_to_first_global": first["ended"] - launched,
            "wall": returned - launched}


NAMES = {"median_round": "median round", "rounds_seconds": "15 rounds", "launch_to_first_round":
         "launch to first round", "launch_to_first_global": "launch to first global", "wall": "whole run",
         "imports": "python and imports", "first_request": "launch to the participants' first request",
         "participant_requests": "a participant's requests per round (steady)",
         "coordinator_requests": "coordinator-side requests per round (steady)"}


def print_against(figures: dict[str, float], flower: dict[str, Any], flower_source: str,
                  recorded: dict[str, Any] | None) -> None:
    """Each figure beside Flower's (with the target) and the last recorded one, as ratios."""
    print(f"\nthe figures (Flower: {flower_source}; last recorded: "
          f"{recorded['date'] + ', ' + recorded['machine'] if recorded else 'none'})")
    print(f"  {'figure':<46} {'now':>9} {'Flower':>9} {'x Flower':>9} {'target':>7} {'recorded':>9} "
          f"{'now/rec':>8}")
    for key, value in figures.items():
        theirs = flower.get(key)
        target = TARGETS.get(key)
        then = (recorded or {}).get("figures", {}).get(key)
        vs_flower = f"{value / theirs:9.3f}" if theirs else f"{'-':>9}"
        met = "" if not (theirs and target) else (" ok" if value / theirs <= target else " MISS")
        print(f"  {NAMES.get(key, key):<46} {value:9.3f} {theirs if theirs else '-':>9} {vs_flower} "
              f"{(f'{target:.2f}' if target else '-'):>7}{met:<5}{(f'{then:9.3f}' if then else '-'):>9} "
              f"{(f'{value / then:8.3f}' if then else '-'):>8}")
    print(f"  polling era (2026-11-23): median round {POLLING['median_round']} s, 15 rounds "
          f"{POLLING['rounds_seconds']} s, launch to first round {POLLING['launch_to_first_round']} s")


# --- the requests ---------------------------------------------------------------------------------------


def object_kind(path: str) -> str:
    """The kind of run object an S3 request's path (/bucket/key) names (`shared.keys.ObjectKind`), or "other"."""
    from shared import keys

    try:
        return keys.parse_key(path.split("/", 2)[2]).kind.value
    except (IndexError, keys.KeyError_):
        return "other"


def request_counts(report: dict[str, Any], done: list[dict[str, Any]], events: list[Event]
                   ) -> tuple[dict[str, Counter[tuple[str, str]]], dict[str, Counter[tuple[str, str]]]]:
    """Per caller, (service, operation) counts over the whole run and in the steady state (round 0's start to the
    last round's end): the participants and shard workers from the server's events, this process's callers from its
    own calls."""
    start, end = report["rounds"][0]["started"], done[-1]["ended"]
    whole: dict[str, Counter[tuple[str, str]]] = defaultdict(Counter)
    steady: dict[str, Counter[tuple[str, str]]] = defaultdict(Counter)
    for at, who, svc, op, path, _ in events:
        if who != STACK:
            what = f"{op} {object_kind(path)}" if path else op
            whole[who][(svc, what)] += 1
            if start <= at <= end:
                steady[who][(svc, what)] += 1
    for at, who, svc, op in _calls:
        whole[who][(svc, op)] += 1
        if start <= at <= end:
            steady[who][(svc, op)] += 1
    return whole, steady


def print_requests(title: str, counts: Counter[tuple[str, str]], divisor: float, detail: bool = True) -> float:
    """Print `counts / divisor` (by service and operation under `title`); return the total / divisor."""
    total = sum(counts.values()) / divisor
    print(f"  {total:7.2f}  {title}")
    if detail:
        for (svc, op), n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
            print(f"             {n / divisor:7.2f}  {svc:<11} {op}")
    return total


def print_request_counts(report: dict[str, Any], done: list[dict[str, Any]], events: list[Event]
                         ) -> tuple[dict[str, float], Counter[tuple[str, str]], float, float]:
    """The steady state's requests per round by caller; returns the per-caller totals, the whole run's
    participant counts, and the per-participant and coordinator-side figures."""
    whole, steady = request_counts(report, done, events)
    rounds = len(done)
    served = sum(n for _, _, n in report.get("requests", []))
    mine = sum(1 for e in events if e[1] == STACK)
    print(f"\nAWS requests answered by the local server: {served}; of them this process's {mine} (its own count of "
          f"its calls: {len(_calls)})")
    print(f"\nrequests per round in the steady state (round 0's start to round {done[-1]['round']}'s end, / "
          f"{rounds} rounds), by caller:")
    totals: dict[str, float] = {}
    part = print_requests(f"the {PARTICIPANTS} participants, per participant", steady[PARTICIPANT],
                          PARTICIPANTS * rounds)
    coordinator = 0.0
    for who in sorted(steady):
        if who in (PARTICIPANT, OBSERVER, EVALUATOR):
            continue
        totals[who] = print_requests(who, steady[who], rounds)
        coordinator += totals[who]
    print(f"  {coordinator:7.2f}  the coordinator side: every caller above but the participants")
    for who in (OBSERVER, EVALUATOR):
        totals[who] = print_requests(f"{who} (the demo's, not the system's; not counted above)", steady[who],
                                     rounds, detail=False)
    whole_part = sum(whole[PARTICIPANT].values()) / (PARTICIPANTS * rounds)
    print(f"  (a participant's requests per round over the whole run, joining and exit included: {whole_part:.2f})")
    return totals, whole[PARTICIPANT], part, coordinator


# --- main ---------------------------------------------------------------------------------------------------


def load_json(path: Path) -> dict[str, Any] | None:
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return None


def main() -> int:
    launched = process_started_at()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="Also write the figures and the demo's report here.")
    parser.add_argument("--timeout", type=float, default=600.0, help="Give up on the run after this many seconds.")
    parser.add_argument("--flower", type=Path, default=None,
                        help="A Flower run of the same work in this session: JSON with median_round, rounds_seconds, "
                             "launch_to_first_round and wall (seconds). Default: the Flower run recorded in "
                             f"{RECORDED.name}, else the anchor document's figures.")
    parser.add_argument("--record", action="store_true",
                        help=f"Write this run's figures to {RECORDED.relative_to(ROOT)} as the last recorded ones.")
    args = parser.parse_args()

    from rich.console import Console

    from fed.demo import DemoFailed, DemoOptions, run_demo

    rounds = meta().ROUNDS
    opts = DemoOptions(participants=PARTICIPANTS, task="flower", rounds=rounds, count_requests=True,
                       timeout=args.timeout)
    called = time.time()
    try:
        with CpuSampler() as cpu:
            report = run_demo(opts, Console())
    except DemoFailed as exc:
        print(f"bench-rounds: the run failed: {exc}", file=sys.stderr)
        return 1
    returned = time.time()
    events: list[Event] = [(t, sender(address, key), svc, op, path, served)
                           for t, address, svc, op, path, served, key in report.pop("request_events")]
    spans: list[Span] = [(str(f), str(k), float(b), float(e)) for f, k, b, e in report["timeline"]["invocations"]]
    rows = report["rounds"]
    done, problems = check(report, rounds)
    print_rounds(rows, done)
    if not done:
        print("bench-rounds FAILED: no round was aggregated", file=sys.stderr)
        return 1
    print(f"\nfinal test accuracy {round(report['final_accuracy'], 4):.4f} (Flower {meta().FLOWER_ACCURACY:.4f})")
    phases = startup_phases(report, events, launched, called)
    print_phases("the start-up, on its critical path", phases)
    steps = round_steps(done, events, spans)
    print_round_steps(steps)
    print_phases("after the last round", ending_phases(report, done, launched, returned))
    callers, participant_whole, per_participant, coordinator = print_request_counts(report, done, events)
    span = done[-1]["ended"] - done[0]["started"]
    used = cpu.between(done[0]["started"], done[-1]["ended"])
    print(f"\nCPU in the steady state, a round (this machine: {os.cpu_count()} cores; {span / len(done):.3f} s a "
          "round):")
    for kind, seconds in sorted(used.items(), key=lambda kv: -kv[1]):
        print(f"  {seconds / len(done):7.3f} s  {kind}")
    print(f"  {sum(used.values()) / len(done):7.3f} s  in all: {sum(used.values()) / span:.2f} of the cores' "
          f"{os.cpu_count()}")

    figures = times(report, done, launched, returned)
    figures.update(imports=called - launched, first_request=phases[3][1], participant_requests=per_participant,
                   coordinator_requests=coordinator)
    flower = load_json(args.flower) if args.flower else None
    if args.flower and flower is None:
        print(f"warning: {args.flower} could not be read: Flower's figures are the anchor document's", file=sys.stderr)
    recorded = load_json(RECORDED)
    flower_recorded = (recorded or {}).get("flower")
    if flower:
        source = f"{args.flower} (this session)"
    elif flower_recorded:
        flower, source = flower_recorded["figures"], f"recorded {flower_recorded['date']}, {flower_recorded['machine']}"
    else:
        flower, source = FLOWER_ANCHOR, "the anchor document, 2026-11-23"
    print_against(figures, flower, source, recorded)
    print("definitions: a round's seconds = ended - started of its round record; launch = this process's start (the "
          "kernel's process start time); first round = round 0's start in its record; whole run = launch to "
          "run_demo's return (the participants have exited, the stack has stopped)")

    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        out = {"figures": figures, "startup": phases,
               "round_steps": {k: statistics.median(v) for k, v in steps.items()},
               "requests_by_caller": callers, "accuracies": [round(r["accuracy"], 4) for r in done],
               "round_seconds": [r["ended"] - r["started"] for r in done], "rounds_recorded": len(rows),
               "problems": problems, "report": report}
        args.out.write_text(json.dumps(out, indent=1) + "\n")
        print(f"figures and the demo's report: {args.out}")
    if problems:
        print("bench-rounds FAILED: " + "; ".join(problems), file=sys.stderr)
        return 1
    if args.record:
        record = {"date": datetime.date.today().isoformat(), "machine": "dev machine",
                  "figures": {k: round(v, 4) for k, v in figures.items()}}
        if args.flower and load_json(args.flower):
            record["flower"] = {"date": record["date"], "machine": "dev machine", "source": str(args.flower),
                                "figures": flower}
        elif flower_recorded:
            record["flower"] = flower_recorded
        RECORDED.write_text(json.dumps(record, indent=1) + "\n")
        print(f"recorded: {RECORDED.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
