"""Each participant's upload budget in the run's table: one counter per participant and window, and what was dropped.

Counting an upload is one conditional write (`UpdateItem`: add one to the window's counter if it is below the
budget), so checking the budget costs the same whatever the object is and reads nothing. An upload over the budget
adds one to the participant's `dropped#` item instead: a flood leaves one item per participant however many objects
it sends, where a refusal each would leave one item per object. The dropped count is kept on an item of its own,
not on the window's counter, so that it outlives the counter (which expires after two windows) and the operator lists
every participant that went over in one query of at most one item per participant.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pynamodb.exceptions import DoesNotExist, UpdateError

from shared.config import UPLOAD_WINDOW_SECONDS
from shared.limits import MAX_ID_CHARS, bounded
from shared.table_keys import DROPPED_PREFIX, dropped_sk, upload_count_sk
from store.records import Models, condition_failed

__all__ = ["DroppedUploads", "UploadBudgets"]


@dataclass(frozen=True)
class DroppedUploads:
    """A participant's objects dropped over its upload budget: how many, and when the latest arrived."""

    pid: str
    dropped: int
    last_at: float


class UploadBudgets:
    """The upload counters of one run (`pk`) through its item classes (`m`), mixed into `store.table.StateStore`."""

    pk: str
    m: Models

    def count_upload(self, pid: str, at: float, budget: int) -> bool:
        """Count one upload of `pid` arriving at `at` (epoch seconds) in its window: True if it is within `budget`
        uploads of the window, False (and counted as dropped) past it."""
        window = int(at // UPLOAD_WINDOW_SECONDS)
        pid = bounded(pid, MAX_ID_CHARS)
        c = self.m.upload_count
        try:  # (the item outlives its window by one, so a late event of the window before is still counted there)
            c(self.pk, upload_count_sk(window, pid)).update(
                actions=[c.n.add(1), c.expires_at.set((window + 2) * UPLOAD_WINDOW_SECONDS)],
                condition=c.n.does_not_exist() | (c.n < budget))
            return True
        except UpdateError as exc:
            if not condition_failed(exc):
                raise
        d = self.m.dropped
        d(self.pk, dropped_sk(pid)).update(actions=[d.n.add(1), d.pid.set(pid), d.last_at.set(math.ceil(at))])
        return False

    def uploads_counted(self, pid: str, at: float) -> int:
        """Uploads of `pid` counted within the budget in the window of `at`."""
        try:
            item = self.m.upload_count.get(self.pk, upload_count_sk(int(at // UPLOAD_WINDOW_SECONDS), pid),
                                           consistent_read=True)
        except DoesNotExist:
            return 0
        return int(item.n or 0)

    def dropped_uploads(self) -> dict[str, DroppedUploads]:
        """Every participant that went over its budget, with its objects dropped: one item each."""
        d = self.m.dropped
        items = d.query(self.pk, d.sk.startswith(DROPPED_PREFIX), consistent_read=True)
        return {i.pid: DroppedUploads(i.pid, int(i.n or 0), float(i.last_at or 0)) for i in items}
