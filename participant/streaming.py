"""Streaming DiLoCo on the participant (`fragments` > 1, `shared.fragments`): its own model between rounds.

In a plain run every round trains from the round's global model. With fragments, a participant keeps training
its own model, and each round syncs one fragment: the update is that fragment's delta from the global (the
fragment's value at its last sync), and when the next round's global arrives the participant mixes the fragment
just synced into its model, `fragment_mix` x its own values + (1 - fragment_mix) x the global's, as the paper
merges an arriving fragment. Every other tensor stays its own.

The model is kept in the state directory after each round's training, with the round it trained, so a restart
goes on from it. A participant that did not train some rounds since (it restarted past a round, or was not
selected) catches up: the fragments those rounds synced are taken from the global, whose every fragment is its
latest sync; one that missed a sync of every fragment starts again from the global.

Error feedback (`participant.compressed.Residual`) carries what an update did not send, as without fragments. The
mix keeps fragment_mix x our deviation from the new global in the own model, and the next delta of that fragment
holds it again; so the residual gives up that much at the merge (`Residual.shift`): over the next sync, the own
model and the residual together carry exactly what was not sent.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from participant.compressed import native, write_atomic
from shared import wire
from shared.fragments import fragments_of, round_fragment

if TYPE_CHECKING:
    import torch
    from torch import nn

log = logging.getLogger("participant")


def synced_tensors(model: nn.Module, fragments: int, round_no: int) -> frozenset[str] | None:
    """The tensors round `round_no` syncs (its update holds them alone); None: every tensor."""
    from participant.tensors import manifest_of

    return round_fragment(manifest_of(model), fragments, round_no)


class OwnModel:
    """The participant's own model between the rounds of a fragmented run, in `directory`."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / "own-model.safetensors"

    def kept(self) -> tuple[int, int] | None:
        """The round the kept model trained (and the steps it trained on after its upload), if one is kept and
        readable."""
        if not self.path.exists():
            return None
        try:
            with self.path.open("rb") as f:
                first = f.read(8)
                size = self.path.stat().st_size
                header = wire.parse_header_prefix(first + f.read(wire.header_length(first, size)), size)
            return int(header.metadata["fed.trained"]), int(header.metadata.get("fed.ahead", "0"))
        except (wire.WireError, KeyError, ValueError, OSError):
            return None

    def resume(self, model: nn.Module, round_no: int, fragments: int, mix: float,
               retained: dict[str, np.ndarray] | None = None) -> int | None:
        """Turn `model`, which holds round `round_no`'s global, into our own: the kept one (trained in round k),
        with the fragment round k synced mixed in from the global, and every fragment a later round synced without
        us taken from the global (caught up); the steps it trained ahead (`fragment_overlap`). None (the global as
        it is) when no model of an earlier round is kept, or every fragment was synced without us since. What the
        mix retains of our own deviation from the global, fragment_mix x (own - global), goes into `retained` (by
        tensor, float32): the error feedback takes it out of what it carries (`Residual.shift`)."""
        import torch

        from participant.tensors import TensorMismatch, load_into, manifest_of

        kept = self.kept()
        if kept is None or not 0 <= kept[0] < round_no:
            return None
        missed = {r % fragments for r in range(kept[0] + 1, round_no)}
        if len(missed) == fragments:
            return None
        split = fragments_of(manifest_of(model), fragments)
        caught_up = {n for f in missed for n in split[f]}
        merged = split[kept[0] % fragments] - caught_up
        held = {n: t.detach().clone() for n, t in model.state_dict().items() if n in merged | caught_up}
        try:
            load_into(model, self.path)
        except (TensorMismatch, wire.WireError, OSError, ValueError) as exc:
            log.warning("our own model %s does not load (%s); training from the global model", self.path, exc)
            for name, value in held.items():
                model.state_dict()[name].copy_(value)
            return None
        with torch.no_grad():
            state = model.state_dict()
            for name, value in held.items():
                own = state[name]
                if name in merged and own.is_floating_point():
                    if retained is not None:
                        kept_deviation = (own.float() - value.float()) * mix
                        retained[name] = native(kept_deviation).astype(np.float32)
                    own.mul_(mix).add_(value.to(own.dtype), alpha=1 - mix)
                else:
                    own.copy_(value)
        if caught_up:
            log.info("round %d: caught up %d tensor(s) synced since round %d from the global model", round_no,
                     len(caught_up), kept[0])
        return kept[1]

    def keep(self, model: nn.Module, round_no: int, ahead: int = 0) -> None:
        """Our model as trained in round `round_no` (and `ahead` steps after its upload), kept for the next round
        (written whole, then renamed)."""
        tensors: dict[str, torch.Tensor] = dict(model.state_dict())
        from participant.tensors import to_bytes

        write_atomic(self.path, to_bytes(tensors, {"fed.trained": str(round_no), "fed.ahead": str(ahead)}))


class Ahead:
    """Training on after an upload (`fragment_overlap`, the paper's overlap tau): a thread trains our own model up
    to `steps` more steps on the round's data while the round aggregates, then keeps it (`OwnModel.keep`); the
    next round waits for it (`finish`), cutting it short, and goes on from there."""

    def __init__(self, own: OwnModel) -> None:
        self.own = own
        self._thread: threading.Thread | None = None
        self._cut = threading.Event()

    def start(self, train: Callable[[Callable[[int, int], None]], object], model: nn.Module, round_no: int,
              steps: int) -> None:
        self.finish()
        self._cut.clear()

        def run() -> None:
            done = [0]

            def progress(step: int, total: int) -> None:
                done[0] = step
                if self._cut.is_set() or step >= steps:
                    raise _Cut()

            try:
                train(progress)
            except _Cut:
                pass
            except Exception as exc:  # noqa: BLE001 - training ahead is extra: the round goes on without it
                log.warning("round %d: training on after the upload failed (%s); going on from the upload", round_no,
                            exc)
                return
            if done[0]:
                self.own.keep(model, round_no, done[0])
                log.info("round %d: trained %d step(s) on after the upload", round_no, done[0])

        self._thread = threading.Thread(target=run, name="train-ahead", daemon=True)
        self._thread.start()

    def finish(self) -> None:
        """Cut the training ahead short (after its current step) and wait for it to keep what it trained."""
        if self._thread is not None:
            self._cut.set()
            self._thread.join()
            self._thread = None


class _Cut(Exception):
    """Training ahead stops here (enough steps, or the next round started)."""
