"""Chaos: a real run (4 participant processes training digits) while everything that may fail does.

At random moments, from one printed seed (CHAOS_SEED=<seed> repeats the plan):
- participants are SIGKILLed (at any moment, or while selected and before their update arrives) and
  restarted with the same --id and --state-dir, so they resume;
- S3 events are held back and delivered late (after later ones), delivered to two invocations at once,
  and delivered again after they succeeded;
- bursts of extra ticks race the dispatcher's ticks (and each other);
- the ingest function dies after recording an update, before its tick; an aggregating tick dies after
  writing the new global model, before committing;
- the dispatcher process (standing in for Lambda) is SIGKILLed in the middle of an aggregation, before or
  after the new global model is written, and a new one is started; what it had in flight comes back.

Then: the run finished; no update was lost or counted twice; every global model is the recomputed
aggregate of its round's counted updates (`fed verify`'s check, and an independent FedAvg here).

And a disaster: the run's table and every participant are lost at once, mid-round, after a checkpoint
(`checkpoint_every`). The table is created again, empty; the operator runs `fed run restore` and restarts the
participants with their ids and state directories; the run goes on from the checkpoint's round to the end,
and `fed verify` passes.
"""

from __future__ import annotations

import json
import os
import random
import time
from collections.abc import Callable
from pathlib import Path

import boto3
import pytest

from coordinator.service import run_tick
from coordinator.verify import verify_run
from fed.demo import Participants, await_joins
from fed.localrun import store_for
from functions.settings import deps_from_env
from local.stack import LocalStack
from shared.state import Phase
from tests.e2e.chaos_support import (
    DISPATCHER_KILLED_AFTER,
    DISPATCHER_KILLED_BEFORE,
    EVENT_AGAIN,
    EVENT_COPIES,
    EVENT_HELD,
    EXTRA_TICKS,
    PARTICIPANT_KILLED,
    PARTICIPANT_KILLED_MID_ROUND,
    DispatcherChaos,
    ParticipantKiller,
    RacingTicks,
    Spawner,
    Tally,
    audit_run,
    fed_command,
    keep_log,
    latest_checkpoint,
    lose_table,
    recompute_fedavg,
)
from tests.e2e.harness import Run, e2e_config

pytestmark = [pytest.mark.chaos, pytest.mark.e2e, pytest.mark.timeout(420)]

NAMES = ["p1", "p2", "p3", "p4"]
RUN_TIMEOUT = 300.0
DISPATCHER_KILLS = 3


def chaos_config():  # type: ignore[no-untyped-def]
    """Eight short rounds in two epochs; three of four participants are enough to go on."""
    return e2e_config(
        run_id="chaos", min_clients=3, fraction_per_round=1.0, min_per_round=3, min_updates=2, total_rounds=8,
        rounds_per_epoch=4, warmup_time=5, max_round_train_time=25, cooldown_time=0, liveness_timeout=30,
        strategy="fedavg",  # each round is recomputed below by an independent FedAvg
    )


def test_the_run_survives_chaos_without_losing_or_double_counting_an_update(tmp_path: Path) -> None:
    seed = int(os.environ.get("CHAOS_SEED") or random.SystemRandom().randrange(2**32))
    print(f"\nchaos seed {seed} (CHAOS_SEED={seed} repeats this plan)")
    rng = random.Random(seed)
    tally = Tally()
    config = chaos_config()
    stack = LocalStack(config, dispatch=False, log_file=tmp_path / "functions.log", log_level="INFO")
    stack.start()
    assert stack.resources is not None
    began = time.monotonic()
    connection_file = tmp_path / "connection.json"
    stack.connection.save(connection_file)
    procs = Participants(connection_file, tmp_path)
    store = store_for(stack.connection)
    spawner = Spawner()  # every (re)start of a process from one thread that lives as long as the test
    ticks = RacingTicks(random.Random(rng.random()), tally)
    dispatchers = DispatcherChaos(stack.resources, tmp_path, random.Random(rng.random()), tally, DISPATCHER_KILLS,
                                  spawner, on_blocked=lambda: ticks.burst(3))
    killer = ParticipantKiller(procs, store, random.Random(rng.random()), tally, spawner, gap=(3.0, 8.0))
    try:
        # Given four participants that asked to join, and a dispatcher process that delivers with faults
        spawner.call(lambda: procs.spawn(NAMES))
        await_joins(stack, NAMES, procs, timeout=120, heard=False)  # no tick yet: no config, no heartbeats
        dispatchers.start()

        def healthy() -> None:
            failed = procs.failed()
            assert not failed, f"{failed[0].name} exited {failed[0].process.returncode}:\n{procs.tail(failed[0].name)}"
            assert not ticks.errors, f"an extra tick failed: {ticks.errors[0]}"
            assert not killer.errors, f"the participant killer failed: {killer.errors[0]}"
            assert not dispatchers.errors, dispatchers.errors[0]
            assert not dispatchers.problem(), dispatchers.problem()

        def wait(predicate, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
            deadline = time.monotonic() + timeout
            while not predicate():
                healthy()
                if time.monotonic() > deadline:
                    s = store.read_state()
                    logs = "\n".join(f"--- {n}\n{procs.tail(n)}" for n in NAMES)
                    pytest.fail(f"timed out waiting for {what}: phase {s.phase}, round {s.round}, aggregated "
                                f"{s.aggregated}\n{logs}")
                time.sleep(0.1)

        wait(lambda: store.read_state().phase is Phase.TRAIN, 90, "the first round")

        # When participants are killed and restarted, events go astray and ticks race, until the run ends
        ticks.start()
        killer.start()
        wait(lambda: store.read_state().phase is Phase.FINISHED, RUN_TIMEOUT, "the run to finish")
        run_seconds = time.monotonic() - began
        killer.stop()
        ticks.stop()
        for name in NAMES:  # the killer may have stopped between a kill and its restart
            if procs.procs[name].process.poll() is not None and procs.procs[name].killed:
                killer.restart(name)
        wait(lambda: queue_drained(stack), 60, "the ingest queue to drain")
        stats = dispatchers.stop()
        healthy()
        exited = procs.wait_exit(60)

        # Then every (round, participant) was counted at most once, and every uploaded update has an outcome
        c = stack.connection
        s3 = boto3.client("s3", endpoint_url=c.endpoint, region_name=c.region)
        audit = audit_run(store, s3, c.bucket, c.run_id)
        state = store.read_state()
        aggregated = [s for s in audit.rounds if s.aggregated]
        print_rounds(audit.rounds)
        print(f"run finished in {run_seconds:.1f}s: {len(audit.rounds)} rounds, {len(aggregated)} aggregated; "
              f"{audit.uploads} update uploads, {audit.counted} counted, {len(audit.left_out)} left out with a "
              f"reason, {audit.not_aggregated} in rounds carried over; lost {audit.lost}, double-counted "
              f"{len(audit.double_counted)}")
        print(f"dispatcher (last process): {stats}")
        for where, why in audit.left_out.items():
            print(f"  left out: {where}: {why}")
        assert state.phase is Phase.FINISHED and state.aggregated == config.total_rounds
        assert audit.double_counted == [] and audit.counted_without_record == []
        assert audit.unexplained == [], audit.unexplained
        assert audit.unrecorded == [], audit.unrecorded
        assert audit.lost == 0

        # and every global model is its round's aggregate: recomputed by `fed verify`'s code, and by our own FedAvg
        checks = verify_run(deps_from_env())
        assert [ch.round for ch in checks] == [s.round for s in aggregated]
        bad = [ch for ch in checks if not ch.ok]
        assert not bad, bad
        records = {(int(u.round), u.pid): u for u in store.all_updates()}
        worst = 0.0
        for summary in aggregated:
            diff, problems = recompute_fedavg(s3, c.bucket, c.run_id, summary, records, config.max_share_ratio)
            assert not problems, problems
            worst = max(worst, diff)
        print(f"fed verify: {len(checks)} rounds match; independent FedAvg of {len(aggregated)} rounds: largest "
              f"difference {worst:.2g}")
        assert state.global_digest == aggregated[-1].global_digest

        # and the chaos was real: each kind of fault happened
        assert tally[PARTICIPANT_KILLED] + tally[PARTICIPANT_KILLED_MID_ROUND] >= 1
        assert tally[EVENT_HELD] >= 1 and tally[EVENT_COPIES] + tally[EVENT_AGAIN] >= 1
        assert tally[EXTRA_TICKS] >= 1
        assert tally[DISPATCHER_KILLED_BEFORE] + tally[DISPATCHER_KILLED_AFTER] >= 1
        # and the participants noticed the end
        assert exited, f"participants still running after the run finished:\n{still_running(procs)}"
        assert [p.process.returncode for p in procs.procs.values()] == [0] * len(NAMES)
    finally:
        print(f"\nchaos seed {seed}; faults injected:\n{tally.table()}")
        killer.stop()
        ticks.stop()
        dispatchers.stop()
        procs.stop()
        spawner.stop()
        stack.stop()


RESTORE_NAMES = ["p1", "p2", "p3"]


def restore_config():  # type: ignore[no-untyped-def]
    """Ten short rounds in one epoch, a checkpoint every two aggregated rounds; all three participants train."""
    return e2e_config(
        run_id="chaos-restore", min_clients=3, fraction_per_round=1.0, min_per_round=3, min_updates=2,
        total_rounds=10, checkpoint_every=2, warmup_time=5, max_round_train_time=25, cooldown_time=0,
        liveness_timeout=10,
    )


@pytest.mark.timeout(420)
def test_a_run_that_loses_its_table_and_every_participant_at_once_is_restored_and_finishes(
    local_run: Callable[..., Run],
) -> None:
    began = time.monotonic()
    config = restore_config()
    run = local_run(config)
    c = run.stack.connection
    s3 = boto3.client("s3", endpoint_url=c.endpoint, region_name=c.region)
    names = RESTORE_NAMES

    # Given three participants training, in a round open after a checkpoint and one more aggregated round (so the
    # restored run has a round to train again)
    run.start_participants(names)

    def mid_round_past_a_checkpoint() -> bool:  # (a round takes about a second here: four chances to catch one)
        s = run.state()
        odd = s.phase is Phase.TRAIN and s.aggregated >= 3 and s.aggregated % config.checkpoint_every != 0
        return odd or s.phase is Phase.FINISHED

    run.wait_for(mid_round_past_a_checkpoint, 180, "a round open after a checkpoint and one more aggregated round")

    # When every participant is SIGKILLed and the table is lost, at once
    for name in names:
        run.procs.kill(name)
    before = run.state()  # (nothing new can arrive now; at most an update already sent is still counted)
    assert before.phase is not Phase.FINISHED, "the run finished before the test caught a round open"
    lose_table(c.endpoint, c.region, c.run_id, c.table)
    lost_at = time.monotonic()
    checkpoint = latest_checkpoint(s3, c.bucket, c.run_id)
    assert checkpoint is not None
    saved = checkpoint["state"]
    assert checkpoint["round"] == saved["round"] and 0 < saved["aggregated"] < config.total_rounds, checkpoint
    # (usually one round behind the round lost; but the updates of that round, sent before the kill, may still have
    # been aggregated, and checkpointed, before the table went)
    print(f"\nlost the table and {len(names)} participants in round {before.round} ({before.aggregated} aggregated); "
          f"the latest checkpoint keeps round {checkpoint['round']} ({saved['aggregated']} aggregated), epoch "
          f"{checkpoint['epoch']}")

    # Then a tick on the empty table does not start a new run over the checkpoint: it waits for the operator
    waiting = run_tick(deps_from_env())
    assert not waiting.committed and any("fed run restore" in n for n in waiting.notes), waiting
    assert run.state().version == 0

    # When the operator restores the run from its latest checkpoint (no --force needed: the table holds no state)
    restored = fed_command("run", "restore", "--connection", str(run.connection_file))
    assert restored.returncode == 0, restored
    assert f"round {checkpoint['round']}," in restored.stdout, restored.stdout

    # Then the run waits, at the checkpoint's round, with the checkpoint's model, for its members
    state = run.state()
    assert state.phase is Phase.WAITING and state.members == {}
    assert (state.round, state.aggregated, state.epoch) == (checkpoint["round"], saved["aggregated"], saved["epoch"])
    assert state.global_digest == checkpoint["global_digest"]

    # When the operator restarts every participant on its host: same --id, same --state-dir (its journal from before)
    for name in names:
        keep_log(run.procs.procs[name].log)
    run.procs.spawn(names)

    # Then they join the restored run again, and it trains from the checkpoint's round to the end
    run.wait_for(lambda: run.state().phase is Phase.FINISHED, 240, "the restored run to finish")
    restored_seconds = time.monotonic() - lost_at
    state = run.state()
    assert state.phase is Phase.FINISHED and state.aggregated == config.total_rounds
    rounds = sorted(run.store.rounds(), key=lambda r: r.round)  # the new table holds only the rounds since restore
    aggregated = [r for r in rounds if r.aggregated]
    print_rounds(rounds)
    # the numbering goes on from the checkpoint: no round before it trained again, none skipped, none counted twice
    assert [r.round for r in rounds] == list(range(checkpoint["round"], state.round)), [r.round for r in rounds]
    assert rounds[0].epoch == saved["epoch"] + 1
    assert len(aggregated) == config.total_rounds - saved["aggregated"]
    assert state.global_digest == aggregated[-1].global_digest
    audit = audit_run(run.store, s3, c.bucket, c.run_id)
    assert audit.double_counted == [] and audit.counted_without_record == [] and audit.unexplained == []
    # every restarted participant noticed that its journal was of the run before the loss, and trained again
    for name in names:
        log = run.procs.procs[name].log.read_text(errors="replace")
        assert "discarding its progress" in log, f"{name}:\n{run.procs.tail(name, 40)}"
    assert set(names) <= {pid for r in aggregated for pid in r.counted}, [(r.round, r.counted) for r in aggregated]

    # and `fed verify` recomputes every round since the restore from the bucket, and they all match
    verified = fed_command("verify", "--connection", str(run.connection_file), "--json")
    assert verified.returncode == 0, verified
    report = json.loads(verified.stdout)
    assert report["ok"] is True
    assert [(v["round"], v["ok"]) for v in report["rounds"]] == [(r.round, True) for r in aggregated], report

    # and no participant crashed: each saw the end and exited cleanly
    assert run.procs.wait_exit(60), f"participants still running after the run finished:\n{still_running(run.procs)}"
    assert [p.process.returncode for p in run.procs.procs.values()] == [0] * len(names)
    print(f"restored run: {len(aggregated)} rounds from round {checkpoint['round']} in {restored_seconds:.1f}s after "
          f"the loss; the whole test took {time.monotonic() - began:.1f}s")


def queue_drained(stack: LocalStack) -> bool:
    assert stack.resources is not None
    sqs = boto3.client("sqs", endpoint_url=stack.endpoint, region_name=stack.resources.region)
    attrs = sqs.get_queue_attributes(QueueUrl=stack.resources.queue_url, AttributeNames=["All"])["Attributes"]
    return attrs["ApproximateNumberOfMessages"] == "0" and attrs["ApproximateNumberOfMessagesNotVisible"] == "0"


def print_rounds(rounds) -> None:  # type: ignore[no-untyped-def]
    print("round  epoch  aggregated  counted         left out / dropped")
    for s in rounds:
        other = {**s.refused, **s.dropped}
        print(f"{s.round:5d}  {s.epoch:5d}  {'yes' if s.aggregated else 'no':10s}  {','.join(s.counted):14s}  "
              + "; ".join(f"{p}: {r}" for p, r in sorted(other.items())))


def still_running(procs: Participants) -> str:
    """Which participants have not exited, each with the end of its log: what it was waiting for."""
    return "\n".join(f"--- {p.name} (pid {p.process.pid}):\n{procs.tail(p.name, 25)}" for p in procs.running())
