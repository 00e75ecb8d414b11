"""Witnesses: who checks a round's updates, how many must agree, and the proofs they upload.

Witnesses are elected per round from the round's seed by the same SHA-256 shuffle every process
computes. A witness evaluates every recorded update of the round and uploads a proof: two bloom
filters, one over the participants it attests and one over the update digests it attests. The
coordinator counts, for each update, the proofs containing both its participant and its digest —
that count is the update's health score — and aggregates only updates a quorum attested.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from shared.messages import MAX_BLOOM_BITS as MAX_BLOOM_BITS
from shared.messages import MAX_HASHES as MAX_HASHES
from shared.messages import MAX_PROOF_BYTES as MAX_PROOF_BYTES
from shared.messages import MAX_PROOF_RECORD_BYTES as MAX_PROOF_RECORD_BYTES
from shared.messages import PROOF_SCHEMA as PROOF_SCHEMA
from shared.messages import BloomEnvelope, MessageError, ProofEnvelope, parse_message
from shared.selection import shuffled


class ProofError(ValueError):
    """A witness proof that is not well-formed; the message is the recorded refusal reason."""


def quorum(witnesses: int) -> int:
    """Psyche's rule: 1 of 1, 2 of 2 or 3, otherwise two thirds (at least 1)."""
    if witnesses <= 0:
        return 0
    if witnesses == 1:
        return 1
    if witnesses <= 3:
        return 2
    return max(1, (2 * witnesses) // 3)


def elect(seed_hex: str, candidates: Sequence[str], count: int) -> tuple[str, ...]:
    """The round's witnesses, in position order."""
    if count <= 0:
        return ()
    return tuple(shuffled(f"{seed_hex}:witness", sorted(candidates))[:count])


@dataclass
class BloomFilter:
    bits: int
    hashes: int
    data: bytearray = field(default_factory=bytearray)

    def __post_init__(self) -> None:
        if not self.data:
            self.data = bytearray((self.bits + 7) // 8)

    @classmethod
    def for_capacity(cls, items: int, false_positive_rate: float = 0.01) -> BloomFilter:
        """Sized so that `items` entries give about `false_positive_rate` false positives."""
        n = max(1, items)
        bits = max(64, math.ceil(-n * math.log(false_positive_rate) / math.log(2) ** 2))
        hashes = max(1, round(bits / n * math.log(2)))
        return cls(bits, min(hashes, MAX_HASHES))

    def _positions(self, item: str) -> Iterable[int]:
        data = item.encode()
        for i in range(self.hashes):  # one independent hash per position: exact design error rates
            h = hashlib.blake2b(data, digest_size=8, salt=i.to_bytes(16, "little")).digest()
            yield int.from_bytes(h, "little") % self.bits

    def add(self, item: str) -> None:
        for p in self._positions(item):
            self.data[p // 8] |= 1 << (p % 8)

    def set_bits(self) -> int:
        return sum(bin(b).count("1") for b in self.data)

    def __contains__(self, item: str) -> bool:
        return all(self.data[p // 8] & (1 << (p % 8)) for p in self._positions(item))

    def to_json(self) -> dict[str, Any]:
        return {"bits": self.bits, "hashes": self.hashes, "hex": self.data.hex()}

    @classmethod
    def from_envelope(cls, body: BloomEnvelope) -> BloomFilter:
        """A validated envelope's filter (its size, hash count and data were checked)."""
        return cls(body.bits, body.hashes, bytearray.fromhex(body.hex))

    @classmethod
    def from_json(cls, body: Any) -> BloomFilter:
        if not isinstance(body, dict):
            raise ProofError("bloom filter is not an object")
        bits, hashes, text = body.get("bits"), body.get("hashes"), body.get("hex")
        if not (isinstance(bits, int) and 8 <= bits <= MAX_BLOOM_BITS):
            raise ProofError(f"bloom filter size must be 8..{MAX_BLOOM_BITS} bits")
        if not (isinstance(hashes, int) and 1 <= hashes <= MAX_HASHES):
            raise ProofError(f"bloom filter hash count must be 1..{MAX_HASHES}")
        if not isinstance(text, str) or len(text) != 2 * ((bits + 7) // 8):
            raise ProofError("bloom filter data does not match its size")
        try:
            return cls(bits, hashes, bytearray.fromhex(text))
        except ValueError:
            raise ProofError("bloom filter data is not hex") from None


def attestation(participant: str, digest: str) -> str:
    """The digest filter's entry: an update is attested by its participant and its exact bytes."""
    return f"{participant}:{digest}"


@dataclass(frozen=True)
class Proof:
    """What a witness uploads at rounds/<round>/witness/<id>."""

    run_id: str
    round: int
    witness: str
    position: int
    participants: BloomFilter
    digests: BloomFilter
    complete: bool  # it evaluated every update recorded when it wrote the proof
    loss: float = 0.0
    throughput: float = 0.0
    evaluations: dict[str, float] = field(default_factory=dict)

    def attests(self, participant: str, digest: str) -> bool:
        return participant in self.participants and attestation(participant, digest) in self.digests

    @classmethod
    def build(
        cls, run_id: str, round_no: int, witness: str, position: int, attested: dict[str, str], expected: int,
        complete: bool, loss: float = 0.0, throughput: float = 0.0, evaluations: dict[str, float] | None = None,
    ) -> Proof:
        participants = BloomFilter.for_capacity(expected)
        digests = BloomFilter.for_capacity(expected)
        for pid, dig in attested.items():
            participants.add(pid)
            digests.add(attestation(pid, dig))
        return cls(run_id, round_no, witness, position, participants, digests, complete, loss, throughput,
                   dict(evaluations or {}))

    def to_json(self) -> str:
        return json.dumps({
            "schema": PROOF_SCHEMA, "run_id": self.run_id, "round": self.round, "witness": self.witness,
            "position": self.position, "participants": self.participants.to_json(),
            "digests": self.digests.to_json(), "complete": self.complete, "loss": self.loss,
            "throughput": self.throughput, "evaluations": self.evaluations,
        }, sort_keys=True)

    @classmethod
    def from_json(cls, text: bytes | str) -> Proof:
        """Parse a proof through its envelope (shared.messages.ProofEnvelope); raise ProofError naming what is
        malformed."""
        try:
            body = parse_message(ProofEnvelope, text)
        except MessageError as exc:
            raise ProofError(_proof_problem(exc)) from None
        return cls(
            run_id=body.run_id, round=body.round, witness=body.witness, position=body.position,
            participants=BloomFilter.from_envelope(body.participants),
            digests=BloomFilter.from_envelope(body.digests), complete=body.complete, loss=body.loss,
            throughput=body.throughput, evaluations=dict(body.evaluations),
        )


def _proof_problem(exc: MessageError) -> str:
    """The refusal reason for a proof that does not fit its envelope, in the words proofs were refused with."""
    problems = exc.problems
    if any(p.kind == "json_invalid" for p in problems if not p.field):
        return "witness proof is not JSON"
    if any(not p.field or p.field == "schema" for p in problems):
        return f"witness proof must be a JSON object with schema {PROOF_SCHEMA}"
    missing = [p.field for p in problems if p.kind == "missing"]
    if missing:
        return f"witness proof lacks {missing[0]!r}"
    return f"witness proof {exc}"


def health_scores(proofs: Iterable[Proof], updates: dict[str, str]) -> dict[str, int]:
    """For each participant with an update (digest), how many proofs attest exactly that update."""
    proofs = list(proofs)
    return {pid: sum(1 for p in proofs if p.attests(pid, dig)) for pid, dig in updates.items()}


MAX_FALSE_ATTESTATION = 0.05  # a filter that would attest more than this share of updates it never saw claims too much


def overclaim(proof: Proof, recorded: int) -> str:
    """Why a proof's filters claim more than the round could let a witness know, or "".

    `recorded` updates (the round's accepted ones) put at most `recorded x hashes` bits in a filter; an
    honest filter also stays sparse enough that an update it never saw passes it rarely (its design rate
    is 1%). A filter with more bits set, or one that would pass over MAX_FALSE_ATTESTATION of unseen
    entries (say every bit set), attests what its witness could not have checked."""
    for name, bloom in (("participants", proof.participants), ("digests", proof.digests)):
        ones, most = bloom.set_bits(), min(bloom.bits, recorded * bloom.hashes)
        if ones > most:
            return (f"its {name} filter has {ones} of {bloom.bits} bits set; the round's {recorded} recorded "
                    f"update(s) set at most {most} with {bloom.hashes} hash(es)")
        rate = (ones / bloom.bits) ** bloom.hashes
        if rate > MAX_FALSE_ATTESTATION:
            return (f"its {name} filter would attest {rate:.0%} of entries it never saw ({ones} of {bloom.bits} "
                    f"bits set, {bloom.hashes} hash(es)); at most {MAX_FALSE_ATTESTATION:.0%}")
    return ""


def verdicts(proofs: dict[str, Proof], updates: dict[str, str]) -> dict[str, frozenset[str]]:
    """For each witness, the updates (participant -> digest) its proof attests."""
    return {w: frozenset(pid for pid, dig in updates.items() if p.attests(pid, dig)) for w, p in proofs.items()}


def evidence(proofs: dict[str, Proof], updates: dict[str, str], selected: Iterable[str], seats: int
             ) -> dict[str, int]:
    """The health scores a member may be dropped on, for each selected participant the evidence covers.

    A participant with no counted update scores 0: the coordinator's own records show it. One with a counted
    update scores the proofs that attest it; a score under the quorum counts only when every one of the `seats`
    elected witnesses sent a proof and none attested it. When the witnesses disagree (some attest, some do not)
    or some proofs are missing, the update is left out: no evidence either way, nobody dropped on it. So
    witnesses that withhold attestations cannot evict the honest unless they hold every seat."""
    need, everyone = quorum(seats), len(proofs) == seats
    out = {pid: 0 for pid in selected if pid not in updates}
    for pid, score in health_scores(proofs.values(), updates).items():
        if score >= need or (everyone and score == 0):
            out[pid] = score
    return out


def suspects(proofs: dict[str, Proof], updates: dict[str, str], seats: int) -> dict[str, str]:
    """Witnesses whose proof refused an update that a quorum of the other witnesses attested, with why."""
    need, out = quorum(seats), dict[str, str]()
    seen = verdicts(proofs, updates)
    for pid in sorted(updates):
        attesters = sorted(w for w, got in seen.items() if pid in got)
        if len(attesters) < need:
            continue
        for w in sorted(seen):
            if pid not in seen[w] and w not in out:
                out[w] = f"refused the update of {pid}, which {len(attesters)} other witness(es) attested"
    return out
