"""The upload budget: the first thing ingest does with an object, before anything reads it or records a refusal.

Every object a participant uploads is an ingest invocation, and, past the budget, all it costs the account is that
invocation and one conditional write (`store.budget`): the object is dropped, counted against its uploader, neither
read nor recorded one by one, and ticks nothing. The uploader is read from the key alone, as the participant role
grants writes (`shared.keys.uploader`), so junk that does not parse (at any depth below a participant's keys) and
re-writes of a participant's own keys count against that participant, and no participant can spend another's
budget. The window is a minute of the event's time (`shared.config.UPLOAD_WINDOW_SECONDS`), not the round a key
names: a participant can name any round, and a budget per named round would be as many budgets as it names.
"""

from __future__ import annotations

from coordinator.deps import Deps
from coordinator.intake.common import Ingested, ObjectCreated
from shared import keys

DROPPED = "dropped"  # the kind an object dropped over its uploader's budget is reported as


def over_budget(deps: Deps, obj: ObjectCreated) -> Ingested | None:
    """Count `obj` against its uploader's budget: None if it is within it (or no participant can have uploaded it),
    else the outcome of an object dropped (not recorded, no tick)."""
    pid = keys.uploader(deps.config.run_id, obj.key)
    if pid is None:
        return None
    budget = deps.config.upload_budget
    if deps.store.count_upload(pid, obj.time, budget):
        return None
    return Ingested(DROPPED, obj.key, False, f"over the upload budget of {budget} objects a minute", pid,
                    recorded=False, refusal=True)
