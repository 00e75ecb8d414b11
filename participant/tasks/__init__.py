"""Built-in tasks. `participant.tasks.digits:task` is the default of every run."""
