"""The whole loop at real model size: the local stack, real `fed-participant` processes, a ~1 GB update.

    .venv/bin/python benchmarks/big_loop.py [--megabytes 1070] [--participants 2] [--rounds 3]
                                            [--dtypes fp32,bf16] [--shards 1,2]

--megabytes is one of participant.tasks.wide's named sizes: 64, 271 or 1070.

For each dtype (the wide digits MLP of participant.tasks.wide: ~1.07 GB of float32, or the same parameters
in bfloat16) and each shard count K, one run of `--rounds` rounds on a fresh local stack (moto's server in a
process of its own, as `fed local` runs it; ingest and tick in this process's threads as the dispatcher runs them;
aggregation shards on worker processes) with `--participants` participant processes. Printed per round:

- train / upload / download: each participant's, from its log (the slowest shown);
- ingest: seconds the ingest function spent on each accepted update (the slowest shown);
- aggregation: the tick's whole aggregation (pieces computed and written by the shard workers, parts
  stitched); global write: of that, completing the multipart upload and copying it to its content address;
- coordinator: from the start of the last accepted update's ingest to the next global model committed;
- round s: from the round's global model committed to the next one's (the whole round, as a user sees it).

Then, measured in the same run against the same server and bytes: the data-movement limit (plain boto3
transfer of the same bytes, numpy's weighted sum of the same arrays), the ratios, and peak resident memory
of every process: the stack (the server, and this process with the functions), each participant, each shard
worker, and one ingest and one shard invocation each run alone in a fresh process (their peak above the process's
own baseline).
A benchmark, not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

GB, MB = 1e9, 1e6


def vm(pid: int | str, field: str) -> int:
    """VmHWM / VmRSS of a process in bytes (0 if it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class Timings:
    """Wraps the coordinator's functions in this process to time each call."""

    def __init__(self) -> None:
        self.ingest: list[tuple[str, float, float, bool]] = []  # key, start, end, accepted
        self.aggregations: list[tuple[float, float]] = []
        self.global_writes: list[tuple[float, float]] = []  # (start, end) of each stitch and copy
        self.commits: dict[int, float] = {}  # round -> when the state moved to it

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        import coordinator.intake as intake
        import coordinator.tick as tick
        from store.blobs import Bucket
        from store.table import StateStore

        saved = (intake.ingest_object, tick.write_aggregate, Bucket.complete_multipart, Bucket.copy,  # type: ignore[attr-defined]
                 StateStore.commit)

        def ingest_object(deps: Any, obj: Any) -> Any:
            started = time.time()
            outcome = saved[0](deps, obj)
            if outcome.kind == "update":
                self.ingest.append((obj.key, started, time.time(), outcome.accepted))
            return outcome

        def write_aggregate(deps: Any, effect: Any, *lease: Any) -> tuple[str, str]:
            started = time.time()
            written = saved[1](deps, effect, *lease)
            self.aggregations.append((started, time.time()))
            return written

        def timed(original: Callable[..., Any]) -> Callable[..., Any]:
            def call(*args: Any, **kwargs: Any) -> Any:
                started = time.time()
                try:
                    return original(*args, **kwargs)
                finally:
                    self.global_writes.append((started, time.time()))
            return call

        def commit(store: Any, state: Any, *args: Any, **kwargs: Any) -> int:
            version = saved[4](store, state, *args, **kwargs)
            self.commits.setdefault(state.round, time.time())  # (the first commit of a round: when it began)
            return int(version)

        import coordinator.service  # noqa: F401  (loaded now, so its reference to ingest_object is replaced below)

        replaced: list[tuple[Any, str, Any]] = [(m, "ingest_object", ingest_object) for m in list(sys.modules.values())
                                                if getattr(m, "ingest_object", None) is saved[0]]
        replaced += [(tick, "write_aggregate", write_aggregate), (Bucket, "complete_multipart", timed(saved[2])),
                     (Bucket, "copy", timed(saved[3])), (StateStore, "commit", commit)]
        originals = [(owner, name, getattr(owner, name)) for owner, name, _ in replaced]
        for owner, name, value in replaced:
            setattr(owner, name, value)
        try:
            yield
        finally:
            for owner, name, value in originals:
                setattr(owner, name, value)


def cpu_seconds(pid: int | str) -> float:
    """User + system CPU seconds a process has used so far (0 if it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Watcher(threading.Thread):
    """Samples every process's peak memory and CPU seconds used so far (from /proc: no request to the stack, whose
    CPU it measures)."""

    def __init__(self, pids: Callable[[], dict[str, int]]) -> None:
        super().__init__(daemon=True)
        self.pids = pids
        self.peaks: dict[str, int] = defaultdict(int)
        self.cpu: list[tuple[float, dict[str, float]]] = []  # (time, process name -> CPU seconds so far)
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.05):
            pids = self.pids()
            for name, pid in pids.items():
                self.peaks[name] = max(self.peaks[name], vm(pid, "VmHWM"))
            self.cpu.append((time.time(), {name: cpu_seconds(pid) for name, pid in pids.items()}))

    def cpu_between(self, began: float, ended: float) -> dict[str, float]:
        """CPU seconds each kind of process (server, functions, shard workers, participants) used between two
        times, from the samples nearest them."""
        inside = [sample for at, sample in self.cpu if began <= at <= ended]
        if len(inside) < 2:
            return {}
        kinds: dict[str, float] = defaultdict(float)
        for name in inside[-1]:
            kind = "shard workers" if name.startswith("shard worker") else name
            kind = "participants" if name.startswith("p") and name[1:].isdigit() else kind
            kinds[kind] += max(0.0, inside[-1][name] - inside[0].get(name, 0.0))
        return dict(kinds)


def pool_pids(stack: Any) -> dict[str, int]:
    """The stack's shard workers (`local.shard_pool`), by process id."""
    shards = stack.dispatcher.functions.shards if stack.dispatcher is not None else None
    return {f"shard worker {i}": pid for i, pid in enumerate(shards.worker_pids() if shards is not None else [])}


_UPLOAD = re.compile(r"round (\d+): update uploaded \(.*?([0-9.]+)s\)")
_DOWNLOAD = re.compile(r"round (\d+): global model \w+ \(.*?downloaded in ([0-9.]+)s\)")
_TRAINED = re.compile(r"round (\d+): trained in ([0-9.]+)s")


def participant_times(log: Path) -> tuple[dict[int, float], dict[int, float], dict[int, float]]:
    """Seconds of each round's upload, download and training, from a participant's log."""
    text = log.read_text(errors="replace")
    return tuple({int(r): float(s) for r, s in pattern.findall(text)}  # type: ignore[return-value]
                 for pattern in (_UPLOAD, _DOWNLOAD, _TRAINED))


def one_run(megabytes: float, dtype: str, shards: int, participants: int, rounds: int, workdir: Path) -> dict[str, Any]:
    from fed.demo import Participants, await_joins, check_processes
    from fed.localrun import store_for
    from local.server import ServerProcess
    from local.stack import LocalStack
    from participant.tasks.wide import wide
    from shared.config import RunConfig
    from shared.state import Phase

    hidden = wide(megabytes).hidden
    model_bytes = (75 * hidden + 10) * (4 if dtype == "fp32" else 2)
    presets = {1070: "gb1", 271: "mb271", 64: "mb64"}  # participant.tasks.wide's named sizes
    if int(megabytes) not in presets:
        raise SystemExit(f"--megabytes must be one of {sorted(presets)} (participant.tasks.wide's named sizes)")
    task = f"participant.tasks.wide:{presets[int(megabytes)]}" + ("" if dtype == "fp32" else "_bf16")
    config = RunConfig(
        run_id=f"big-{dtype}-k{shards}", task=task, dataset_size=64, batch_size=8, strategy="fedavg",
        min_clients=participants, min_per_round=participants, min_updates=participants, total_rounds=rounds,
        warmup_time=1, max_round_train_time=900, cooldown_time=0, liveness_timeout=900, learning_rate=0.01,
        max_update_bytes=4 * 1024**3, shard_bytes=max(8 * 1024**2, -(-model_bytes // shards) + 8 * 1024**2),
    )
    timings = Timings()
    names = [f"p{i}" for i in range(participants)]
    with contextlib.suppress(OSError):  # this process's peak so far (an earlier run's) is not this run's
        Path("/proc/self/clear_refs").write_text("5")
    with timings.installed(), LocalStack(config, tick_interval=1.0, log_level="WARNING",
                                         server_process=True) as stack:
        server_pid = stack.server.pid if isinstance(stack.server, ServerProcess) else os.getpid()
        connection = workdir / f"{config.run_id}.json"
        stack.connection.save(connection)
        procs = Participants(connection, workdir / config.run_id)
        store = store_for(stack.connection)
        watcher = Watcher(lambda: {**{n: p.process.pid for n, p in procs.procs.items()}, **pool_pids(stack),
                                   "stack: functions (this process)": os.getpid(), "stack: server": server_pid})
        watcher.start()
        began = time.time()
        procs.spawn(names)
        await_joins(stack, names, procs, timeout=600)
        stack.release_events()
        while store.read_state().phase is not Phase.FINISHED:
            check_processes(procs)
            if time.time() - began > 3600:
                raise SystemExit("the run took over an hour")
            time.sleep(0.5)
        procs.wait_exit(120)
        watcher.stop.set()
        watcher.join()
        summaries = sorted(store.rounds(), key=lambda s: s.round)
        limit = data_movement_limit(stack, workdir, model_bytes, participants)
        alone = {kind: measure_alone(kind, stack, workdir) for kind in ("ingest", "shard")}
        logs = {n: participant_times(p.log) for n, p in procs.procs.items()}
    return {"config": config, "model_bytes": model_bytes, "timings": timings, "summaries": summaries,
            "peaks": dict(watcher.peaks), "cpu": [watcher.cpu_between(b, e) for b, e in timings.aggregations],
            "limit": limit, "alone": alone, "logs": logs,
            "seconds": time.time() - began}


def data_movement_limit(stack: Any, workdir: Path, model_bytes: int, updates: int) -> dict[str, float]:
    """Plain boto3 transfer of a model-sized object against the same server, and numpy's weighted sum of
    `updates` model-sized float32 arrays."""
    import boto3
    from boto3.s3.transfer import TransferConfig
    from botocore.config import Config

    c = stack.connection
    s3 = boto3.client("s3", endpoint_url=c.endpoint, region_name=c.region,
                      config=Config(request_checksum_calculation="when_required",
                                    response_checksum_validation="when_required"))
    path = workdir / "plain.bin"
    with path.open("wb") as f:
        for _ in range(-(-model_bytes // (64 * 1024**2))):
            f.write(os.urandom(min(64 * 1024**2, model_bytes - f.tell())))
    transfer = TransferConfig(multipart_chunksize=8 * 1024**2, max_concurrency=4)
    started = time.perf_counter()
    s3.upload_file(str(path), c.bucket, "bench/plain.bin", Config=transfer)
    put = time.perf_counter() - started
    started = time.perf_counter()
    s3.download_file(c.bucket, "bench/plain.bin", str(path), Config=transfer)
    get = time.perf_counter() - started
    path.unlink()
    arrays = [np.ones(model_bytes // 4, np.float32) * i for i in range(updates)]
    started = time.perf_counter()
    acc = arrays[0] * np.float32(1 / updates)
    tmp = np.empty_like(acc)
    for x in arrays[1:]:
        np.multiply(x, np.float32(1 / updates), out=tmp)
        acc += tmp
    weighted = time.perf_counter() - started
    return {"put_gbps": model_bytes / put / GB, "get_gbps": model_bytes / get / GB,
            "sum_gbps": updates * model_bytes / weighted / GB}


def measure_alone(kind: str, stack: Any, workdir: Path) -> dict[str, float]:
    """One ingest of the run's last accepted update, or one shard of its last round, in a fresh process:
    (peak - baseline) of that process, and seconds."""
    out = workdir / f"alone-{kind}.json"
    env = {**os.environ}
    subprocess.run([sys.executable, __file__, "--alone", kind, "--out", str(out)], check=True, cwd=REPO, env=env)
    return dict(json.loads(out.read_text()))


def alone(kind: str, out: Path) -> None:
    """(In a fresh process, with the stack's function environment inherited.)"""
    from coordinator.aggregation import job_id, run_shard
    from coordinator.intake import ObjectCreated, _signed_model
    from coordinator.model_files import read_global
    from functions.settings import deps_from_env
    from shared import keys
    from shared.aggregate import round_plan
    from shared.messages import ShardInput, ShardTask

    deps = deps_from_env()
    state = deps.store.read_state()
    last = max(s.round for s in deps.store.rounds() if s.aggregated)
    records = [u for u in deps.store.all_updates() if u.round == last and u.accepted]
    base_digest = next((s.global_digest for s in deps.store.rounds() if s.round == last - 1), None)
    base_digest = base_digest or deps.store.participants()[state.model_source].init_digest
    baseline = vm("self", "VmRSS")
    started = time.perf_counter()
    if kind == "ingest":
        rec = records[0]
        head = deps.bucket.client.head_object(Bucket=deps.bucket.name, Key=rec.key, VersionId=rec.version_id)
        obj = ObjectCreated(deps.bucket.name, rec.key, int(head["ContentLength"]), rec.etag, rec.version_id, 0.0)
        model = read_global(deps, last, base_digest)
        baseline = vm("self", "VmRSS")  # the global's header read; now one update streams through
        started = time.perf_counter()
        _signed_model(deps, obj, rec.pid, model, check=True)
    else:
        base = read_global(deps, last, base_digest)
        inputs = [ShardInput(participant=u.pid, samples=u.samples, digest=u.digest, version_id=u.version_id,
                             norm=u.norm) for u in sorted(records, key=lambda u: u.pid)]
        from coordinator.aggregation import weighted_inputs

        plan = round_plan(deps.config, base.manifest, last + 1, weighted_inputs(deps, last, base, inputs))
        staging = keys.staging_key(deps.config.run_id, last + 1, job_id(plan, base_digest))
        upload_id = deps.bucket.start_multipart(staging)
        shard = plan.shards(deps.config.shard_bytes)[0]
        task = ShardTask(round=last, base_digest=base_digest, base_version=base.version_id, base_size=base.size,
                         inputs=inputs, staging=staging, upload_id=upload_id, first=shard.start, stop=shard.stop)
        baseline = vm("self", "VmRSS")
        started = time.perf_counter()
        run_shard(deps, task)
        deps.bucket.abort_multipart(staging, upload_id)
    seconds = time.perf_counter() - started
    out.write_text(json.dumps({"above_baseline": vm("self", "VmHWM") - baseline, "baseline": baseline,
                               "seconds": seconds}))


def report(run: dict[str, Any]) -> None:
    config, timings, model_bytes = run["config"], run["timings"], run["model_bytes"]
    print(f"\n== {config.run_id}: {len(run['logs'])} participants, update {model_bytes / MB:,.0f} MB, K = "
          f"{-(-model_bytes // config.shard_bytes)} shard(s), {len(run['summaries'])} rounds in {run['seconds']:.0f}s")
    print(f"{'round':>5}{'train':>8}{'upload':>9}{'ingest':>9}{'aggreg.':>9}{'glob.wr':>9}{'download':>10}"
          f"{'coord.':>9}{'round s':>9}")
    ingests = sorted(timings.ingest, key=lambda i: i[1])
    accepted = [i for i in ingests if i[3]]
    coordinator = []
    for s in run["summaries"]:
        r = s.round
        mine = [i for i in accepted if f"/rounds/{r:06d}/" in i[0]]
        up = max((u.get(r, 0.0) for u, _, _ in run["logs"].values()), default=0.0)
        down = max((d.get(r + 1, 0.0) for _, d, _ in run["logs"].values()), default=0.0)
        train = max((t.get(r, 0.0) for _, _, t in run["logs"].values()), default=0.0)
        ingest = max((e - b for _, b, e, _ in mine), default=0.0)
        committed = timings.commits.get(r + 1, 0.0)
        # the aggregation that produced round r + 1's model: the last one to end before that commit
        aggs = [a for a in timings.aggregations if committed and a[1] <= committed]
        agg_span = aggs[-1] if aggs else (0.0, 0.0)
        agg = agg_span[1] - agg_span[0]
        writes = sum(e - b for b, e in timings.global_writes if agg_span[0] <= b <= agg_span[1])
        coord = committed - mine[-1][1] if mine and committed else 0.0
        coordinator.append(coord)
        whole = committed - timings.commits[r] if committed and r in timings.commits else 0.0
        print(f"{r:5d}{train:8.2f}{up:9.2f}{ingest:9.2f}{agg:9.2f}{writes:9.2f}{down:10.2f}{coord:9.2f}{whole:9.2f}")
    limit = run["limit"]
    n = len(run["logs"])
    # what the coordinator must move after the last upload: one update read at ingest, every update read and
    # the global written by the aggregation, plus the weighted sum itself
    moved = model_bytes / (limit["get_gbps"] * GB) + n * model_bytes / (limit["get_gbps"] * GB) \
        + model_bytes / (limit["put_gbps"] * GB) + n * model_bytes / (limit["sum_gbps"] * GB)
    med = statistics.median(c for c in coordinator if c) if any(coordinator) else 0.0
    print(f"data-movement limit on this server: boto3 put {limit['put_gbps']:.2f} GB/s, get {limit['get_gbps']:.2f} "
          f"GB/s, numpy weighted sum {limit['sum_gbps']:.2f} GB/s of update bytes; the coordinator's bytes after "
          f"the last upload at those rates: {moved:.2f}s; coordinator median {med:.2f}s = {med / moved:.2f}x the "
          "limit")
    for (b, e), cpu in zip(run["timings"].aggregations, run["cpu"], strict=True):
        if cpu:
            print(f"aggregation of {e - b:.2f}s: CPU seconds " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(
                cpu.items())) + f"; all together {sum(cpu.values()):.2f}, i.e. at least "
                f"{sum(cpu.values()) / (os.cpu_count() or 1):.2f}s on this machine's {os.cpu_count()} cores")
    print("peak resident memory:")
    for name, peak in sorted(run["peaks"].items()):
        print(f"  {name:24}{peak / GB:7.2f} GB")
    print(f"  sum of peaks            {sum(run['peaks'].values()) / GB:7.2f} GB (an upper bound of the whole run)")
    for kind, figures in run["alone"].items():
        print(f"  one {kind} alone: {figures['above_baseline'] / MB:6.0f} MB above its baseline of "
              f"{figures['baseline'] / MB:.0f} MB ({figures['seconds']:.2f}s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megabytes", type=float, default=1070)
    parser.add_argument("--participants", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--shards", default="1,2")
    parser.add_argument("--alone", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.alone:
        alone(args.alone, Path(args.out))
        return
    runs = []
    with tempfile.TemporaryDirectory(prefix="fed-bench-big-") as tmp:
        for dtype in args.dtypes.split(","):
            for shards in (int(k) for k in args.shards.split(",")):
                run = one_run(args.megabytes, dtype, shards, args.participants, args.rounds, Path(tmp))
                report(run)
                runs.append(run)
    by_k = {(r["config"].run_id.split("-")[1], -(-r["model_bytes"] // r["config"].shard_bytes)): r for r in runs}
    for dtype in args.dtypes.split(","):
        one, two = by_k.get((dtype, 1)), by_k.get((dtype, 2))
        if one and two:
            a = statistics.median(e - b for b, e in one["timings"].aggregations)
            b = statistics.median(e - b for b, e in two["timings"].aggregations)
            print(f"{dtype}: aggregation K=2 / K=1 speed: {a / b:.2f}x")


if __name__ == "__main__":
    main()
