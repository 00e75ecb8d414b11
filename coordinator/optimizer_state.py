"""The server optimizer's state in the bucket (`shared.server_opt`): read back piece by piece, authenticated by
the digests its index lists; carried, checkpointed and restored with the global model it goes with."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from coordinator.deps import Deps
from shared import keys
from shared.digest import PIECE_BYTES
from shared.server_opt import (
    MAX_INDEX_BYTES,
    ServerStep,
    StateError,
    decode_index,
    decode_piece,
    gather,
    index_pieces,
)
from store.blobs import NotFound, Tampered
from store.ranges import CorruptInput


def max_piece_bytes(step: ServerStep) -> int:
    """The largest state piece file: each slot's float32 values over a piece of 2-byte elements, and a header."""
    return 2 * PIECE_BYTES * len(step.slots) + 64 * 1024


def read_state_file(deps: Deps, key: str, want: str, limit: int) -> bytes:
    try:
        return deps.bucket.get_verified(key, want, limit)
    except (NotFound, Tampered, ValueError) as exc:
        raise CorruptInput(f"the optimizer state file {key[-80:]} cannot be read back: {exc}",
                           missing=isinstance(exc, NotFound)) from None


class StoredState:
    """The state a round starts from (a `shared.aggregate.StateSource`), named by its index's digest: the elements
    a piece of this round needs are read from whichever of the stored piece files hold them (the pieces of the
    round that wrote it, whose header may have been longer or shorter than this round's)."""

    def __init__(self, deps: Deps, step: ServerStep, round_no: int, digest: str, floats: int) -> None:
        self.deps, self.step, self.round = deps, step, round_no
        index = read_state_file(deps, keys.optimizer_key(deps.config.run_id, round_no, digest), digest,
                                MAX_INDEX_BYTES)
        try:
            listed = decode_index(step, index, floats)
        except StateError as exc:
            raise CorruptInput(f"the optimizer state of round {round_no}: {exc}") from None
        self.files = [file for file, _ in listed]
        self.counts = [count for _, count in listed]
        self._held: tuple[int, dict[str, np.ndarray]] | None = None  # the last file read: the next piece starts in it

    def load(self, first: int, count: int) -> dict[str, np.ndarray]:
        try:
            return gather(self.step.slots, self.counts, first, count, self._file)
        except (StateError, keys.KeyError_) as exc:
            raise CorruptInput(f"the optimizer state of round {self.round}: {exc}") from None

    def _file(self, j: int) -> dict[str, np.ndarray]:
        if self._held is not None and self._held[0] == j:
            return self._held[1]
        want = self.files[j]
        key = keys.optimizer_key(self.deps.config.run_id, self.round, want)
        data = read_state_file(self.deps, key, want, max_piece_bytes(self.step))
        slots = decode_piece(self.step, j, data, self.counts[j])
        self._held = (j, slots)
        return slots


def state_files(deps: Deps, round_no: int, digest: str) -> list[str]:
    """The digests of a stored state's index and every piece file it lists (index first)."""
    index = read_state_file(deps, keys.optimizer_key(deps.config.run_id, round_no, digest), digest, MAX_INDEX_BYTES)
    try:
        return [digest, *index_pieces(index)]
    except StateError as exc:
        raise CorruptInput(f"the optimizer state of round {round_no}: {exc}") from None


def copy_state(deps: Deps, round_no: int, digest: str, dest_key: Callable[[str], str]) -> None:
    """Copy a state's index and pieces (their authenticated versions) to `dest_key(file digest)`."""
    run_id = deps.config.run_id
    for file_digest in state_files(deps, round_no, digest):
        key = keys.optimizer_key(run_id, round_no, file_digest)
        try:
            version, _ = deps.bucket.verified_version(key, file_digest)
        except (NotFound, Tampered) as exc:
            raise CorruptInput(f"the optimizer state file {key[-80:]} cannot be read back: {exc}",
                               missing=isinstance(exc, NotFound)) from None
        deps.bucket.copy(key, dest_key(file_digest), version_id=version)
