"""Writing a round's aggregate: the global model computed piece by piece from ranged reads of the counted
updates, in parameter shards, and stored once under its content address.

A model of one piece (8 MiB) is computed and PUT in one go. A larger one is written as a multipart upload
to a staging key named by the aggregation job (a digest of everything that determines the output), each
shard of pieces by its own worker: every piece is one part, hashed as it is written, so the digest
(`shared.digest`) is combined from the workers' piece hashes without reading the object again. When every
part is in, the upload is completed and copied to `keys.global_key(round, digest)`.

A worker's outcome answers one task (`shared.messages.ShardOutcome`, named by `shard_task_digest`): the tick acts
on no other. Its word that an input cannot be read leaves that update out of the round only where the coordinator
confirms it (`confirmed`): whoever else writes an outcome's key can delay an aggregation, never leave an update
out of it.
"""

from __future__ import annotations

import hashlib
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from coordinator.deps import Deps, ShardRunner
from coordinator.model_files import GlobalModel, read_global, read_header, written_global
from coordinator.optimizer_state import StoredState
from shared import keys
from shared.aggregate import PieceAggregator, PieceOutput, RangeSource, StateSource, WeightedInput, round_plan
from shared.compress import CachedRange, DecodedSource
from shared.delta import index_of
from shared.digest import PIECE_BYTES, combine, digest, piece_hash
from shared.fragments import round_fragment
from shared.messages import (
    MAX_OUTCOME_TEXT,
    MessageError,
    PieceDone,
    ShardCorrupt,
    ShardDone,
    ShardInput,
    ShardOutcome,
    ShardTask,
    parse_message,
    shard_task_digest,
)
from shared.plan import PiecePlan
from shared.server_opt import ServerStep, encode_index
from shared.state import Aggregate, AggregateInput
from shared.strategies import strategy_of
from shared.wire import Manifest
from store.blobs import UploadGone
from store.ranges import CorruptInput, HeldRange, ObjectRange

log = logging.getLogger("fed-coordinator")

SHARD_ATTEMPTS = 3
# An aggregation that takes more than a moment holds a lease on its round: every tick in the meantime (a
# heartbeat's, the schedule's) would otherwise start the same aggregation again, reading every update again. It
# expires after a conservative estimate of the work, so an invocation that dies holding it delays the round by at
# most that long. Only a small model with a few updates goes without (two writes would cost more than doing it twice).
LEASE_SLACK_SECONDS = 30.0
LEASE_BYTES_PER_SECOND = 100e6  # update bytes aggregated per second, well below what the shard workers reach
# Each input is at least one ranged GET, read one after another: a thousand small updates are seconds of requests
# before any byte counts (measured at 1,000 participants on the local stack: the lease, sized by bytes alone,
# expired mid-aggregation and a second tick read 55 % of the updates again).
LEASE_SECONDS_PER_INPUT = 0.1
UNLEASED_INPUTS = 8  # a small model's aggregation of at most this many updates takes no lease


def lease_seconds(model_bytes: int, inputs: int) -> float:
    """How long an aggregation of `inputs` updates of a `model_bytes` model may hold its round's lease."""
    return LEASE_SLACK_SECONDS + model_bytes * (inputs + 1) / LEASE_BYTES_PER_SECOND + inputs * LEASE_SECONDS_PER_INPUT


class AggregationBusy(RuntimeError):
    """Another invocation is aggregating this round (it commits; this one does nothing)."""


@dataclass
class RoundLease:
    """One tick's hold on the rounds it aggregates, given back once that tick's commit is in or lost
    (`release`), not when the aggregate is written: a tick that read the state before that commit and claims
    the round after it would otherwise aggregate the round again (measured at 200 and 1,000 participants, where
    a tick's reads take seconds: every update read three times, not twice). A claim that succeeds is checked
    against the state version the tick decided on (`decided_on`): a round committed meanwhile is left alone."""

    holder: str = field(default_factory=lambda: uuid.uuid4().hex)
    decided_on: int = -1  # the state version the holder's decision was made on; -1: not checked
    held: list[str] = field(default_factory=list)

    def release(self, deps: Deps) -> None:
        for name in self.held:
            deps.store.release(name, self.holder)
        self.held.clear()


def weighted_inputs(
    deps: Deps, round_no: int, base: GlobalModel, inputs: Sequence[AggregateInput | ShardInput]
) -> list[WeightedInput]:
    """The counted updates of round `round_no` (which trained from `base`) as range sources over the exact object
    versions ingest accepted (hashed then: an S3 object version never changes, so they are not hashed again);
    compressed ones (`update_encoding`) decoded against `base` as they are read, which is read once per range for
    all of them."""
    run_id, encoding = deps.config.run_id, deps.config.encoding
    shared_base = CachedRange(base.source(deps)) if encoding.is_delta else None
    synced = round_fragment(base.manifest, deps.config.fragments, round_no)  # (a fragment's update: its tensors)

    def source(i: AggregateInput | ShardInput) -> RangeSource:
        stored = ObjectRange(deps.bucket, keys.update_key(run_id, round_no, i.participant), i.version_id,
                             i.data_offset, owner=i.participant)
        if shared_base is None:
            return stored
        return DecodedSource(base.manifest, encoding, shared_base, stored, synced)

    return [WeightedInput(i.participant, i.samples, i.digest, source(i), i.norm) for i in inputs]


def job_id(plan: PiecePlan, base_digest: str, optimizer_digest: str = "") -> str:
    return hashlib.sha256(plan.header + base_digest.encode() + optimizer_digest.encode()).hexdigest()


def write_aggregate(deps: Deps, effect: Aggregate, lease: RoundLease | None = None) -> tuple[str, str]:
    """Compute and store the global model of `effect.round + 1` and, with a server optimizer, the state its
    step leaves (its piece files, then its index); their digests ("" for no state). With `lease`, the round's
    lease stays held when this returns (the caller releases it after its commit); without, it is released here."""
    size = read_global(deps, effect.round, effect.base_digest).size  # (authenticated once per warm function)
    if size <= PIECE_BYTES and len(effect.inputs) <= UNLEASED_INPUTS:  # a moment's work: a second tick costs little
        return _write_aggregate(deps, effect)
    held = lease or RoundLease()
    name = f"aggregate#{effect.round}"
    if not deps.store.claim(name, held.holder, time.time() + lease_seconds(size, len(effect.inputs)), time.time()):
        raise AggregationBusy(f"round {effect.round} is being aggregated by another invocation")
    if name not in held.held:
        held.held.append(name)
    try:
        if held.decided_on >= 0 and deps.store.read_state().version != held.decided_on:
            raise AggregationBusy(f"round {effect.round} was committed by another invocation meanwhile")
        written = _write_aggregate(deps, effect)
    except BaseException:
        held.release(deps)  # (another invocation may take the round over at once)
        raise
    if lease is None:
        held.release(deps)
    return written


def _write_aggregate(deps: Deps, effect: Aggregate) -> tuple[str, str]:
    base = read_global(deps, effect.round, effect.base_digest)
    inputs = weighted_inputs(deps, effect.round, base, effect.inputs)
    plan = round_plan(deps.config, base.manifest, effect.round + 1, inputs)
    if plan.pieces == 1:
        state = state_source(deps, effect.round, effect.optimizer_digest, plan)
        worker = PieceAggregator(deps.config, plan, inputs, base_source(deps, base), state)
        made = worker.piece_output(0)
        written = digest(made.data)
        deps.bucket.put(keys.global_key(deps.config.run_id, effect.round + 1, written), made.data)
        written_global(deps, effect.round + 1, written, made.data)
        done = _side_files(deps, effect.round + 1, 0, "", piece_hash(made.data), made)
        return _finish(deps, effect, plan, written, [done])
    return _write_in_shards(deps, effect, plan, base)


def _finish(deps: Deps, effect: Aggregate, plan: PiecePlan, written: str, pieces: list[PieceDone]) -> tuple[str, str]:
    """Once the global model of `effect.round + 1` is in: its download delta's index and its optimizer state's
    index (each written after every piece it lists). Returns the global's and the state's digests."""
    if deps.config.download.is_delta:
        index = index_of(effect.round + 1, written, effect.base_digest, deps.config.download, plan.size,
                         [bytes.fromhex(p.hash) for p in pieces], [p.delta for p in pieces])
        deps.bucket.put(keys.delta_key(deps.config.run_id, effect.round + 1, written), index.encode())
    return written, _put_state_index(deps, effect.round + 1, written, [p.state for p in pieces if p.state],
                                     [plan.layout(p.index).count for p in pieces if p.state])


def state_source(deps: Deps, round_no: int, optimizer_digest: str, plan: PiecePlan) -> StateSource | None:
    """The server optimizer state round `round_no` starts from (None: zeros, or no optimizer)."""
    step = ServerStep.of(deps.config)
    if step is None or not optimizer_digest:
        return None
    return StoredState(deps, step, round_no, optimizer_digest, plan.float_count)


def _side_files(deps: Deps, round_no: int, index: int, etag: str, sha: bytes, made: PieceOutput) -> PieceDone:
    """Store a computed piece's optimizer state and download delta files (if any): what the tick's indexes list."""
    return PieceDone(index=index, etag=etag, hash=sha.hex(), state=_put_state_piece(deps, round_no, made.state),
                     delta=_put_by_digest(deps, keys.delta_key, round_no, made.delta))


def _put_state_piece(deps: Deps, round_no: int, data: bytes | None) -> str:
    return _put_by_digest(deps, keys.optimizer_key, round_no, data)


def _put_by_digest(deps: Deps, key: Callable[[str, int, str], str], round_no: int, data: bytes | None) -> str:
    """Store a content-addressed file at `key(run, round, its digest)`; its digest ("" and nothing stored: none)."""
    if data is None:
        return ""
    written = digest(data)
    deps.bucket.put(key(deps.config.run_id, round_no, written), data)
    return written


def _put_state_index(deps: Deps, round_no: int, global_digest: str, pieces: list[str], counts: list[int]) -> str:
    """Written last, once every piece file is in: the state's digest names only a complete state."""
    step = ServerStep.of(deps.config)
    if step is None:
        return ""
    return _put_state_piece(deps, round_no, encode_index(step, round_no, global_digest, pieces, counts))


def _write_in_shards(deps: Deps, effect: Aggregate, plan: PiecePlan, base: GlobalModel) -> tuple[str, str]:
    run_id = deps.config.run_id
    staging = keys.staging_key(run_id, effect.round + 1, job_id(plan, effect.base_digest, effect.optimizer_digest))
    upload_id = deps.bucket.start_multipart(staging)
    tasks = [
        ShardTask(round=effect.round, base_digest=effect.base_digest, base_version=base.version_id,
                  base_size=base.size, inputs=[ShardInput(participant=i.participant, samples=i.samples,
                                                          digest=i.digest, version_id=i.version_id, norm=i.norm,
                                                          data_offset=i.data_offset)
                                               for i in effect.inputs],
                  staging=staging, upload_id=upload_id, first=shard.start, stop=shard.stop,
                  optimizer_digest=effect.optimizer_digest)
        for shard in plan.shards(deps.config.shard_bytes)
    ]
    try:
        try:
            results = (deps.shard_runner or threads_runner(deps))(tasks)
        except ReportedCorrupt as exc:
            verdict = confirmed(deps, effect, exc)
            if verdict is exc:
                raise
            raise verdict from exc
        pieces = [p for done in results for p in done.pieces]
        if [p.index for p in pieces] != list(range(plan.pieces)):
            raise RuntimeError(f"shard workers returned pieces {[p.index for p in pieces][:10]}..., expected "
                               f"0..{plan.pieces - 1}")
        version = deps.bucket.complete_multipart(staging, upload_id, [(p.etag, bytes.fromhex(p.hash)) for p in pieces])
    except BaseException:
        try:
            deps.bucket.abort_multipart(staging, upload_id)
        except Exception as exc:  # noqa: BLE001 - the shard's failure is the one raised; the bucket's lifecycle rule
            # aborts an upload left open. (A shard still uploading parts can race the abort: moto then fails it.)
            log.warning("could not abort the staging upload %s of %s (%s: %s)", upload_id, staging,
                        type(exc).__name__, exc)
        raise
    written = combine(bytes.fromhex(p.hash) for p in pieces)
    deps.bucket.copy(staging, keys.global_key(run_id, effect.round + 1, written), version_id=version)
    return _finish(deps, effect, plan, written, pieces)


def base_source(deps: Deps, base: GlobalModel) -> ObjectRange | HeldRange | None:
    """The round's global model, read by range: what clipping, a server optimizer and a download delta start
    from, and where a fragment's round takes every other tensor from."""
    config = deps.config
    needed = (strategy_of(config).needs_base or ServerStep.of(config) is not None or config.download.is_delta
              or config.fragments > 1)
    return base.source(deps) if needed else None


def run_shard(deps: Deps, task: ShardTask) -> ShardDone:
    """A shard worker's job: compute pieces [first, stop) of the task's global model and upload each as its
    part (idempotent: a retried shard writes the same bytes to the same part numbers). Memory: a few pieces."""
    key = keys.global_key(deps.config.run_id, task.round, task.base_digest)
    header = read_header(deps.bucket, key, task.base_version, task.base_size)
    base = GlobalModel(key, Manifest.of(header), task.base_version, header.data_offset, task.base_size)
    inputs = weighted_inputs(deps, task.round, base, task.inputs)
    plan = round_plan(deps.config, base.manifest, task.round + 1, inputs)
    job = job_id(plan, task.base_digest, task.optimizer_digest)
    if keys.staging_key(deps.config.run_id, task.round + 1, job) != task.staging:
        raise ValueError("the shard task's staging key does not name the job its inputs make")
    state = state_source(deps, task.round, task.optimizer_digest, plan)
    worker = PieceAggregator(deps.config, plan, inputs, base_source(deps, base), state)

    def upload(index: int, made: PieceOutput) -> PieceDone:
        sha = piece_hash(made.data)
        etag = deps.bucket.put_part(task.staging, task.upload_id, index + 1, made.data, sha)
        return _side_files(deps, task.round + 1, index, etag, sha, made)

    pieces: list[PieceDone] = []
    with ThreadPoolExecutor(max_workers=1) as uploader:  # piece i is hashed and uploaded while i + 1 is computed
        pending: Future[PieceDone] | None = None  # (at most one: memory stays at two pieces)
        uploading: bytearray | None = None
        spare: bytearray | None = None  # the bytes of a piece already uploaded: the next piece but one reuses them
        for index in range(task.first, min(task.stop, plan.pieces)):
            made = worker.piece_output(index, spare)
            if pending is not None:
                pieces.append(pending.result())
            spare, uploading = uploading, made.data
            pending = uploader.submit(upload, index, made)
        if pending is not None:
            pieces.append(pending.result())
    return ShardDone(pieces=pieces)


def threads_runner(deps: Deps, workers: int | None = None) -> ShardRunner:
    """Shards on threads of this process (numpy and hashing release the GIL): the default, and what a tick
    does without shard workers."""

    def run(tasks: Sequence[ShardTask]) -> list[ShardDone]:
        with ThreadPoolExecutor(max_workers=workers or len(tasks)) as pool:
            return list(pool.map(lambda t: retried(lambda: run_shard(deps, t), t), tasks))

    return run


def shard_outcome(deps: Deps, task: ShardTask, retry: bool = False) -> ShardOutcome:
    """A shard worker's reply, bound to `task`: its `ShardDone`, or which input could not be read (an exception
    would not carry the participant across a process or a Lambda invocation). With `retry`, the shard is tried up
    to SHARD_ATTEMPTS times first."""
    try:
        done = retried(lambda: run_shard(deps, task), task) if retry else run_shard(deps, task)
        return ShardOutcome(task=shard_task_digest(task), upload_id=task.upload_id, done=done)
    except CorruptInput as exc:
        named = next((i for i in task.inputs if exc.participant and i.participant == exc.participant), None)
        corrupt = ShardCorrupt(participant=named.participant if named else "", digest=named.digest if named else "",
                               version_id=named.version_id if named else "", missing=exc.missing,
                               message=str(exc)[:MAX_OUTCOME_TEXT])
        return ShardOutcome(task=shard_task_digest(task), upload_id=task.upload_id, corrupt=corrupt)


def failed_outcome(task: ShardTask, why: str) -> ShardOutcome:
    """A shard that failed every attempt: the waiting tick fails at once (and is retried as a tick)."""
    return ShardOutcome(task=shard_task_digest(task), upload_id=task.upload_id, failed=why[:MAX_OUTCOME_TEXT] or "?")


class OutcomeRefused(RuntimeError):
    """A shard outcome the tick does not act on: it answers another task, or reports an input unreadable that the
    coordinator reads as recorded. The aggregation is not done (its upload is aborted, the tick fails and is
    retried); a later tick aggregates afresh under a new upload, which no outcome written before it answers."""


class ReportedCorrupt(CorruptInput):
    """A shard worker's word that an input cannot be read as recorded: acted on only once the coordinator
    confirms it (`confirmed`)."""


def mismatch(outcome: ShardOutcome, task: ShardTask) -> str:
    """Why `outcome` does not answer `task` ("" if it does): another upload's (an earlier attempt at the same job,
    which no tick waits for), or one that names another task while claiming this upload."""
    if outcome.upload_id != task.upload_id:
        return "an outcome for another upload of the job"
    if outcome.task != shard_task_digest(task):
        return (f"an outcome for upload {task.upload_id[:40]!r} that names task {outcome.task[:16]}…, not this one "
                f"({shard_task_digest(task)[:16]}…: inputs, base model, pieces [{task.first}, {task.stop}))")
    return ""


def from_outcome(outcome: ShardOutcome | str | bytes, task: ShardTask) -> ShardDone:
    """What the shard worker's `outcome` of `task` says: the pieces it wrote, or the input it could not read (a
    `ReportedCorrupt` raised here), or its failure (RuntimeError). An outcome that is not `task`'s, or whose
    verdict names an input other than as the task records it, or whose pieces are not the task's, is refused
    (`OutcomeRefused`)."""
    if not isinstance(outcome, ShardOutcome):
        try:
            outcome = parse_message(ShardOutcome, outcome)
        except MessageError as exc:
            raise OutcomeRefused(f"the shard [{task.first}, {task.stop}) left no shard outcome: {exc}") from None
    if why := mismatch(outcome, task):
        raise OutcomeRefused(f"shard [{task.first}, {task.stop}): {why}")
    if outcome.failed:
        raise RuntimeError(f"shard worker failed: {outcome.failed[:500]}")
    if outcome.corrupt is not None:
        c = outcome.corrupt
        if c.participant and not any((i.participant, i.digest, i.version_id) == (c.participant, c.digest,
                                                                                  c.version_id) for i in task.inputs):
            raise OutcomeRefused(f"shard [{task.first}, {task.stop}) reports an input the task does not hold "
                                 f"({c.participant[:63]!r}, version {c.version_id[:64]!r})")
        raise ReportedCorrupt(c.message, c.participant, c.missing)
    assert outcome.done is not None
    indexes = [p.index for p in outcome.done.pieces]
    if not indexes or indexes != list(range(task.first, task.first + len(indexes))) or indexes[-1] >= task.stop:
        raise OutcomeRefused(f"shard [{task.first}, {task.stop}) reports pieces {indexes[:10]}")
    return outcome.done


def confirmed(deps: Deps, effect: Aggregate, exc: ReportedCorrupt) -> CorruptInput | OutcomeRefused:
    """A shard worker's verdict that a counted update cannot be read, as the tick acts on it: only where the
    coordinator itself finds the version it recorded for that update gone from the bucket (an S3 object version
    never changes, and ingest hashed and checked this one whole, so a version that is there reads as recorded).
    Anything else is an `OutcomeRefused` to raise instead: nobody is left out of a round on a worker's word."""
    if not exc.participant:  # the base model or the optimizer state: the tick leaves no one out for it
        return exc
    recorded = next((i for i in effect.inputs if i.participant == exc.participant), None)
    if recorded is None:
        return OutcomeRefused(f"a shard worker reports {exc.participant[:63]!r} unreadable, which round "
                              f"{effect.round} does not count")
    key = keys.update_key(deps.config.run_id, effect.round, recorded.participant)
    there = (deps.bucket.has_version(key, recorded.version_id) if recorded.version_id
             else deps.bucket.head(key) is not None)
    if there:
        log.warning("a shard worker reports the update of %r unreadable, but its recorded version %r is in the "
                    "bucket: not acted on (%s)", recorded.participant, recorded.version_id[:64], str(exc)[:300])
        return OutcomeRefused(f"a shard worker reports the update of {recorded.participant!r} unreadable, but the "
                              f"version recorded for it is in the bucket: nobody is left out on a worker's word")
    return exc


def retried(attempt: Callable[[], ShardDone], task: ShardTask) -> ShardDone:
    """A shard task tried up to SHARD_ATTEMPTS times (its work is idempotent); an unreadable input is not
    retried (the tick confirms it and leaves that update out), nor a task whose upload is gone (no tick waits for
    it). An outcome refused as not the task's is retried like any failure."""
    for n in range(1, SHARD_ATTEMPTS + 1):
        try:
            return attempt()
        except (CorruptInput, UploadGone):
            raise
        except Exception as exc:
            if n == SHARD_ATTEMPTS:
                raise
            log.warning("shard [%d, %d) of round %d failed (%s: %s); retrying", task.first, task.stop, task.round,
                        type(exc).__name__, exc)
    raise AssertionError("unreachable")
