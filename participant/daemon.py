"""The participant daemon: join, poll, fetch, train, upload, witness, repeat until the run is Finished.

The protocol's rules live in `participant.decide` (pure) and its poll loop in `participant.protocol` (no torch,
shared with the load test's simulated participants); this module runs them for real: it joins with this host's
signing key, sends heartbeats on their own thread, retries through AWS faults (`participant.remote`), keeps the
on-disk journal that makes restarts resume (`participant.journal`), and hands the rest to its duties: training
(`participant.training`: the task, the global-model cache, a round's training and upload) and witnessing
(`participant.witness_duty`: witness duty and health reports).
"""

from __future__ import annotations

import json
import logging
import math
import os
import platform
import random
import socket
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from participant.decide import (
    CheckUpdates,
    Fetch,
    Finish,
    Local,
    ReportHealth,
    SendProof,
    Train,
    Wait,
    heartbeat_due,
    next_heartbeat,
)
from participant.journal import JournalFile, JournalKeeper
from participant.protocol import POLL_MAX, Feed, Participant, ParticipantExit
from participant.remote import Remote, Retrier, Stopped
from participant.training import Training, Workload, load_workload
from participant.ui import Reporter
from participant.witness_duty import Witnessing
from shared import keys
from shared.config import RunConfig
from shared.messages import MAX_RATE, Heartbeat, JoinRequest, Progress
from shared.signing import Signer
from shared.state import RunState
from store.connection import Connection
from store.push import Pushed, StateQueue

log = logging.getLogger("participant")
STOP_CHECK_SECONDS = 0.2  # how promptly a stop request ends a long poll of the push queue


@dataclass
class Options:
    pid: str
    state_dir: Path
    task: str | None = None  # module:object; None: the run config's task
    device: str = "auto"
    threads: int = 0  # torch intra-op threads; 0: torch's default
    max_rounds: int = 0  # leave after uploading this many updates; 0: run to the end
    poll_max: float = POLL_MAX
    data: str | None = None  # local data mode: what the task's local_data loads (a path or a split spec)
    throttle: float = 1.0  # testing aid: train at this fraction of the host's speed (--throttle)
    push: bool = True  # listen on a push queue of our own where the run has a state topic (--push/--poll)
    gpus: int = 1  # ranks of this node (participant.node); 1: this process alone
    parallel: str = "auto"  # how the node spreads the model: auto, ddp or fsdp (participant.node)
    signing_key: Path | None = None  # the upload-signing key's file; None: state_dir/signing-key.pem (--invite: the
    # key bound with the host key at redemption, `participant.credentials.HostSession.upload_key_path`)


def default_state_dir(run_id: str, pid: str) -> Path:
    return Path.home() / ".fed" / run_id / pid


def host_info(device: Any, device_option: str, task: str | None) -> dict[str, Any]:
    """What our join request and heartbeats say about this host (`fed status` shows it): its name, process,
    Python and torch, the device we train on (`device_option` until the task is loaded), and the task once known."""
    import torch

    info: dict[str, Any] = {
        "host": socket.gethostname(),
        "os_pid": os.getpid(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": str(device) if device is not None else device_option,
    }
    if device is not None and device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    if task is not None:
        info["task"] = task
    return info


def listen_unless_stopped(feed: Feed, seconds: float, stop: threading.Event) -> Pushed | None:
    """One long poll of `feed`, on a daemon thread of its own so that a stop request ends the wait at once (raises
    `Stopped`); an error of the long poll is raised here."""
    got: list[Pushed | None | BaseException] = []
    done = threading.Event()

    def receive() -> None:
        try:
            got.append(feed.wait(seconds))
        except BaseException as exc:  # handed to the caller's thread below
            got.append(exc)
        finally:
            done.set()

    threading.Thread(target=receive, name="push", daemon=True).start()
    while not done.wait(STOP_CHECK_SECONDS):
        if stop.is_set():
            raise Stopped()
    result = got[0]
    if isinstance(result, BaseException):
        raise result
    return result


class Daemon(Participant):
    """`fed-participant start`: the protocol loop run for real, with this host's signing key, the journal on disk,
    heartbeats on a thread of their own, and training and witnessing handed to its duties."""

    def __init__(self, conn: Connection, options: Options, stop: threading.Event, reporter: Reporter) -> None:
        keys.validate_participant_id(options.pid)
        pid, run_id, state_dir = options.pid, conn.run_id, Path(options.state_dir)
        # The signing key lives beside the journal (an invited host's, beside its host key): a restarted participant
        # keeps the identity it registered.
        self.signer = Signer.load_or_create(options.signing_key or state_dir / "signing-key.pem")
        self.remote = Remote(conn, pid, Retrier(stop), self.signer)
        self.journal_file = JournalFile(state_dir, run_id, pid)
        journal, why = self.journal_file.load()
        if why:
            log.warning(why)
        super().__init__(pid, run_id, self.remote, JournalKeeper(journal, self.journal_file), options.poll_max,
                         options.max_rounds)
        self.conn, self.opt, self.stop, self.ui = conn, options, stop, reporter
        # the run's task on this host, loaded once the run's config is known
        self.config: RunConfig | None = None
        self.task: Any = None
        self.specs: Any = None  # the task model's tensor specs (participant.tensors.specs_of)
        self.device: Any = None
        self.own: Any = None  # local data mode: the indices of this participant's own data
        self.node: Any = None  # --gpus N: the node's other ranks (participant.node.Node)
        self.training = Training(self.remote, self.kept, reporter, stop, self._doing, state_dir / "cache", run_id,
                                 pid, throttle=options.throttle)
        self.witnessing = Witnessing(self.remote, self.kept, self.training, stop, self._doing, state_dir, run_id, pid)
        self.last_seen: tuple[Any, ...] | None = None  # the state's phase, epoch, round and model last logged
        # shared with the heartbeat thread
        self.ready_epoch = 0
        self.activity = "starting"
        self._beat_lock = threading.Lock()
        self._beats_stop = threading.Event()

    def run(self) -> ParticipantExit:
        heart = None
        try:
            work = None
            if self.opt.data:  # its own data: loaded first, since the join request registers its sample count
                self.config = self._wait_for_config()
                work = self._load_workload(self.config)
            self._join()
            self.config = self.config or self._wait_for_config()
            self.feed = self._open_feed()
            log.info("run config: task %s, %d rounds, %d local epoch(s), batch %d, learning rate %g",
                     self.opt.task or self.config.task, self.config.total_rounds, self.config.local_epochs,
                     self.config.batch_size, self.config.learning_rate)
            # Alive from now on: loading torch and the task's data can take longer than the liveness timeout on a
            # busy host, and an epoch admits only participants it has heard from recently.
            self.activity = "loading the task"
            heart = threading.Thread(target=self._heartbeats, name="heartbeat", daemon=True)
            heart.start()
            if work is None:
                self._load_workload(self.config)
            if self.journal.training:
                log.info("round %s was being trained when this participant last stopped; it is retrained if "
                         "the round is still open", self.journal.training.get("round"))
            return self._loop()
        except Stopped:
            log.info("stopped; progress is saved in %s", self.journal_file.path)
            return ParticipantExit(False, self.me.rounds_uploaded, reason="stopped")
        finally:
            self._beats_stop.set()
            if heart is not None:
                heart.join(timeout=5)
            if self.node is not None:
                self.node.stop()

    def _open_feed(self) -> StateQueue | None:
        """Our push queue, subscribed to the run's state topic; None (we poll) where there is none or it cannot
        be made (a role without the permission, a participant id too long for a queue name)."""
        if not self.opt.push or not self.conn.state_topic:
            return None
        try:
            c = self.conn
            feed = StateQueue.connect(self.run_id, self.pid, c.state_topic, c.endpoint, c.region)
        except (ClientError, BotoCoreError) as exc:
            log.warning("no push queue (%s): polling the run state instead", exc)
            return None
        if feed is None:
            log.info("the participant id is too long for a push queue's name: polling the run state instead")
        else:
            log.info("listening for new rounds on %s", feed.url)
        return feed

    def _listen(self, seconds: float) -> Pushed | None:
        """The long poll, ended at once by a stop request (`listen_unless_stopped`). A failed one costs a read of
        the state item, nothing else."""
        assert self.feed is not None
        try:
            return listen_unless_stopped(self.feed, seconds, self.stop)
        except (ClientError, BotoCoreError) as exc:
            log.warning("the push queue failed (%s); reading the run state", exc)
            self.view.stale()  # read the state item next
            self._pause(1.0)
            return None

    def _load_workload(self, config: RunConfig) -> Workload:
        work = load_workload(self.opt.task or config.task, config, self.opt.device, self.opt.threads, self.opt.data,
                             self.opt.gpus, self.opt.parallel)
        self.task, self.device, self.specs, self.own = work.task, work.device, work.specs, work.own
        self.node = work.node
        if self.node is not None:
            self.node.log_dir = Path(self.opt.state_dir)
        return work

    def _work(self) -> Workload:
        """The run's task on this host (loaded by `run`)."""
        if self.config is None or self.task is None:
            raise RuntimeError("the run's task is not loaded yet")
        return Workload(self.opt.task or self.config.task, self.config, self.task, self.device, self.specs, self.own,
                        self.node)

    def _doing(self, activity: str) -> None:
        self.activity = activity

    # --- the protocol loop's hooks ------------------------------------------------------------------

    def _check_stop(self) -> None:
        if self.stop.is_set():
            raise Stopped()

    def _pause(self, seconds: float) -> None:
        if self.stop.wait(seconds):
            raise Stopped()

    def _observe(self, state: RunState) -> None:
        seen = (state.phase, state.epoch, state.round, state.global_digest)
        if seen == self.last_seen:
            return
        self.last_seen = seen
        member = state.members.get(self.pid)
        status = "not a member" if member is None else member.status.value
        sel = "selected" if self.pid in state.selected else "not selected"
        log.info("run %s: phase %s, epoch %d, round %d (%s, %s)", self.run_id, state.phase.value, state.epoch,
                 state.round, status, sel)

    def _waiting(self, action: Wait, new_reason: bool) -> None:
        if new_reason:
            log.info("waiting: %s", action.reason)
        self.activity = f"waiting: {action.reason}"[:190]

    def _local(self, state: RunState) -> Local:
        local = super()._local(state)
        missing, unchecked = self.witnessing.facts(state, local)
        return replace(local, witness_missing=missing, witness_unchecked=unchecked,
                       health_confirmed=self.witnessing.confirmed(state))

    def _forget(self) -> None:
        super()._forget()
        self.ready_epoch = 0
        self.witnessing.forget()

    # --- join, heartbeats, readiness ------------------------------------------------------------------

    def _info(self) -> dict[str, Any]:
        task = (self.opt.task or self.config.task) if self.config is not None else None
        return host_info(self.device, self.opt.device, task)

    def _send_join(self) -> None:
        info, samples = self._info(), len(self.own) if self.own is not None else None

        def request() -> dict[str, Any]:  # (sent now: each attempt's is)
            return JoinRequest(run_id=self.run_id, participant=self.pid, public_key=self.signer.public_key,
                               sent_at=self.sent_at(), info=info, samples=samples).model_dump(mode="json")

        self.remote.put_fresh_json(keys.join_key(self.run_id, self.pid), request, "sending the join request")

    def _heartbeats(self) -> None:
        assert self.config is not None
        every, after_update = self.config.heartbeat_every, self.config.heartbeat_after_update
        last = -math.inf
        while not self._beats_stop.is_set() and not self.stop.is_set():
            try:
                if heartbeat_due(time.monotonic(), self.training.update_sent_at, after_update * 0.9):
                    self._beat()
                    last = time.monotonic()
            except Stopped:
                return
            except Exception as exc:  # never let the heartbeat thread die
                log.warning("heartbeat failed: %s: %s", type(exc).__name__, exc)
                last = time.monotonic()  # (tried: the next try one interval on)
            jitter = random.uniform(0.9, 1.0)
            due = next_heartbeat(last, self.training.update_sent_at, every * jitter, after_update * jitter)
            if self._beats_stop.wait(max(0.0, due - time.monotonic())):
                return

    def _beat(self) -> None:
        with self._beat_lock:
            info = self._info()
            info["activity"] = self.activity
            progress, rate = self.training.progress, self.training.rate

            def beat() -> dict[str, Any]:  # (sent now: each attempt's is)
                return Heartbeat(
                    participant=self.pid, sent_at=self.sent_at(), ready_epoch=self.ready_epoch, info=info,
                    progress=Progress(round=progress[0], done=progress[1], total=progress[2])
                    if progress is not None else None,
                    samples_per_second=min(rate, MAX_RATE) if rate and math.isfinite(rate) else None,
                ).model_dump(mode="json")

            self.remote.put_fresh_json(keys.heartbeat_key(self.run_id, self.pid), beat, "sending a heartbeat")

    def _send_ready(self, epoch: int) -> None:
        self.ready_epoch = epoch
        self.activity = f"ready for epoch {epoch}"
        self._beat()

    # --- the duties -------------------------------------------------------------------------------------

    def _offer_model(self) -> None:
        self.training.offer_model(self._work())

    def _fetch(self, action: Fetch) -> None:
        path = self.training.fetch_file(self._work(), action)
        if path is not None:
            self.me.held, self.me.held_model = action.digest, path

    def _train(self, action: Train) -> bool:
        return self.training.train(self._work(), action, self.me.held_model)

    def _check_updates(self, action: CheckUpdates, state: RunState) -> None:
        config = self._work().config
        self.witnessing.check_updates(action, state, self.me.held_model, config.encoding, config.fragments)

    def _send_proof(self, action: SendProof, state: RunState) -> None:
        self.witnessing.send_proof(self._work(), action, state, self.me.held, self.me.held_model, self.me.joined_at)

    def _report_health(self, action: ReportHealth, state: RunState) -> None:
        self.witnessing.report_health(action, state)

    def _finish(self, action: Finish) -> ParticipantExit:
        if self.feed is not None:  # the run is over: no more changes to hear of
            self.feed.close()
            self.feed = None
        if not action.digest:
            log.warning("the run finished without a model")
            return ParticipantExit(True, self.me.rounds_uploaded, reason="finished without a model")
        if action.unfit:
            log.warning("the run finished with a global model that does not fit our task: nothing to evaluate")
            return ParticipantExit(True, self.me.rounds_uploaded,
                                   reason="finished with a model that does not fit our task")
        final = self.training.evaluate(self._work(), self.me.held_model)
        result = {"run_id": self.run_id, "participant": self.pid, "round": action.round, "digest": action.digest,
                  "rounds_uploaded": len(self.journal.uploaded), **final}
        out = Path(self.opt.state_dir) / "result.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1, sort_keys=True))
        log.info("run finished: final global model %s (round %d)", action.digest[:12], action.round)
        return ParticipantExit(True, self.me.rounds_uploaded, final)
