"""The state item every participant polls has the same size whatever the membership; what grows with it (the
roster) lives beside it in the bucket, by digest, and is read back only as the committed state names it."""

from __future__ import annotations

import json

from shared import keys
from shared.sizing import Share, Speed
from shared.state import Member, MemberStatus, Phase, RunState
from shared.table_keys import STATE_SK
from store.records import ROSTER
from store.table import StateStore
from tests.functional.conftest import Harness


def crowded(run_id: str, members: int) -> RunState:
    """A state in the middle of a round with `members` members, every per-member field filled."""
    pids = [f"p{i:05d}" for i in range(members)]
    return RunState(
        run_id, phase=Phase.TRAIN, epoch=3, round=41, aggregated=40, seed="ab" * 16, phase_started=1000.0,
        deadline=1060.0, round_started=1000.0, rounds_in_epoch=7, global_digest="cd" * 32,
        members={p: Member(MemberStatus.ACTIVE, 900.0, "") for p in pids},
        selected=tuple(pids), counted=tuple(pids[: members // 2]), excluded={pids[-1]: "too far from the others"},
        witnesses=tuple(pids[:3]), health_round=40, health={p: 3 for p in pids}, health_quorum=2,
        strikes={p: 1 for p in pids},
        speeds={p: Speed(812.5, 1.25, 4) for p in pids}, plan=tuple(Share(p, 100, 12) for p in pids),
        late=tuple(pids[:2]), round_units=123456.0,
    )


def item_bytes(store: StateStore) -> int:
    item = store.m.run.get(store.pk, STATE_SK, consistent_read=True)
    return len(json.dumps(item.body))


def test_the_state_item_has_the_same_size_with_10_and_5000_members(harness: Harness) -> None:
    store = harness.deps.store
    sizes = {}
    for n in (10, 5000):
        state = crowded(harness.config.run_id, n)
        before = store.read_state()
        store.commit(state, before.version)
        sizes[n] = item_bytes(store)
        # what comes back is the whole state: the item and the roster it names
        assert store.read_state() == state.evolve(version=before.version + 1)
        # a reader that never saw this roster (a participant, another function) gets it from the bucket
        fresh = StateStore(store.m.run.Meta.table_name, store.run_id, harness.deps.bucket, store.m.run.Meta.host)
        assert fresh.read_state() == state.evolve(version=before.version + 1)
    assert sizes[10] == sizes[5000] < 1024, sizes


def test_a_commit_that_changes_only_the_item_writes_no_roster(harness: Harness) -> None:
    store = harness.deps.store
    state = crowded(harness.config.run_id, 50)
    version = store.commit(state, store.read_state().version)
    written = store.rosters.writes
    version = store.commit(state.evolve(version=version, deadline=2000.0), version)
    assert store.rosters.writes == written  # the membership did not change: the item names the same roster
    assert store.read_state().deadline == 2000.0 and store.read_state().version == version


def test_a_roster_written_over_is_not_taken_for_the_committed_one(harness: Harness) -> None:
    store = harness.deps.store
    state = crowded(harness.config.run_id, 20)
    store.commit(state, store.read_state().version)
    named = store.m.run.get(store.pk, STATE_SK, consistent_read=True).body[ROSTER]
    forged = json.dumps({"members": {"mallory": {"status": "active", "since": 0, "reason": ""}}}).encode()
    harness.deps.bucket.put(keys.roster_key(store.run_id, named), forged)
    fresh = StateStore(store.m.run.Meta.table_name, store.run_id, harness.deps.bucket, store.m.run.Meta.host)
    assert fresh.read_state().members == state.members  # the version whose bytes match its digest


def test_a_new_run_keeps_no_roster_object(harness: Harness) -> None:
    store = harness.deps.store
    store.commit(RunState(harness.config.run_id, phase=Phase.WAITING), store.read_state().version)
    assert harness.deps.bucket.keys(f"{keys.run_prefix(store.run_id)}roster/") == []
    assert store.read_state().members == {}
