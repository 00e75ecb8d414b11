"""A witness proof: an elected witness's account of the round's updates, recorded for its seat.

A proof that is signed by the elected witness and well-formed but wrong (another run, round or seat; claims beyond
the updates recorded; too long to record) is still recorded for its seat, as refused: the tick counts it a strike.
"""

from __future__ import annotations

from coordinator.deps import Deps
from coordinator.intake.common import Ingested, ObjectCreated, refuse, signed
from shared.state import Phase
from shared.witness import MAX_PROOF_BYTES, MAX_PROOF_RECORD_BYTES, Proof, ProofError, overclaim
from store.blobs import NotFound


def ingest(deps: Deps, obj: ObjectCreated, pid: str, round_no: int) -> Ingested:
    existing = deps.store.proof_record(round_no, pid)
    if existing is not None:
        if existing.etag == obj.etag:
            return Ingested("witness", obj.key, True, participant=pid, recorded=False)
        return refuse(deps, obj, "witness", f"duplicate: {pid} already sent its proof for round {round_no}", pid)
    state = deps.store.read_state()
    if round_no != state.round or state.phase not in (Phase.TRAIN, Phase.WITNESS):
        return refuse(deps, obj, "witness", f"proof for round {round_no}, which is not being witnessed", pid)
    if pid not in state.witnesses:
        return refuse(deps, obj, "witness", f"{pid} is not an elected witness of round {round_no}", pid)
    try:
        sent = Proof.from_json(signed(deps, obj, pid, MAX_PROOF_BYTES))
    except (ProofError, ValueError, NotFound) as exc:
        return refuse(deps, obj, "witness", f"witness proof refused: {exc}", pid)
    position = state.witnesses.index(pid)
    recorded = sum(1 for u in deps.store.updates(round_no).values() if u.accepted)
    body = sent.to_json()
    why = ""
    if (sent.run_id, sent.round, sent.witness) != (deps.config.run_id, round_no, pid):
        why = "witness proof names another run, round or witness than its key"
    elif sent.position != position:
        why = f"spoofed position: {sent.position}, {pid} is witness {position}"
    elif reason := overclaim(sent, recorded):
        why = f"witness proof refused: {reason}"
    elif len(body.encode()) > MAX_PROOF_RECORD_BYTES:  # its numbers and keys written out longer than they came in
        why = (f"witness proof refused: {len(body.encode())} bytes as recorded, over the record limit of "
               f"{MAX_PROOF_RECORD_BYTES}")
    if why:  # signed by the elected witness and well-formed, but refused: its seat's proof, a strike (the tick)
        deps.store.record_proof(round_no, pid, "", obj.etag, obj.time, refused=why)
        return refuse(deps, obj, "witness", why, pid)
    if not deps.store.record_proof(round_no, pid, body, obj.etag, obj.time):
        return Ingested("witness", obj.key, True, participant=pid, recorded=False)
    return Ingested("witness", obj.key, True, participant=pid)
