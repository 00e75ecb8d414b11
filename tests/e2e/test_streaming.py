"""Streaming DiLoCo with topk updates, end to end: real participant processes sync one fragment of two a round as
sparse 2-bit deltas with error feedback, training on while each round aggregates, and fetch each new global as the
synced fragment's bytes, one of them is
killed mid-run and started again (its residual and own model survive), the model still learns, and `fed verify`
recomputes every fragment's global."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest

from participant.tasks.digits import task
from shared import keys
from shared.state import Phase
from tests.e2e.harness import Run, e2e_config

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

UPLOADED = re.compile(r"round (\d+): update uploaded \((\d+) bytes")
REBUILT = re.compile(r"rebuilt the global model from the previous one and the synced fragment \((\d+) bytes")


def _accuracy(model: object) -> float:
    import torch

    return float(task.evaluate(model, torch.device("cpu"))["test_accuracy"])


def test_topk_streaming_diloco_learns_through_a_restart_and_verifies(local_run: Callable[..., Run]) -> None:
    # Given a run of three participants syncing fragments of two, in topk (5 % at 2 bits), with DiLoCo's outer steps
    # with 12 inner steps a round, 3 of them trained on after each upload while the round aggregates
    config = e2e_config(update_encoding="topk", topk_percent=5, fragments=2, server_optimizer="diloco",
                        local_steps=12, fragment_overlap=3, total_rounds=10, max_round_train_time=30,
                        liveness_timeout=20)
    run = local_run(config)
    run.start_participants(["p1", "p2", "p3"])

    # When p2 is killed just after an update of its was counted, and started again at once
    def p2_counted() -> bool:
        return any("p2" in r.counted for r in run.store.rounds() if r.round >= 2)

    run.wait_for(p2_counted, 120, "p2's update counted in round 2 or later")
    state_dir = run.workdir / "participants" / "p2"
    assert (state_dir / "residual.safetensors").exists() and (state_dir / "own-model.safetensors").exists()
    run.procs.kill("p2")
    restarted_at = run.state().round
    run.procs.spawn(["p2"])

    # Then the run finishes, p2 counted again after its restart
    run.wait_for(lambda: run.state().phase is Phase.FINISHED, 240, "the run to finish")
    rounds = sorted(run.store.rounds(), key=lambda r: r.round)
    assert [r.round for r in rounds] == list(range(10)) and all(r.aggregated for r in rounds)
    assert any("p2" in r.counted for r in rounds if r.round > restarted_at), [(r.round, r.counted) for r in rounds]
    # and its error feedback survived the restart: it carried the residual kept before it on, and went on training its
    # own model
    log = run.procs.procs["p2"].log.read_text()
    assert "error feedback: carrying the kept residual" in log and "training our own model" in log, log[-3000:]

    # and each sync sent one fragment as a sparse delta: a small part of the fp32 model's bytes
    final = run.state()
    model_bytes = len(run.bucket.get(keys.global_key(config.run_id, final.round, final.global_digest)).data)
    sizes = [int(n) for _, n in UPLOADED.findall(run.procs.procs["p1"].log.read_text())]
    assert sizes and max(sizes) < model_bytes / 8, (sizes, model_bytes)
    # and each new global was rebuilt from the one before and the synced fragment's bytes (the rest is unchanged):
    # the digits model's two layers are 87 % and 16 % of it, about half on average
    rebuilt = [int(n) for n in REBUILT.findall(run.procs.procs["p1"].log.read_text())]
    assert len(rebuilt) >= 5 and sum(rebuilt) / len(rebuilt) < 0.6 * model_bytes, (rebuilt, model_bytes)

    # and each trained on after its uploads, going on from there in the next round with the new fragment mixed in
    p1_log = run.procs.procs["p1"].log.read_text()
    assert re.search(r"trained [1-3] step\(s\) on after the upload", p1_log), p1_log[-3000:]
    assert re.search(r"training our own model \([1-3] step\(s\) ahead\)", p1_log), p1_log[-3000:]

    # and the model learned: the final global is far better than the initial one
    first = _accuracy(task.build_model(config.seed))
    last = run.accuracy(final.round, final.global_digest)
    assert last > 0.6 and last > first + 0.3, (first, last)

    # and anyone recomputes every fragment's global (and DiLoCo's state) from the bucket
    code, out = run.fed("verify")
    assert code == 0, out
