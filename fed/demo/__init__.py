"""`fed demo`: the local stack plus N real participant processes training a built-in task to the end.

The demo is an observer: it starts the stack and the participants, then only reads what the coordinator
records (round summaries, the run state) and the global models in the bucket, which it evaluates with
the task on its held-out test set. It never drives the run itself.

Four built-in tasks (`--task`): `digits` (the default: an MLP on scikit-learn's digits; each round's test
accuracy), `lm` (a ~1M-parameter byte-level transformer on Python's help text, participant.tasks.lm; each
round's held-out loss and perplexity), `hf` (a Hugging Face causal LM, by default a tiny Llama built offline,
participant.tasks.hf; also with LoRA adapters) and `flower` (the Flower anchor's digits work, each participant its own
shard).

The modules, each importing only those before it: `errors` (DemoFailed), `tasks` (which task, its settings),
`options` (what the operator asked, the run configuration it comes to), `processes` (the participant processes),
`report` (the rows and the report JSON) and `run` (`run_demo`). This package gives the names `fed demo`, the
benchmarks and the end-to-end harness use.
"""

from fed.demo.errors import DemoFailed
from fed.demo.options import DemoOptions
from fed.demo.processes import Participants, await_joins, check_processes
from fed.demo.run import run_demo
from fed.demo.tasks import DEMO_TASKS, DemoTask, demo_config

__all__ = [
    "DEMO_TASKS",
    "DemoFailed",
    "DemoOptions",
    "DemoTask",
    "Participants",
    "await_joins",
    "check_processes",
    "demo_config",
    "run_demo",
]
