"""moto, as the local stack runs it: the parts of moto 5.2.5 it replaces, one module per service.

`s3` (objects moved in blocks), `dynamodb`, `sqs`, `sns`, `events` (S3's EventBridge notifications), `routing`
(the server's routing of requests to services), and `pin` (the one moto version they were written for).
`apply_all()` applies every patch; the local server adds `server=True` for those safe only where it serves each
DynamoDB request whole (`local.server.SerialDynamoDB`).

Nothing here imports moto until a patch is applied (moto costs about a second to import): the modules import it,
as `from moto...`, which is the top-level moto package, never this one (imports are absolute)."""

from __future__ import annotations

from local.moto import dynamodb, events, routing, s3, sns, sqs


def apply_all(server: bool = False) -> None:
    """Apply every patch (idempotent). `server`: the local server's too."""
    dynamodb.apply()
    if server:
        dynamodb.serve_query_results()  # (safe there: SerialDynamoDB serves each request and response whole)
    events.apply()
    s3.apply()
    if server:
        routing.apply()
    sns.apply()
    sqs.apply()
