"""torch <-> safetensors files (on disk) and bytes (small ones). Never pickle: files are parsed by safetensors only.

Tensors keep their names, shapes and dtypes, so the coordinator's numpy side (`shared.wire`) reads what a
participant writes and the reverse. Model files of real sizes (hundreds of MB to GB) live on disk: they are
written with `safetensors.torch.save_file` (safetensors' own layout, which the coordinator checks) and read one
tensor at a time through `safe_open` (memory-mapped), so a model is never held twice in memory. A model file is
named by a `ModelSource`: its path, or its bytes (small files, tests).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load as _st_load
from safetensors.torch import save as _st_save
from safetensors.torch import save_file as _st_save_file
from torch import nn

from shared.wire import Manifest, TensorSpec

ModelSource = bytes | Path

# safetensors' dtype tags of the dtypes a model file may hold
_TORCH_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


class TensorMismatch(ValueError):
    """A model file whose tensors do not fit the local model."""


def _for_saving(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tensors as safetensors saves them: on the CPU, detached, contiguous, and not sharing storage (a tensor
    whose storage an earlier one already uses, tied weights say, is copied; no other tensor is)."""
    out: dict[str, torch.Tensor] = {}
    storages: set[int] = set()
    for name, tensor in tensors.items():
        t = tensor.detach()
        t = t.to("cpu") if t.device.type != "cpu" else t
        t = t.contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr in storages:
            t = t.clone()
        elif t.numel():
            storages.add(ptr)
        out[name] = t
    return out


def to_bytes(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> bytes:
    """Serialise tensors with string metadata into bytes (small files: control objects, tests)."""
    return _st_save(_for_saving(tensors), metadata=dict(metadata) if metadata else None)


def from_bytes(data: bytes) -> dict[str, torch.Tensor]:
    """Parse a safetensors file into CPU tensors (no code is ever executed)."""
    return _st_load(data)


def model_bytes(model: nn.Module, metadata: Mapping[str, str] | None = None) -> bytes:
    return to_bytes(model.state_dict(), metadata)


def save_model_file(tensors: Mapping[str, torch.Tensor], path: Path, metadata: Mapping[str, str] | None = None) -> Path:
    """Write tensors to `path` with `safetensors.torch.save_file` (its own layout), atomically: a temporary file
    beside it, renamed once complete. Memory: copies of CUDA tensors (one state dict on the CPU) at most."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        _st_save_file(_for_saving(tensors), tmp, metadata=dict(metadata) if metadata else None)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def save_model(model: nn.Module, path: Path, metadata: Mapping[str, str] | None = None) -> Path:
    return save_model_file(model.state_dict(), path, metadata)


class TensorFile:
    """A model file's tensors, read one at a time: from disk through `safe_open` (memory-mapped; a tensor is read
    when asked for), or parsed from bytes."""

    def __init__(self, handle: Any, tensors: dict[str, torch.Tensor] | None) -> None:
        self._handle, self._tensors = handle, tensors

    def names(self) -> list[str]:
        return list(self._tensors) if self._tensors is not None else list(self._handle.keys())

    def spec(self, name: str) -> tuple[tuple[int, ...], torch.dtype | str]:
        """A tensor's shape and dtype, without reading its values."""
        if self._tensors is not None:
            t = self._tensors[name]
            return tuple(t.shape), t.dtype
        part = self._handle.get_slice(name)
        tag = str(part.get_dtype())
        return tuple(int(n) for n in part.get_shape()), _TORCH_DTYPES.get(tag, tag)

    def tensor(self, name: str) -> torch.Tensor:
        if self._tensors is not None:
            return self._tensors[name]
        tensor: torch.Tensor = self._handle.get_tensor(name)
        return tensor


@contextmanager
def open_tensors(source: ModelSource) -> Iterator[TensorFile]:
    if isinstance(source, Path):
        with safe_open(str(source), framework="pt", device="cpu") as handle:
            yield TensorFile(handle, None)
    else:
        yield TensorFile(None, from_bytes(source))


Specs = Mapping[str, tuple[tuple[int, ...], torch.dtype]]  # a model's tensor names, shapes and dtypes


def specs_of(model: nn.Module) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    return {name: (tuple(t.shape), t.dtype) for name, t in model.state_dict().items()}


_TAGS = {dtype: tag for tag, dtype in _TORCH_DTYPES.items()}


def manifest_of(model: nn.Module) -> Manifest:
    """The manifest of the file `model` saves to, from its tensors' shapes and dtypes (nothing copied off a GPU)."""
    return Manifest({name: TensorSpec(_TAGS[t.dtype], tuple(t.shape)) for name, t in model.state_dict().items()})


def check_fits(specs: Specs, source: ModelSource) -> None:
    """Raise TensorMismatch unless the file's tensor names, shapes and dtypes are `specs` (its header only: no
    model is built and nothing is loaded)."""
    with open_tensors(source) as f:
        _check(specs, f)


def _check(own: Specs, f: TensorFile) -> None:
    names = set(f.names())
    missing, extra = sorted(set(own) - names), sorted(names - set(own))
    if missing or extra:
        raise TensorMismatch(f"model file does not fit the task's model: missing {missing[:5]}, unexpected {extra[:5]}")
    for name in sorted(names):
        shape, dtype = f.spec(name)
        if (shape, dtype) != own[name]:
            raise TensorMismatch(f"tensor {name}: file has {shape} {dtype}, model has {own[name][0]} {own[name][1]}")


def load_into(model: nn.Module, source: ModelSource) -> nn.Module:
    """Load a model file into `model`, insisting on the same names, shapes and dtypes. From a file, one tensor at a
    time is read and copied into the model's own storage (memory: the model and one tensor)."""
    own = model.state_dict()
    with open_tensors(source) as f:
        _check(specs_of(model), f)
        with torch.no_grad():
            for name in f.names():
                own[name].copy_(f.tensor(name))
    return model
