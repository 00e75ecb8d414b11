"""Witness duty: check the round's updates for meaning, and say which ones passed in a proof.

The coordinator (no torch) checks an update's structure when it arrives; an elected witness (with
torch and the task's held-out data) checks what it would do to the model. As each update the
coordinator recorded as accepted comes in, the witness

1. downloads exactly the recorded object version to disk and checks its content digest (`shared.digest`)
   against the recorded one;
2. checks its tensors' names, shapes and dtypes against the round's global model, and that they are finite
   (one tensor at a time);
3. keeps the verified file on disk (memory stays O(model) however many participants there are).

When it writes its proof (every selected participant's update recorded, or the round closed first) it
evaluates, on the task's held-out data, the round's aggregate `A` (the weighted mean of every verified update
whose direction passes, as FedAvg would make it of what is attested) and, for each of them `i`, the aggregate
without it `A - i` (the round's global model if `i` is alone). It attests `i` if

    cos(i - G, median_j(j - G)) >= witness_min_cosine     (with at least three updates; the median of an odd
                                                           count: the others in an even round, all in an odd one)
    loss(A) <= loss(A - i) * (1 + witness_tolerance)
    loss(A - i + i at the median weight) <= loss(A - i) * (1 + witness_tolerance)   (when its weight differs)

that is, if its change does not point away from the round's robust direction (the coordinate-wise median of
the updates' changes from the global model G: `directions`), and applying it to the rest of the round
does not make the model clearly worse, at its own weight nor at the round's median weight (with shares sized by
throughput a host that reports itself slow trains a small share, and a flipped update of a few steps passed
both of the other tests at its 4 % weight). The direction test catches a sign-flipped update early in a run, where
its loss effect can hide inside a loose tolerance; late in a run honest changes are nearly orthogonal to each
other (cosines about 0, -0.52 at worst measured), and the loss test decides (docs/protocol.md, *Witnesses under
attack*; benchmarks/witness_errors.py).

Why not compare each update alone with the global model: measured on digits, an honest update trained
on 1/n of the data is itself a worse model than the global once the run has converged (its loss
reaches 2x the global's), so that test refuses honest work late in a run; and from a random first
model even a poisoned update (a scaled, sign-flipped delta) lowers the loss when applied at its 1/n
share (0.98-1.11x the global's in round 0), so that test misses it when it matters most, in the first
round. Leaving it out of the round's aggregate separates them (6 participants, learning rate 0.1, 2
local epochs, 10 rounds, 3 seeds: honest updates 1.04x at worst, the poisoned one 1.34x in round 0 and
1.16x at least; with 4 participants over 20 rounds honest updates reach 1.14x late in the run, so
small runs want a larger tolerance).

The proof (shared.witness.Proof) carries bloom filters over the attested participants and over
`participant:digest`, the witness's own training loss and throughput, and its evaluations: for each
participant the loss of the aggregate without its update, and the global model's under "global" (a
reserved participant id, so it cannot collide).
"""

from __future__ import annotations

import dataclasses
import math
import mmap
import shutil
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shared.compress import Encoding
from shared.sizing import fedavg_weights
from shared.wire import Header, WireError, parse_header

if TYPE_CHECKING:
    from participant.tensors import ModelSource

GLOBAL = "global"  # the evaluations' key for the round's global model (a reserved participant id)


@dataclass(frozen=True)
class PeerUpdate:
    """What the coordinator recorded about one participant's update of the round."""

    pid: str
    accepted: bool
    digest: str = ""
    version_id: str = ""
    samples: int = 0
    reason: str = ""

    @classmethod
    def from_record(cls, item: Any) -> PeerUpdate:
        return cls(str(item.pid), bool(item.accepted), str(item.digest or ""), str(item.version_id or ""),
                   int(item.samples or 0), str(item.reason or ""))


@dataclass(frozen=True)
class Check:
    """The outcome of verifying one downloaded update (before any evaluation)."""

    pid: str
    digest: str
    samples: int
    problem: str = ""  # why it cannot be attested; "" when verified
    path: Path | None = None  # the verified file, kept for the evaluation


@dataclass(frozen=True)
class Verdict:
    pid: str
    digest: str
    attested: bool
    loss_without: float | None  # loss of the round's aggregate without this update
    reason: str  # why it was not attested, or ""


@dataclass
class RoundWitness:
    """One round's witness work in progress: the records seen, the updates verified, the verdicts."""

    round: int
    global_digest: str
    workdir: Path
    records: dict[str, PeerUpdate] = field(default_factory=dict)
    checks: dict[str, Check] = field(default_factory=dict)
    verdicts: dict[str, Verdict] = field(default_factory=dict)
    global_loss: float = math.nan
    aggregate_loss: float = math.nan
    cosines: dict[str, float] = field(default_factory=dict)  # each update's direction against the others
    evaluation_seconds: float = 0.0
    verify_seconds: float = 0.0  # downloads and checks, all updates together

    def missing(self, selected: Iterable[str]) -> list[str]:
        """Selected participants with no recorded update yet."""
        return [p for p in selected if p not in self.records]

    def unchecked(self, selected: Iterable[str]) -> list[PeerUpdate]:
        """Accepted updates of selected participants not yet verified."""
        return [r for p in selected if (r := self.records.get(p)) is not None and r.accepted
                and (p not in self.checks or self.checks[p].digest != r.digest)]

    def attested(self, selected: Iterable[str]) -> dict[str, str]:
        chosen = set(selected)
        return {p: v.digest for p, v in sorted(self.verdicts.items()) if v.attested and p in chosen}

    def evaluations(self) -> dict[str, float]:
        out = {p: v.loss_without for p, v in sorted(self.verdicts.items())
               if v.loss_without is not None and math.isfinite(v.loss_without)}
        if math.isfinite(self.global_loss):
            out[GLOBAL] = self.global_loss
        return out

    def update_path(self, pid: str) -> Path:
        """Where a participant's update is downloaded to (and kept, once verified)."""
        return self.workdir / f"{pid}.safetensors"

    def verify(self, rec: PeerUpdate, path: Path | None, got: str, reference: ModelSource,
               encoding: Encoding = Encoding(), fragments: int = 1) -> Check:
        """Check a downloaded file (None: not in the bucket) whose content digest is `got` against the record and
        the global model (a compressed update is decoded in place first); a file that fails is deleted."""
        problem = ""
        if path is None:
            problem = "the recorded version is not in the bucket"
        elif got != rec.digest:
            problem = f"digest {got[:12]} is not the recorded {rec.digest[:12]}"
        else:
            problem = _decoded(path, reference, encoding, fragments, self.round)
            problem = problem or structure_problem(path, reference) or non_finite(path)
        if problem and path is not None:
            path.unlink(missing_ok=True)
        check = Check(rec.pid, rec.digest, rec.samples, problem, None if problem else path)
        self.checks[rec.pid] = check
        return check

    def evaluate(self, task: Any, device: Any, build_seed: int, reference: ModelSource, global_loss: float,
                 tolerance: float, selected: Iterable[str], stopping: Callable[[], bool] = lambda: False,
                 min_cosine: float = -1.0, max_share: float = math.inf) -> None:
        """Decide every verified update of `selected`: its direction against the others' (`directions`; with at
        least two others), then, for those whose direction passes, leave-one-out against their aggregate, at its
        real weight (what FedAvg gives
        it: its claimed samples capped at `max_share` x the median claim, `shared.sizing.fedavg_weights`) and at
        the round's median weight (a small share must not hide a harmful change: sized by throughput, a host
        reporting itself slow gets one; nor a large one a change that only its weight makes look good). Updates are
        read from their files one tensor at a time; memory: the global model, the float64 sums, and one tensor of
        every update."""
        from participant.tensors import open_tensors

        started = time.perf_counter()
        self.global_loss = global_loss
        chosen = set(selected)
        checks = [c for p, c in sorted(self.checks.items()) if p in chosen]
        self.verdicts = {c.pid: Verdict(c.pid, c.digest, False, None, c.problem) for c in checks if c.problem}
        verified = [(c, c.path) for c in checks if not c.problem and c.path is not None]
        if not verified:
            return
        with open_tensors(reference) as f:
            base = {name: f.tensor(name) for name in f.names()}
        # Direction first: an update that points away is refused, and left out of the aggregate the others are
        # judged against (a x5 flip at twice the median weight made leaving out any honest update look better:
        # loss 1.49 with it, 1.17-1.19 without, measured on digits in a run's second round)
        self.cosines = directions(base, {c.pid: path for c, path in verified}) if len(verified) >= 3 else {}
        good = []
        for c, path in verified:
            cosine = self.cosines.get(c.pid)
            if cosine is not None and not cosine >= min_cosine:
                why = (f"its change points away from the others': cosine {cosine:.3f} with the coordinate-wise median "
                       f"of their changes (at least {min_cosine:g})")
                self.verdicts[c.pid] = Verdict(c.pid, c.digest, False, None, why)
            else:
                good.append((c, path))
        if good:
            self._leave_one_out(task, device, build_seed, base, good, global_loss, tolerance, stopping, max_share)
            kept = {c.pid for c, _ in good}
            for c, _ in verified:  # the aggregate without an update that points away is that of the others
                if c.pid not in kept:
                    self.verdicts[c.pid] = dataclasses.replace(self.verdicts[c.pid], loss_without=self.aggregate_loss)
        self.evaluation_seconds = time.perf_counter() - started

    def _leave_one_out(self, task: Any, device: Any, build_seed: int, base: dict[str, Any],
                       good: list[tuple[Check, Path]], global_loss: float, tolerance: float,
                       stopping: Callable[[], bool], max_share: float) -> None:
        """Judge each of `good` by what leaving it out of their aggregate does, at its own weight and at the
        median weight."""
        from participant.tensors import open_tensors

        weights = {p: float(n) for p, n in fedavg_weights({c.pid: max(c.samples, 1) for c, _ in good},
                                                          max_share).items()}
        total = sum(weights.values())
        sums = {name: t.double() * 0 for name, t in base.items() if t.is_floating_point()}
        for c, path in good:  # pass 1: the weighted sum of every update judged
            with open_tensors(path) as update:
                for name in sums:
                    sums[name] += weights[c.pid] * update.tensor(name).double()

        def loss_of(tensors: dict[str, Any]) -> float:
            if stopping():
                raise InterruptedError("stopping")
            model = task.build_model(build_seed)
            model.load_state_dict({**base, **{n: t.to(base[n].dtype) for n, t in tensors.items()}}, strict=True)
            return float(task.evaluate(model, device).get("test_loss", math.nan))

        self.aggregate_loss = loss_of({n: s / total for n, s in sums.items()})
        median = statistics.median(weights.values())
        for c, path in good:  # pass 2: each update left out in turn
            raised = math.nan  # the aggregate's loss with it weighted as the median update (when its own differs)
            own, rest = weights[c.pid], total - weights[c.pid]
            if len(good) == 1:
                without = global_loss
            else:
                with open_tensors(path) as update:
                    rests = {n: s - own * update.tensor(n).double() for n, s in sums.items()}
                    if own != median:
                        raised = loss_of({n: (r + median * update.tensor(n).double()) / (rest + median)
                                          for n, r in rests.items()})
                without = loss_of({n: r / rest for n, r in rests.items()})
            bound = without * (1 + tolerance)
            if not math.isfinite(self.aggregate_loss) or not math.isfinite(without):
                self.verdicts[c.pid] = Verdict(c.pid, c.digest, False, None, "its evaluation is not finite")
            elif self.aggregate_loss > bound:
                why = (f"the round's aggregate has loss {self.aggregate_loss:.4f} with it, {without:.4f} without "
                       f"(tolerance x{1 + tolerance:g})")
                self.verdicts[c.pid] = Verdict(c.pid, c.digest, False, without, why)
            elif raised > bound:  # NaN (not computed) compares false
                why = (f"weighted as the round's median update it gives the aggregate loss {raised:.4f}, {without:.4f} "
                       f"without it (tolerance x{1 + tolerance:g}; its own weight is {own / median:.0%} of the median)")
                self.verdicts[c.pid] = Verdict(c.pid, c.digest, False, without, why)
            else:
                self.verdicts[c.pid] = Verdict(c.pid, c.digest, True, without, "")

    def discard(self) -> None:
        """Remove the verified files kept on disk (after the proof was sent)."""
        shutil.rmtree(self.workdir, ignore_errors=True)


LEAVE_ONE_OUT_MEDIAN = 32  # an even round up to this many updates: each compared with the median of its others


def directions(base: dict[str, Any], paths: dict[str, Path]) -> dict[str, float]:
    """For each update (a file of the round's weights), the cosine between its change from `base` and a robust
    direction of the round: the coordinate-wise median of an odd number of the round's changes, the other updates'
    when there is an odd number of them (an even round), else all of them (an odd round; over
    LEAVE_ONE_OUT_MEDIAN updates, all of them). The median of an odd count is held by a majority of it: fewer
    than half of it flipped and scaled cannot move it. The median of an even count is the mean of its middle two,
    which half of it can turn: with three updates an honest one's two others are one honest and one flipped
    (measured: cosines -0.82 and -0.90 for two honest first-round digits updates beside a x5 flip), and with five
    updates of which two are flipped, an honest one's four others are two and two (measured: every honest update
    refused, every round). Float tensors only, read one tensor of every update at a time."""
    import contextlib

    import torch

    from participant.tensors import open_tensors

    pids = sorted(paths)
    n = len(pids)
    dots, own, theirs = (torch.zeros(n, dtype=torch.float64) for _ in range(3))
    with contextlib.ExitStack() as stack:
        files = [stack.enter_context(open_tensors(paths[p])) for p in pids]
        for name, reference in base.items():
            if not reference.is_floating_point():
                continue
            flat = reference.double().flatten()
            deltas = torch.stack([f.tensor(name).double().flatten() - flat for f in files])
            own += deltas.pow(2).sum(1)
            everyone = _median(deltas) if n % 2 == 1 or n > LEAVE_ONE_OUT_MEDIAN else None
            for i in range(n):
                middle = everyone if everyone is not None else _median(torch.cat([deltas[:i], deltas[i + 1:]]))
                dots[i] += deltas[i] @ middle
                theirs[i] += middle @ middle
    out = {}
    for i, pid in enumerate(pids):
        norm = math.sqrt(float(own[i]) * float(theirs[i]))
        out[pid] = float(dots[i]) / norm if norm > 0 else 0.0
    return out


def _median(rows: Any) -> Any:
    """The coordinate-wise median of the rows (the mean of the middle two for an even count)."""
    ordered = rows.sort(dim=0).values
    k = ordered.shape[0]
    return (ordered[(k - 1) // 2] + ordered[k // 2]) / 2


def _decoded(path: Path, reference: ModelSource, encoding: Encoding, fragments: int, round_no: int) -> str:
    """Decode a compressed update (of round `round_no`'s fragment, in a run of `fragments`) in place
    (`participant.compressed`); why it cannot be, or ""."""
    if not encoding.is_delta:
        return ""
    from participant.compressed import decode_update_file

    try:
        decode_update_file(path, reference, encoding, fragments, round_no)
    except ValueError as exc:  # WireError, CompressError
        return f"not a valid {encoding} update: {exc}"
    return ""


def header_of(source: ModelSource) -> Header:
    """A model file's header, checked by `shared.wire` (from a file: only its header is read)."""
    if not isinstance(source, Path):
        return parse_header(source)
    with source.open("rb") as f:
        if source.stat().st_size == 0:
            return parse_header(b"")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped, memoryview(mapped) as view:
            return parse_header(view)


def structure_problem(update: ModelSource, reference: ModelSource) -> str:
    """Why the update's tensors do not match the global model's names, shapes and dtypes, or ""."""
    try:
        mine, ref = header_of(update).tensors, header_of(reference).tensors
    except WireError as exc:
        return str(exc)
    if set(mine) != set(ref):
        missing, extra = sorted(set(ref) - set(mine)), sorted(set(mine) - set(ref))
        return f"tensor names differ from the global model's: missing {missing[:5]}, unexpected {extra[:5]}"
    for name, spec in ref.items():
        if mine[name] != spec:
            return (f"tensor {name}: {mine[name].dtype} {list(mine[name].shape)}, the global model has "
                    f"{spec.dtype} {list(spec.shape)}")
    return ""


def non_finite(source: ModelSource) -> str:
    """A tensor with NaN or infinite values, named; "" if all are finite (read one tensor at a time)."""
    import torch

    from participant.tensors import open_tensors

    with open_tensors(source) as f:
        for name in f.names():
            t = f.tensor(name)
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                return f"tensor {name} has non-finite values"
    return ""
