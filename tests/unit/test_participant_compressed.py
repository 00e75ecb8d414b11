"""The participant's side of compressed updates (`participant.compressed`): the file it writes is what the
coordinator expects (`shared.compress`), error feedback carries what was lost only once an update is sent, and
a witness decodes a peer's update to the weights it stands for."""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch

from participant.compressed import Residual, decode_update_file, native, write_update
from participant.tensors import save_model_file
from shared import wire
from shared.compress import Encoding, decode_arrays, encoded_manifest

BF16 = np.dtype(ml_dtypes.bfloat16)


def state(seed: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"fc.weight": torch.randn(20, 30, generator=g).to(dtype), "fc.bias": torch.randn(20, generator=g).to(dtype),
            "steps": torch.tensor([3], dtype=torch.int64)}


def numpy_of(tensors: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    return {n: native(t) for n, t in tensors.items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["bf16", "int8"])
def test_the_update_written_is_the_encoded_delta_the_coordinator_decodes(tmp_path: Path, dtype: torch.dtype,
                                                                          kind: str) -> None:
    enc = Encoding(kind, 32)
    held = save_model_file(state(0, dtype), tmp_path / "global.safetensors")
    trained = {n: (t + 0.01 * torch.ones_like(t)) if t.is_floating_point() else t + 1
               for n, t in state(0, dtype).items()}
    path = write_update(trained, held, enc, tmp_path / "update.safetensors", {"fed.schema": "1"}, None)
    arrays, header = wire.decode(path.read_bytes())
    base = numpy_of(state(0, dtype))
    manifest = wire.Manifest({n: wire.spec_of(n, a) for n, a in base.items()})
    assert encoded_manifest(manifest, enc).mismatch(header) is None
    assert Encoding.of_metadata(header.metadata) == enc and header.metadata["fed.schema"] == "1"
    decoded = decode_arrays(arrays, base, enc)
    want = numpy_of(trained)
    for name in base:
        assert decoded[name].dtype == base[name].dtype
        np.testing.assert_allclose(decoded[name].astype(np.float64), want[name].astype(np.float64), atol=2e-3)


def test_error_feedback_is_kept_only_once_the_update_is_sent(tmp_path: Path) -> None:
    enc = Encoding("int8", 16)
    held = save_model_file(state(0), tmp_path / "global.safetensors")
    residual = Residual(tmp_path)
    trained = {n: t + 0.001 * torch.arange(t.numel()).reshape(t.shape) if t.is_floating_point() else t
               for n, t in state(0).items()}
    write_update(trained, held, enc, tmp_path / "u1.safetensors", {}, residual)
    assert residual.next.exists() and not residual.kept.exists()
    residual.discard()  # not sent: nothing is carried
    assert not residual.next.exists() and not residual.kept.exists()
    path = write_update(trained, held, enc, tmp_path / "u2.safetensors", {}, residual)
    residual.commit()  # sent: what it lost is carried into the next one
    lost = wire.decode(residual.kept.read_bytes())[0]
    sent = decode_arrays(wire.decode(path.read_bytes())[0], numpy_of(state(0)), enc)
    np.testing.assert_allclose(sent["fc.weight"] + lost["fc.weight"], native(trained["fc.weight"]), atol=1e-6)
    # and the next round's delta includes it
    nxt = write_update(trained, held, enc, tmp_path / "u3.safetensors", {}, residual)
    again = decode_arrays(wire.decode(nxt.read_bytes())[0], numpy_of(state(0)), enc)
    delta = native(trained["fc.weight"]) - native(state(0)["fc.weight"])
    np.testing.assert_allclose(again["fc.weight"] - native(state(0)["fc.weight"]), delta + lost["fc.weight"],
                               atol=float(np.abs(delta).max()) / 100)


def test_a_residual_that_does_not_fit_the_model_is_ignored(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    residual = Residual(tmp_path)
    residual.kept.write_bytes(wire.encode({"fc.weight": np.zeros((2, 2), np.float32)}))
    assert residual.load(state(0)) is None
    assert "does not fit" in caplog.text


def test_a_witness_decodes_a_peer_update_in_place(tmp_path: Path) -> None:
    enc = Encoding("bf16")
    held = save_model_file(state(0), tmp_path / "global.safetensors")
    trained = {n: t * 1.01 if t.is_floating_point() else t for n, t in state(0).items()}
    path = write_update(trained, held, enc, tmp_path / "peer.safetensors", {"fed.round": "0"}, None)
    decode_update_file(path, held, enc)
    arrays, header = wire.decode(path.read_bytes())
    assert header.tensors["fc.weight"].dtype == "F32" and header.metadata["fed.round"] == "0"
    np.testing.assert_allclose(arrays["fc.weight"], native(trained["fc.weight"]), rtol=1e-2)
    with pytest.raises(wire.WireError, match="not encoded as int8"):
        decode_update_file(path, held, Encoding("int8"))
