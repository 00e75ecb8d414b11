"""Witness duty and health reports, as the daemon carries them out (the evaluation itself: participant.witness_eval).

As an elected witness of a round, once its own update is uploaded, the participant reads the coordinator's
record of each selected participant's update, downloads and verifies every accepted one, and when all are in
(or the round closed first) evaluates them and uploads its proof, once. After a witnessed round, every active
member that finds a quorum of proofs sends one health report naming the members too few witnesses attested.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from participant.decide import CheckUpdates, Local, ReportHealth, SendProof, is_witness_duty, unhealthy
from participant.journal import JournalKeeper
from participant.remote import Remote, Stopped
from participant.training import Doing, Training, Workload
from participant.witness_eval import PeerUpdate, RoundWitness
from shared import keys
from shared.compress import Encoding
from shared.messages import HealthReport
from shared.state import LIVE_PHASES, MemberStatus, Phase, RunState
from shared.witness import Proof
from store.blobs import NotFound

if TYPE_CHECKING:
    from participant.tensors import ModelSource

log = logging.getLogger("participant")


class Witnessing:
    """One participant's witness duty (the round it witnesses, in progress) and its health reports."""

    def __init__(self, remote: Remote, kept: JournalKeeper, training: Training, stop: threading.Event,
                 doing: Doing, state_dir: Path, run_id: str, pid: str) -> None:
        self.remote, self.kept, self.training, self.stop, self.doing = remote, kept, training, stop, doing
        self.state_dir, self.run_id, self.pid = Path(state_dir), run_id, pid
        self.witness: RoundWitness | None = None  # witness work of the round we are a witness of
        self.health_confirmed: dict[int, bool] = {}  # round -> its proofs reached the quorum

    def forget(self) -> None:
        """Joining again as a new incarnation of the run: nothing of the old one's witness work counts."""
        self.witness = None
        self.health_confirmed.clear()

    def _workdir(self, round_no: int) -> Path:
        return self.state_dir / "witness" / f"{round_no:06d}"

    # --- witness duty ---------------------------------------------------------------------------------

    def facts(self, state: RunState, local: Local) -> tuple[int, int]:
        """As a witness owing the round's proof (after our own update): read the records not yet seen (a
        GetItem each) and return how many selected participants have none (as far as we know), and how many
        recorded updates are not verified yet."""
        r = state.round
        if not is_witness_duty(state, local):
            return 0, 0
        if state.phase is Phase.TRAIN and r not in local.uploaded and not local.recorded:
            return 0, 0  # our own training comes first
        w = self.witness
        if w is None or w.round != r or w.global_digest != state.global_digest:
            if w is not None:
                w.discard()
            w = self.witness = RoundWitness(r, state.global_digest, self._workdir(r))
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

    def check_updates(self, action: CheckUpdates, state: RunState, held_model: ModelSource,
                      encoding: Encoding = Encoding(), fragments: int = 1) -> None:
        """Download each recorded update not yet verified, by its recorded version, to disk, and verify it (a
        compressed one decoded against the global model first: witnesses evaluate weights)."""
        assert self.witness is not None and self.witness.round == action.round
        w = self.witness
        for rec in w.unchecked(state.selected):
            if self.stop.is_set():
                raise Stopped()
            self.doing(f"witnessing round {action.round}: checking the update of {rec.pid}")
            key = keys.update_key(self.run_id, action.round, rec.pid)
            started = time.perf_counter()
            path: Path | None = w.update_path(rec.pid)
            got = ""
            try:
                with self.training.ui.track(f"round {action.round}: download the update of {rec.pid}", 0,
                                            "bytes") as progress:
                    got = self.remote.download_file(key, w.update_path(rec.pid), progress, version_id=rec.version_id)
            except NotFound:
                path = None
            check = w.verify(rec, path, got, held_model, encoding, fragments)
            w.verify_seconds += time.perf_counter() - started
            if check.problem:
                log.warning("round %d: witness: the update of %s cannot be attested: %s", action.round, rec.pid,
                            check.problem)

    def send_proof(self, work: Workload, action: SendProof, state: RunState, held: str, held_model: ModelSource,
                   joined_at: float | None) -> None:
        """Evaluate what was verified and upload the proof, unless this incarnation of us sent it already."""
        r = action.round
        w = self.witness
        if w is None or w.round != r:
            w = RoundWitness(r, state.global_digest, self._workdir(r))
        key = keys.witness_key(self.run_id, r, self.pid)
        if self.remote.ours_since(key, joined_at):
            log.info("round %d: our witness proof is already in the bucket (sent before a restart)", r)
            attested = {}
        else:
            self.doing(f"witnessing round {r}: evaluating {len(w.checks)} update(s)")
            global_loss = float(self.training.global_eval(work, held, held_model).get("test_loss", math.nan))
            try:
                w.evaluate(work.task, work.device, work.config.seed, held_model, global_loss,
                           work.config.witness_tolerance, state.selected, self.stop.is_set,
                           work.config.witness_min_cosine, work.config.max_share_ratio)
            except InterruptedError:
                raise Stopped() from None
            attested = w.attested(state.selected)
            for pid, v in sorted(w.verdicts.items()):
                if not v.attested:
                    log.warning("round %d: witness: %s not attested: %s", r, pid, v.reason)
            loss, throughput = self._own_training(work, r)
            proof = Proof.build(self.run_id, r, self.pid, state.witnesses.index(self.pid), attested,
                                expected=len(state.selected), complete=action.complete, loss=loss,
                                throughput=throughput, evaluations=w.evaluations())
            self.doing(f"witnessing round {r}: sending the proof")
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
        self.kept.journal.witnessed[r] = {"complete": action.complete, "attested": sorted(attested), "at": time.time()}
        self.kept.save()
        self.doing(f"witnessed round {r}")

    def _own_training(self, work: Workload, round_no: int) -> tuple[float, float]:
        """Our training loss and throughput (samples per second) in a round, for the witness proof."""
        entry = self.kept.journal.uploaded.get(round_no) or {}
        metrics, samples = dict(entry.get("metrics") or {}), int(entry.get("samples") or 0)
        if not metrics:  # uploaded before a restart that lost the journal: the coordinator's record has them
            rec = self.remote.update_record(round_no)
            if rec is not None:
                metrics, samples = dict(rec.metrics or {}), int(rec.samples or 0)
        seconds = float(metrics.get("train_seconds", 0.0))
        throughput = samples * work.config.local_epochs / seconds if seconds > 0 else 0.0
        loss = float(metrics.get("loss", 0.0))
        return (loss if math.isfinite(loss) else 0.0), (throughput if math.isfinite(throughput) else 0.0)

    # --- health reports -------------------------------------------------------------------------------

    def confirmed(self, state: RunState) -> bool:
        """Whether a health report about state.health_round is due and would mean something: we are an active
        member, someone was attested by fewer than a quorum, that round's proofs reached the quorum (a round
        whose witnesses did not show up scores everyone low: that confirms nothing), and it is a round of this
        epoch (a new epoch admits again those dropped in the last one)."""
        r = state.health_round
        member = state.members.get(self.pid)
        if (state.phase not in LIVE_PHASES or r < 0 or r in self.kept.journal.health_reported or member is None
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

    def report_health(self, action: ReportHealth, state: RunState) -> None:
        key = keys.health_key(self.run_id, action.round, self.pid)
        report = HealthReport(unhealthy=tuple(action.unhealthy))
        self.remote.put_json(key, report.model_dump(mode="json"), f"sending the round {action.round} health report")
        self.kept.journal.health_reported[action.round] = list(action.unhealthy)
        self.kept.save()
        scores = ", ".join(f"{p} ({state.health.get(p, 0)})" for p in action.unhealthy)
        log.warning("round %d: health report sent: %s attested by fewer than %d witness(es)", action.round, scores,
                    state.health_quorum)
