"""Compressed updates: bytes on the wire, aggregation speed and memory, and what the encodings cost in accuracy.

    .venv/bin/python benchmarks/compressed.py [--updates 8] [--params 25000000] [--repeat 3]

Writes a float32 global model of ~25M parameters and N trained updates (global + a small random step) in each
encoding (`shared.compress`: weights, bf16 delta, int8 delta per 256-element block, topk's 2 % of each 4096-element
chunk at 2 and 4 bits), then aggregates each set
with the coordinator's code (`PieceAggregator`, FedAvg; compressed inputs read through `DecodedSource`, the
global's range read once for all inputs through `CachedRange`), each in a fresh process (peak resident memory
above its baseline, VmHWM). Printed, per encoding: the bytes a participant uploads, the bytes the aggregation
reads, the seconds and the rate in update-weights-equivalent bytes per second, peak memory, and the relative
L2 error of the aggregate against the aggregate of the exact weights. A benchmark, not a test: nothing is
asserted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from aggregation import FileRange, model_shapes, peak_rss  # noqa: E402  (benchmarks/aggregation.py)

from shared import wire  # noqa: E402
from shared.aggregate import PieceAggregator, WeightedInput, round_plan  # noqa: E402
from shared.compress import CachedRange, DecodedSource, Encoding, encode_delta  # noqa: E402
from shared.config import RunConfig  # noqa: E402

ENCODINGS = ("weights", "bf16", "int8/256", "topk/2/4096/82", "topk/4/4096/82")  # topk: 2 % of each chunk
GB = 1e9


class CountingRange:
    """A range source that counts the bytes read through it."""

    def __init__(self, source: FileRange, counter: list[int]) -> None:
        self.source, self.counter = source, counter

    def readinto(self, begin: int, buf: memoryview) -> None:
        self.counter[0] += len(buf)
        self.source.readinto(begin, buf)


def write_files(directory: Path, n: int, params: int) -> None:
    rng = np.random.default_rng(0)
    shapes = model_shapes(params)
    base = {name: rng.standard_normal(shape, np.float32) for name, shape in shapes.items()}
    (directory / "global.safetensors").write_bytes(wire.encode(base))
    for i in range(n):
        trained = {k: v + rng.normal(0, 1e-3, v.shape).astype(np.float32) for k, v in base.items()}
        for text in ENCODINGS:
            enc = Encoding.parse(text)
            encoded, _ = encode_delta(trained, base, enc)
            meta = wire.UpdateMeta("bench", 0, f"p{i:02d}", 100 + i, {"loss": 1.0}).to_metadata()
            (directory / f"{text.replace('/', '-')}-p{i:02d}.safetensors").write_bytes(
                wire.encode(encoded, meta | enc.metadata()))


def aggregate(directory: Path, text: str, n: int, out: Path | None = None) -> int:
    """FedAvg of the `text` updates (written to `out` if given); the bytes read."""
    enc = Encoding.parse(text)
    base_path = directory / "global.safetensors"
    with base_path.open("rb") as f:
        first = f.read(8)
        prefix = first + f.read(int.from_bytes(first, "little"))
    manifest = wire.Manifest.of(wire.parse_header_prefix(prefix, base_path.stat().st_size))
    counter = [0]
    shared_base = CachedRange(CountingRange(FileRange(base_path), counter))
    inputs = []
    for i in range(n):
        stored = CountingRange(FileRange(directory / f"{text.replace('/', '-')}-p{i:02d}.safetensors"), counter)
        source = DecodedSource(manifest, enc, shared_base, stored) if enc.is_delta else stored
        inputs.append(WeightedInput(f"p{i:02d}", 100 + i, "", source))
    config = RunConfig(run_id="bench", strategy="fedavg")  # the weighted sum the encodings are compared under
    plan = round_plan(config, manifest, 1, inputs)
    worker = PieceAggregator(config, plan, inputs, None)
    with (out.open("wb") if out else open("/dev/null", "wb")) as f:
        for index in range(plan.pieces):
            f.write(worker.piece(index))
    return counter[0]


def child(directory: str, text: str, n: int, out: str) -> None:
    before = peak_rss()
    started = time.perf_counter()
    read = aggregate(Path(directory), text, n)
    seconds = time.perf_counter() - started
    Path(out).write_text(json.dumps({"seconds": seconds, "peak": peak_rss() - before, "read": read}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--updates", type=int, default=8)
    parser.add_argument("--params", type=int, default=25_000_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        directory, text, n, out = args.child
        child(directory, text, int(n), out)
        return
    with tempfile.TemporaryDirectory(prefix="fed-bench-") as tmp:
        work = Path(tmp)
        write_files(work, args.updates, args.params)
        weights_bytes = (work / "weights-p00.safetensors").stat().st_size
        print(f"{args.updates} updates of a {weights_bytes / 1e6:.0f} MB float32 model; FedAvg by the coordinator's "
              f"code, median of {args.repeat} runs, each in a fresh process")
        exact = None
        errors = {}
        for text in ENCODINGS:
            out = work / f"agg-{text.replace('/', '-')}.safetensors"
            aggregate(work, text, args.updates, out)
            got, _ = wire.decode(out.read_bytes())
            if exact is None:
                exact = {k: v.astype(np.float64) for k, v in got.items()}
                base, _ = wire.decode((work / "global.safetensors").read_bytes())
                step = np.sqrt(sum(float(((exact[k] - base[k]) ** 2).sum()) for k in exact))
            diff = np.sqrt(sum(float(((got[k] - exact[k]) ** 2).sum()) for k in exact))
            errors[text] = diff / step
            out.unlink()
        runs: dict[str, list[dict[str, float]]] = {t: [] for t in ENCODINGS}
        for _ in range(args.repeat):
            for text in ENCODINGS:
                result = work / "result.json"
                subprocess.run([sys.executable, __file__, "--child", str(work), text, str(args.updates), str(result)],
                               check=True, cwd=REPO)
                runs[text].append(json.loads(result.read_text()))
        print(f"{'encoding':16}{'upload MB':>11}{'x weights':>10}{'read GB':>9}{'seconds':>9}{'GB/s*':>8}"
              f"{'peak MB':>9}{'error of the aggregate step':>29}")
        base_seconds = statistics.median(r["seconds"] for r in runs["weights"])
        for text in ENCODINGS:
            size = (work / f"{text.replace('/', '-')}-p00.safetensors").stat().st_size
            seconds = statistics.median(r["seconds"] for r in runs[text])
            read = runs[text][0]["read"]
            peak = max(r["peak"] for r in runs[text])
            rate = weights_bytes * args.updates / seconds / GB
            print(f"{text:16}{size / 1e6:11.1f}{size / weights_bytes:10.3f}{read / GB:9.2f}{seconds:9.2f}{rate:8.2f}"
                  f"{peak / 1e6:9.0f}{errors[text]:29.2e}")
            if text != "weights":
                print(f"  {text}: aggregation time / weights' {seconds / base_seconds:.2f}x, bytes read / weights' "
                      f"{read / runs['weights'][0]['read']:.2f}x, upload / weights' {size / weights_bytes:.3f}x")
        int8 = statistics.median(r["seconds"] for r in runs["int8/256"])
        for text in ENCODINGS:
            if text.startswith("topk"):
                ratio = int8 / statistics.median(r["seconds"] for r in runs[text])
                verdict = "met" if ratio >= 0.5 else "MISSED"
                print(f"  {text}: throughput / int8's {ratio:.2f}x (target >= 0.5x: {verdict}),"
                      f" peak memory {max(r['peak'] for r in runs[text]) / 1e6:.0f} MB vs int8's "
                      f"{max(r['peak'] for r in runs['int8/256']) / 1e6:.0f} MB")
        print("* update-weights-equivalent bytes aggregated per second; error: |aggregate - exact aggregate| / "
              "|exact aggregate - global| (L2)")


if __name__ == "__main__":
    main()
