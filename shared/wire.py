"""The wire format: safetensors files and their metadata. The only module that reads or writes them.

The coordinator side uses numpy; participants use torch through `participant.tensors`, and both read
each other's files because both are plain safetensors. Nothing here ever unpickles.

Update metadata lives in the safetensors header (`__metadata__`, strings only):
    fed.schema       "1"
    fed.run          run id
    fed.round        round number the update trained from
    fed.participant  participant id
    fed.samples      number of training samples used (weight in FedAvg)
    fed.metrics      JSON object of training metrics (loss, accuracy, seconds, ...)
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from safetensors.numpy import load as _st_load

SCHEMA_VERSION = "1"
MAX_HEADER_BYTES = 16 * 1024 * 1024
MAX_METRICS_BYTES = 4096

# safetensors dtype tag -> (numpy dtype, bytes per element)
DTYPES: dict[str, tuple[str, int]] = {
    "F64": ("float64", 8),
    "F32": ("float32", 4),
    "F16": ("float16", 2),
    "I64": ("int64", 8),
    "I32": ("int32", 4),
    "I16": ("int16", 2),
    "I8": ("int8", 1),
    "U8": ("uint8", 1),
    "BOOL": ("bool", 1),
}
FLOAT_TAGS = frozenset({"F64", "F32", "F16"})


class WireError(ValueError):
    """A file that is not a well-formed model file; the message is the recorded refusal reason."""


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class TensorSpec:
    dtype: str  # safetensors tag, e.g. "F32"
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Header:
    tensors: dict[str, TensorSpec]
    metadata: dict[str, str] = field(default_factory=dict)


def parse_header(data: bytes) -> Header:
    """Check a safetensors file's framing without trusting it; raise WireError with the reason."""
    if len(data) < 8:
        raise WireError(f"not a safetensors file: {len(data)} bytes is shorter than the 8-byte header length")
    (n,) = struct.unpack("<Q", data[:8])
    if n > MAX_HEADER_BYTES:
        raise WireError(f"not a safetensors file: header length {n} exceeds {MAX_HEADER_BYTES}")
    if 8 + n > len(data):
        raise WireError(f"truncated safetensors file: header claims {n} bytes, file has {len(data) - 8}")
    try:
        raw = json.loads(data[8 : 8 + n].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise WireError("not a safetensors file: header is not JSON") from None
    if not isinstance(raw, dict):
        raise WireError("not a safetensors file: header is not a JSON object")
    metadata = raw.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise WireError("malformed metadata: __metadata__ must map strings to strings")
    body = len(data) - 8 - n
    tensors: dict[str, TensorSpec] = {}
    spans: list[tuple[int, int, str]] = []
    for name, entry in raw.items():
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise WireError(f"malformed header entry for tensor {name!r}")
        tag, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if tag not in DTYPES:
            raise WireError(f"tensor {name!r}: unsupported dtype {tag!r}")
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise WireError(f"tensor {name!r}: malformed shape {shape!r}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
            raise WireError(f"tensor {name!r}: malformed data offsets")
        begin, end = offsets
        spec = TensorSpec(tag, tuple(shape))
        if not 0 <= begin <= end <= body:
            raise WireError(
                f"truncated or corrupt file: tensor {name!r} data offsets {offsets} "
                f"outside the {body}-byte data section"
            )
        if end - begin != spec.numel * DTYPES[tag][1]:
            raise WireError(f"tensor {name!r}: header and data lengths disagree")
        tensors[name] = spec
        spans.append((begin, end, name))
    position = 0
    for begin, end, name in sorted(spans):
        if begin != position:
            raise WireError(f"tensor {name!r}: data sections overlap or leave gaps")
        position = end
    if position != body:
        raise WireError(f"header and data lengths disagree: {body - position} trailing bytes")
    return Header(tensors, dict(metadata))


_TAG_OF = {np.dtype(name): tag for tag, (name, _) in DTYPES.items()}


def encode(tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> bytes:
    """A safetensors file with a canonical layout: the same tensors and metadata always give the same bytes.

    (The safetensors library orders metadata by a hash map, so two writes of one model can differ; a
    global model's digest must be reproducible by anyone, so the layout is fixed here.)
    """
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(sorted(metadata.items()))
    chunks, offset = [], 0
    for name in sorted(tensors):
        arr = np.ascontiguousarray(tensors[name])
        if arr.dtype not in _TAG_OF:
            raise WireError(f"tensor {name!r}: dtype {arr.dtype} cannot be stored")
        raw = arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes()
        span = [offset, offset + len(raw)]
        header[name] = {"dtype": _TAG_OF[arr.dtype], "shape": list(arr.shape), "data_offsets": span}
        chunks.append(raw)
        offset += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + b"".join(chunks)


def decode(data: bytes) -> tuple[dict[str, np.ndarray], Header]:
    """Parse and load a file after checking its framing; tensors are numpy arrays."""
    header = parse_header(data)
    try:
        arrays = _st_load(data)
    except Exception as exc:  # safetensors raises its own error types
        raise WireError(f"not a loadable safetensors file: {exc}") from None
    return arrays, header


# --- the model manifest ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Manifest:
    """What every model of a run looks like: names, shapes and dtypes, fixed by the first global model."""

    tensors: dict[str, TensorSpec]

    def to_json(self) -> str:
        body = {
            "schema": SCHEMA_VERSION,
            "tensors": {n: {"dtype": s.dtype, "shape": list(s.shape)} for n, s in sorted(self.tensors.items())},
        }
        return json.dumps(body, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> Manifest:
        body = json.loads(text)
        return cls({n: TensorSpec(t["dtype"], tuple(t["shape"])) for n, t in body["tensors"].items()})

    @classmethod
    def of(cls, header: Header) -> Manifest:
        return cls(dict(header.tensors))

    @property
    def nbytes(self) -> int:
        return sum(s.numel * DTYPES[s.dtype][1] for s in self.tensors.values())

    def mismatch(self, header: Header) -> str | None:
        """The first way a file differs from the manifest, as a refusal reason; None if it matches."""
        missing = sorted(set(self.tensors) - set(header.tensors))
        extra = sorted(set(header.tensors) - set(self.tensors))
        if missing:
            return f"missing tensors: {', '.join(missing[:5])}"
        if extra:
            return f"unexpected tensors: {', '.join(extra[:5])}"
        for name, want in sorted(self.tensors.items()):
            got = header.tensors[name]
            if got.dtype != want.dtype:
                return f"wrong dtype for {name}: {got.dtype}, expected {want.dtype}"
            if got.shape != want.shape:
                return f"wrong shape for {name}: {list(got.shape)}, expected {list(want.shape)}"
        return None


def non_finite(arrays: dict[str, np.ndarray]) -> str | None:
    for name, arr in sorted(arrays.items()):
        if arr.dtype.kind == "f" and not np.isfinite(arr).all():
            return f"non-finite values (NaN or Inf) in {name}"
    return None


# --- update metadata -------------------------------------------------------------------------------


@dataclass(frozen=True)
class UpdateMeta:
    run_id: str
    round: int
    participant: str
    samples: int
    metrics: dict[str, float]

    def to_metadata(self) -> dict[str, str]:
        return {
            "fed.schema": SCHEMA_VERSION,
            "fed.run": self.run_id,
            "fed.round": str(self.round),
            "fed.participant": self.participant,
            "fed.samples": str(self.samples),
            "fed.metrics": json.dumps(self.metrics, sort_keys=True),
        }

    @classmethod
    def from_metadata(cls, md: dict[str, str]) -> UpdateMeta:
        """Parse update metadata; raise WireError naming what is malformed."""
        if md.get("fed.schema") != SCHEMA_VERSION:
            raise WireError(f"malformed metadata: fed.schema must be {SCHEMA_VERSION!r}")
        for name in ("fed.run", "fed.round", "fed.participant", "fed.samples"):
            if name not in md:
                raise WireError(f"malformed metadata: {name} missing")
        try:
            round_no, samples = int(md["fed.round"]), int(md["fed.samples"])
        except ValueError:
            raise WireError("malformed metadata: fed.round and fed.samples must be integers") from None
        raw = md.get("fed.metrics", "{}")
        if len(raw) > MAX_METRICS_BYTES:
            raise WireError(f"malformed metadata: fed.metrics exceeds {MAX_METRICS_BYTES} bytes")
        try:
            metrics: Any = json.loads(raw)
        except json.JSONDecodeError:
            raise WireError("malformed metadata: fed.metrics is not JSON") from None
        if not isinstance(metrics, dict) or not all(
            isinstance(k, str) and isinstance(v, int | float) and math.isfinite(v) for k, v in metrics.items()
        ):
            raise WireError("malformed metadata: fed.metrics must map names to finite numbers")
        return cls(md["fed.run"], round_no, md["fed.participant"], samples, {k: float(v) for k, v in metrics.items()})
