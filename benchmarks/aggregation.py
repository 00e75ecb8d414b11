"""Aggregation throughput and peak memory: the coordinator's streaming FedAvg against holding everything.

    .venv/bin/python benchmarks/aggregation.py [--updates 8] [--params 25000000] [--repeat 3]

Writes N safetensors updates of a ~25M-parameter float32 model (the wire format participants upload) to a
temporary directory, then aggregates them with

- streaming: `shared.aggregate.fedavg`, the coordinator's code path (each update read, decoded and added
  into one float64 accumulator, one at a time), and
- hold-all: the naive baseline, as Flower's `aggregate()` does it: decode every update first, then
  multiply each by its sample count and sum layer by layer (every update, and every weighted copy, held).

Each measurement runs in a fresh process (its peak resident memory, VmHWM, above what the process held
before aggregating, is its own), alternating the two,
`--repeat` times; the median time is reported. Throughput is update bytes aggregated per second.
Printed: GB/s and peak memory (above the process's baseline, and in model sizes) of each, and the ratios,
all measured in this one run. It is a benchmark, not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from functools import reduce
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from shared import wire  # noqa: E402
from shared.aggregate import WeightedInput, fedavg  # noqa: E402

GB = 1e9


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
    shapes = model_shapes(params)
    files = []
    for i in range(n):
        arrays = {name: rng.standard_normal(shape, dtype=np.float32) for name, shape in shapes.items()}
        samples = int(rng.integers(50, 500))
        meta = wire.UpdateMeta("bench", 0, f"p{i:02d}", samples, {"loss": 1.0})
        path = directory / f"p{i:02d}.safetensors"
        path.write_bytes(wire.encode(arrays, meta.to_metadata()))
        files.append((path, samples))
    return files


# --- the two ways, each run in a child process ---------------------------------------------------------


def streaming(files: list[tuple[Path, int]]) -> dict[str, np.ndarray]:
    """The coordinator's FedAvg: loaders read and decode one update when the accumulator asks for it."""
    manifest = wire.Manifest.of(wire.parse_header(files[0][0].read_bytes()))

    def loader(path: Path):  # type: ignore[no-untyped-def]
        return lambda: wire.decode(path.read_bytes())[0]

    inputs = [WeightedInput(path.stem, samples, "", loader(path)) for path, samples in files]
    return fedavg(manifest, inputs)


def hold_all(files: list[tuple[Path, int]]) -> dict[str, np.ndarray]:
    """Decode every update, then Flower's `aggregate()`: weighted copies of all, summed layer by layer."""
    from safetensors.numpy import load

    decoded = [(load(path.read_bytes()), samples) for path, samples in files]
    names = sorted(decoded[0][0])
    results = [([arrays[name] for name in names], samples) for arrays, samples in decoded]
    num_examples_total = sum(num_examples for (_, num_examples) in results)
    weighted_weights = [[layer * num_examples for layer in weights] for weights, num_examples in results]
    weights_prime = [
        reduce(np.add, layer_updates) / num_examples_total for layer_updates in zip(*weighted_weights, strict=True)
    ]
    return dict(zip(names, weights_prime, strict=True))


def peak_rss() -> int:
    """This process's resident-memory high-water mark in bytes (VmHWM: unlike ru_maxrss, not inherited
    from the parent across fork and exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def child(method: str, listing: str, out: str) -> None:
    files = [(Path(p), int(s)) for p, s in json.loads(listing)]
    before = peak_rss()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    started = time.perf_counter()
    result = streaming(files) if method == "streaming" else hold_all(files)
    seconds = time.perf_counter() - started
    peak = peak_rss()
    after = resource.getrusage(resource.RUSAGE_SELF)
    system = after.ru_stime - usage.ru_stime
    faults = after.ru_minflt - usage.ru_minflt
    checksum = {name: float(np.asarray(value, np.float64).sum()) for name, value in sorted(result.items())[:4]}
    Path(out).write_text(json.dumps({"seconds": seconds, "peak": peak - before, "checksum": checksum,
                                     "system": system, "faults": faults}))


def measure(method: str, files: list[tuple[Path, int]], workdir: Path) -> dict[str, object]:
    out = workdir / f"{method}.json"
    listing = json.dumps([[str(p), s] for p, s in files])
    subprocess.run([sys.executable, __file__, "--child", method, "--listing", listing, "--out", str(out)],
                   check=True, cwd=REPO)
    return dict(json.loads(out.read_text()))


def bandwidth(nbytes: int) -> float:
    """Bytes per second numpy streams through `acc += x` on float32 arrays of the model's size."""
    x = np.ones(nbytes // 4, np.float32)
    acc = np.zeros_like(x)
    acc += x  # touch the pages first
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        acc += x
        best = min(best, time.perf_counter() - started)
    return 3 * nbytes / best  # reads x and acc, writes acc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--updates", type=int, default=8)
    parser.add_argument("--params", type=int, default=25_000_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--child", choices=["streaming", "hold-all"], help=argparse.SUPPRESS)
    parser.add_argument("--listing", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.listing, args.out)
        return

    with tempfile.TemporaryDirectory(prefix="fed-bench-") as tmp:
        workdir = Path(tmp)
        began = time.perf_counter()
        files = write_updates(workdir, args.updates, args.params)
        model_bytes = files[0][0].stat().st_size
        params = sum(int(np.prod(s)) for s in model_shapes(args.params).values())
        total = sum(p.stat().st_size for p, _ in files)
        print(f"{args.updates} updates of {params / 1e6:.1f}M float32 parameters ({model_bytes / 1e6:.0f} MB each, "
              f"{total / 1e9:.2f} GB in all); median of {args.repeat} runs, each in a fresh process")
        runs: dict[str, list[dict[str, object]]] = {"streaming": [], "hold-all": []}
        for _ in range(args.repeat):
            for method in runs:
                runs[method].append(measure(method, files, workdir))
        a, b = runs["streaming"][0]["checksum"], runs["hold-all"][0]["checksum"]
        close = all(np.isclose(a[k], b[k], rtol=1e-5) for k in a)  # type: ignore[index]
        print("the two results agree (to float32 rounding)" if close else f"the results DIFFER: {a} vs {b}")
        figures = {}
        for method, results in runs.items():
            seconds = statistics.median(float(r["seconds"]) for r in results)  # type: ignore[arg-type]
            peak = max(int(r["peak"]) for r in results)  # type: ignore[call-overload]
            system = statistics.median(float(r["system"]) for r in results)  # type: ignore[arg-type]
            faults = statistics.median(int(r["faults"]) for r in results)  # type: ignore[call-overload]
            figures[method] = (seconds, total / seconds / GB, peak, system, faults)
        print(f"{'':12}{'seconds':>9}{'GB/s':>8}{'peak memory':>14}{'x model':>9}{'in kernel':>11}{'page faults':>13}")
        for method, (seconds, rate, peak, system, faults) in figures.items():
            print(f"{method:12}{seconds:9.2f}{rate:8.2f}{peak / 1e6:11.0f} MB{peak / model_bytes:9.1f}"
                  f"{system:10.2f}s{faults:13,.0f}")
        (_, s_rate, s_peak, *_), (_, h_rate, h_peak, *_) = figures["streaming"], figures["hold-all"]
        print(f"streaming / hold-all: throughput {s_rate / h_rate:.2f}x, peak memory {s_peak / h_peak:.2f}x "
              f"({h_peak / s_peak:.1f}x less)")
        bw = bandwidth(model_bytes)
        print(f"for scale: numpy's float32 `acc += x` on model-sized arrays moves {bw / GB:.1f} GB/s of memory "
              f"here; streaming FedAvg aggregates {s_rate:.2f} GB/s of update bytes, most of its time in the kernel "
              "faulting in fresh buffers (each update is read into new memory, decoded into more, then widened)")
        print(f"benchmark took {time.perf_counter() - began:.0f}s")


if __name__ == "__main__":
    main()
