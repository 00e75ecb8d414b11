"""The machinery of the chaos test: fault plans, a dispatcher in a process of its own that can be killed
mid-aggregation, participant and tick chaos, and an audit of the finished run.

Faults are counted by kind in one `Tally`; its table is what the chaos test prints. Everything random
draws from seeded `random.Random` objects, so a run can be repeated with the seed it printed (the
timing of processes still varies, so the same seed gives the same plan, not the same interleaving).
"""

from __future__ import annotations

import json
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import boto3
import numpy as np

from local.dispatcher import Delivery
from local.resources import LocalResources
from shared import keys
from shared.keys import KeyError_, ObjectKind
from shared.state import Phase, RoundSummary
from store.table import StateStore

REPO = Path(__file__).resolve().parents[2]

# --- counting faults ---------------------------------------------------------------------------------

# Kinds, in the order the table prints them.
PARTICIPANT_KILLED = "participant SIGKILLed (random moment) and restarted"
PARTICIPANT_KILLED_MID_ROUND = "participant SIGKILLed while selected, before its update, and restarted"
EVENT_HELD = "S3 event held back, delivered late (out of order)"
EVENT_COPIES = "S3 event delivered to 2 invocations at once"
EVENT_AGAIN = "S3 event delivered again after it succeeded"
INGEST_DIED = "ingest died after recording, before ticking (retried)"
AGGREGATION_DIED = "function died mid-aggregation, global written, not committed (retried)"
DISPATCHER_KILLED_BEFORE = "dispatcher SIGKILLed mid-aggregation, before the global was written"
DISPATCHER_KILLED_AFTER = "dispatcher SIGKILLed mid-aggregation, global written, before the commit"
DISPATCHER_RESTARTED = "dispatcher restarted"
TICK_BURSTS = "bursts of racing extra ticks"
EXTRA_TICKS = "extra ticks run"
EXTRA_TICKS_COMMITTED = "extra ticks that committed"
LOST_RACES = "commits lost to a racing tick (re-read, retried)"
KINDS = (PARTICIPANT_KILLED, PARTICIPANT_KILLED_MID_ROUND, EVENT_HELD, EVENT_COPIES, EVENT_AGAIN, INGEST_DIED,
         AGGREGATION_DIED, DISPATCHER_KILLED_BEFORE, DISPATCHER_KILLED_AFTER, DISPATCHER_RESTARTED, TICK_BURSTS,
         EXTRA_TICKS, EXTRA_TICKS_COMMITTED, LOST_RACES)


class Tally:
    """Thread-safe counts of injected faults, by kind."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts: Counter[str] = Counter()

    def add(self, kind: str, n: int = 1) -> None:
        with self._lock:
            self.counts[kind] += n

    def __getitem__(self, kind: str) -> int:
        with self._lock:
            return self.counts[kind]

    def table(self) -> str:
        with self._lock:
            counts = Counter(self.counts)
        order = [k for k in KINDS] + sorted(set(counts) - set(KINDS))
        width = max(len(k) for k in order)
        lines = [f"{'fault injected':<{width}}  count", f"{'-' * width}  -----"]
        lines += [f"{k:<{width}}  {counts[k]:5d}" for k in order]
        return "\n".join(lines)


# --- event faults (used in the dispatcher process) -----------------------------------------------------


class RandomFaults:
    """A dispatcher fault plan: each event's first receipt is, at the given rates, held back, delivered to
    two invocations at once, or delivered again after it succeeded. `report(kind, key)` is told of each."""

    def __init__(self, rng: random.Random, report: Callable[[str, str], None], hold: float = 0.15,
                 copies: float = 0.1, again: float = 0.1) -> None:
        self.rng, self.report = rng, report
        self.rates = (hold, copies, again)
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def delivery(self, event: dict[str, Any], receive_count: int) -> Delivery:
        key = str(event.get("detail", {}).get("object", {}).get("key", ""))
        ident = f"{key}#{event.get('detail', {}).get('object', {}).get('version-id', '')}"
        with self._lock:
            if ident in self._seen:  # one fault per event: the run must still make progress
                return Delivery()
            self._seen.add(ident)
            draw = self.rng.random()
            seconds = self.rng.randint(1, 4)
        hold, copies, again = self.rates
        if draw < hold:
            self.report(EVENT_HELD, key)
            return Delivery(hold=seconds)
        if draw < hold + copies:
            self.report(EVENT_COPIES, key)
            return Delivery(copies=2)
        if draw < hold + copies + again:
            self.report(EVENT_AGAIN, key)
            return Delivery(again_after=seconds)
        return Delivery()


class SimulatedCrash(RuntimeError):
    """A function invocation dying at an injected point (Lambda retries it, as after any crash)."""


def install_crash_hooks(rng: random.Random, report: Callable[[str, dict[str, Any]], None], kill_at: int,
                        kill_point: str, aggregation_crash_rate: float, ingest_crash_rate: float) -> None:
    """In the dispatcher process: make the coordinator die at chosen points (no file of it is changed; its
    module-level functions are wrapped, which run_tick and the ingest handler look up at call time).

    - The `kill_at`-th aggregation this process attempts blocks at `kill_point` ("before_write": about to
      aggregate, nothing written; "after_write": the new global written, the state not committed) after
      reporting "blocked"; the test then SIGKILLs the process.
    - Other aggregations raise `SimulatedCrash` after writing the global, at `aggregation_crash_rate`.
    - A recorded update's ingest raises before its tick at `ingest_crash_rate`.
    """
    import coordinator.service as service
    import coordinator.tick as coordinator
    from shared.state import Aggregate

    original_carry, original_write = coordinator.carry_out_before_commit, coordinator.write_aggregate
    original_ingest = service.ingest_object
    lock = threading.Lock()
    attempts = [0]
    local = threading.local()

    def block(round_no: int, point: str) -> None:
        report("blocked", {"round": round_no, "point": point})
        threading.Event().wait(60)  # the test kills this process long before
        raise SimulatedCrash("not killed while blocked")

    def write_aggregate(deps: Any, effect: Any, *lease: Any) -> tuple[str, str]:
        if getattr(local, "kill", False) and kill_point == "before_write":
            block(effect.round, kill_point)
        return original_write(deps, effect, *lease)  # type: ignore[no-any-return]

    def carry_out_before_commit(deps: Any, decision: Any, **lease: Any) -> Any:
        rounds = [e.round for e in decision.effects if isinstance(e, Aggregate)]
        if not rounds:
            return original_carry(deps, decision, **lease)
        with lock:
            attempts[0] += 1
            local.kill = attempts[0] == kill_at
            crash = not local.kill and rng.random() < aggregation_crash_rate
        result = original_carry(deps, decision, **lease)
        if local.kill:
            block(rounds[0], kill_point)
        if crash:
            report(AGGREGATION_DIED, {"round": rounds[0]})
            raise SimulatedCrash(f"died aggregating round {rounds[0]}: global written, state not committed")
        return result

    def ingest_object(deps: Any, obj: Any) -> Any:
        outcome = original_ingest(deps, obj)
        if outcome.kind == "update" and outcome.recorded:
            with lock:
                crash = rng.random() < ingest_crash_rate
            if crash:
                report(INGEST_DIED, {"key": obj.key})
                raise SimulatedCrash(f"died after recording {obj.key}, before ticking")
        return outcome

    coordinator.write_aggregate = write_aggregate
    coordinator.carry_out_before_commit = carry_out_before_commit
    service.ingest_object = ingest_object


# --- the dispatcher in its own process -------------------------------------------------------------------


@dataclass(frozen=True)
class DispatcherPlan:
    """What one dispatcher process does; passed to `python -m tests.e2e.dispatcher_process` as JSON.
    The defaults inject nothing: a faithful dispatcher, as `LocalStack` runs in its own process."""

    seed: int = 0
    kill_at: int = 0  # block (to be SIGKILLed) at this aggregation attempt; 0: never
    kill_point: str = "after_write"
    aggregation_crash_rate: float = 0.0
    ingest_crash_rate: float = 0.0
    hold_rate: float = 0.0
    copies_rate: float = 0.0
    again_rate: float = 0.0
    tick_interval: float = 1.0
    workers: int = 3
    join_workers: int = 1
    visibility_timeout: int = 15
    max_attempts: int = 3

    @property
    def faulty(self) -> bool:
        return bool(self.kill_at or self.aggregation_crash_rate or self.ingest_crash_rate or self.hold_rate
                    or self.copies_rate or self.again_rate)


# The chaos test's dispatchers: events go astray, functions die, and it is killed mid-aggregation.
CHAOS_PLAN = DispatcherPlan(aggregation_crash_rate=0.3, ingest_crash_rate=0.05, hold_rate=0.15, copies_rate=0.1,
                            again_rate=0.1, tick_interval=0.5, visibility_timeout=4, max_attempts=10)


class DispatcherProcess:
    """One dispatcher process; its reports (JSON lines on stdout) go to `on_report` from a reader thread."""

    def __init__(self, resources: LocalResources, plan: DispatcherPlan, log: Path,
                 on_report: Callable[[DispatcherProcess, dict[str, Any]], None] | None = None) -> None:
        """Started with this process's environment, which must hold the functions' (LocalStack sets it)."""
        self.plan, self.on_report = plan, on_report
        self.started = threading.Event()
        self.stats: dict[str, Any] = {}
        cmd = [sys.executable, "-m", "tests.e2e.dispatcher_process", "--resources", json.dumps(asdict(resources)),
               "--plan", json.dumps(asdict(plan)), "--log-file", str(log)]
        self.process = child_process(cmd, log)
        self._reader = threading.Thread(target=self._read, name="dispatcher-reports", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for raw in self.process.stdout:
            try:
                report = json.loads(raw)
            except ValueError:
                continue
            if report.get("event") == "started":
                self.started.set()
            elif report.get("event") == "stopped":
                self.stats = report.get("stats", {})
            if self.on_report is not None:
                self.on_report(self, report)

    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL: deliveries in flight die with it; their messages come back after the visibility timeout."""
        if self.alive():
            self.process.send_signal(signal.SIGKILL)
        self.process.wait()

    def stop(self, timeout: float = 40.0) -> dict[str, Any]:
        """SIGTERM: finish deliveries in flight, report its statistics (returned), exit."""
        if self.alive():
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._reader.join(5)
        return self.stats


class DispatcherChaos:
    """Keeps one dispatcher process running; kills it when it reports being blocked mid-aggregation
    (after letting a burst of racing ticks loose on the half-done aggregation) and starts the next one."""

    def __init__(self, resources: LocalResources, workdir: Path, rng: random.Random, tally: Tally, kills: int,
                 spawner: Spawner, on_blocked: Callable[[], None] | None = None) -> None:
        self.resources, self.workdir, self.rng, self.tally = resources, workdir, rng, tally
        self.spawner = spawner
        self.kills_left = kills
        self.on_blocked = on_blocked
        self.generation = 0
        self._first_point = rng.randrange(2)
        self.current: DispatcherProcess | None = None
        self.errors: list[str] = []
        self._lock = threading.Lock()
        self._stopping = False

    def start(self) -> None:
        with self._lock:
            self._spawn()

    def _spawn(self) -> None:
        self.generation += 1
        kill_at = 0
        if self.kills_left > 0:
            self.kills_left -= 1
            kill_at = 1 if self.generation == 1 else self.rng.randint(1, 2)
        point = ("before_write", "after_write")[(self.generation + self._first_point) % 2]  # both, in turn
        plan = replace(CHAOS_PLAN, seed=self.rng.randrange(2**31), kill_at=kill_at, kill_point=point)
        log = self.workdir / "logs" / "dispatcher.log"
        self.current = self.spawner.call(lambda: DispatcherProcess(self.resources, plan, log, self._report))

    def _report(self, proc: DispatcherProcess, report: dict[str, Any]) -> None:
        if "fault" in report:
            self.tally.add(report["fault"])
        if report.get("event") == "error":
            self.errors.append(str(report.get("message")))
        if report.get("event") != "blocked":
            return
        if self.on_blocked is not None:
            self.on_blocked()  # racing ticks find the aggregation half done
        with self._lock:
            if self._stopping or proc is not self.current:
                return
            proc.kill()
            point = report.get("point")
            self.tally.add(DISPATCHER_KILLED_BEFORE if point == "before_write" else DISPATCHER_KILLED_AFTER)
            self._spawn()
            self.tally.add(DISPATCHER_RESTARTED)

    def problem(self) -> str:
        """Why the dispatcher is not running when it should be, or ""."""
        with self._lock:
            proc = self.current
            if self._stopping or proc is None or proc.alive():
                return ""
            return f"dispatcher process {self.generation} exited with status {proc.process.returncode}"

    def stop(self) -> dict[str, Any]:
        with self._lock:
            self._stopping = True
            proc = self.current
        if proc is None:
            return {}
        return proc.stop()


def child_process(cmd: list[str], log: Path) -> subprocess.Popen[bytes]:
    """A helper process of the test: reports on its stdout, logs to `log`, dies with the test process."""
    from fed.zygote import die_with_parent

    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as err:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL, env=env, cwd=REPO,
                                preexec_fn=die_with_parent if sys.platform.startswith("linux") else None)  # noqa: PLW1509


class Spawner:
    """Starts processes from one long-lived thread. Children die with the thread that started them (Linux's
    PR_SET_PDEATHSIG, which fed.demo's participants and `child_process` set), so a restart must not be
    spawned from a short-lived thread (a report reader, a killer loop): it would be SIGTERMed when that ends."""

    def __init__(self) -> None:
        self._jobs: queue.Queue[tuple[Callable[[], Any], list[Any], threading.Event] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="spawner", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, out, done = job
            try:
                out.append(fn())
            except BaseException as exc:  # handed to the caller
                out.append(exc)
            done.set()

    def call(self, fn: Callable[[], Any]) -> Any:
        out: list[Any] = []
        done = threading.Event()
        self._jobs.put((fn, out, done))
        done.wait()
        if isinstance(out[0], BaseException):
            raise out[0]
        return out[0]

    def stop(self) -> None:
        """Only once its children are no longer needed: they are SIGTERMed when its thread ends."""
        self._jobs.put(None)
        self._thread.join(10)


# --- racing ticks and participant kills (in the test process) ------------------------------------------


class RacingTicks:
    """Bursts of extra ticks, several at once behind a barrier, at random moments (and on demand)."""

    def __init__(self, rng: random.Random, tally: Tally, gap: tuple[float, float] = (0.3, 1.5)) -> None:
        from functions.settings import deps_from_env

        self.deps = deps_from_env()
        self.rng, self.tally, self.gap = rng, tally, gap
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="racing-ticks", daemon=True)

    def start(self) -> RacingTicks:
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.rng.uniform(*self.gap)):
            self.burst(self.rng.randint(2, 4))

    def burst(self, n: int = 3) -> None:
        from coordinator.service import run_tick
        from coordinator.tick import TickContention

        barrier = threading.Barrier(n)

        def one() -> None:
            try:
                barrier.wait(5)
                result = run_tick(self.deps)
                self.tally.add(EXTRA_TICKS)
                self.tally.add(LOST_RACES, result.attempts - 1)
                if result.committed:
                    self.tally.add(EXTRA_TICKS_COMMITTED)
            except TickContention:
                self.tally.add(EXTRA_TICKS)
            except Exception as exc:  # reported by the test: a tick must never fail
                self.errors.append(f"{type(exc).__name__}: {exc}")

        self.tally.add(TICK_BURSTS)
        threads = [threading.Thread(target=one, daemon=True) for _ in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.ident is not None:  # started (a test that failed early stops it all the same)
            self._thread.join(30)


class ParticipantKiller:
    """SIGKILLs a participant now and then (at a random moment, or while it is selected and its update is
    not in yet) and restarts it with the same --id and --state-dir after a short pause."""

    def __init__(self, procs: Any, store: StateStore, rng: random.Random, tally: Tally, spawner: Spawner,
                 gap: tuple[float, float] = (2.0, 6.0), down: tuple[float, float] = (0.3, 2.5)) -> None:
        self.procs, self.store, self.rng, self.tally = procs, store, rng, tally
        self.spawner = spawner
        self.gap, self.down = gap, down
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="participant-killer", daemon=True)

    def start(self) -> ParticipantKiller:
        self._thread.start()
        return self

    def _loop(self) -> None:
        try:
            while not self._stop.wait(self.rng.uniform(*self.gap)):
                if self.store.read_state().phase is Phase.FINISHED:
                    return
                up = [n for n in sorted(self.procs.procs) if self._up(n)]
                if not up:
                    continue
                victim = self.rng.choice(up)
                mid_round = self.rng.random() < 0.5
                if mid_round and not self._await_selected(victim):
                    continue
                self.procs.kill(victim)
                self.tally.add(PARTICIPANT_KILLED_MID_ROUND if mid_round else PARTICIPANT_KILLED)
                self._stop.wait(self.rng.uniform(*self.down))  # down for a while, even when asked to stop
                self.restart(victim)
        except Exception as exc:
            self.errors.append(f"{type(exc).__name__}: {exc}")

    def _up(self, name: str) -> bool:
        """Running, and past start-up: its current incarnation has joined (killing it while it imports
        torch tests little)."""
        p = self.procs.procs[name]
        try:
            return p.process.poll() is None and "joined run" in p.log.read_text(errors="replace")
        except OSError:
            return False

    def _await_selected(self, pid: str, timeout: float = 10.0) -> bool:
        """Wait until `pid` is selected in an open round with no update recorded yet."""
        deadline = time.monotonic() + timeout
        while not self._stop.is_set() and time.monotonic() < deadline:
            s = self.store.read_state()
            if s.phase is Phase.FINISHED:
                return False
            if s.phase is Phase.TRAIN and pid in s.selected and self.store.update_record(s.round, pid) is None:
                return True
            self._stop.wait(0.05)
        return False

    def restart(self, name: str) -> None:
        """Same --id and --state-dir, so it resumes; the old log is kept beside the new one."""
        keep_log(self.procs.procs[name].log)
        self.spawner.call(lambda: self.procs.spawn([name]))

    def stop(self) -> None:
        self._stop.set()
        if self._thread.ident is not None:  # started (a test that failed early stops it all the same)
            self._thread.join(30)


def keep_log(log: Path) -> None:
    """Move a participant's log aside (`p1.log` -> `p1.<n>.log`) before a new process of it writes `p1.log`."""
    n = 1
    while log.with_suffix(f".{n}.log").exists():
        n += 1
    log.rename(log.with_suffix(f".{n}.log"))


# --- losing the table, and the operator's commands ------------------------------------------------------


def lose_table(endpoint: str, region: str, run_id: str, table: str) -> None:
    """The run's DynamoDB table is lost: deleted, then created again, empty (as `cdk deploy` or `fed local`
    would recreate it), by `local.resources.create_resources`."""
    from local.resources import create_resources

    boto3.client("dynamodb", endpoint_url=endpoint, region_name=region).delete_table(TableName=table)
    create_resources(run_id, endpoint, region)


def latest_checkpoint(s3: Any, bucket: str, run_id: str) -> dict[str, Any] | None:
    """The body of the checkpoint `checkpoints/latest.json` points to, or None if there is none yet."""
    try:
        pointer = json.loads(s3.get_object(Bucket=bucket, Key=keys.latest_checkpoint_key(run_id))["Body"].read())
    except s3.exceptions.NoSuchKey:
        return None
    return dict(json.loads(s3.get_object(Bucket=bucket, Key=pointer["state_key"])["Body"].read()))


def fed_command(*args: str, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    """Run the operator's `fed` command line (the console script beside this interpreter) in a process of its own,
    as an operator would; its environment is this process's (the local stack's credentials and region)."""
    beside = Path(sys.executable).with_name("fed")
    cmd = [str(beside)] if beside.exists() else [sys.executable, "-c", "from fed.cli import app; app()"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200", "NO_COLOR": "1"}
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO,
                          stdin=subprocess.DEVNULL, check=False)


# --- the audit of a finished run ---------------------------------------------------------------------


@dataclass
class Audit:
    rounds: list[RoundSummary]
    counted: int = 0  # (round, participant) pairs counted in an aggregation
    double_counted: list[str] = field(default_factory=list)
    counted_without_record: list[str] = field(default_factory=list)
    left_out: dict[str, str] = field(default_factory=dict)  # accepted, not counted, and the summary says why
    not_aggregated: int = 0  # accepted updates of rounds that were carried over (counted nowhere, by design)
    unexplained: list[str] = field(default_factory=list)  # accepted, not counted, no reason anywhere
    unrecorded: list[str] = field(default_factory=list)  # uploaded update versions with no outcome at all
    uploads: int = 0  # update object versions in the bucket

    @property
    def lost(self) -> int:
        return len(self.unexplained) + len(self.unrecorded)


def audit_run(store: StateStore, s3: Any, bucket: str, run_id: str) -> Audit:
    """Who was counted where, and whether every uploaded update has an outcome (invariant 1)."""
    summaries = sorted(store.rounds(), key=lambda s: s.round)
    by_round = {s.round: s for s in summaries}
    records = {(int(u.round), u.pid): u for u in store.all_updates()}
    audit = Audit(summaries)

    seen: Counter[tuple[int, str]] = Counter()
    for s in summaries:
        for pid in s.counted:
            seen[(s.round, pid)] += 1
            rec = records.get((s.round, pid))
            if rec is None or not rec.accepted:
                audit.counted_without_record.append(f"round {s.round} {pid}")
    audit.counted = sum(seen.values())
    audit.double_counted = [f"round {r} {p} counted {n} times" for (r, p), n in seen.items() if n > 1]

    for (round_no, pid), rec in sorted(records.items()):
        if not rec.accepted or (round_no, pid) in seen:
            continue
        s = by_round.get(round_no)
        if s is None:
            audit.unexplained.append(f"round {round_no} {pid}: accepted, and the round has no summary")
        elif not s.aggregated:
            audit.not_aggregated += 1
        elif pid in s.refused or pid in s.dropped:
            audit.left_out[f"round {round_no} {pid}"] = s.refused.get(pid) or s.dropped[pid]
        else:
            audit.unexplained.append(f"round {round_no} {pid}: accepted, not counted, no reason recorded")

    outcomes = {(u.key, u.version_id) for u in records.values()}
    refused = {(r.key, str(r.etag).rsplit(":", 1)[-1]) for r in store.refusals()}
    pages = s3.get_paginator("list_object_versions").paginate(Bucket=bucket, Prefix=keys.run_prefix(run_id))
    for page in pages:
        for v in page.get("Versions", []):
            try:
                kind = keys.parse_key(v["Key"]).kind
            except KeyError_:
                continue
            if kind is not ObjectKind.UPDATE:
                continue
            audit.uploads += 1
            ident = (v["Key"], v["VersionId"])
            if ident not in outcomes and ident not in refused:
                audit.unrecorded.append(f"{v['Key']} version {v['VersionId']}: no record and no refusal")
    return audit


def safetensors_header(data: bytes) -> dict[str, Any]:
    """The JSON header of a safetensors file, parsed here (not with the coordinator's reader)."""
    n = int.from_bytes(data[:8], "little")
    return dict(json.loads(data[8 : 8 + n]))


def recompute_fedavg(s3: Any, bucket: str, run_id: str, summary: RoundSummary, records: dict[tuple[int, str], Any],
                     max_share: float) -> tuple[float, list[str]]:
    """FedAvg of a round's counted updates, computed independently (own parsing, weights from each update's
    own header, capped at a fair share as the run's rule says: `shared.sizing.fedavg_weights`, numpy's weighted
    mean), against the stored global of the next round: (max abs difference, problems)."""
    from safetensors.numpy import load

    from shared.sizing import fedavg_weights

    problems: list[str] = []
    arrays, claims = [], []
    for pid in summary.counted:
        rec = records[(summary.round, pid)]
        body = s3.get_object(Bucket=bucket, Key=keys.update_key(run_id, summary.round, pid),
                             VersionId=rec.version_id)["Body"].read()
        samples = int(safetensors_header(body)["__metadata__"]["fed.samples"])
        if samples != int(rec.samples):
            problems.append(f"round {summary.round} {pid}: file says {samples} samples, record {rec.samples}")
        arrays.append(load(body))
        claims.append(samples)
    capped = fedavg_weights(dict(zip(summary.counted, claims, strict=True)), max_share)
    weights = [capped[pid] for pid in summary.counted]
    stored = s3.get_object(Bucket=bucket, Key=keys.global_key(run_id, summary.round + 1, summary.global_digest))[
        "Body"
    ].read()
    header = safetensors_header(stored)["__metadata__"]
    listed = [(p, int(n)) for p, n, _ in json.loads(header["fed.inputs"])]
    if listed != sorted(zip(summary.counted, weights, strict=True)):
        problems.append(f"round {summary.round}: the global's header lists {listed}")
    global_arrays = load(stored)
    worst = 0.0
    for name, value in global_arrays.items():
        stack = np.stack([a[name].astype(np.float64) for a in arrays])
        mean = np.average(stack, axis=0, weights=np.asarray(weights, np.float64)).astype(value.dtype)
        diff = float(np.max(np.abs(mean.astype(np.float64) - value.astype(np.float64)))) if value.size else 0.0
        worst = max(worst, diff)
        if not np.allclose(mean, value, rtol=1e-5, atol=1e-6):
            problems.append(f"round {summary.round} {name}: off by up to {diff:.3g}")
    return worst, problems


def s3_client_for(endpoint: str, region: str) -> Any:
    return boto3.client("s3", endpoint_url=endpoint, region_name=region)
