"""torch <-> safetensors bytes. Never pickle: files are parsed by safetensors only.

Tensors keep their names, shapes and dtypes, so the coordinator's numpy side (`shared.wire`) reads
what a participant writes and the reverse.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from safetensors.torch import load as _st_load
from safetensors.torch import save as _st_save
from torch import nn


class TensorMismatch(ValueError):
    """A model file whose tensors do not fit the local model."""


def to_bytes(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> bytes:
    """Serialise tensors (moved to the CPU, detached, contiguous, unshared) with string metadata."""
    cpu = {name: t.detach().to("cpu").contiguous().clone() for name, t in tensors.items()}
    return _st_save(cpu, metadata=dict(metadata) if metadata else None)


def from_bytes(data: bytes) -> dict[str, torch.Tensor]:
    """Parse a safetensors file into CPU tensors (no code is ever executed)."""
    return _st_load(data)


def model_bytes(model: nn.Module, metadata: Mapping[str, str] | None = None) -> bytes:
    return to_bytes(model.state_dict(), metadata)


def load_into(model: nn.Module, data: bytes) -> nn.Module:
    """Load a model file into `model`, insisting on the same names, shapes and dtypes."""
    tensors = from_bytes(data)
    own = model.state_dict()
    missing, extra = sorted(set(own) - set(tensors)), sorted(set(tensors) - set(own))
    if missing or extra:
        raise TensorMismatch(f"model file does not fit the task's model: missing {missing[:5]}, unexpected {extra[:5]}")
    for name, tensor in tensors.items():
        if tensor.shape != own[name].shape or tensor.dtype != own[name].dtype:
            raise TensorMismatch(
                f"tensor {name}: file has {tuple(tensor.shape)} {tensor.dtype}, "
                f"model has {tuple(own[name].shape)} {own[name].dtype}"
            )
    model.load_state_dict(tensors, strict=True)
    return model
