"""Aggregation from files: the coordinator's piece-wise path against Flower's algorithm and numpy's limit.

    .venv/bin/python benchmarks/aggregation.py [--updates 8] [--params 25000000] [--repeat 5]

Writes N safetensors updates of a ~25M-parameter float32 model (the wire format participants upload) to a
temporary directory, then aggregates them (FedAvg, weighted by sample counts) with

- project K=1: `shared.aggregate.PieceAggregator`, the coordinator's code (each 8 MiB piece of the output
  computed from every update's range of it, read and summed 1 MiB at a time — the file stands in for a ranged
  GET streamed in slices — hashed with the digest's piece hash, and written once to an output file), in one
  process;
- project K=1, 1 core and K=2, 1 core each: the same pieces as one shard, and cut into two shards as
  `PiecePlan.shards` cuts them (as evenly as whole pieces allow) computed
  by two processes at once, each pinned to its own core (a shard-worker function below 1,769 MB has one
  vCPU; the local stack's workers are processes): wall time from the common start to the last end;
- Flower: Flower's `aggregate_inplace` algorithm reproduced (every update loaded with safetensors first,
  then scaled in place and summed layer by layer), cross-checked against the 1.7-1.9 GB/s FACTS.md records;
- numpy: the float32 weighted sum over the same arrays already in memory (no file reads): element-wise with a
  reused temporary, and as one BLAS matrix-vector product over the stacked updates (memory speed, but its
  summation order depends on the BLAS kernel, so the coordinator cannot use it: a global model's bytes must
  be recomputable anywhere); and numpy from files (each update read with `np.fromfile`, one at a time).

Each runs in a fresh process (its peak resident memory, VmHWM, above the process's baseline is its own),
`--repeat` times, alternating; the median is reported. Throughput counts update bytes aggregated per second
(the basis every limit is stated on). A benchmark, not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from shared import wire  # noqa: E402
from shared.aggregate import AtOffsets, PieceAggregator, WeightedInput, round_plan  # noqa: E402
from shared.config import RunConfig  # noqa: E402
from shared.digest import combine, piece_hash  # noqa: E402
from shared.plan import PiecePlan  # noqa: E402

GB = 1e9
METHODS = ("project K=1", "project K=1, 1 core", "project K=2, 1 core each", "Flower", "numpy from files",
           "numpy f32 in memory", "numpy BLAS in memory")


def model_shapes(params: int) -> dict[str, tuple[int, ...]]:
    """Square 1024-wide layers with biases, as many as make about `params` parameters."""
    width = 1024
    layers = max(1, round(params / (width * width + width)))
    shapes: dict[str, tuple[int, ...]] = {}
    for i in range(layers):
        shapes[f"layer{i:02d}.weight"] = (width, width)
        shapes[f"layer{i:02d}.bias"] = (width,)
    return shapes


def write_updates(directory: Path, n: int, params: int) -> list[tuple[Path, int]]:
    rng = np.random.default_rng(0)
    files = []
    for i in range(n):
        arrays = {name: rng.standard_normal(shape, np.float32) for name, shape in model_shapes(params).items()}
        meta = wire.UpdateMeta("bench", 0, f"p{i:02d}", 100 + i, {"loss": 1.0})
        path = directory / f"p{i:02d}.safetensors"
        path.write_bytes(wire.encode(arrays, meta.to_metadata()))
        files.append((path, 100 + i))
    return files


class FileRange:
    """A RangeSource over an update file on disk (the bench's stand-in for ranged GETs)."""

    def __init__(self, path: Path) -> None:
        self.fd = os.open(path, os.O_RDONLY)
        first = os.pread(self.fd, 8, 0)
        self.data_offset = 8 + int.from_bytes(first, "little")

    def readinto(self, begin: int, buf: memoryview) -> None:
        done = 0
        while done < len(buf):
            done += os.preadv(self.fd, [buf[done:]], self.data_offset + begin + done)

    def stream(self, begin: int, end: int) -> AtOffsets:  # (a ranged GET read in slices, on Lambda)
        return AtOffsets(self, begin)


def project_plan(files: list[tuple[Path, int]]) -> tuple[PiecePlan, list[WeightedInput], RunConfig]:
    config = RunConfig(run_id="bench", strategy="fedavg")  # Flower's algorithm, measured against it
    path = files[0][0]
    with path.open("rb") as f:
        first = f.read(8)
        prefix = first + f.read(int.from_bytes(first, "little"))
    manifest = wire.Manifest.of(wire.parse_header_prefix(prefix, path.stat().st_size))
    inputs = [WeightedInput(p.stem, s, "", FileRange(p)) for p, s in files]
    return round_plan(config, manifest, 1, inputs), inputs, config


def project(files: list[tuple[Path, int]], out: Path, shard: int = 0, shards: int = 1) -> str:
    """Pieces of the global (shard `shard` of `shards`) written to `out` at their offsets; their hash."""
    plan, inputs, config = project_plan(files)
    worker = PieceAggregator(config, plan, inputs, None)
    pieces = range(shard * plan.pieces // shards, (shard + 1) * plan.pieces // shards)  # as `PiecePlan.shards` cuts
    hashes = []
    with out.open("r+b" if out.exists() else "w+b") as f, ThreadPoolExecutor(max_workers=1) as writer:

        def write(index: int, data: bytearray) -> None:  # hashed and written while the next piece is computed
            hashes.append(piece_hash(data))
            os.pwrite(f.fileno(), data, plan.piece_span(index)[0])

        pending, writing, spare = None, None, None
        for index in pieces:
            data = worker.piece_output(index, spare).data  # (the buffer of the piece written before the last)
            if pending is not None:
                pending.result()
            spare, writing = writing, data
            pending = writer.submit(write, index, data)
        if pending is not None:
            pending.result()
    return combine(hashes)


def flower(files: list[tuple[Path, int]]) -> dict[str, np.ndarray]:
    """Flower's in-place FedAvg: every update decoded first (all held), then each scaled by its share of the
    samples in place and summed layer by layer into the first."""
    from safetensors.numpy import load_file

    loaded = [(load_file(str(p)), s) for p, s in files]
    total = sum(s for _, s in loaded)
    names = sorted(loaded[0][0])
    params = [np.multiply(loaded[0][0][n], np.float32(loaded[0][1] / total), out=loaded[0][0][n]) for n in names]
    for arrays, samples in loaded[1:]:
        scale = np.float32(samples / total)
        for i, n in enumerate(names):
            np.add(params[i], np.multiply(arrays[n], scale, out=arrays[n]), out=params[i])
    return dict(zip(names, params, strict=True))


def numpy_from_files(files: list[tuple[Path, int]]) -> np.ndarray:
    total = sum(s for _, s in files)
    acc = None
    for path, samples in files:
        offset = FileRange(path).data_offset
        x = np.fromfile(path, np.float32, offset=offset)
        acc = x * np.float32(samples / total) if acc is None else acc + x * np.float32(samples / total)
    assert acc is not None
    return acc


def peak_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def child(method: str, listing: str, out: str, shard: int, start_at: float) -> None:
    files = [(Path(p), int(s)) for p, s in json.loads(listing)]
    arrays, stacked = None, None
    if method.endswith("in memory"):  # loaded before the clock starts: only the weighted sum is timed
        arrays = [(np.fromfile(p, np.float32, offset=FileRange(p).data_offset), s) for p, s in files]
        stacked = np.stack([x for x, _ in arrays]) if "BLAS" in method else None
    before = peak_rss()
    while time.time() < start_at:  # (K=2: both workers start together)
        time.sleep(0.001)
    started = time.time()
    if method.startswith("project"):
        shards = 2 if "K=2" in method else 1
        if "1 core" in method:  # a shard worker with one vCPU (a Lambda function below 1,769 MB has one)
            os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[shard % len(os.sched_getaffinity(0))]})
        project(files, Path(out).with_suffix(".global"), shard, shards)
    elif method == "Flower":
        flower(files)
    elif method == "numpy from files":
        numpy_from_files(files)
    elif stacked is not None:  # one matrix-vector product over the stacked updates: memory speed
        total = sum(s for _, s in arrays or [])
        np.dot(np.array([s / total for _, s in arrays or []], np.float32), stacked)
    else:  # element-wise, no temporaries allocated: what numpy does without BLAS
        assert arrays is not None
        total = sum(s for _, s in arrays)
        acc = arrays[0][0] * np.float32(arrays[0][1] / total)
        tmp = np.empty_like(acc)
        for x, s in arrays[1:]:
            np.multiply(x, np.float32(s / total), out=tmp)
            acc += tmp
    ended = time.time()
    Path(out).write_text(json.dumps({"started": started, "ended": ended, "peak": peak_rss() - before}))


def measure(method: str, files: list[tuple[Path, int]], workdir: Path) -> dict[str, float]:
    listing = json.dumps([[str(p), s] for p, s in files])
    workers = 2 if "K=2" in method else 1
    start_at = time.time() + 3.0  # time to import numpy and open the files
    procs, outs = [], []
    for shard in range(workers):
        out = workdir / f"result-{shard}.json"
        outs.append(out)
        procs.append(subprocess.Popen([sys.executable, __file__, "--child", method, "--listing", listing,
                                       "--out", str(out), "--shard", str(shard), "--start-at", str(start_at)],
                                      cwd=REPO))
    for p in procs:
        if p.wait() != 0:
            raise RuntimeError(f"{method} failed")
    results = [json.loads(o.read_text()) for o in outs]
    return {"seconds": max(r["ended"] for r in results) - min(r["started"] for r in results),
            "peak": max(r["peak"] for r in results)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--updates", type=int, default=8)
    parser.add_argument("--params", type=int, default=25_000_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--listing", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--shard", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--start-at", type=float, default=0.0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.listing, args.out, args.shard, args.start_at)
        return

    with tempfile.TemporaryDirectory(prefix="fed-bench-") as tmp:
        workdir = Path(tmp)
        began = time.perf_counter()
        files = write_updates(workdir, args.updates, args.params)
        model_bytes = files[0][0].stat().st_size
        total = sum(p.stat().st_size for p, _ in files)
        params = sum(int(np.prod(s)) for s in model_shapes(args.params).values())
        print(f"{args.updates} updates of {params / 1e6:.1f}M float32 parameters ({model_bytes / 1e6:.0f} MB each, "
              f"{total / 1e9:.2f} GB in all); median of {args.repeat} runs, each in fresh processes; "
              f"{os.cpu_count()} cores")
        check = workdir / "check"
        single = project(files, check.with_suffix(".k1"))
        split = [project(files, check.with_suffix(".k2"), s, 2) for s in range(2)]
        same = check.with_suffix(".k1").read_bytes() == check.with_suffix(".k2").read_bytes()
        want = flower(files)
        got, _ = wire.decode(check.with_suffix(".k1").read_bytes())
        worst = max(float(np.abs(got[n].astype(np.float64) - want[n]).max()) for n in want)
        print(f"K=1 and K=2 outputs byte-identical: {same}; largest difference from Flower's result: {worst:.2e} "
              f"(float32 rounding); digest pieces {single[:12]} / {split[0][:12]}")
        runs: dict[str, list[dict[str, float]]] = {m: [] for m in METHODS}
        for _ in range(args.repeat):
            for method in METHODS:
                runs[method].append(measure(method, files, workdir))
        rates = {}
        print(f"{'':26}{'seconds':>9}{'GB/s':>8}{'peak memory':>14}{'x model':>9}")
        for method, results in runs.items():
            seconds = statistics.median(r["seconds"] for r in results)
            peak = max(r["peak"] for r in results)
            rates[method] = total / seconds / GB
            print(f"{method:26}{seconds:9.2f}{rates[method]:8.2f}{peak / 1e6:11.0f} MB{peak / model_bytes:9.1f}")
        k1, k2 = rates["project K=1"], rates["project K=2, 1 core each"]
        print(f"project K=1 / Flower: {k1 / rates['Flower']:.2f}x   project K=2 / Flower: {k2 / rates['Flower']:.2f}x")
        for limit in ("numpy from files", "numpy f32 in memory", "numpy BLAS in memory"):
            print(f"project K=1 / {limit}: {k1 / rates[limit]:.2f}x   K=2 / {limit}: {k2 / rates[limit]:.2f}x")
        print(f"K=2 / K=1 with one core per shard worker: {k2 / rates['project K=1, 1 core']:.2f}x")
        print(f"benchmark took {time.perf_counter() - began:.0f}s")


if __name__ == "__main__":
    main()
