"""The participant daemon: join, poll, fetch, train, upload, witness, repeat until the run is Finished.

The protocol's rules live in `participant.decide` (pure); this module gathers the facts `decide`
needs, carries out the action it returns, and handles everything around it: heartbeats on their own
thread, jittered backoff while waiting, retries through AWS faults (`participant.remote`), the
on-disk journal that makes restarts resume (`participant.journal`), the global-model cache, witness
duty (`participant.witness`) and health reports.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import platform
import random
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from participant.decide import (
    LIVE_PHASES,
    CheckUpdates,
    Fetch,
    Finish,
    Join,
    Local,
    OfferModel,
    ReportHealth,
    ReportReady,
    SendProof,
    Train,
    Wait,
    decide,
    is_resend,
    is_witness_duty,
    unhealthy,
)
from participant.journal import Journal, JournalFile
from participant.remote import Remote, Retrier, Stopped
from participant.ui import Reporter
from participant.witness import PeerUpdate, RoundWitness
from shared import keys
from shared.blobs import NotFound
from shared.config import RunConfig
from shared.connection import Connection
from shared.selection import assignment
from shared.signing import Signer
from shared.state import MemberStatus, Phase, RunState
from shared.wire import UpdateMeta, digest
from shared.witness import Proof

log = logging.getLogger("participant")

POLL_FIRST, POLL_MAX, POLL_GROWTH = 0.2, 2.0, 1.6
CACHE_KEEP = 3
RECORD_CHECK_SECONDS = 3.0  # while not a member: how often to check that our participant record still exists


class ParticipantError(RuntimeError):
    """A problem the participant cannot work around (wrong task, wrong run, bad device); exit 1."""


@dataclass
class Options:
    pid: str
    state_dir: Path
    task: str | None = None  # module:object; None: the run config's task
    device: str = "auto"
    threads: int = 0  # torch intra-op threads; 0: torch's default
    max_rounds: int = 0  # leave after uploading this many updates; 0: run to the end
    poll_max: float = POLL_MAX


@dataclass
class Outcome:
    """How the daemon ended."""

    finished: bool
    rounds: int
    final: dict[str, float] = field(default_factory=dict)
    reason: str = ""


def default_state_dir(run_id: str, pid: str) -> Path:
    return Path.home() / ".fed" / run_id / pid


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


def warm_up_autograd(device: Any) -> None:
    """One backward pass and optimizer step on a throwaway layer: torch initialises autograd and the optimizers
    lazily, which costs about a second on a CPU (several on a busy one). Paid here, at start-up, it does not
    make the first round slower than the others (and miss a tight deadline)."""
    import torch

    layer = torch.nn.Linear(4, 2).to(device)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1, momentum=0.9)
    loss = torch.nn.functional.cross_entropy(layer(torch.zeros(3, 4, device=device)),
                                             torch.zeros(3, dtype=torch.long, device=device))
    loss.backward()
    opt.step()


class Daemon:
    def __init__(self, conn: Connection, options: Options, stop: threading.Event, reporter: Reporter) -> None:
        keys.validate_participant_id(options.pid)
        self.conn, self.opt, self.stop, self.ui = conn, options, stop, reporter
        self.pid, self.run_id = options.pid, conn.run_id
        # The signing key lives beside the journal: a restarted participant keeps the identity it registered.
        self.signer = Signer.load_or_create(Path(options.state_dir) / "signing-key.pem")
        self.remote = Remote(conn, self.pid, Retrier(stop), self.signer)
        self.journal_file = JournalFile(options.state_dir, self.run_id, self.pid)
        self.journal, why = self.journal_file.load()
        if why:
            log.warning(why)
        self.cache_dir = Path(options.state_dir) / "cache"
        self.config: RunConfig | None = None
        self.task: Any = None
        self.device: Any = None
        self.dataset_size = 0
        # what decide() needs to know about us
        self.joined_at: float | None = None
        self.join_sent, self.join_sends = 0.0, 0
        self.offered = False
        self.held = ""
        self.held_bytes = b""
        self.reported_ready = 0
        self.ready_sent, self.ready_sends = 0.0, 0
        self.stored: set[int] = set()  # rounds with an update of ours found in the bucket or table
        self.skipped: set[int] = set()  # rounds trained but not sent (the round closed meanwhile)
        self.rounds_uploaded = 0
        self.global_evals: dict[str, dict[str, float]] = {}  # the held global model's evaluation, by digest
        self.witness: RoundWitness | None = None  # witness work of the round we are a witness of
        self.health_confirmed: dict[int, bool] = {}  # round -> its proofs reached the quorum
        self.record_checked = 0.0
        # shared with the heartbeat thread
        self.ready_epoch = 0
        self.activity = "starting"
        self._beat_lock = threading.Lock()
        self._beats_stop = threading.Event()

    # --- the main loop ------------------------------------------------------------------------------

    def run(self) -> Outcome:
        heart = None
        try:
            self._join()
            self.config = self._wait_for_config()
            # Alive from now on: loading torch and the task's data can take longer than the liveness timeout on a
            # busy host, and an epoch admits only participants it has heard from recently.
            self.activity = "loading the task"
            heart = threading.Thread(target=self._heartbeats, name="heartbeat", daemon=True)
            heart.start()
            self._prepare_task(self.config)
            if self.journal.training:
                log.info("round %s was being trained when this participant last stopped; it is retrained if "
                         "the round is still open", self.journal.training.get("round"))
            return self._loop()
        except Stopped:
            log.info("stopped; progress is saved in %s", self.journal_file.path)
            return Outcome(False, self.rounds_uploaded, reason="stopped")
        finally:
            self._beats_stop.set()
            if heart is not None:
                heart.join(timeout=5)

    def _loop(self) -> Outcome:
        delay, last_wait, last_seen = POLL_FIRST, None, None
        while True:
            if self.stop.is_set():
                raise Stopped()
            state = self.remote.read_state()
            seen = (state.phase, state.epoch, state.round, state.global_digest)
            if seen != last_seen:
                self._log_state(state)
                last_seen = seen
            self._check_outcome(state)
            local = self._local(state)
            action = decide(state, local)
            if isinstance(action, Wait):
                marker = (state.version, action.reason)
                if marker != last_wait:
                    if last_wait is None or action.reason != last_wait[1]:
                        log.info("waiting: %s", action.reason)
                    self.activity = f"waiting: {action.reason}"[:190]
                    delay, last_wait = POLL_FIRST, marker
                if self.stop.wait(delay * random.uniform(0.75, 1.25)):
                    raise Stopped()
                delay = min(delay * POLL_GROWTH, self.opt.poll_max)
                continue
            resend = is_resend(action, local)
            if not resend:  # a re-send is no progress: keep polling at the slower pace
                delay, last_wait = POLL_FIRST, None
            if isinstance(action, Finish):
                return self._finish(action)
            if isinstance(action, Join):
                age = time.monotonic() - self.join_sent
                log.warning("join request not recorded after %.0fs; sending it again", age)
                self._join()
            elif isinstance(action, OfferModel):
                self._offer_model()
            elif isinstance(action, Fetch):
                self._fetch(action)
            elif isinstance(action, ReportReady):
                self._report_ready(action.epoch, again=resend)
            elif isinstance(action, ReportHealth):
                self._report_health(action, state)
            elif isinstance(action, CheckUpdates):
                self._check_updates(action, state)
            elif isinstance(action, SendProof):
                self._send_proof(action, state)
            elif isinstance(action, Train):
                self._train(action)
                if self.opt.max_rounds and self.rounds_uploaded >= self.opt.max_rounds:
                    log.info("leaving after %d uploaded round(s) (--max-rounds)", self.rounds_uploaded)
                    return Outcome(False, self.rounds_uploaded, reason="max-rounds")

    def _local(self, state: RunState) -> Local:
        ready_recorded = self.reported_ready
        if self.joined_at is not None and self.pid not in state.members:
            self._check_still_registered()
        if self.joined_at is None:
            record = self.remote.participant_record()
            if record is not None:
                self._adopt_incarnation(float(record.joined_at))
        elif (state.phase is Phase.WARMUP and self.reported_ready >= state.epoch
              and state.members.get(self.pid) is not None):
            record = self.remote.participant_record()
            ready_recorded = int(record.ready_epoch or 0) if record is not None else 0
        recorded = False
        if state.phase is Phase.TRAIN and self.pid in state.selected and state.round not in self._done():
            recorded = self._update_exists(state.round)
        missing, unchecked = self._witness_facts(state, recorded)
        return Local(
            pid=self.pid,
            joined=self.joined_at is not None,
            join_age=time.monotonic() - self.join_sent,
            join_sends=self.join_sends,
            offered=self.offered,
            held=self.held,
            reported_ready=self.reported_ready,
            ready_age=time.monotonic() - self.ready_sent,
            ready_sends=self.ready_sends,
            ready_recorded=ready_recorded,
            uploaded=self._done(),
            recorded=recorded,
            witnessed=frozenset(self.journal.witnessed),
            witness_missing=missing,
            witness_unchecked=unchecked,
            health_reported=frozenset(self.journal.health_reported),
            health_confirmed=self._health_confirmed(state),
        )

    def _check_still_registered(self) -> None:
        """Not a member: make sure the coordinator still knows us. A run restored from its checkpoint after
        its table was lost (`fed run restore`) has no participant records: join again, as a new incarnation."""
        if time.monotonic() - self.record_checked < RECORD_CHECK_SECONDS:
            return
        self.record_checked = time.monotonic()
        if self.remote.participant_record() is not None:
            return
        log.warning("the coordinator has no record of this participant any more (the run's state was lost or "
                    "restored?); joining again")
        self.joined_at = None
        self.stored.clear()
        self.skipped.clear()
        self.reported_ready = self.ready_epoch = 0
        self.witness = None
        self.health_confirmed.clear()
        self._join()

    def _done(self) -> frozenset[int]:
        return self.journal.uploaded_rounds | self.skipped

    def _update_exists(self, round_no: int) -> bool:
        if round_no in self.stored:
            return True
        if self.remote.update_record(round_no) is not None or self.remote.update_stored(round_no, self.joined_at):
            log.info("round %d: an update of ours is already stored (uploaded before a restart); not redone", round_no)
            self.stored.add(round_no)
            return True
        return False

    def _adopt_incarnation(self, joined_at: float) -> None:
        """Tie the journal to this incarnation of the run (see participant.journal)."""
        self.joined_at = joined_at
        j = self.journal
        if j.joined_at is not None and abs(j.joined_at - joined_at) > 1e-3:
            log.warning("the run was recreated since %s was written (joined at %.3f, now %.3f); discarding "
                        "its progress", self.journal_file.path, j.joined_at, joined_at)
            self.journal = Journal(self.run_id, self.pid)
        if self.journal.joined_at is None:
            self.journal.joined_at = joined_at
            self.journal_file.save(self.journal)
        log.info("joined run %s as %s", self.run_id, self.pid)

    def _log_state(self, state: RunState) -> None:
        member = state.members.get(self.pid)
        status = "not a member" if member is None else member.status.value
        sel = "selected" if self.pid in state.selected else "not selected"
        log.info("run %s: phase %s, epoch %d, round %d (%s, %s)", self.run_id, state.phase.value, state.epoch,
                 state.round, status, sel)

    def _check_outcome(self, state: RunState) -> None:
        """Log, once, whether the coordinator accepted our latest upload."""
        pending = [r for r in self.journal.uploaded if r not in self.journal.outcomes]
        if not pending:
            return
        r = max(pending)
        rec = self.remote.update_record(r)
        if rec is None:
            if state.round > r:  # the round closed without a record of ours: do not ask again
                self.journal.outcomes[r] = "no record"
                self.journal_file.save(self.journal)
            return
        if rec.accepted:
            log.info("round %d: update accepted", r)
            self.journal.outcomes[r] = "accepted"
        else:
            log.warning("round %d: update refused: %s", r, rec.reason)
            self.journal.outcomes[r] = rec.reason or "refused"
        self.journal_file.save(self.journal)

    # --- set-up -----------------------------------------------------------------------------------

    def _info(self) -> dict[str, Any]:
        import torch

        info: dict[str, Any] = {
            "host": socket.gethostname(),
            "os_pid": os.getpid(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "device": str(self.device) if self.device is not None else self.opt.device,
        }
        if self.device is not None and self.device.type == "cuda":
            info["gpu"] = torch.cuda.get_device_name(self.device)
        if self.config is not None:
            info["task"] = self.opt.task or self.config.task
        return info

    def _join(self) -> None:
        body = {"run_id": self.run_id, "participant": self.pid, "public_key": self.signer.public_key,
                "info": self._info()}
        self.remote.put_json(keys.join_key(self.run_id, self.pid), body, "sending the join request")
        self.join_sent, self.join_sends = time.monotonic(), self.join_sends + 1
        log.info("join request sent for run %s", self.run_id)

    def _wait_for_config(self) -> RunConfig:
        delay, announced = POLL_FIRST, False
        while True:
            config = self.remote.read_config()
            if config is not None:
                break
            if not announced:
                log.info("waiting for the run configuration (the coordinator publishes it on its first tick)")
                announced = True
            if self.stop.wait(delay * random.uniform(0.75, 1.25)):
                raise Stopped()
            delay = min(delay * POLL_GROWTH, self.opt.poll_max)
        if config.run_id != self.run_id:
            raise ParticipantError(f"the published config is for run {config.run_id!r}, not {self.run_id!r}")
        log.info("run config: task %s, %d rounds, %d local epoch(s), batch %d, learning rate %g",
                 self.opt.task or config.task, config.total_rounds, config.local_epochs, config.batch_size,
                 config.learning_rate)
        return config

    def _prepare_task(self, config: RunConfig) -> None:
        from participant.task import TaskError, load_task

        spec = self.opt.task or config.task
        try:
            self.task = load_task(spec)
        except TaskError as exc:
            raise ParticipantError(str(exc)) from None
        size = int(self.task.train_size)
        if config.dataset_size and config.dataset_size != size:
            raise ParticipantError(
                f"the run's dataset_size is {config.dataset_size}, but task {spec} has {size} training samples: "
                "every participant must train the same data set (fix the run config or --task)"
            )
        self.dataset_size = config.dataset_size or size
        import torch

        if self.opt.threads > 0:
            torch.set_num_threads(self.opt.threads)
        self.device = resolve_device(self.opt.device)
        started = time.perf_counter()
        fresh = self.task.evaluate(self.task.build_model(config.seed), self.device)  # loads the data now
        warm_up_autograd(self.device)
        log.info("task %s: %d training samples, data loaded in %.1fs (untrained model: test accuracy %.4f); "
                 "device %s, %d torch thread(s)", spec, self.dataset_size, time.perf_counter() - started,
                 fresh.get("test_accuracy", math.nan), self.device, torch.get_num_threads())

    # --- heartbeats -------------------------------------------------------------------------------

    def _heartbeats(self) -> None:
        assert self.config is not None
        every = self.config.heartbeat_every
        while not self._beats_stop.is_set() and not self.stop.is_set():
            try:
                self._beat()
            except Stopped:
                return
            except Exception as exc:  # never let the heartbeat thread die
                log.warning("heartbeat failed: %s: %s", type(exc).__name__, exc)
            if self._beats_stop.wait(every * random.uniform(0.9, 1.0)):
                return

    def _beat(self) -> None:
        with self._beat_lock:
            info = self._info()
            info["activity"] = self.activity
            body = {"participant": self.pid, "ready_epoch": self.ready_epoch, "info": info}
            self.remote.put_json(keys.heartbeat_key(self.run_id, self.pid), body, "sending a heartbeat")

    def _report_ready(self, epoch: int, again: bool) -> None:
        self.ready_epoch = epoch
        self.activity = f"ready for epoch {epoch}"
        self._beat()
        self.reported_ready, self.ready_sent = epoch, time.monotonic()
        self.ready_sends = self.ready_sends + 1 if again else 1
        if again:
            log.info("ready for epoch %d: not yet recorded by the coordinator, heartbeat sent again", epoch)
        else:
            log.info("ready for epoch %d (heartbeat sent)", epoch)

    # --- the model ----------------------------------------------------------------------------------

    def _offer_model(self) -> None:
        from participant.tensors import model_bytes

        assert self.config is not None
        data = model_bytes(self.task.build_model(self.config.seed))
        self.remote.upload(keys.init_key(self.run_id, self.pid), data, "offering the initial model")
        self.offered = True
        log.info("offered the initial model (%d bytes, sha256 %s)", len(data), digest(data)[:12])

    def _fetch(self, action: Fetch) -> None:
        from participant.tensors import TensorMismatch, load_into

        path = self.cache_dir / f"{action.digest}.safetensors"
        data = b""
        if path.exists():
            data = path.read_bytes()
            if digest(data) != action.digest:
                log.warning("cached model %s is corrupt; downloading it again", path.name[:12])
                data = b""
        source = "cache"
        if not data:
            key = keys.global_key(self.run_id, action.round, action.digest)
            self.activity = f"downloading the global model of round {action.round}"
            started = time.perf_counter()
            try:
                with self.ui.track(f"download round {action.round}", 0, "bytes") as progress:
                    data = self.remote.download(key, progress)
            except NotFound:
                log.warning("round %d: the global model %s is not in the bucket yet; retrying", action.round, key)
                if self.stop.wait(1.0):
                    raise Stopped() from None
                return
            if digest(data) != action.digest:
                log.warning("round %d: downloaded global model has sha256 %s, the run says %s; retrying",
                            action.round, digest(data)[:12], action.digest[:12])
                if self.stop.wait(1.0):
                    raise Stopped()
                return
            self._cache(path, data)
            source = f"downloaded in {time.perf_counter() - started:.2f}s"
        try:
            load_into(self.task.build_model(0), data)
        except TensorMismatch as exc:
            raise ParticipantError(f"the run's global model does not fit task {self.opt.task or self.config.task}: "
                                   f"{exc}") from None
        self.held, self.held_bytes = action.digest, data
        log.info("round %d: global model %s (%d bytes, %s)", action.round, action.digest[:12], len(data), source)

    def _cache(self, path: Path, data: bytes) -> None:
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)
        files = sorted(self.cache_dir.glob("*.safetensors"), key=lambda p: p.stat().st_mtime, reverse=True)
        for old in files[CACHE_KEEP:]:
            old.unlink(missing_ok=True)

    # --- a round --------------------------------------------------------------------------------

    def _train(self, a: Train) -> None:
        import torch

        from participant.tensors import load_into, model_bytes

        assert self.config is not None
        config, task = self.config, self.task
        indices = assignment(a.seed, self.dataset_size, a.selected, self.pid)
        previous = self.journal.training
        if previous and previous.get("round") == a.round:
            log.info("round %d: retraining (interrupted by a restart)", a.round)
        self.journal.training = {"round": a.round, "digest": a.digest, "started": time.time()}
        self.journal_file.save(self.journal)

        model = load_into(task.build_model(config.seed), self.held_bytes)
        global_eval = task.evaluate(model, self.device)
        self.global_evals = {a.digest: dict(global_eval)}  # a witness compares the round's updates with it
        seed = train_seed(a.seed, self.pid)
        torch.manual_seed(seed)
        self.activity = f"training round {a.round}"
        started = time.perf_counter()

        def progress_cb(done: int, total: int) -> None:
            if self.stop.is_set():
                raise Stopped()
            bar(done, total)
            self.activity = f"training round {a.round} ({100 * done // max(total, 1)}%)"

        log.info("round %d: training %d samples for %d local epoch(s)", a.round, len(indices), config.local_epochs)
        with self.ui.track(f"train round {a.round}", 0) as bar:
            metrics = dict(task.train(model, indices, config, self.device, progress_cb, seed=seed))
        seconds = time.perf_counter() - started
        local_eval = task.evaluate(model, self.device)
        metrics.update(
            test_accuracy=local_eval.get("test_accuracy", math.nan),
            test_loss=local_eval.get("test_loss", math.nan),
            global_test_accuracy=global_eval.get("test_accuracy", math.nan),
            global_test_loss=global_eval.get("test_loss", math.nan),
            train_seconds=seconds,
        )
        metrics = {k: float(v) for k, v in metrics.items() if isinstance(v, int | float) and math.isfinite(v)}
        meta = UpdateMeta(self.run_id, a.round, self.pid, len(indices), metrics)
        data = model_bytes(model, meta.to_metadata())
        log.info("round %d: trained in %.2fs: loss %.4f, test accuracy %.4f (global model %.4f)", a.round, seconds,
                 metrics.get("loss", math.nan), metrics.get("test_accuracy", math.nan),
                 metrics.get("global_test_accuracy", math.nan))

        if len(data) > config.max_update_bytes:
            log.error("round %d: the update is %d bytes, over the run's limit of %d; not sent", a.round, len(data),
                      config.max_update_bytes)
            self._skip(a.round)
            return
        now = self.remote.read_state()
        if now.round != a.round or now.phase is not Phase.TRAIN or self.pid not in now.selected:
            log.warning("round %d closed while training (now round %d, %s); update not sent", a.round, now.round,
                        now.phase.value)
            self._skip(a.round)
            return
        key = keys.update_key(self.run_id, a.round, self.pid)
        self.activity = f"uploading round {a.round}"
        started = time.perf_counter()
        with self.ui.track(f"upload round {a.round}", len(data), "bytes") as up:
            self.remote.upload(key, data, f"uploading the round {a.round} update", up)
        self.journal.uploaded[a.round] = {"digest": digest(data), "samples": len(indices), "at": time.time(),
                                          "metrics": metrics}
        self.journal.training = None
        self.journal_file.save(self.journal)
        self.rounds_uploaded += 1
        self.activity = f"uploaded round {a.round}"
        log.info("round %d: update uploaded (%d bytes, %d samples, %.2fs)", a.round, len(data), len(indices),
                 time.perf_counter() - started)

    # --- witness duty and health reports ---------------------------------------------------------------

    def _witness_facts(self, state: RunState, recorded: bool) -> tuple[int, int]:
        """As a witness owing the round's proof (after our own update): read the records not yet seen (a
        GetItem each) and return how many selected participants have none (as far as we know), and how many
        recorded updates are not verified yet."""
        r = state.round
        if not is_witness_duty(state, Local(pid=self.pid, witnessed=frozenset(self.journal.witnessed))):
            return 0, 0
        if state.phase is Phase.TRAIN and r not in self._done() and not recorded:
            return 0, 0  # our own training comes first
        w = self.witness
        if w is None or w.round != r or w.global_digest != state.global_digest:
            if w is not None:
                w.discard()
            workdir = Path(self.opt.state_dir) / "witness" / f"{r:06d}"
            w = self.witness = RoundWitness(r, state.global_digest, workdir)
        # Records are written once and never change. While the round is open, read them in order and stop at the
        # first one not there yet (one GetItem per poll while waiting, however many are missing); once it has
        # closed, no more can come: read every one still unseen.
        for pid in state.selected:
            if pid not in w.records:
                item = self.remote.update_record(r, pid)
                if item is not None:
                    w.records[pid] = PeerUpdate.from_record(item)
                elif state.phase is Phase.TRAIN:
                    break
        return len(w.missing(state.selected)), len(w.unchecked(state.selected))

    def _global_eval(self) -> dict[str, float]:
        """The held global model's evaluation on the task's held-out data (computed once per model)."""
        from participant.tensors import load_into

        assert self.config is not None
        if self.held not in self.global_evals:
            model = load_into(self.task.build_model(self.config.seed), self.held_bytes)
            self.global_evals = {self.held: dict(self.task.evaluate(model, self.device))}
        return self.global_evals[self.held]

    def _check_updates(self, action: CheckUpdates, state: RunState) -> None:
        """Download each recorded update not yet verified, by its recorded version, and verify it."""
        assert self.witness is not None and self.witness.round == action.round
        w = self.witness
        for rec in w.unchecked(state.selected):
            if self.stop.is_set():
                raise Stopped()
            self.activity = f"witnessing round {action.round}: checking the update of {rec.pid}"
            key = keys.update_key(self.run_id, action.round, rec.pid)
            started = time.perf_counter()
            try:
                data: bytes | None = self.remote.download(key, version_id=rec.version_id)
            except NotFound:
                data = None
            check = w.verify(rec, data, self.held_bytes)
            w.verify_seconds += time.perf_counter() - started
            if check.problem:
                log.warning("round %d: witness: the update of %s cannot be attested: %s", action.round, rec.pid,
                            check.problem)

    def _send_proof(self, action: SendProof, state: RunState) -> None:
        assert self.config is not None
        r = action.round
        w = self.witness
        if w is None or w.round != r:
            w = RoundWitness(r, state.global_digest, Path(self.opt.state_dir) / "witness" / f"{r:06d}")
        key = keys.witness_key(self.run_id, r, self.pid)
        if self.remote.stored_since(key, self.joined_at):
            log.info("round %d: our witness proof is already in the bucket (sent before a restart)", r)
            attested = {}
        else:
            self.activity = f"witnessing round {r}: evaluating {len(w.checks)} update(s)"
            global_loss = float(self._global_eval().get("test_loss", math.nan))
            try:
                w.evaluate(self.task, self.device, self.config.seed, self.held_bytes, global_loss,
                           self.config.witness_tolerance, state.selected, self.stop.is_set)
            except InterruptedError:
                raise Stopped() from None
            attested = w.attested(state.selected)
            for pid, v in sorted(w.verdicts.items()):
                if not v.attested:
                    log.warning("round %d: witness: %s not attested: %s", r, pid, v.reason)
            loss, throughput = self._own_training(r)
            proof = Proof.build(self.run_id, r, self.pid, state.witnesses.index(self.pid), attested,
                                expected=len(state.selected), complete=action.complete, loss=loss,
                                throughput=throughput, evaluations=w.evaluations())
            self.activity = f"witnessing round {r}: sending the proof"
            self.remote.upload(key, proof.to_json().encode(), f"uploading the round {r} witness proof")
            refused = sorted(p for p, v in w.verdicts.items() if not v.attested and p in state.selected)
            missing = w.missing(state.selected)
            log.info("round %d: witness proof sent (%s): attested %d of %d selected (aggregate loss %.4f, global "
                     "%.4f; %d update(s) downloaded and verified in %.3fs, %d evaluations in %.3fs)%s%s", r,
                     "complete" if action.complete else "incomplete: the round closed first", len(attested),
                     len(state.selected), w.aggregate_loss, global_loss, len(w.checks), w.verify_seconds,
                     len(w.verdicts) + 1, w.evaluation_seconds,
                     f"; not attested: {', '.join(refused)}" if refused else "",
                     f"; no update from: {', '.join(missing)}" if missing else "")
        w.discard()
        self.journal.witnessed[r] = {"complete": action.complete, "attested": sorted(attested), "at": time.time()}
        self.journal_file.save(self.journal)
        self.activity = f"witnessed round {r}"

    def _own_training(self, round_no: int) -> tuple[float, float]:
        """Our training loss and throughput (samples per second) in a round, for the witness proof."""
        assert self.config is not None
        entry = self.journal.uploaded.get(round_no) or {}
        metrics, samples = dict(entry.get("metrics") or {}), int(entry.get("samples") or 0)
        if not metrics:  # uploaded before a restart that lost the journal: the coordinator's record has them
            rec = self.remote.update_record(round_no)
            if rec is not None:
                metrics, samples = dict(rec.metrics or {}), int(rec.samples or 0)
        seconds = float(metrics.get("train_seconds", 0.0))
        throughput = samples * self.config.local_epochs / seconds if seconds > 0 else 0.0
        loss = float(metrics.get("loss", 0.0))
        return (loss if math.isfinite(loss) else 0.0), (throughput if math.isfinite(throughput) else 0.0)

    def _health_confirmed(self, state: RunState) -> bool:
        """Whether a health report about state.health_round is due and would mean something: we are an active
        member, someone was attested by fewer than a quorum, that round's proofs reached the quorum (a round
        whose witnesses did not show up scores everyone low: that confirms nothing), and it is a round of this
        epoch (a new epoch admits again those dropped in the last one)."""
        r = state.health_round
        member = state.members.get(self.pid)
        if (state.phase not in LIVE_PHASES or r < 0 or r in self.journal.health_reported or member is None
                or member.status is not MemberStatus.ACTIVE or not unhealthy(state, self.pid)):
            return False
        if r not in self.health_confirmed:
            summary = self.remote.round_summary(r)
            if summary is None:
                return False
            quorate = summary.quorum > 0 and summary.proofs >= summary.quorum
            self.health_confirmed[r] = quorate and summary.epoch == state.epoch
            if not quorate:
                log.info("round %d: %d of %d witness proofs arrived (quorum %d): its health scores confirm nothing; "
                         "no health report", r, summary.proofs, len(summary.witnesses), summary.quorum)
            elif summary.epoch != state.epoch:
                log.info("round %d belongs to epoch %d: a new epoch admits everyone again; no health report", r,
                         summary.epoch)
        return self.health_confirmed[r]

    def _report_health(self, action: ReportHealth, state: RunState) -> None:
        key = keys.health_key(self.run_id, action.round, self.pid)
        self.remote.put_json(key, {"unhealthy": list(action.unhealthy)}, f"sending the round {action.round} health "
                             "report")
        self.journal.health_reported[action.round] = list(action.unhealthy)
        self.journal_file.save(self.journal)
        scores = ", ".join(f"{p} ({state.health.get(p, 0)})" for p in action.unhealthy)
        log.warning("round %d: health report sent: %s attested by fewer than %d witness(es)", action.round, scores,
                    state.health_quorum)

    def _skip(self, round_no: int) -> None:
        self.skipped.add(round_no)
        self.journal.training = None
        self.journal_file.save(self.journal)

    # --- the end ----------------------------------------------------------------------------------

    def _finish(self, action: Finish) -> Outcome:
        from participant.tensors import load_into

        if not action.digest:
            log.warning("the run finished without a model")
            return Outcome(True, self.rounds_uploaded, reason="finished without a model")
        assert self.config is not None
        model = load_into(self.task.build_model(self.config.seed), self.held_bytes)
        final = {k: float(v) for k, v in self.task.evaluate(model, self.device).items()}
        result = {"run_id": self.run_id, "participant": self.pid, "round": action.round, "digest": action.digest,
                  "rounds_uploaded": len(self.journal.uploaded), **final}
        out = Path(self.opt.state_dir) / "result.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1, sort_keys=True))
        log.info("run finished: final global model %s (round %d)", action.digest[:12], action.round)
        return Outcome(True, self.rounds_uploaded, final)
