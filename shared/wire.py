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

import functools
import json
import math
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shared.digest import digest

__all__ = ["digest"]  # (re-exported: the one content digest of model files, shared.digest)

SCHEMA_VERSION = "1"
MAX_HEADER_BYTES = 16 * 1024 * 1024
MAX_METRICS_BYTES = 4096

# safetensors dtype tag -> bytes per element, in safetensors' own dtype order: a file lays its tensors out by this
# order descending, then by name, so every tensor starts at a multiple of its element size (see `canonical_layout`)
ITEMSIZE: dict[str, int] = {
    "BOOL": 1, "U8": 1, "I8": 1, "I16": 2, "F16": 2, "BF16": 2, "I32": 4, "F32": 4, "F64": 8, "I64": 8,
}
_RANK = {tag: i for i, tag in enumerate(ITEMSIZE)}
_NUMPY_NAMES = {"BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "F16": "float16", "I32": "int32",
                "F32": "float32", "F64": "float64", "I64": "int64"}  # and BF16: `bfloat16()`
_TAG_OF = {np.dtype(name): tag for tag, name in _NUMPY_NAMES.items()}


@functools.cache
def bfloat16() -> np.dtype[Any]:
    """numpy's bfloat16 (from ml_dtypes), imported on first use: the import costs about 0.6 s of CPU, which every
    Lambda cold start, CLI call and participant would pay though most runs never hold a bfloat16 tensor."""
    import ml_dtypes

    dtype: np.dtype[Any] = np.dtype(ml_dtypes.bfloat16)
    return dtype


def numpy_dtype(tag: str) -> np.dtype[Any]:
    """The numpy dtype of a safetensors dtype tag (one of `ITEMSIZE`)."""
    return bfloat16() if tag == "BF16" else np.dtype(_NUMPY_NAMES[tag])


def is_float(dtype: np.dtype[Any]) -> bool:
    """Whether a numpy dtype holds floats: numpy's own, or ml_dtypes' bfloat16 (its kind is "V")."""
    return dtype.kind == "f" or dtype.name == "bfloat16"


def tag_of(dtype: np.dtype[Any]) -> str | None:
    """The safetensors tag of a numpy dtype, or None if a file cannot hold it. (An array of bfloat16 exists only
    once ml_dtypes is imported, so asking for `bfloat16()` here imports nothing new.)"""
    if dtype.name == "bfloat16" and dtype == bfloat16():
        return "BF16"
    return _TAG_OF.get(dtype)


FLOAT_TAGS = frozenset({"F64", "F32", "F16", "BF16"})


class WireError(ValueError):
    """A file that is not a well-formed model file; the message is the recorded refusal reason."""


@dataclass(frozen=True)
class TensorSpec:
    dtype: str  # safetensors tag, e.g. "F32"
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


    @property
    def nbytes(self) -> int:
        return self.numel * ITEMSIZE[self.dtype]


@dataclass(frozen=True)
class Header:
    tensors: dict[str, TensorSpec]
    metadata: dict[str, str] = field(default_factory=dict)
    data_offset: int = 0  # where the data section starts in the file: 8 + the header's length
    offsets: dict[str, tuple[int, int]] = field(default_factory=dict)  # each tensor's span in the data section


def header_length(first8: bytes, total: int) -> int:
    """The header length a file's first 8 bytes declare, checked against the file's `total` size."""
    if total < 8 or len(first8) < 8:
        raise WireError(f"not a safetensors file: {total} bytes is shorter than the 8-byte header length")
    (n,) = struct.unpack("<Q", first8[:8])
    if n > MAX_HEADER_BYTES:
        raise WireError(f"not a safetensors file: header length {n} exceeds {MAX_HEADER_BYTES}")
    if 8 + n > total:
        raise WireError(f"truncated safetensors file: header claims {n} bytes, file has {total - 8}")
    return int(n)


def parse_header(data: bytes | memoryview) -> Header:
    """Check a safetensors file's framing without trusting it; raise WireError with the reason."""
    return parse_header_prefix(bytes(data[: 8 + header_length(bytes(data[:8]), len(data))]), len(data))


def parse_header_prefix(prefix: bytes, total: int) -> Header:
    """The same checks from the file's first 8 + n bytes and its size: no need to hold the data section."""
    n = header_length(prefix, total)
    if len(prefix) < 8 + n:
        raise WireError(f"truncated safetensors file: header claims {n} bytes, {len(prefix) - 8} given")
    data = prefix
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
    body = total - 8 - n
    tensors: dict[str, TensorSpec] = {}
    spans: list[tuple[int, int, str]] = []
    placed: dict[str, tuple[int, int]] = {}
    for name, entry in raw.items():
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise WireError(f"malformed header entry for tensor {name!r}")
        tag, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if tag not in ITEMSIZE:
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
        if end - begin != spec.numel * ITEMSIZE[tag]:
            raise WireError(f"tensor {name!r}: header and data lengths disagree")
        tensors[name] = spec
        spans.append((begin, end, name))
        placed[name] = (begin, end)
    position = 0
    for begin, end, name in sorted(spans):
        if begin != position:
            raise WireError(f"tensor {name!r}: data sections overlap or leave gaps")
        position = end
    if position != body:
        raise WireError(f"header and data lengths disagree: {body - position} trailing bytes")
    return Header(tensors, dict(metadata), 8 + n, placed)


def canonical_layout(tensors: dict[str, TensorSpec]) -> dict[str, tuple[int, int]]:
    """Each tensor's span in the data section of a canonical file: by dtype (widest first, safetensors' own
    order, so files torch writes through safetensors have it too), then by name. Every tensor starts at a
    multiple of its element size, so any 8-aligned byte range of the data section cuts no element in two."""
    layout, offset = {}, 0
    for name in sorted(tensors, key=lambda n: (-_RANK[tensors[n].dtype], n)):
        layout[name] = (offset, offset + tensors[name].nbytes)
        offset += tensors[name].nbytes
    return layout


def encode_header(tensors: dict[str, TensorSpec], metadata: dict[str, str] | None = None) -> bytes:
    """The 8-byte length and the JSON header of a canonical file (metadata sorted, padded to 8 bytes)."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(sorted(metadata.items()))
    for name, (begin, end) in canonical_layout(tensors).items():
        spec = tensors[name]
        header[name] = {"dtype": spec.dtype, "shape": list(spec.shape), "data_offsets": [begin, end]}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def spec_of(name: str, arr: np.ndarray) -> TensorSpec:
    tag = tag_of(arr.dtype)
    if tag is None:
        raise WireError(f"tensor {name!r}: dtype {arr.dtype} cannot be stored")
    return TensorSpec(tag, tuple(arr.shape))


def encode(tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> bytes:
    """A safetensors file with a canonical layout: the same tensors and metadata always give the same bytes.

    (The safetensors library orders metadata by a hash map, so two writes of one model can differ; a
    global model's digest must be reproducible by anyone, so the layout is fixed here.)
    """
    specs = {name: spec_of(name, arr) for name, arr in tensors.items()}
    chunks = [encode_header(specs, metadata)]
    for name in canonical_layout(specs):
        arr = np.ascontiguousarray(tensors[name])
        chunks.append(arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes())
    return b"".join(chunks)


def decode(data: bytes | memoryview) -> tuple[dict[str, np.ndarray], Header]:
    """Parse a file after checking its framing; tensors are read-only numpy views of `data` (no copy)."""
    header = parse_header(data)
    arrays = {name: tensor_view(data, header.data_offset + header.offsets[name][0], spec)
              for name, spec in header.tensors.items()}
    return arrays, header


def tensor_view(buffer: bytes | memoryview | bytearray, offset: int, spec: TensorSpec) -> np.ndarray:
    dtype = numpy_dtype(spec.dtype).newbyteorder("<")
    return np.frombuffer(buffer, dtype=dtype, count=spec.numel, offset=offset).reshape(spec.shape)


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
        return sum(s.nbytes for s in self.tensors.values())

    def layout(self) -> dict[str, tuple[int, int]]:
        return canonical_layout(self.tensors)

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
        if header.offsets:
            for name, span in self.layout().items():
                if header.offsets[name] != span:
                    return (f"tensor {name} is not where a canonical file puts it (data offsets "
                            f"{list(header.offsets[name])}, expected {list(span)}): write the file with safetensors")
        return None


# --- update metadata -------------------------------------------------------------------------------


@dataclass(frozen=True)
class UpdateMeta:
    run_id: str
    round: int
    participant: str
    samples: int
    metrics: dict[str, float]
    # what the update was trained from (a Hugging Face run: its config, tokenizer and base digests); {}: not named
    model: dict[str, str] = field(default_factory=dict)

    def to_metadata(self) -> dict[str, str]:
        named = {"fed.model": json.dumps(self.model, sort_keys=True)} if self.model else {}
        return {
            "fed.schema": SCHEMA_VERSION,
            "fed.run": self.run_id,
            "fed.round": str(self.round),
            "fed.participant": self.participant,
            "fed.samples": str(self.samples),
            "fed.metrics": json.dumps(self.metrics, sort_keys=True),
        } | named

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
        metrics = _json_mapping(md, "fed.metrics", "finite numbers",
                                lambda v: isinstance(v, int | float) and math.isfinite(v))
        model = _json_mapping(md, "fed.model", "digests", lambda v: isinstance(v, str))
        return cls(md["fed.run"], round_no, md["fed.participant"], samples, {k: float(v) for k, v in metrics.items()},
                   {k: str(v) for k, v in model.items()})


def _json_mapping(md: dict[str, str], name: str, what: str, fits: Callable[[Any], bool]) -> dict[str, Any]:
    """Metadata entry `name` (absent: {}) as a bounded JSON object of names to values that `fits`; WireError
    naming the entry otherwise."""
    raw = md.get(name, "{}")
    if len(raw) > MAX_METRICS_BYTES:
        raise WireError(f"malformed metadata: {name} exceeds {MAX_METRICS_BYTES} bytes")
    try:
        value: Any = json.loads(raw)
    except json.JSONDecodeError:
        raise WireError(f"malformed metadata: {name} is not JSON") from None
    if not isinstance(value, dict) or not all(isinstance(k, str) and fits(v) for k, v in value.items()):
        raise WireError(f"malformed metadata: {name} must map names to {what}")
    return value
