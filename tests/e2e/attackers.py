"""Attacker identities' scripted witness seats, for end-to-end attack tests: a registered participant's key signs
proofs that a script uploads (plain S3 puts, as the participant itself may) the moment the participant is elected.
"""

from __future__ import annotations

import itertools
import json
import threading
from collections.abc import Iterable
from pathlib import Path

from shared import keys
from shared.signing import Signer
from shared.state import Phase
from shared.witness import Proof
from tests.e2e.harness import Run


class ScriptedWitness:
    """Uploads `attacker`'s proofs, signed with its key, as soon as it holds a seat of a round: `kinds` in turn,
    "empty" (attests nobody) or "overfull" (filters with every bit set: claims to attest everything)."""

    def __init__(self, run: Run, attacker: str, key_file: Path, kinds: Iterable[str] = ("empty", "overfull")) -> None:
        self.run, self.attacker, self.key_file = run, attacker, key_file
        self.stop = threading.Event()
        self.sent: dict[int, str] = {}  # round -> what kind of proof
        self.kinds = itertools.cycle(kinds)
        self.thread = threading.Thread(target=self._loop, name=f"witness-{attacker}", daemon=True)

    def __enter__(self) -> ScriptedWitness:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=10)

    def _loop(self) -> None:
        while not self.stop.wait(0.2):
            if not self.key_file.exists():
                continue
            s = self.run.state()
            if (s.phase not in (Phase.TRAIN, Phase.WITNESS) or self.attacker not in s.witnesses
                    or s.round in self.sent):
                continue
            kind = next(self.kinds)
            proof = json.loads(Proof.build(self.run.config.run_id, s.round, self.attacker,
                                           s.witnesses.index(self.attacker), {}, len(s.selected),
                                           complete=True).to_json())
            if kind == "overfull":
                for name in ("participants", "digests"):
                    proof[name]["hex"] = "ff" * (len(proof[name]["hex"]) // 2)
            body = json.dumps(proof).encode()
            key = keys.witness_key(self.run.config.run_id, s.round, self.attacker)
            signer = Signer.load_or_create(self.key_file)
            self.run.bucket.put(key, body, signer.metadata(key, body))
            self.sent[s.round] = kind
