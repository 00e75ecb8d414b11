"""moto, as the local stack runs it: the parts of moto 5.2.5 it replaces, one module per service.

The rule. Every change to moto is a `Patch` (`local.moto.patches`) in its service module's `PATCHES`, listed here
with its kind, and nothing replaces moto's internals any other way:

- a *bug* fix: moto answers otherwise than AWS (or loses what AWS keeps), and the patch makes it answer as AWS does;
- *speed*: moto's answers, unchanged, for less work (the local stack at a thousand participants, or 1 GB models).

Each names what of moto's it replaces and why, and has a test named after it in
tests/functional/test_moto_patches.py that shows moto's own behaviour beside ours: for a bug fix, that moto
5.2.5 answers wrongly and the patched one as AWS does; for speed, the same answers (and, where cheap, less work).
On an upgrade of moto (`pin.py`), a bug fix whose test finds moto answering right is no longer needed.

| patch | kind |
|---|---|
| s3_object_bytes_in_blocks | speed |
| s3_completion_of_the_parts_files | speed |
| s3_etag_under_the_object_lock | bug |
| s3_part_of_a_gone_upload_is_no_such_upload | bug |
| dynamodb_transaction_backs_up_its_items | speed |
| dynamodb_query_sorts_on_key_values | speed |
| dynamodb_attribute_values_written_directly | speed |
| dynamodb_query_results_uncopied | speed (local server only) |
| sqs_send_reads_one_attribute | speed |
| sqs_retention_read_alone | speed |
| sqs_delete_excludes_sends | bug |
| sqs_long_poll_sleeps_until_due | speed |
| sns_publish_delivers_as_sns | bug |
| sns_subscriptions_under_one_lock | bug |
| events_s3_delivery_tried_again | bug |
| events_multipart_upload_announced_once | bug |
| routing_modules_listed_once | speed (local server only) |
| core_method_names_listed_once | speed |
| core_request_ids_from_urandom | speed |

`apply_all()` applies them; the local server adds `server=True` for those only it takes. `pin.py` holds the one
moto version they were written for. Nothing here imports moto until a patch is applied (moto costs about a second
to import); the modules import it as `from moto...`, which is the top-level moto, never this package (imports are
absolute).
"""

from __future__ import annotations

from local.moto import core, dynamodb, events, routing, s3, sns, sqs
from local.moto.patches import Patch, apply

PATCHES: tuple[Patch, ...] = s3.PATCHES + dynamodb.PATCHES + sqs.PATCHES + sns.PATCHES + events.PATCHES + \
    routing.PATCHES + core.PATCHES


def apply_all(server: bool = False) -> None:
    """Apply every patch (idempotent). `server`: the local server's too."""
    apply(patch for patch in PATCHES if server or not patch.server_only)


def patch(name: str) -> Patch:
    """The patch of that name."""
    for each in PATCHES:
        if each.name == name:
            return each
    raise KeyError(name)
