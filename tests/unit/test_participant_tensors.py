"""torch <-> safetensors bytes: readable by the coordinator's numpy side, and the reverse; never pickle."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from participant.tensors import TensorMismatch, from_bytes, load_into, model_bytes, to_bytes
from shared import wire


def small_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))


def test_participant_file_is_read_by_the_coordinator_with_names_shapes_dtypes_and_metadata() -> None:
    # Given a trained model and the update metadata the daemon attaches
    model = small_model()
    meta = wire.UpdateMeta("r-run", 4, "alice", 359, {"loss": 0.25, "test_accuracy": 0.9})
    # When it is written on the participant side
    data = model_bytes(model, meta.to_metadata())
    # Then shared.wire decodes it to the same arrays, and the metadata parses back
    arrays, header = wire.decode(data)
    state = model.state_dict()
    assert set(arrays) == set(state)
    for name, tensor in state.items():
        assert arrays[name].dtype == np.float32 and arrays[name].shape == tuple(tensor.shape)
        np.testing.assert_array_equal(arrays[name], tensor.numpy())
        assert header.tensors[name].dtype == "F32"
    assert wire.UpdateMeta.from_metadata(header.metadata) == meta
    assert all(np.isfinite(a).all() for a in arrays.values())


def test_coordinator_file_loads_into_the_participant_model() -> None:
    model = small_model(1)
    arrays = {k: np.full(tuple(v.shape), 0.5, np.float32) for k, v in model.state_dict().items()}
    load_into(model, wire.encode(arrays))
    for tensor in model.state_dict().values():
        assert torch.equal(tensor, torch.full_like(tensor, 0.5))


def test_manifest_of_a_participant_file_matches_the_coordinator_encoding() -> None:
    data = model_bytes(small_model())
    arrays, header = wire.decode(data)
    assert wire.Manifest.of(header).mismatch(wire.parse_header(wire.encode(arrays))) is None


def test_round_trip_keeps_values_and_detaches_from_the_model() -> None:
    model = small_model()
    tensors = from_bytes(to_bytes(model.state_dict()))
    with torch.no_grad():
        next(model.parameters()).add_(1.0)  # the serialised copy must not follow later changes
    assert not torch.equal(tensors["0.weight"], model.state_dict()["0.weight"])


def test_shared_tensors_are_serialised_as_copies() -> None:
    weight = torch.ones(2, 2)
    data = to_bytes({"a": weight, "b": weight})  # safetensors refuses shared storage unless copied
    assert set(from_bytes(data)) == {"a", "b"}


def test_wrong_shape_names_or_dtype_are_refused_clearly() -> None:
    model = small_model()
    arrays = {k: v.numpy() for k, v in model.state_dict().items()}
    bad_shape = dict(arrays, **{"0.weight": np.zeros((5, 4), np.float32)})
    with pytest.raises(TensorMismatch, match=r"0\.weight.*\(5, 4\)"):
        load_into(model, wire.encode(bad_shape))
    missing = {k: v for k, v in arrays.items() if k != "2.bias"}
    with pytest.raises(TensorMismatch, match="missing"):
        load_into(model, wire.encode(missing))
    bad_dtype = dict(arrays, **{"2.bias": arrays["2.bias"].astype(np.float64)})
    with pytest.raises(TensorMismatch, match="float64"):
        load_into(model, wire.encode(bad_dtype))


def test_a_pickle_is_not_a_model_file() -> None:
    import pickle

    with pytest.raises(Exception):  # noqa: B017 - safetensors raises its own error type
        from_bytes(pickle.dumps({"w": [1.0, 2.0]}))
