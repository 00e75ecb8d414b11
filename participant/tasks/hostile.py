"""Testing aid: a participant that attacks the protocol's own numbers (`--task participant.tasks.hostile:task`).

Everything `participant.tasks.poisoned` does (it trains honestly, then uploads the change sign-flipped and scaled
5x, under the norm bound), and besides:

- it offers a 3 x 3 model as the run's initial model (the first participant by id once chose round 0's global, and
  every honest participant then exited);
- every update it uploads claims `train_seconds = 1e-6` (a self-reported speed once bought its sender 8 x the median
  share of a round's data, and with it of its FedAvg weight).

It rewrites its own client to do so, in its own process only, as an attacker runs modified code. Its witness-seat
attacks (empty or over-full proofs) are scripted by the test that runs it. Never use it outside tests.
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from participant import training
from participant.tasks.poisoned import Poisoned
from shared import keys
from shared.wire import UpdateMeta

CLAIMED_SECONDS = 1e-6


def _offer_a_model_of_its_own(self: training.Training, work: training.Workload) -> None:
    from participant.tensors import save_model

    path = save_model(nn.Linear(3, 3), Path(self.outbox) / "init-hostile.safetensors")
    try:
        self.remote.upload_file(keys.init_key(self.run_id, self.pid), path, "offering a 3 x 3 initial model")
    finally:
        path.unlink(missing_ok=True)


def _claiming(run_id: str, round_no: int, participant: str, samples: int, metrics: dict[str, float],
              model: dict[str, str] | None = None) -> UpdateMeta:
    return UpdateMeta(run_id, round_no, participant, samples, {**metrics, "train_seconds": CLAIMED_SECONDS},
                      model or {})


training.Training.offer_model = _offer_a_model_of_its_own  # type: ignore[method-assign]
training.UpdateMeta = _claiming  # type: ignore[assignment, attr-defined]

task = Poisoned()
