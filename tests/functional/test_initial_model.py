"""An initial model that cannot be hijacked: a run names its initial model (by schema or digest), ingest refuses
every other offer with its reason, and the run starts from an honest participant's offer instead."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from coordinator.intake import model_schema
from participant.tasks import digits_meta, flower_digits_meta, lm_meta
from shared import keys, wire
from shared.config import load_config
from shared.signing import Signer
from shared.state import Phase
from tests.functional.conftest import MODEL, Harness
from tests.functional.test_local_robustness import cold_start

SCHEMA = model_schema(wire.parse_header(wire.encode(MODEL)).tensors)
# sorts before the honest participants: the first eligible offer by id was the one adopted
ATTACKER, HONEST = "adversary", ["alice", "bob"]
HIJACK = {"weight": np.ones((3, 3), np.float32)}


def shifted(k: float) -> dict[str, np.ndarray]:
    return {name: (arr + k).astype(arr.dtype) for name, arr in MODEL.items()}


def join_everyone(h: Harness) -> None:
    h.scheduled_tick()
    for pid in [ATTACKER, *HONEST]:
        h.join_alive(pid)


def trains_round_0_from_alices_offer(h: Harness) -> None:
    """The run started from alice's offer, and round 0 is aggregated from updates that fit it."""
    state = h.state()
    assert state.phase is Phase.TRAIN and state.round == 0
    assert state.model_source == "alice"
    assert state.global_digest == wire.digest(wire.encode(MODEL))
    for pid in state.selected:
        assert h.upload(pid, shifted(1.0))["accepted"] is True
    h.scheduled_tick()
    state = h.state()
    assert state.aggregated == 1 and state.round == 1
    assert np.allclose(h.global_model(1)["dense.weight"], MODEL["dense.weight"] + 1.0)


def test_an_offer_of_another_model_from_the_first_id_is_refused_and_the_run_starts_from_an_honest_one(
        harness_factory: Callable[..., Harness]) -> None:
    # Given a run that names its initial model's tensors, and three participants: the adversary sorts first
    h = harness_factory(min_clients=3, min_per_round=3, initial_model_schema=SCHEMA)
    join_everyone(h)
    # When the adversary offers a 3x3 model
    offer = h.offer(ATTACKER, HIJACK)
    # Then it is refused with the reason recorded (what it held and the schema the run wants), and no epoch starts
    assert offer["accepted"] is False
    reason = offer["reason"]
    assert "initial model refused" in reason and "weight F32 [3, 3]" in reason and SCHEMA[:16] in reason
    refused = [r for r in h.deps.store.refusals() if r.pid == ATTACKER]
    assert [r.reason for r in refused] == [reason] and refused[0].key == keys.init_key(h.config.run_id, ATTACKER)
    assert h.deps.store.participants()[ATTACKER].init_digest == ""
    assert h.state().phase is Phase.WAITING and not h.state().has_model
    # When alice offers the task's model
    assert h.offer("alice")["accepted"] is True
    # Then the run starts from hers, and trains
    trains_round_0_from_alices_offer(h)


def test_a_run_file_that_pins_nothing_takes_its_tasks_schema_and_refuses_another_shape_from_the_first_id(
        harness_factory: Callable[..., Harness], tmp_path: Path) -> None:
    # Given a hand-written run file of the digits task that names no initial model (neither schema nor digest)
    written = tmp_path / "run.toml"
    written.write_text('[run]\nrun_id = "by-hand"\nmin_clients = 3\nmin_per_round = 3\nmin_updates = 1\n'
                       'task = "participant.tasks.digits:task"\n')
    config = load_config(written)
    # Then the run takes the schema from its task, not from the first offer ingested
    assert config.initial_model_schema == digits_meta.MODEL_SCHEMA and config.initial_model_digest == ""
    settings = {name: getattr(config, name) for name in ("run_id", "min_clients", "min_per_round", "task")}
    h = harness_factory(**settings, max_update_bytes=1 << 20)
    join_everyone(h)
    # When the adversary, first by id, offers a 3x3 model
    offer = h.offer(ATTACKER, HIJACK)
    # Then it is refused, with the reason naming what it held and the task's schema
    assert offer["accepted"] is False
    assert "weight F32 [3, 3]" in offer["reason"] and digits_meta.MODEL_SCHEMA[:16] in offer["reason"]
    assert h.state().phase is Phase.WAITING and not h.state().has_model
    # And once alice offers the digits model, the run starts from hers and aggregates round 0
    mlp = {name: np.full(spec.shape, 0.01, np.float32) for name, spec in digits_meta.mlp_tensors().items()}
    assert h.offer("alice", mlp)["accepted"] is True
    state = h.state()
    assert state.phase is Phase.TRAIN and state.model_source == "alice"
    for pid in state.selected:
        trained = {name: arr + 0.5 for name, arr in mlp.items()}
        assert h.upload(pid, trained)["accepted"] is True
    h.scheduled_tick()
    assert h.state().aggregated == 1
    assert np.allclose(h.global_model(1)["0.weight"], 0.51)


def test_an_offer_overtaking_its_join_is_checked_before_it_is_kept(harness_factory: Callable[..., Harness]) -> None:
    # Given a run that names its initial model's tensors, and the adversary's join request still in its lane
    h = harness_factory(min_clients=3, min_per_round=3, initial_model_schema=SCHEMA)
    h.scheduled_tick()
    join = h.put(keys.join_key(h.config.run_id, ATTACKER), h.join_bytes(ATTACKER))
    # When its 3x3 offer is delivered, then its join request
    offer = h.offer(ATTACKER, HIJACK)
    h.deliver(join)
    h.heartbeat(ATTACKER)
    # Then the offer was refused, not kept for the registration to take
    assert offer["accepted"] is False and "initial model refused" in offer["reason"]
    assert h.deps.store.kept_offer(ATTACKER, h.signer(ATTACKER).public_key) == ("", "")
    assert h.deps.store.participants()[ATTACKER].init_digest == ""
    # And once alice and bob joined and alice offered, the run starts from hers
    for pid in HONEST:
        h.join_alive(pid)
    assert h.state().phase is Phase.WAITING
    assert h.offer("alice")["accepted"] is True
    trains_round_0_from_alices_offer(h)


def test_a_run_that_names_its_initial_models_digest_takes_no_other_weights(
        harness_factory: Callable[..., Harness]) -> None:
    # Given a run that names the digest of its initial model
    want = wire.digest(wire.encode(MODEL))
    h = harness_factory(min_clients=3, min_per_round=3, initial_model_digest=want)
    join_everyone(h)
    # When the adversary offers a model of the right tensors with other weights
    offer = h.offer(ATTACKER, shifted(100.0))
    # Then it is refused, with the digest the run wants
    assert offer["accepted"] is False
    assert "initial model refused" in offer["reason"] and f"initial_model_digest {want[:16]}" in offer["reason"]
    assert h.state().phase is Phase.WAITING
    # And the run starts from alice's offer of that model
    assert h.offer("alice")["accepted"] is True
    trains_round_0_from_alices_offer(h)


def test_an_offer_is_checked_against_the_record_read_again_when_the_one_held_has_another_key(
        harness_factory: Callable[..., Harness]) -> None:
    # Given alice registered, and the record of hers the warm function holds (`Deps.registered`) carrying another
    # key, as one read before a restored run re-registered everyone would
    h = harness_factory(min_clients=3, min_per_round=3, initial_model_schema=SCHEMA)
    h.scheduled_tick()
    h.join_alive("alice")
    deps = h.deps
    held = (deps.store.pk, "alice")
    record = deps.store.participant("alice")
    assert record is not None
    deps.registered[held] = dataclasses.replace(record, public_key=Signer.generate().public_key)
    # When she offers the task's model, signed with her registered key
    assert h.offer("alice")["accepted"] is True
    # Then the offer was checked against her record read again, which the function now holds
    assert deps.registered[held].public_key == h.signer("alice").public_key


def test_an_offer_buried_under_versions_its_sender_wrote_first_is_adopted_by_its_recorded_version(
        harness_factory: Callable[..., Harness]) -> None:
    # Given an offerer that wrote 25 other objects at its own offer key before its offer and one after (it may
    # write that key): a look-back through the key's versions, oldest first, gives up before reaching the offer
    h = harness_factory(min_clients=3, min_per_round=3, initial_model_schema=SCHEMA)
    h.scheduled_tick()
    for pid in (ATTACKER, "alice"):
        h.join_alive(pid)
    key = keys.init_key(h.config.run_id, ATTACKER)
    for i in range(25):
        h.put(key, wire.encode(shifted(100.0 + i)))
    assert h.offer(ATTACKER)["accepted"] is True
    h.put(key, wire.encode(shifted(200.0)))  # and one more after it: its offer is neither the oldest nor the newest
    # When the epoch starts (bob joins) and a tick that never saw the offer adopts it
    calls = cold_start(h)
    h.join_alive("bob")
    # Then it read the version ingest recorded, directly (no listing of the key's versions): round 0 trains from it
    assert not [c for c in calls.listings() if c.key == key], calls.listings()
    state = h.state()
    assert state.phase is Phase.TRAIN and state.model_source == ATTACKER
    assert state.global_digest == wire.digest(wire.encode(MODEL))
    assert np.array_equal(h.global_model(0)["dense.weight"], MODEL["dense.weight"])


def test_a_recorded_offer_that_is_gone_is_withdrawn_and_another_adopted(
        harness_factory: Callable[..., Harness]) -> None:
    # Given two offers of the run's initial model recorded, the first by id then gone from the bucket
    h = harness_factory(min_clients=3, min_per_round=3, initial_model_schema=SCHEMA)
    h.scheduled_tick()
    for pid in (ATTACKER, "alice"):
        h.join_alive(pid)
        assert h.offer(pid, shifted(1.0) if pid == ATTACKER else MODEL)["accepted"] is True
    version = h.deps.store.participants()[ATTACKER].init_version
    assert version
    # (by whoever administers the bucket: no principal of the run may delete a version)
    h.s3.delete_object(Bucket=h.res.bucket, Key=keys.init_key(h.config.run_id, ATTACKER), VersionId=version)
    # When the epoch starts
    h.join_alive("bob")
    # Then the tick withdrew the offer it could not read as recorded (before: every tick failed) and adopted alice's
    assert h.deps.store.participants()[ATTACKER].init_digest == ""
    trains_round_0_from_alices_offer(h)


def test_the_schema_ignores_metadata_and_names_the_tensors() -> None:
    metadata = wire.encode(MODEL, {"note": "anything"})
    assert model_schema(wire.parse_header(metadata).tensors) == SCHEMA
    other_dtype = {name: arr.astype(np.float64) for name, arr in MODEL.items()}
    renamed = {f"x.{name}": arr for name, arr in MODEL.items()}
    reshaped = {**MODEL, "dense.bias": np.zeros(5, np.float32)}
    for model in (other_dtype, renamed, reshaped):
        assert model_schema(wire.parse_header(wire.encode(model)).tensors) != SCHEMA


@pytest.mark.parametrize("meta", [digits_meta, flower_digits_meta, lm_meta], ids=lambda m: m.__name__)
def test_a_built_in_tasks_schema_is_that_of_the_model_its_participants_offer(meta: Any, tmp_path: Path) -> None:
    # (the meta modules declare it without torch; a participant offers the model its task builds)
    tensors = pytest.importorskip("participant.tensors")
    from participant.task import load_task

    task = load_task(meta.TASK)
    offered = tensors.save_model(task.build_model(0), tmp_path / "init.safetensors")
    assert model_schema(wire.parse_header(offered.read_bytes()).tensors) == meta.MODEL_SCHEMA


def test_the_default_runs_name_their_tasks_schema() -> None:
    from fed.demo import demo_config
    from fed.localrun import default_local_config
    from tests.e2e.harness import e2e_config

    assert default_local_config().initial_model_schema == digits_meta.MODEL_SCHEMA
    assert e2e_config().initial_model_schema == digits_meta.MODEL_SCHEMA
    assert demo_config(2).initial_model_schema == digits_meta.MODEL_SCHEMA
    assert demo_config(2, task="lm").initial_model_schema == lm_meta.MODEL_SCHEMA
    assert demo_config(4, task="flower").initial_model_schema == flower_digits_meta.MODEL_SCHEMA
    # another task than the one whose schema it knows: any offer, as before
    assert default_local_config(task="participant.tasks.wide:mb64").initial_model_schema == ""
