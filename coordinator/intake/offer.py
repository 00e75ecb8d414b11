"""An initial-model offer: a model round 0 may train from, offered by a participant of a run without one.

A joiner offers right after its join request, which has a lane of its own: an offer from a joiner not registered
yet is checked against the key its join request registers, and kept for the join function to take.
"""

from __future__ import annotations

from coordinator.deps import Deps
from coordinator.intake.common import Ingested, ObjectCreated, refuse, registered, signed_model, streamed
from coordinator.streamed import Streamed
from shared import keys
from shared.config import RunConfig
from shared.digest import digest
from shared.messages import MAX_CONTROL_BYTES, JoinRequest, parse_message
from shared.signing import verify, verify_digest
from shared.wire import TensorSpec, WireError, encode_header
from store.blobs import NotFound


def ingest(deps: Deps, obj: ObjectCreated, pid: str) -> Ingested:
    state = deps.store.read_state()
    if state.has_model:  # every participant offers; once one offer was adopted the others are moot
        return Ingested("init", obj.key, False, "the run already has a model", pid, recorded=False, refusal=True)
    record = registered(deps, pid)
    key = ""
    try:
        if record is not None:
            scanned = signed_model(deps, obj, pid, None, check=True)
        else:  # from a joiner not registered yet: signed by the key its join request registers
            key = _join_request_key(deps, pid)
            scanned = streamed(deps, obj, None, check=True)
            verify_digest(key, obj.key, scanned.digest, scanned.metadata)
        if scanned.problem:
            raise WireError(scanned.problem)
    except (WireError, ValueError, NotFound) as exc:
        return refuse(deps, obj, "init", f"initial model refused: {exc}", pid)
    if reason := initial_model_problem(deps.config, scanned):
        return refuse(deps, obj, "init", f"initial model refused: {reason}", pid)
    if record is None:
        # Kept for the join function, which takes it when it registers the joiner. It may have registered it since
        # we looked (and looked for a kept offer before this one was kept): look again, after keeping it.
        deps.store.keep_offer(pid, scanned.digest, key, obj.version_id)
        joined = deps.store.participant(pid)
        if joined is None or joined.public_key != key:
            return Ingested("init", obj.key, True, "kept until its join request is registered", pid, ticks=False)
    deps.store.set_init_offer(pid, scanned.digest, obj.version_id)
    # An offer can start the first epoch only once enough participants registered (as a heartbeat, a tick reads
    # every participant: a tick on each of a thousand joiners' offers was quadratic)
    return Ingested("init", obj.key, True, participant=pid,
                   ticks=deps.store.participant_count() >= deps.config.min_clients)


def initial_model_problem(config: RunConfig, scanned: Streamed) -> str:
    """Why a well-formed offer cannot be round 0's global model of this run ("" if it can): the run names the
    initial model by its digest (`initial_model_digest`) or by its tensors (`initial_model_schema`). The first
    eligible offer recorded is adopted, so an unchecked offer lets whoever offers first pick round 0's global: one
    the honest participants' task cannot load trains no round."""
    want = config.initial_model_digest
    if want and scanned.digest != want:
        return f"its digest {scanned.digest[:16]} is not the run's initial_model_digest {want[:16]}"
    schema = config.initial_model_schema
    if schema and scanned.header is not None and (got := model_schema(scanned.header.tensors)) != schema:
        tensors = sorted(scanned.header.tensors.items())
        listed = ", ".join(f"{name} {spec.dtype} {list(spec.shape)}" for name, spec in tensors[:3])
        more = f" and {len(tensors) - 3} more" if len(tensors) > 3 else ""
        return (f"its tensors ({listed}{more}; schema {got[:16]}) are not the ones the run's task declares "
                f"(initial_model_schema {schema[:16]})")
    return ""


def model_schema(tensors: dict[str, TensorSpec]) -> str:
    """A model's tensors (names, dtypes, shapes) as `initial_model_schema` names them: the content digest of their
    canonical header without metadata, whatever the file's metadata or layout."""
    return digest(encode_header(tensors))


def _join_request_key(deps: Deps, pid: str) -> str:
    """The public key `pid`'s join request registers (the request checked as the join function checks it)."""
    key = keys.join_key(deps.config.run_id, pid)
    try:
        blob = deps.bucket.get(key, max_bytes=MAX_CONTROL_BYTES)
    except NotFound:
        raise ValueError("from a participant that never joined") from None
    request = parse_message(JoinRequest, blob.data)
    verify(request.public_key, key, blob.data, blob.metadata)
    if request.participant != pid or request.run_id != deps.config.run_id:
        raise ValueError("its join request names another participant or run")
    return request.public_key
