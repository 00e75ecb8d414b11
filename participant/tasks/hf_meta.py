"""Facts about the Hugging Face task that must be importable without torch or transformers (run files, the demo,
`fed export`): its spec, and how a spec names it."""

from __future__ import annotations

TASK = "participant.tasks.hf:task"


def is_hf(task: str) -> bool:
    """Whether a run's `task` is the Hugging Face task (its module; the object may be named otherwise)."""
    return task.partition(":")[0] == TASK.partition(":")[0]
