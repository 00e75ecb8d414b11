"""The S3 key layout as IAM resource patterns, derived from `shared.keys` so policies follow the layout.

A key function is called with a placeholder participant id and round 0, and the placeholder becomes the
IAM policy variable holding the session's participant id, the round a `*`.
"""

from __future__ import annotations

from shared import keys
from shared.naming import PARTICIPANT_TAG

SELF = f"${{aws:PrincipalTag/{PARTICIPANT_TAG}}}"  # the session's own participant id, substituted by IAM
_PID = "pidplaceholder0"
_ROUND = 0
_JOB = "0" * 64  # a placeholder aggregation job id (64 hex digits), which becomes a `*`
# Not in shared.keys yet: where the coordinator may write checkpoints.
CHECKPOINTS = "checkpoints/*"


def _any_round(run_id: str, key: str) -> str:
    return key.replace(keys.round_prefix(run_id, _ROUND), f"{keys.run_prefix(run_id)}rounds/*/")


def _as_self(key: str) -> str:
    assert key.count(_PID) == 1, key
    return key.replace(_PID, SELF)


def participant_writes(run_id: str) -> list[str]:
    """Keys ending in the participant's own id: join request, initial-model offer, heartbeat, updates."""
    return [
        _as_self(keys.join_key(run_id, _PID)),
        _as_self(keys.init_key(run_id, _PID)),
        _as_self(keys.heartbeat_key(run_id, _PID)),
        own_updates(run_id),
    ]


def own_updates(run_id: str) -> str:
    """rounds/*/<own id>: its updates; the `*` also spans rounds/<round>/witness/ and health/ reports."""
    return _as_self(_any_round(run_id, keys.update_key(run_id, _ROUND, _PID)))


def global_models(run_id: str) -> str:
    """rounds/*/global/*: every round's global model, whatever its digest."""
    return _any_round(run_id, keys.global_prefix(run_id, _ROUND) + "*")


def participant_reads(run_id: str, witnessing: bool = False) -> list[str]:
    """Global models, manifest, published config, and its own updates (to resume: did my upload land?).

    With witnessing on, every object of every round: an elected witness evaluates the round's updates
    of the other participants (as Psyche's witnesses receive every trainer's results). Updates are then
    shared among the run's participants, never beyond them.
    """
    if witnessing:
        return [round_objects(run_id), rosters(run_id), keys.manifest_key(run_id), keys.config_key(run_id)]
    return [global_models(run_id), delta_objects(run_id), rosters(run_id), keys.manifest_key(run_id),
            keys.config_key(run_id), own_updates(run_id)]


def round_objects(run_id: str) -> str:
    return f"{keys.run_prefix(run_id)}rounds/*"


def staging_objects(run_id: str) -> str:
    """rounds/*/staging/*: global models being written in parts by the shard workers (`keys.staging_key`)."""
    return _any_round(run_id, keys.staging_key(run_id, _ROUND, _JOB).replace(_JOB, "*"))


def optimizer_objects(run_id: str) -> str:
    """rounds/*/optimizer/*: the server optimizer state's index and piece files (`keys.optimizer_key`)."""
    return _any_round(run_id, keys.optimizer_key(run_id, _ROUND, _JOB).replace(_JOB, "*"))


def delta_objects(run_id: str) -> str:
    """rounds/*/delta/*: the download deltas' index and piece files (`keys.delta_key`)."""
    return _any_round(run_id, keys.delta_key(run_id, _ROUND, _JOB).replace(_JOB, "*"))


def rosters(run_id: str) -> str:
    """roster/*: the per-member part of each committed run state (`keys.roster_key`); participants read theirs to
    know whether they are members, selected, witnesses, and their share."""
    return keys.roster_key(run_id, _JOB).replace(_JOB, "*")


def coordinator_round_objects(run_id: str) -> list[str]:
    """What the coordinator alone writes below rounds/<round>/: global models, staged aggregates and their shards'
    outcomes, optimizer state and download deltas (each a reserved name, so no participant id)."""
    return [global_models(run_id), staging_objects(run_id), optimizer_objects(run_id), delta_objects(run_id)]


def coordinator_writes(run_id: str) -> list[str]:
    """Objects only the coordinator writes: global models, optimizer state, download deltas, rosters, manifest,
    published config, checkpoints."""
    return [
        global_models(run_id),
        optimizer_objects(run_id),
        delta_objects(run_id),
        rosters(run_id),
        keys.manifest_key(run_id),
        keys.config_key(run_id),
        f"{keys.run_prefix(run_id)}{CHECKPOINTS}",
    ]
