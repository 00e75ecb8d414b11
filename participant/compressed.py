"""Compressed updates on the participant (`shared.compress`): writing our update as the delta from the global
model in the run's `update_encoding`, with error feedback, and decoding a peer's for a witness.

Error feedback: what the encoding loses this round (float32, per float tensor) is kept in a residual file and
added to the next round's delta. The residual written for a round (`next`) replaces the kept one only once the
update is uploaded and journaled (`Residual.commit`); an update that is not sent leaves the kept one as it was.
Memory: the model, its encoded update and two residuals (float32) — a model's size about three times over.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from shared import wire
from shared.compress import Encoding, decode_arrays, encode_delta, encoded_manifest

if TYPE_CHECKING:
    import torch

    from participant.tensors import ModelSource

log = logging.getLogger("participant")


def native(t: torch.Tensor) -> np.ndarray:
    """A tensor as a numpy array of the same dtype, on the CPU (bfloat16 through ml_dtypes)."""
    import torch

    t = t.detach().to("cpu")
    if t.dtype == torch.bfloat16:
        return t.contiguous().view(torch.int16).numpy().view(wire.bfloat16())
    return t.numpy()


def write_atomic(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


class Residual:
    """The error-feedback residual kept in `directory`: `kept` (added to this round's delta) and `next` (what
    this round's encoding lost, kept once the update is sent)."""

    def __init__(self, directory: Path) -> None:
        self.kept = directory / "residual.safetensors"
        self.next = directory / "residual-next.safetensors"
        self.announced = False

    def load(self, model: Mapping[str, torch.Tensor]) -> dict[str, np.ndarray] | None:
        """The kept residual, if it fits `model` (else None, said once in the log)."""
        if not self.kept.exists():
            return None
        try:
            arrays, _ = wire.decode(self.kept.read_bytes())
        except wire.WireError as exc:
            log.warning("the error-feedback residual %s is unreadable (%s); starting without", self.kept, exc)
            return None
        fits = all(name in model and tuple(model[name].shape) == a.shape for name, a in arrays.items())
        if not fits:
            log.warning("the error-feedback residual %s does not fit the model; starting without", self.kept)
            return None
        if not self.announced:  # (once a process: after a restart, the residual kept before it is carried on)
            self.announced = True
            norm = float(np.sqrt(sum(float(np.square(a, dtype=np.float64).sum()) for a in arrays.values())))
            log.info("error feedback: carrying the kept residual of %d tensors (L2 norm %.4g)", len(arrays), norm)
        return dict(arrays)

    def shift(self, retained: Mapping[str, np.ndarray], model: Mapping[str, torch.Tensor], round_no: int) -> None:
        """Take from the kept residual what the own model of a fragmented run retained when the model it kept in
        round `round_no` was merged (`participant.streaming.OwnModel.resume`): carried in both, it would be sent
        twice. Once for that model: the residual says which round's model it was shifted for, so a second merge
        of it (after a restart, or a round not sent) leaves it alone."""
        arrays: dict[str, np.ndarray] = {}
        if self.kept.exists():
            try:
                found, header = wire.decode(self.kept.read_bytes())
            except wire.WireError:
                found, header = {}, None
            if header is not None and header.metadata.get("fed.shifted") == str(round_no):
                return
            arrays = {n: np.array(a, np.float32) for n, a in found.items()}
        for name, value in retained.items():
            arrays[name] = arrays.get(name, np.zeros(tuple(model[name].shape), np.float32)) - value
        write_atomic(self.kept, wire.encode(arrays, {"fed.shifted": str(round_no)}))

    def commit(self) -> None:
        """The update was sent: what its encoding lost is carried into the next round."""
        if self.next.exists():
            os.replace(self.next, self.kept)

    def discard(self) -> None:
        """The update was not sent: the kept residual stays as it was."""
        self.next.unlink(missing_ok=True)


def write_update(model: Mapping[str, torch.Tensor], held: ModelSource, encoding: Encoding, path: Path,
                 metadata: dict[str, str], residual: Residual | None, only: frozenset[str] | None = None) -> Path:
    """Write our trained `model` to `path` in `encoding` (the delta from the global model `held`) — of the tensors
    `only` (a Streaming DiLoCo fragment), or all (None). The residual of tensors not sent is carried on as it was."""
    from participant.tensors import open_tensors

    previous = residual.load(model) if residual is not None else None
    encoded: dict[str, np.ndarray] = {}
    lost: dict[str, np.ndarray] = {}
    with open_tensors(held) as base:
        for name, tensor in model.items():  # one tensor at a time
            if only is not None and name not in only:
                if previous is not None and name in previous:
                    lost[name] = previous[name]
                continue
            carried = {name: previous[name]} if previous is not None and name in previous else None
            sent, missed = encode_delta({name: native(tensor)}, {name: native(base.tensor(name))}, encoding, carried)
            encoded.update(sent)
            lost.update(missed)
    if residual is not None:
        write_atomic(residual.next, wire.encode(lost))
    return write_atomic(path, wire.encode(encoded, metadata | encoding.metadata()))


def decode_update_file(path: Path, held: ModelSource, encoding: Encoding, fragments: int = 1,
                       round_no: int = 0) -> None:
    """Replace a peer's encoded update at `path` with the weights it stands for (a witness evaluates weights); in a
    run of `fragments`, an update of round `round_no`'s fragment alone. Raises WireError (or CompressError) for a
    file that is not an update in `encoding`."""
    from participant.tensors import open_tensors
    from shared.fragments import round_fragment

    arrays, header = wire.decode(path.read_bytes())
    if Encoding.of_metadata(header.metadata) != encoding:
        raise wire.WireError(f"not encoded as {encoding}, the run's update encoding")
    with open_tensors(held) as f:
        base = {name: native(f.tensor(name)) for name in f.names()}
    manifest = wire.Manifest({n: wire.spec_of(n, a) for n, a in base.items()})
    synced = round_fragment(manifest, fragments, round_no)
    if problem := encoded_manifest(manifest, encoding, synced).mismatch(header):
        raise wire.WireError(problem)
    metadata = {k: v for k, v in header.metadata.items() if k not in encoding.metadata()}  # (weights now)
    write_atomic(path, wire.encode(decode_arrays(arrays, base, encoding, synced), metadata))
