"""Which task the demo trains and with what settings: the built-in tasks and the run configuration that finishes
quickly on a 2-core CPU machine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fed.demo.errors import DemoFailed
from participant.tasks import digits_meta, flower_digits_meta, hf_meta, lm_meta
from shared.config import RunConfig

DEMO_RUN_ID = "demo"
DEFAULT_ROUNDS = 20
# Witnesses attest an update if the round's aggregate with it is at most this much worse than without it (a task's
# settings may say otherwise: digits, measured, uses 0.2).
WITNESS_TOLERANCE = 0.3


@dataclass(frozen=True)
class DemoTask:
    """A built-in task the demo can run (`--task NAME`): its spec and training set size, and the rounds and
    training settings that finish quickly on a 2-core CPU machine (and the initial model's schema: an offer of any
    other model is refused)."""

    name: str
    spec: str
    train_size: int
    rounds: int
    settings: dict[str, Any]
    split: str | None = None  # a task that trains on local data: the --split its participants' data follows
    torch_optimizers: bool = True  # the task's own `torch_optimizers`: False, and the demo's zygote does not preload
    # torch.optim's compiler stack (fed.zygote.OPTIMIZERS)


DEMO_TASKS: dict[str, DemoTask] = {
    "digits": DemoTask(
        "digits", digits_meta.TASK, digits_meta.TRAIN_SIZE, DEFAULT_ROUNDS,
        # measured on 4 participants: >= 0.95 from round 5, about 0.97 after 20. Witness tolerance: leaving an honest
        # update out of 4 moves the aggregate's loss by up to 18% late in a run, a sign-flipped update scaled 5x by
        # 24% at least (benchmarks/witness_errors.py, 30 rounds, IID and Dirichlet 0.5); 0.3 let such updates in
        dict(local_epochs=2, batch_size=32, learning_rate=0.1, witness_tolerance=0.2,
             initial_model_schema=digits_meta.MODEL_SCHEMA),
        torch_optimizers=digits_meta.TORCH_OPTIMIZERS,
    ),
    "lm": DemoTask(
        "lm", lm_meta.TASK, lm_meta.TRAIN_SIZE, 4,
        # AdamW, one pass over the corpus a round: a round takes 20-60 s on a 2-core machine (4 participants, one
        # thread each) and the held-out loss falls from 5.55 (untrained) to about 3.0 after round 0, 2.35 after 4
        dict(local_epochs=1, batch_size=16, learning_rate=3e-3, max_round_train_time=300.0, liveness_timeout=30.0,
             initial_model_schema=lm_meta.MODEL_SCHEMA),
    ),
    # the Flower anchor's work (participant.tasks.flower_digits): participant p<i+1> trains the anchor's shard i, all
    # of them every round, plain FedAvg, no witnesses (make bench-rounds)
    "flower": DemoTask(
        "flower", flower_digits_meta.TASK, flower_digits_meta.TRAIN_SIZE, flower_digits_meta.ROUNDS,
        dict(local_epochs=flower_digits_meta.LOCAL_EPOCHS, batch_size=flower_digits_meta.BATCH_SIZE,
             learning_rate=flower_digits_meta.LEARNING_RATE, witness_nodes=0, work_sizing="equal", strategy="fedavg",
             initial_model_schema=flower_digits_meta.MODEL_SCHEMA),
        split="iid", torch_optimizers=digits_meta.TORCH_OPTIMIZERS,
    ),
    # a Hugging Face model (participant.tasks.hf): the tiny Llama (or --model DIR), 1,119 sequences of 128 tokens of
    # the help text; a round takes a few seconds of training. Full fine-tuning at 3e-3: held-out loss 5.55 -> 4.30 in
    # 4 rounds of a quarter of the data (one process); LoRA on q/v (--adapter lora) at 2e-2: 5.55 -> 5.13.
    # dataset_size and the model's digests and schema: from the model itself (fed.demo.hf)
    "hf": DemoTask(
        "hf", hf_meta.TASK, 0, 6,
        # equal shares: the same sequences to the same participant in every run, so the curve repeats exactly
        dict(local_epochs=1, batch_size=16, learning_rate=3e-3, max_round_train_time=300.0, liveness_timeout=30.0,
             work_sizing="equal"),
    ),
}
DEFAULT_TASK = "digits"
LORA_LEARNING_RATE = 2e-2  # adapters learn from a standing start: a higher rate than the full model's


def demo_task(name: str) -> DemoTask:
    """The built-in task called `name`; DemoFailed naming the choices if there is none."""
    try:
        return DEMO_TASKS[name]
    except KeyError:
        raise DemoFailed(f"unknown demo task {name!r}: choose one of {', '.join(DEMO_TASKS)}") from None


def reports_loss(task_spec: str) -> bool:
    """Whether the demo reports a run of this task by its held-out loss (the LM task, any size) rather than by
    its test accuracy."""
    return task_spec.partition(":")[0] == lm_meta.TASK.partition(":")[0] or hf_meta.is_hf(task_spec)


def demo_config(participants: int, rounds: int | None = None, kill_one: bool = False,
                run_id: str = DEMO_RUN_ID, task: str = DEFAULT_TASK, **overrides: Any) -> RunConfig:
    """Settings that finish quickly on a 2-core CPU machine: for digits (default: 20 rounds), >= 0.95 test
    accuracy; for the LM task (`task="lm"`, default 4 rounds), a held-out loss falling every round.

    Every participant trains every round (fraction 1.0) on its 1/N share of the training set. Two of them,
    drawn each round, witness it: each checks every update on its held-out data and the round is aggregated
    from the updates both attested (see participant/witness_eval.py). With `kill_one`, one participant will die
    mid-run, so the run must keep going with N-1 members.
    """
    if participants < 1:
        raise DemoFailed("a demo needs at least one participant")
    chosen = demo_task(task)
    survivors = participants - 1 if kill_one else participants
    if survivors < 1:
        raise DemoFailed("--kill-one needs at least two participants")
    values: dict[str, Any] = dict(
        run_id=run_id,
        min_clients=survivors,
        fraction_per_round=1.0,
        min_per_round=survivors,
        min_updates=max(1, survivors - 1) if survivors > 1 else 1,
        total_rounds=rounds or chosen.rounds,
        rounds_per_epoch=0,
        warmup_time=5.0,
        max_round_train_time=30.0,
        round_witness_time=10.0,  # only when a witness misses the opportunistic close (e.g. --kill-one)
        cooldown_time=0.0,
        liveness_timeout=10.0,
        witness_nodes=2,
        witness_tolerance=WITNESS_TOLERANCE,
        task=chosen.spec,
        dataset_size=chosen.train_size,
    )
    values.update(chosen.settings)
    if chosen.spec == hf_meta.TASK:
        from fed.demo.hf import hf_settings

        adapter = overrides.pop("adapter", None)
        values.update(hf_settings(overrides.pop("model", None), adapter))
        if adapter == "lora":
            values["learning_rate"] = LORA_LEARNING_RATE
    values.update(overrides)
    if values.get("update_encoding") == "topk" and "witness_nodes" not in overrides:
        values["witness_nodes"] = 0  # (a topk update cannot be witnessed: RunConfig says why)
    if not values["witness_nodes"] and "round_witness_time" not in overrides:
        values["round_witness_time"] = 0.0  # nobody to wait for: a witness phase would only add its full length
    return RunConfig(**values)


def steps_with_torch_optim(spec: str) -> bool:
    """Whether a run's task (its spec) steps with torch.optim: true of any but the built-in tasks that do not."""
    return next((t.torch_optimizers for t in DEMO_TASKS.values() if t.spec == spec), True)
