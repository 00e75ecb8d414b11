"""A participant's own model in a fragmented run (`participant.streaming`): the round after a sync mixes the synced
fragment in from the global with `fragment_mix` and keeps its own values elsewhere; a gap starts from the global;
training on after an upload is kept with its step count and cut short by the next round."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import torch
from torch import nn

from participant.compressed import Residual
from participant.streaming import Ahead, OwnModel, synced_tensors
from shared import wire


def model(value: float) -> nn.Module:
    m = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    with torch.no_grad():
        for p in m.parameters():
            p.fill_(value)
    return m


def test_the_round_after_a_sync_mixes_the_synced_fragment_in_and_keeps_the_rest(tmp_path: Path) -> None:
    own = OwnModel(tmp_path)
    own.keep(model(1.0), round_no=4)
    held = model(0.0)  # round 5's global
    synced = synced_tensors(held, 2, 4)  # what round 4 synced
    assert synced == frozenset({"0.weight", "0.bias"})  # (layers dealt out strided: "0" then "2")
    retained: dict = {}
    assert own.resume(held, 5, fragments=2, mix=0.25, retained=retained) == 0
    for name, value in held.state_dict().items():
        want = 0.25 if name in synced else 1.0  # 0.25 x ours + 0.75 x the global's
        assert torch.allclose(value, torch.full_like(value, want)), name
    # and what the mix kept of our deviation from the global is said, for the error feedback to give up
    assert set(retained) == synced and all(np.allclose(v, 0.25) for v in retained.values())


def test_the_residual_gives_up_what_the_mix_retained_once_a_round(tmp_path: Path) -> None:
    residual = Residual(tmp_path)
    m = model(0.0)
    residual.kept.write_bytes(wire.encode({"0.bias": np.full(4, 1.0, np.float32)}))
    retained = {"0.bias": np.full(4, 0.25, np.float32), "0.weight": np.full((4, 3), 0.5, np.float32)}
    residual.shift(retained, m.state_dict(), 4)
    residual.shift(retained, m.state_dict(), 4)  # (a second merge of the model kept in round 4: a restart)
    kept = residual.load(m.state_dict())
    assert kept is not None and np.allclose(kept["0.bias"], 0.75) and np.allclose(kept["0.weight"], -0.5)


def test_a_gap_catches_up_the_fragments_synced_without_us(tmp_path: Path) -> None:
    own = OwnModel(tmp_path)
    own.keep(model(1.0), round_no=3)
    held = model(0.0)  # round 5's global: round 3 synced fragment 1 (ours), round 4 fragment 0 without us
    assert own.resume(held, 5, fragments=3, mix=0.25) == 0
    synced_3, synced_4 = synced_tensors(held, 3, 3), synced_tensors(held, 3, 4)
    assert synced_3 and synced_4
    for name, value in held.state_dict().items():
        want = 0.0 if name in synced_4 else 0.25 if name in synced_3 else 1.0
        assert torch.allclose(value, torch.full_like(value, want)), name


def test_a_gap_past_every_fragments_sync_starts_again_from_the_global(tmp_path: Path) -> None:
    own = OwnModel(tmp_path)
    own.keep(model(1.0), round_no=2)
    held = model(0.0)
    assert own.resume(held, 5, fragments=2, mix=0.5) is None  # (rounds 3 and 4 synced both fragments)
    assert all(torch.equal(v, torch.zeros_like(v)) for v in held.state_dict().values())
    assert OwnModel(tmp_path / "none").resume(held, 5, 2, 0.5) is None
    assert own.resume(held, 2, 2, 0.5) is None  # (a model kept from this round or later is not ours to go on)


def test_training_on_after_an_upload_is_kept_with_its_steps_and_cut_by_the_next_round(tmp_path: Path) -> None:
    own = OwnModel(tmp_path)
    ahead = Ahead(own)
    m = model(1.0)
    reached = threading.Event()

    def train(progress) -> None:  # type: ignore[no-untyped-def]
        for step in range(1, 100):
            with torch.no_grad():
                m[0].bias.add_(1.0)
            progress(step, 99)
            if step == 2:  # the next round starts while this trains on: it waits for the step under way
                reached.set()
                ahead._cut.wait(10)

    ahead.start(train, m, round_no=7, steps=5)
    assert reached.wait(10)
    ahead.finish()  # cut short after the step under way (the third), and what was trained is kept
    assert own.kept() == (7, 3)
    held = model(0.0)
    assert own.resume(held, 8, fragments=2, mix=1.0) == 3
    assert torch.allclose(held.state_dict()["0.bias"], torch.full((4,), 4.0))
