"""`fed plan`: what one round costs in seconds and dollars on AWS, for each shard-worker count K, update encoding
and fragment count F, and which meets a target (`infra.cost_model.plan`)."""

from __future__ import annotations

import re

import typer

_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 1024, "mib": 1024**2, "gib": 1024**3,
          "tib": 1024**4}
_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*", re.IGNORECASE)


def parse_bytes(text: str) -> float:
    """'7e9', '14GB', '14 GiB', '500MB' as bytes."""
    m = _SIZE.fullmatch(text)
    if not m or m.group(2).lower() not in _UNITS:
        raise typer.BadParameter(f"{text!r}: a number of bytes, e.g. 7e9, 14GB or 14GiB")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if value <= 0:
        raise typer.BadParameter(f"{text!r}: must be more than 0 bytes")
    return value


def plan(
    model_bytes: str = typer.Option(..., "--model-bytes", metavar="SIZE", help="The model's size as stored: "
                                    "parameters x bytes per parameter (a 7 B bf16 model is 14GB). 7e9, 14GB, 14GiB."),
    participants: int = typer.Option(..., "--participants", min=1, help="Updates aggregated each round."),
    dtype_bytes: int = typer.Option(2, "--dtype-bytes", help="Bytes per parameter of the model's floats: 2 (bf16), "
                                    "4 (fp32). Sets what each encoding's wire ratio is relative to."),
    upload_mbps: float = typer.Option(1000.0, "--upload-mbps", min=0.001, help="Each participant's measured upload "
                                      "speed to the bucket, in megabits per second."),
    download_mbps: float | None = typer.Option(None, "--download-mbps", min=0.001, help="Each participant's "
                                               "download speed from the bucket, Mbit/s (default: the upload speed)."),
    workers: int | None = typer.Option(None, "--workers", "-K", min=1, help="Fix the shard workers K (default: "
                                       "try 1, 2, 4, ... 64)."),
    encoding: str | None = typer.Option(None, "--encoding", metavar="weights|bf16|int8|topk2|topk4",
                                        help="Fix the update encoding: what participants upload (topk: the top 2 % "
                                        "of each 4096-element chunk, 2- or 4-bit values). Default: try each."),
    download: str | None = typer.Option(None, "--download", metavar="full|bf16|int8|topk2|topk4",
                                        help="Fix what participants download (default: full for weights, else the "
                                        "update encoding's own kind)."),
    fragments: int | None = typer.Option(None, "--fragments", "-F", min=1, help="Fix Streaming DiLoCo's fragments "
                                         "F: a round syncs 1/F of the model (default: try 1, 2, 4, 8, 16)."),
    target_seconds: float = typer.Option(60.0, "--target-seconds", help="The most an aggregation may take."),
    target_dollars: float = typer.Option(0.05, "--target-dollars", help="The most a round may cost, data transfer "
                                         "out of S3 included."),
    egress: float | None = typer.Option(None, "--egress-usd-per-gb", help="S3 data transfer out per GB (default: "
                                        "the internet list price; 0 where the hosts are in the bucket's region)."),
    every_k: bool = typer.Option(False, "--every-k", help="Show every K, not only the best per encoding and F."),
) -> None:
    """Seconds and dollars of one round on AWS, split into upload, ingest, aggregation and download, for each
    candidate shard-worker count K, update encoding and fragment count F; then the one with the fewest fragments,
    then the cheapest, whose aggregation meets --target-seconds and whose round meets --target-dollars, or which
    limit stops them (exit status 1). Every limit and price is a named assumption in infra/cost_model.py
    (docs/deploy.md)."""
    from infra import cost_model as cm

    size = parse_bytes(model_bytes)
    encodings: tuple[str, ...] = cm.PLAN_ENCODINGS
    for name, value in (("--encoding", encoding), ("--download", download)):
        allowed = cm.PLAN_ENCODINGS[1:] + ("full",) if name == "--download" else cm.PLAN_ENCODINGS
        if value is not None and value not in allowed:
            raise typer.BadParameter(f"{value!r}: one of {', '.join(allowed)}", param_hint=name)
    if dtype_bytes not in (2, 4, 8):
        raise typer.BadParameter(f"{dtype_bytes}: 2, 4 or 8", param_hint="--dtype-bytes")
    if encoding is not None:
        encodings = (encoding,)
    assumptions = cm.TimeAssumptions() if egress is None else cm.TimeAssumptions(egress_usd_per_gb=egress)
    result = cm.plan(size, participants, dtype_bytes, upload_mbps * 1e6 / 8,
                     None if download_mbps is None else download_mbps * 1e6 / 8, target_seconds, target_dollars,
                     (workers,) if workers else cm.PLAN_WORKERS, encodings,
                     (fragments,) if fragments else cm.PLAN_FRAGMENTS, download, assumptions)
    if every_k:
        result = cm.Plan(result.candidates, result.candidates, result.pick, result.why_not)
    typer.echo(f"A round of {size / 1e9:,.2f} GB, {participants} participants at {upload_mbps:g} Mbit/s up: "
               f"seconds and dollars per phase (training aside)\n")
    typer.echo(cm.plan_table(result))
    if result.pick is None:
        raise typer.Exit(1)
