"""Size limits on what the coordinator records from outside, in one place.

A DynamoDB item holds at most 400 KB. Anything an uploader controls (a key, an ETag, a version id, a
participant id, a refusal reason that quotes a tensor name or a message field) is cut to a bound before it
is recorded, so recording a refusal can never fail on the content of the refused object.
"""

from __future__ import annotations

MAX_KEY_CHARS = 1024  # S3's own key limit
MAX_ID_CHARS = 128  # ETags, version ids, participant ids as recorded
MAX_REASON_CHARS = 1000
MAX_SUMMARY_REASON_CHARS = 200  # a round summary holds a reason for each refused participant
MAX_ITEM_BYTES = 400 * 1024  # DynamoDB's item limit; every record stays well below it


def bounded(text: str, limit: int) -> str:
    """`text` cut to at most `limit` characters, saying how much was left out."""
    if len(text) <= limit:
        return text
    note = f"… [{len(text) - limit} more characters]"
    return text[: max(0, limit - len(note))] + note
