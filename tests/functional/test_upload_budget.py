"""The upload budget at ingest: past `upload_budget` objects a minute, a participant's uploads are dropped and
counted, before anything reads them or records a refusal, whatever they are (junk at any depth under its keys,
re-writes of its update, heartbeats); another participant's uploads are untouched.

Every call is judged against the stack's roles: the junk keys are written with the participant's own session
(IAM's `rounds/*/<own id>` spans '/'), and the budget's writes are the ingest role's."""

from __future__ import annotations

import time

import numpy as np
import pytest

from coordinator.service import on_upload, run_tick
from fed.status import collect
from functions.events import object_created
from shared import keys
from shared.table_keys import DROPPED_PREFIX, UPLOAD_COUNT_PREFIX
from store.connection import Connection
from store.trace import acting_as, function, participant
from tests.functional.conftest import MODEL, Harness

BUDGET = 12
WHOLE_TEST = 10**10  # seconds: a budget window that every event of a test falls in


def model(k: float) -> dict[str, np.ndarray]:
    return {name: (arr + k).astype(arr.dtype) for name, arr in MODEL.items()}


def send_as(h: Harness, pid: str, key: str, body: bytes) -> dict:  # type: ignore[type-arg]
    """Upload `key` with `pid`'s own session, signed by `pid` (a key that does not parse too: the participant role
    grants it), and deliver its event to ingest."""
    with acting_as(participant(pid)):
        event = h.put(key, body, signed_by=pid)
    return h.deliver(event)


def items_with_prefix(h: Harness, prefix: str) -> list[dict]:  # type: ignore[type-arg]
    table = h.deps.store.m.upload_count
    return [i.attribute_values for i in table.query(h.deps.store.pk, table.sk.startswith(prefix))]


def test_a_flood_past_the_budget_is_dropped_and_counted_before_anything_reads_or_records_it(  # type: ignore[no-untyped-def]
    harness_factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("store.budget.UPLOAD_WINDOW_SECONDS", WHOLE_TEST)  # one window, whenever the test runs
    h = harness_factory(upload_budget=BUDGET)
    run = h.config.run_id
    # Given a run training round 0 with alice and mallory (each has used 3 of its budget: join, heartbeat, offer)
    h.start(["alice", "mallory"])
    assert h.state().round == 0
    store = h.deps.store
    used = store.uploads_counted("mallory", time.time())
    refusals_before = len(store.refusals())

    # When mallory floods: junk below her own keys at any depth, re-writes of her update key, bogus heartbeats
    flood = [keys.run_prefix(run) + f"rounds/{'x/' * (i % 4)}junk{i}/mallory" for i in range(10)]
    flood += [keys.update_key(run, 0, "mallory")] * 10 + [keys.heartbeat_key(run, "mallory")] * 10
    outcomes = []
    for i, key in enumerate(flood):
        body = h.update_bytes("mallory", model(1)) if "/000000/" in key else b"not json %d" % i
        outcomes.append(send_as(h, "mallory", key, body))

    # Then the first ones within her budget go the usual way (refused with a reason, or recorded), and every one
    # past it is dropped: not read, not recorded, no tick
    within = BUDGET - used
    assert all(o["kind"] != "dropped" for o in outcomes[:within]), outcomes[:within]
    dropped = outcomes[within:]
    assert dropped and all(o == {"kind": "dropped", "accepted": False, "recorded": False,
                                 "reason": f"over the upload budget of {BUDGET} objects a minute"} for o in dropped)
    assert len(store.refusals()) - refusals_before <= within
    assert store.dropped_uploads()["mallory"].dropped == len(dropped)
    assert store.uploads_counted("mallory", time.time()) == BUDGET
    # one counter item for her window, one dropped item: not one item per object
    assert [i["n"] for i in items_with_prefix(h, f"{UPLOAD_COUNT_PREFIX}0#mallory")] == [BUDGET]
    assert len(items_with_prefix(h, DROPPED_PREFIX)) == 1
    # and `fed status` shows it, one line for her whatever the flood's size
    status = collect(Connection(run_id=run, bucket=h.res.bucket, table=f"fed-{run}-state"))
    lines = [r for r in status.refusals if "upload budget" in r.reason]
    assert [(r.pid, r.reason) for r in lines] == [
        ("mallory", f"{len(dropped)} uploads dropped over the upload budget ({BUDGET} a minute)")]

    # And alice, meanwhile, uploads her update, which is accepted and recorded, and the round is aggregated (at
    # its deadline: mallory's update was past her budget)
    result = h.upload("alice", model(3))
    assert result["accepted"] and result["recorded"], result
    assert set(store.dropped_uploads()) == {"mallory"}
    with acting_as(function("tick")):
        run_tick(h.deps, now=time.time() + h.config.max_round_train_time + 1)
    assert h.state().aggregated == 1
    assert store.rounds()[0].counted == ("alice",)


def test_what_a_dropped_object_costs_is_one_counter_write_and_one_dropped_count(harness_factory) -> None:  # type: ignore[no-untyped-def]
    """The dropped path on moto: its duration is the figure the cost model charges an invocation for
    (`infra.cost_model.JUNK_INGEST_SECONDS`); printed (timings are not asserted: the machines are noisy)."""
    h = harness_factory(upload_budget=1)
    h.scheduled_tick()
    h.join("mallory")  # the one object of her budget
    key = keys.run_prefix(h.config.run_id) + "rounds/a/b/c/mallory"
    event = h.put(key, b"junk")
    deps = h.deps
    obj = object_created(event)
    calls: list[str] = []
    client = deps.store.m.connection.client
    client.meta.events.register("before-call.dynamodb.*", lambda model, **_: calls.append(model.name))
    began = time.perf_counter()
    n = 200
    with acting_as(function("ingest")):
        for _ in range(n):
            handled = on_upload(deps, obj)
            assert handled.ingested is not None and handled.ingested.kind == "dropped" and handled.tick is None
    seconds = (time.perf_counter() - began) / n
    print(f"\ndropped path on moto: {seconds * 1000:.2f} ms per object; DynamoDB calls per object: "
          f"{calls[:2]}")
    assert calls == ["UpdateItem", "UpdateItem"] * n  # the failed conditional counter, the dropped count: no read
    assert h.deps.store.dropped_uploads()["mallory"].dropped == n
