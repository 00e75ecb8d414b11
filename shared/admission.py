"""Admission rules: whether an upload may take a round slot, whether an update's metadata is believable, how far
an update lies from the global model, and what of a participant's self-description is kept.

Pure functions of core types (RunState, RunConfig, UpdateMeta, numpy arrays): ingest (coordinator/intake/)
reads the object, checks its signature and records the outcome; these decide.
"""

from __future__ import annotations

from collections.abc import Mapping

from shared.config import DataMode, RunConfig
from shared.selection import assigned_count
from shared.state import Phase, RunState
from shared.wire import UpdateMeta, WireError

INFO_ITEMS = 20  # what is kept of a participant's `info`: this many items,
INFO_KEY_CHARS = 40  # keys cut to this many characters,
INFO_TEXT_CHARS = 200  # and values that are not numbers turned to text of this many characters at most


UPLOAD_CLOCK_SLACK = 2.0  # seconds: S3 event times are whole seconds, and S3's clock is not the tick's


def slot_problem(state: RunState, round_no: int, pid: str, uploaded_at: float | None = None) -> str:
    """Why an update cannot belong to a round slot at all (recorded outside the slots), or ""."""
    if state.phase is Phase.FINISHED:
        return "the run is finished"
    if round_no != state.round:
        return f"wrong round: update for round {round_no}, the run is at round {state.round}"
    if state.phase is not Phase.TRAIN:
        return f"round {round_no} is not accepting updates (phase {state.phase})"
    if pid not in state.members:
        return f"{pid} is not a member of epoch {state.epoch}"
    if uploaded_at is not None and uploaded_at + UPLOAD_CLOCK_SLACK < state.round_started:
        return (f"uploaded at {uploaded_at:.0f}, before round {round_no} started at {state.round_started:.0f}: "
                "left over from an earlier run of this round (the run was restored from a checkpoint)")
    return ""


def check_update_meta(
    meta: UpdateMeta, config: RunConfig, state: RunState, pid: str, round_no: int, registered: int = 0
) -> None:
    """Raise WireError unless an update's metadata names its key's run, round and participant and claims a
    believable sample count: positive, in local data mode at most the `registered` count of its own data, and
    (with a known shared data set) at most what the participant was assigned."""
    if meta.run_id != config.run_id or meta.round != round_no or meta.participant != pid:
        raise WireError("metadata names another run, round or participant than the key")
    if meta.samples <= 0:
        raise WireError(f"sample count must be positive, got {meta.samples}")
    if reason := model_mismatch(meta.model, config.hf.identity()):
        raise WireError(reason)
    if config.data_mode is DataMode.LOCAL:
        if meta.samples > registered:
            raise WireError(f"claims {meta.samples} samples, more than the {registered} its join registered")
    elif config.dataset_size:
        assigned = assigned_count(config.dataset_size, state.plan or state.selected, pid)
        if meta.samples > assigned:
            raise WireError(f"claims {meta.samples} samples, more than the {assigned} it was assigned")


def model_mismatch(named: Mapping[str, str], recorded: Mapping[str, str]) -> str:
    """Why an update was not trained from the run's model (a recorded digest it does not name, or names otherwise:
    another tokenizer, config or adapters' base), or ""."""
    for part, digest in recorded.items():
        if named.get(part) != digest:
            theirs = named.get(part, "")[:12] or "none"
            return f"trained from another model: its {part} digest is {theirs}, the run's is {digest[:12]}"
    return ""


def bounded_info(info: Mapping[str, object]) -> dict[str, str | int | float]:
    """A bounded, flat copy of participant-supplied info (it is displayed, never trusted): the first 20 items,
    keys cut to 40 characters, numbers kept and anything else turned to text of at most 200 characters."""
    return {
        str(k)[:INFO_KEY_CHARS]: v if isinstance(v, int | float) else str(v)[:INFO_TEXT_CHARS]
        for k, v in list(info.items())[:INFO_ITEMS]
    }


def staleness(sent_at: float, received_at: float, max_skew: float) -> str:
    """Why a join request or heartbeat is too far from its arrival to be fresh, or "" (a replayed old copy
    arrives long after it was sent; clocks are trusted to `max_skew` seconds)."""
    if abs(received_at - sent_at) <= max_skew:
        return ""
    return (f"stale: sent at {sent_at:.3f}, received at {received_at:.3f}, more than {max_skew:g} s apart "
            "(a replayed copy, or a clock far off)")
