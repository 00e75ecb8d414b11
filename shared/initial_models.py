"""The initial model each built-in task builds, named by its schema (`initial_model_schema`), by the task spec a
run file names: the one table the coordinator reads it from.

The coordinator never imports a task (no torch, no participant code), so it cannot ask one what model it builds. A
run file that pins nothing (no `initial_model_schema`, no `initial_model_digest`) of a task listed here gets the
task's schema where the config is parsed (`shared.config.RunConfig`): which model round 0 may start from is then
the task's, never whoever offers first. The digests are those of `participant.tasks.<name>_meta.MODEL_SCHEMA`
(computed there from the tensors; `tests/unit/test_initial_models.py` holds the two equal).
"""

from __future__ import annotations

# The digits MLP (64 -> 64 -> 10, float32); the Flower anchor's task trains the same model.
_DIGITS_MLP = "482b3126ef77ec18e7aa36131fe635a8d1b566f0c07cfa2cfedb053271fd412a"

TASK_MODEL_SCHEMAS: dict[str, str] = {
    "participant.tasks.digits:task": _DIGITS_MLP,
    "participant.tasks.flower_digits:task": _DIGITS_MLP,
    # the byte-level transformer's default preset (d_model 128, 5 layers, context 128)
    "participant.tasks.lm:task": "3c509ac6a2bce63741a728cdf04f5a22f0ea1fc9b8c1b4372cb744ae5a55fc54",
}


def task_model_schema(task: str) -> str:
    """The schema of the initial model `task` builds, if it is a built-in task's; "" for any other."""
    return TASK_MODEL_SCHEMAS.get(task, "")
