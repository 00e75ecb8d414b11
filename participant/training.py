"""The training duty: the run's task on this host, the global model (downloaded once, cached by digest) and a
round's training and upload.

Model files stay on disk: the global model streams from the bucket into `<state-dir>/cache` (verified against the
digest the run state records before it is used, kept across restarts) and is loaded from there tensor by tensor;
an update (and an initial-model offer) is written by safetensors into `<state-dir>/outbox`, hashed, uploaded from
the file and deleted. A model is held in memory once, by torch.

torch is imported where it is used, so that the daemon starts (and answers --help) without loading it.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from participant.compressed import Residual, write_update
from participant.decide import Fetch, Train
from participant.delta_fetch import rebuild_from_delta
from participant.fragment_fetch import rebuild_from_fragment
from participant.journal import JournalKeeper
from participant.protocol import ForeignInitialModel, ParticipantError, UnfitModel, closed_while_training
from participant.remote import Remote, Stopped
from participant.streaming import Ahead, OwnModel, synced_tensors
from participant.ui import Reporter
from shared import keys
from shared.config import DataMode, RunConfig
from shared.digest import digest_file
from shared.selection import assignment
from shared.sizing import share_of
from shared.wire import UpdateMeta
from store.blobs import NotFound

if TYPE_CHECKING:
    from participant.tensors import ModelSource

log = logging.getLogger("participant")

CACHE_KEEP = 3
MODEL_SUFFIX = ".safetensors"
UNVERIFIED_SUFFIX = ".unverified"  # a downloaded global model until its digest is checked

# Tells the heartbeat what the participant is doing ("training round 3 (40%)").
Doing = Callable[[str], None]


def train_seed(round_seed: str, pid: str) -> int:
    """The torch seed of one participant's round: the same after a restart, different across peers."""
    return int(hashlib.sha256(f"fed-train:{round_seed}:{pid}".encode()).hexdigest()[:15], 16)


def resolve_device(name: str) -> Any:
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ParticipantError("--device cuda: CUDA is not available on this host (torch "
                               f"{torch.__version__}); use --device cpu or auto")
    if name not in {"cpu", "cuda"} and not name.startswith("cuda:"):
        raise ParticipantError(f"--device {name!r}: use auto, cpu, cuda or cuda:N")
    return torch.device(name)


def warm_up_autograd(device: Any, torch_optimizers: bool = True) -> None:
    """One backward pass and optimizer step on a throwaway layer: torch initialises autograd and the optimizers
    lazily, which costs about a second on a CPU (several on a busy one). Paid here, at start-up, it does not
    make the first round slower than the others (and miss a tight deadline). A task that does not step with
    `torch.optim` (`torch_optimizers` False: the digits tasks, `participant.sgd`) does not pay for importing it."""
    import torch

    from participant.sgd import MomentumSGD
    from participant.task import mixed_precision

    layer = torch.nn.Linear(4, 2).to(device)
    opt: Any = (torch.optim.SGD(layer.parameters(), lr=0.1, momentum=0.9) if torch_optimizers else
                MomentumSGD(layer.parameters(), lr=0.1, momentum=0.9))
    with mixed_precision(device):
        loss = torch.nn.functional.cross_entropy(layer(torch.zeros(3, 4, device=device)),
                                                 torch.zeros(3, dtype=torch.long, device=device))
    torch.autograd.backward(loss)  # what loss.backward() calls (and, unlike it, typed)
    opt.step()


@dataclass(frozen=True)
class Workload:
    """The run's task on this host: what training, witnessing and the final evaluation run."""

    spec: str  # module:object of the task
    config: RunConfig
    task: Any  # a participant.task.Task
    device: Any  # a torch.device
    specs: Any = None  # the task model's tensor names, shapes and dtypes (participant.tensors.Specs)
    own: Any = None  # local data mode: the indices of this participant's own data (np.ndarray); None: assigned
    node: Any = None  # a node of several ranks (participant.node.Node, --gpus N); None: this process alone

    @property
    def dataset_size(self) -> int:
        return self.config.dataset_size or int(self.task.train_size)

    @property
    def identity(self) -> dict[str, str]:
        """What the task's model is built from, named in every update (`participant.task.Task.identity`)."""
        return dict(getattr(self.task, "identity", None) or {})

    @property
    def takes_round(self) -> bool:
        return "round_no" in inspect.signature(self.task.train).parameters

    def train(self, model: Any, indices: Any, config: RunConfig, progress: Any, seed: int,
              round_no: int) -> dict[str, float]:
        """The task's training of one round; `round_no` goes to a task whose `train` takes it."""
        extra = {"round_no": round_no} if self.takes_round else {}
        return dict(self.task.train(model, indices, config, self.device, progress, seed=seed, **extra))


def load_workload(spec: str, config: RunConfig, device: str, threads: int, data: str | None = None,
                  gpus: int = 1, parallel: str = "auto") -> Workload:
    """Load the task, check it fits the run, pick the device and load the data (so the first round does not);
    in local data mode, this participant's own data as `data` names it. With `gpus` > 1, a node of that many ranks
    (participant.node: started at the first round), spreading the model as `parallel` says."""
    from participant.task import TaskError, load_task

    try:
        task = load_task(spec, config)
    except TaskError as exc:
        raise ParticipantError(str(exc)) from None
    size = int(task.train_size)
    own = own_data(task, spec, config, data)
    if own is None and config.dataset_size and config.dataset_size != size:
        raise ParticipantError(
            f"the run's dataset_size is {config.dataset_size}, but task {spec} has {size} training samples: "
            "every participant must train the same data set (fix the run config or --task)"
        )
    import torch

    if threads > 0:
        torch.set_num_threads(threads)
    from participant.tensors import specs_of

    started = time.perf_counter()
    model = task.build_model(config.seed)
    node = None
    if gpus > 1:
        from participant.node import Node

        node = Node(gpus, spec, config.model_dump_json(), resolve_device(device), threads, data, parallel)
    work = Workload(spec, config, task, resolve_device(device), specs_of(model), own, node)
    fresh = task.evaluate(model, work.device)  # loads the data now
    del model
    warm_up_autograd(work.device, getattr(task, "torch_optimizers", True))
    log.info("task %s: %d training samples, data loaded in %.1fs (untrained model: test accuracy %.4f); "
             "device %s, %d torch thread(s)", spec, work.dataset_size, time.perf_counter() - started,
             fresh.get("test_accuracy", math.nan), work.device, torch.get_num_threads())
    return work


def own_data(task: Any, spec: str, config: RunConfig, data: str | None) -> np.ndarray | None:
    """Local data mode: the indices of this participant's own samples (`task.local_data(data)`); None in
    assigned mode. A mode and a `--data` that do not fit each other are refused before anything is sent."""
    if config.data_mode is DataMode.ASSIGNED:
        if data:
            raise ParticipantError(f"--data {data}: run {config.run_id} assigns slices of one shared training set "
                                   "each round (data_mode = assigned); start without --data")
        return None
    if not data:
        raise ParticipantError(f"run {config.run_id} trains on each participant's own data (data_mode = local): "
                               "start with --data (for the built-in digits task, iid:I/N or dirichlet:ALPHA:I/N)")
    if not callable(getattr(task, "local_data", None)):
        raise ParticipantError(f"task {spec} cannot load local data: it has no local_data(spec) method "
                               "(see participant.task.Task)")
    try:
        own = np.asarray(task.local_data(data), dtype=np.int64)
    except (ValueError, OSError) as exc:
        raise ParticipantError(f"--data {data}: {exc}") from None
    if own.ndim != 1 or len(own) == 0:
        raise ParticipantError(f"--data {data}: task {spec} found no samples")
    if int(own.min()) < 0 or int(own.max()) >= int(task.train_size):
        raise ParticipantError(f"--data {data}: task {spec} returned indices outside [0, {task.train_size})")
    return own


def train_share(work: Workload, model: Any, held_model: ModelSource, mine: Work, config: RunConfig,
                progress: Callable[[int, int], None], seed: int, round_no: int, outbox: Path) -> dict[str, float]:
    """The task's training of our share: in this process, or on every rank of the node (`participant.node`), each
    loading the global model from its file."""
    if work.node is None:
        return work.train(model, mine.indices, config, progress, seed, round_no)
    if not isinstance(held_model, Path):  # (bytes: tests) the followers read the model from a file
        path = outbox / f"global-{round_no:06d}{MODEL_SUFFIX}"
        path.write_bytes(held_model)
        held_model = path
    job = {"model": str(held_model), "indices": [int(i) for i in mine.indices], "seed": seed, "round": round_no,
           "config": config.model_dump_json(), "takes_round": work.takes_round}
    closed: list[RoundClosed] = []

    def on_node(done: int, total: int) -> None:  # the round closing ends training only between rounds of the node
        try:
            progress(done, total)
        except RoundClosed as exc:
            closed.append(exc)

    metrics = dict(work.node.train(job, model, lambda ddp: work.train(ddp, mine.indices, config, on_node, seed,
                                                                      round_no)))
    if closed:
        raise closed[0]
    return metrics


class RoundClosed(Exception):
    """The round being trained closed meanwhile: training stops, nothing is sent."""


ROUND_CHECK_SECONDS = 2.0  # while training: how often to check that the round is still open for our update
THROTTLE_SLICE = 0.02  # --throttle waits once this many seconds are owed (short waits overshoot)


@dataclass(frozen=True)
class Work:
    """What this participant trains in a round, from the round's plan: the sample indices, the local steps (0: the
    run's local_epochs passes), the samples it claims (its FedAvg weight) and the units its time grows with."""

    indices: np.ndarray
    steps: int
    claim: int
    units: int


def round_work(work: Workload, a: Train, pid: str) -> Work:
    """Our share of round `a` (`shared.sizing`): in assigned mode our slice of the round's permutation, as long as our
    weight makes it; in local mode our own data. With a step count in the plan, that many steps (cycling through the
    data as often as needed) and, in local mode, the distinct samples they reach as the claim."""
    config = work.config
    share = share_of(a.planned, pid)
    steps = share.steps if share is not None else 0
    if work.own is not None:
        indices = work.own
        claim = min(len(indices), steps * config.batch_size) if steps else len(indices)
    else:
        indices = assignment(a.seed, work.dataset_size, a.planned, pid)
        claim = len(indices)
    steps = steps or config.local_steps
    units = steps * config.batch_size if steps else len(indices) * config.local_epochs
    return Work(indices, steps, claim, units)


class Training:
    """Offer the initial model, fetch global models (cached under `cache_dir`), train and upload a round.

    `throttle` (a testing aid, `fed-participant start --throttle F`): train at F of this host's speed, by waiting
    (1/F - 1) times as long as each batch took after it; 1: full speed."""

    def __init__(self, remote: Remote, kept: JournalKeeper, reporter: Reporter, stop: threading.Event,
                 doing: Doing, cache_dir: Path, run_id: str, pid: str, outbox: Path | None = None,
                 throttle: float = 1.0) -> None:
        self.remote, self.kept, self.ui, self.stop, self.doing = remote, kept, reporter, stop, doing
        self.cache_dir, self.run_id, self.pid = cache_dir, run_id, pid
        if not 0 < throttle <= 1:
            raise ParticipantError(f"--throttle {throttle}: must be in (0, 1]")
        self.throttle = throttle
        self.round_check = ROUND_CHECK_SECONDS  # while training, how often to ask whether the round is still open
        # what heartbeats report: (round, batches done, batches in all) of the round trained or trained last, and
        # the training throughput measured then (samples per second); read by the heartbeat thread
        self.progress: tuple[int, int, int] | None = None
        self.rate: float | None = None
        # model files we write, until they are uploaded (beside the cache: the state directory)
        self.outbox = outbox if outbox is not None else cache_dir.parent / "outbox"
        self.residual = Residual(cache_dir.parent)  # error feedback of compressed updates
        self.own_model = OwnModel(cache_dir.parent)  # Streaming DiLoCo: our model between rounds
        self.ahead = Ahead(self.own_model)  # and its training on after an upload (`fragment_overlap`)
        # (the training on, and the model it trains, that the round's upload starts: `fragment_overlap`)
        self.train_on: tuple[Callable[[Callable[[int, int], None]], object], Any] | None = None
        # files a process killed mid-write or mid-download left behind
        leftovers = [*self.outbox.glob("*"), *cache_dir.glob(f"*{UNVERIFIED_SUFFIX}"), *cache_dir.glob(".*.part")]
        for left in leftovers:
            left.unlink(missing_ok=True)
        self.global_evals: dict[str, dict[str, float]] = {}  # the held global model's evaluation, by digest
        self.downloaded = 0  # bytes of global models (or their deltas) downloaded by this process
        self.globals: dict[int, str] = {}  # the digest of the global model of the last rounds fetched, by round
        self.update_sent_at = -math.inf  # time.monotonic() of our last update upload (ingest takes it as a heartbeat)
        self.initial_digest = ""  # the digest of the initial model our task builds from the run's seed, once known

    def _initial_file(self, work: Workload) -> Path:
        """The initial model our task builds from the run's seed, written to the outbox (the caller removes it)."""
        from participant.tensors import save_model

        path = save_model(work.task.build_model(work.config.seed), self.outbox / f"init{MODEL_SUFFIX}")
        self.initial_digest = digest_file(path)
        return path

    def own_initial_digest(self, work: Workload) -> str:
        """The digest of the initial model our task builds (the bytes we offer, the same on every honest host)."""
        if not self.initial_digest:
            self._initial_file(work).unlink(missing_ok=True)
        return self.initial_digest

    def check_initial_model(self, work: Workload, action: Fetch) -> None:
        """Refuse to train from a round 0 whose global model is not our own initial model (ForeignInitialModel).
        Ingest already refuses offers that the run's pin (`initial_model_digest`, or the schema) rules out; this is
        the check that holds where the run file pins nothing the coordinator can check weights against."""
        if action.round != 0:
            return
        own = self.own_initial_digest(work)
        if action.digest != own:
            raise ForeignInitialModel(
                f"round 0's global model {action.digest[:16]} is not the initial model task {work.spec} builds "
                f"from the run's seed ({own[:16]}): the run adopted another participant's weights; not training "
                "on them (pin the initial model with initial_model_digest, as `fed run init` writes it)")

    def offer_model(self, work: Workload) -> None:
        path = self._initial_file(work)
        try:
            size, content_digest = path.stat().st_size, self.initial_digest
            with self.ui.track("offer the initial model", size, "bytes") as up:
                self.remote.upload_file(keys.init_key(self.run_id, self.pid), path, "offering the initial model", up,
                                        content_digest)
        finally:
            path.unlink(missing_ok=True)
        log.info("offered the initial model (%d bytes, digest %s)", size, content_digest[:12])

    # --- the global model ---------------------------------------------------------------------------

    def fetch_file(self, work: Workload, action: Fetch) -> Path | None:
        """The global model `action` names, as a file in the cache: from the cache or streamed from the bucket, its
        digest checked against the run state's before it is used and its tensors fitting the task; None when it is
        not available yet (asked again at the next poll)."""
        from participant.tensors import TensorMismatch, check_fits

        self.check_initial_model(work, action)
        path = self.cache_dir / f"{action.digest}{MODEL_SUFFIX}"
        source = "cache"
        if path.exists() and digest_file(path) != action.digest:
            log.warning("cached model %s is corrupt; downloading it again", path.name[:12])
            path.unlink(missing_ok=True)
        if not path.exists():
            started = time.perf_counter()
            if not self._download(action, path, work.config):
                if self.stop.wait(1.0):
                    raise Stopped() from None
                return None
            source = f"downloaded in {time.perf_counter() - started:.2f}s"
        try:
            check_fits(work.specs, path)
        except TensorMismatch as exc:
            raise UnfitModel(f"the run's global model does not fit task {work.spec}: {exc}") from None
        log.info("round %d: global model %s (%d bytes, %s)", action.round, action.digest[:12], path.stat().st_size,
                 source)
        self.globals = {r: d for r, d in self.globals.items() if r >= action.round - 1} | {action.round: action.digest}
        return path

    def _download(self, action: Fetch, path: Path, config: RunConfig) -> bool:
        """Stream the global model into the cache as `path` (or rebuild it from the previous one and the round's
        compressed delta, `download_encoding`), once its digest is the one the run records; False if it is not in
        the bucket yet, or is not what the run says (then nothing is kept)."""
        key = keys.global_key(self.run_id, action.round, action.digest)
        unverified = path.with_suffix(UNVERIFIED_SUFFIX)
        self.doing(f"downloading the global model of round {action.round}")
        started = time.perf_counter()
        try:
            with self.ui.track(f"download round {action.round}", 0, "bytes") as progress:
                fetched = None
                if config.download.is_delta and action.round > 0:
                    fetched = rebuild_from_delta(self.remote, self.run_id, action.round, action.digest,
                                                 config.download, self._cached, unverified, progress)
                elif config.fragments > 1 and (held := self._cached(self.globals.get(action.round - 1, ""))):
                    fetched = rebuild_from_fragment(self.remote, key, action.digest, held, config.fragments,
                                                    action.round, unverified, progress)
                    if fetched is not None:
                        log.info("round %d: rebuilt the global model from the previous one and the synced "
                                 "fragment (%d bytes downloaded)", action.round, fetched)
                if fetched is None:
                    got = self.remote.download_file(key, unverified, progress)
                    fetched = unverified.stat().st_size
                elif config.download.is_delta:  # every piece was checked against the index, whose hashes combine
                    got = action.digest  # to this digest
                    log.info("round %d: rebuilt the global model from the previous one and its %s delta (%d bytes "
                             "downloaded)", action.round, config.download, fetched)
                else:  # (checked whole against this digest)
                    got = action.digest
            self.downloaded += fetched
        except NotFound as exc:
            self.remote.must_exist(key, exc, f"the global model of round {action.round}")
            log.warning("round %d: the global model %s is not in the bucket yet; retrying", action.round, key)
            return False
        self.remote.found(key)
        if got != action.digest:
            unverified.unlink(missing_ok=True)
            log.warning("round %d: downloaded global model has digest %s, the run says %s; retrying",
                        action.round, got[:12], action.digest[:12])
            return False
        os.replace(unverified, path)
        log.info("round %d: global model downloaded (%d bytes, %.2fs)", action.round, fetched,
                 time.perf_counter() - started)
        files = sorted(self.cache_dir.glob(f"*{MODEL_SUFFIX}"), key=lambda p: p.stat().st_mtime, reverse=True)
        for old in files[CACHE_KEEP:]:
            old.unlink(missing_ok=True)
        return True

    def _cached(self, model_digest: str) -> Path | None:
        path = self.cache_dir / f"{model_digest}{MODEL_SUFFIX}"
        return path if path.exists() else None

    def evaluate(self, work: Workload, model_file: ModelSource) -> dict[str, float]:
        """A model's evaluation on the task's held-out data."""
        from participant.tensors import load_into

        model = load_into(work.task.build_model(work.config.seed), model_file)
        return {k: float(v) for k, v in work.task.evaluate(model, work.device).items()}

    def global_eval(self, work: Workload, held: str, held_model: ModelSource) -> dict[str, float]:
        """The held global model's evaluation (computed once per model)."""
        if held not in self.global_evals:
            self.global_evals = {held: self.evaluate(work, held_model)}
        return self.global_evals[held]

    # --- a round --------------------------------------------------------------------------------------

    def train(self, work: Workload, a: Train, held_model: ModelSource) -> bool:
        """Train our assignment of the round from the global model and upload the update; False if it was not
        sent (too large, or the round closed meanwhile)."""
        mine = round_work(work, a, self.pid)
        previous = self.kept.start_training(a.round, a.digest)
        if previous and previous.get("round") == a.round:
            log.info("round %d: retraining (interrupted by a restart)", a.round)
        try:
            path, metrics = self._fit(work, a, held_model, mine)
        except RoundClosed:
            self.residual.discard()
            return False
        sent = False
        try:
            sent = self._send(work, a, path, mine.claim, metrics)
            return sent
        finally:
            path.unlink(missing_ok=True)
            if sent:
                self.residual.commit()
            else:
                self.residual.discard()
            train_on, self.train_on = self.train_on, None
            if sent and train_on is not None:  # Streaming DiLoCo's overlap: train on while the round aggregates
                self.ahead.start(*train_on, a.round, work.config.fragment_overlap)

    def _send(self, work: Workload, a: Train, path: Path, samples: int, metrics: dict[str, float]) -> bool:
        size = path.stat().st_size
        if size > work.config.max_update_bytes:
            log.error("round %d: the update is %d bytes, over the run's limit of %d; not sent", a.round, size,
                      work.config.max_update_bytes)
            return False
        if closed_while_training(self.remote, a, self.pid):
            return False
        content_digest = digest_file(path)
        key = keys.update_key(self.run_id, a.round, self.pid)
        self.doing(f"uploading round {a.round}")
        started = time.perf_counter()
        with self.ui.track(f"upload round {a.round}", size, "bytes") as up:
            self.remote.upload_file(key, path, f"uploading the round {a.round} update", up, content_digest)
        self.update_sent_at = time.monotonic()
        self.kept.uploaded(a.round, {"digest": content_digest, "samples": samples, "at": time.time(),
                                     "metrics": metrics})
        self.doing(f"uploaded round {a.round}")
        log.info("round %d: update uploaded (%d bytes, %d samples, %.2fs)", a.round, size, samples,
                 time.perf_counter() - started)
        return True

    def _fit(self, work: Workload, a: Train, held_model: ModelSource, mine: Work) -> tuple[Path, dict[str, float]]:
        """Train our share of the round from the global model; return the update's file (in the outbox) and its
        metrics (among them its training seconds, from which the coordinator measures its throughput)."""
        import torch

        from participant.task import mixed_precision
        from participant.tensors import load_into, save_model

        indices = mine.indices
        config, task = work.config, work.task
        if mine.steps != config.local_steps:  # our share's step count (throughput sizing)
            config = config.model_copy(update={"local_steps": mine.steps})
        model = load_into(task.build_model(config.seed), held_model)
        global_eval = task.evaluate(model, work.device)
        self.global_evals = {a.digest: dict(global_eval)}  # a witness compares the round's updates with it
        synced = None  # with fragments (Streaming DiLoCo): our own model goes on, and the round syncs one fragment
        if config.fragments > 1:
            self.ahead.finish()
            retained: dict[str, np.ndarray] = {}
            kept = self.own_model.kept()  # (the merge of the model kept in round k shifts the residual once)
            ahead = self.own_model.resume(model, a.round, config.fragments, config.fragment_mix, retained)
            if retained and kept is not None and config.error_feedback and config.encoding.is_delta:
                self.residual.shift(retained, model.state_dict(), kept[0])
            synced = synced_tensors(model, config.fragments, a.round)
            if ahead and config.local_steps > ahead:  # (steps trained on after the last upload: this round's first)
                config = config.model_copy(update={"local_steps": config.local_steps - ahead})
            log.info("round %d: training %s, syncing fragment %d of %d (%d tensors)", a.round,
                     "from the global model" if ahead is None else f"our own model ({ahead} step(s) ahead)",
                     a.round % config.fragments, config.fragments, len(synced or ()))
        seed = train_seed(a.seed, self.pid)
        torch.manual_seed(seed)
        self.doing(f"training round {a.round}")
        started = time.perf_counter()

        clock = {"batch": time.perf_counter(), "checked": time.monotonic(), "owed": 0.0}
        self.progress = (a.round, 0, 1)

        def progress_cb(done: int, total: int) -> None:
            if self.stop.is_set():
                raise Stopped()
            if self.throttle < 1 and done:  # the testing aid: wait (1/F - 1) x what the batches took
                clock["owed"] += (time.perf_counter() - clock["batch"]) * (1 / self.throttle - 1)
                if clock["owed"] >= THROTTLE_SLICE or done >= total:  # in slices: a wait of microseconds oversleeps
                    waited = time.perf_counter()
                    if self.stop.wait(clock["owed"]):
                        raise Stopped()
                    clock["owed"] -= time.perf_counter() - waited
            clock["batch"] = time.perf_counter()
            self.progress = (a.round, min(done, total), max(total, 1))
            bar(done, total)
            self.doing(f"training round {a.round} ({100 * done // max(total, 1)}%)")
            if time.monotonic() - clock["checked"] >= self.round_check:
                clock["checked"] = time.monotonic()
                if closed_while_training(self.remote, a, self.pid):
                    raise RoundClosed()

        steps = f"{mine.steps} step(s)" if mine.steps else f"{config.local_epochs} local epoch(s)"
        log.info("round %d: training %d samples for %s", a.round, len(indices), steps)
        with self.ui.track(f"train round {a.round}", 0) as bar, mixed_precision(work.device):
            metrics = train_share(work, model, held_model, mine, config, progress_cb, seed, a.round, self.outbox)
        seconds = time.perf_counter() - started
        self.rate = mine.units / seconds if seconds > 0 else None
        local_eval = task.evaluate(model, work.device)
        metrics.update(
            test_accuracy=local_eval.get("test_accuracy", math.nan),
            test_loss=local_eval.get("test_loss", math.nan),
            global_test_accuracy=global_eval.get("test_accuracy", math.nan),
            global_test_loss=global_eval.get("test_loss", math.nan),
            train_seconds=seconds,  # with the samples (or steps) of its share: the coordinator's rate measurement
        )
        metrics = {k: float(v) for k, v in metrics.items() if isinstance(v, int | float) and math.isfinite(v)}
        meta = UpdateMeta(self.run_id, a.round, self.pid, mine.claim, metrics, work.identity)
        path = self.outbox / f"update-{a.round:06d}{MODEL_SUFFIX}"
        if synced is not None:
            self.own_model.keep(model, a.round)
            if config.fragment_overlap and work.node is None:  # trained on once the update is sent (`train`)
                overlap = config.model_copy(update={"local_steps": config.fragment_overlap})
                self.train_on = (lambda progress: work.train(model, indices, overlap, progress, seed + 1, a.round),
                                 model)
        if config.encoding.is_delta:  # the delta from the global model, compressed (`shared.compress`)
            write_update(model.state_dict(), held_model, config.encoding, path, meta.to_metadata(),
                         self.residual if config.error_feedback else None, synced)
        else:
            save_model(model, path, meta.to_metadata())
        log.info("round %d: trained in %.2fs: loss %.4f, test accuracy %.4f (global model %.4f)", a.round, seconds,
                 metrics.get("loss", math.nan), metrics.get("test_accuracy", math.nan),
                 metrics.get("global_test_accuracy", math.nan))
        return path, metrics
