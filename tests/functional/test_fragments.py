"""Streaming DiLoCo's fragments through the handlers (`fragments`): each round's updates hold the fragment it syncs
alone, its global changes that fragment alone (every other tensor is the round's global byte for byte, its server
optimizer state untouched), an update of the whole model is refused with the reason, and `fed verify` recomputes
every fragment's global."""

from __future__ import annotations

import numpy as np
import pytest

from coordinator.verify import verify_run
from shared import keys, wire
from shared.compress import Encoding, decode_arrays, encode_delta
from shared.fragments import fragments_of, round_fragment
from tests.functional.conftest import Harness

PIDS = ("alice", "bob")
MODEL = {f"layers.{i}.weight": np.full((6, 5), 0.1 * (i + 1), np.float32) for i in range(4)} | {
    "embed.weight": np.full((7, 5), 0.3, np.float32), "head.bias": np.zeros(5, np.float32)}


def _send(h: Harness, pid: str, encoded: dict[str, np.ndarray], encoding: Encoding) -> dict:
    s = h.state()
    meta = wire.UpdateMeta(h.config.run_id, s.round, pid, 10, {"loss": 1.0}).to_metadata()
    return h.send(keys.update_key(h.config.run_id, s.round, pid), wire.encode(encoded, meta | encoding.metadata()))


def _start(h: Harness) -> None:
    h.scheduled_tick()
    for pid in PIDS:
        h.join_alive(pid)
    h.offer(PIDS[0], MODEL)
    assert h.state().round == 0, h.state()


@pytest.mark.parametrize("kind", ["int8", "topk"])
def test_each_round_syncs_its_fragment_alone(harness_factory, kind: str) -> None:  # type: ignore[no-untyped-def]
    h: Harness = harness_factory(update_encoding=kind, quant_block=4, topk_chunk=8, topk_percent=50, fragments=2,
                                 server_optimizer="diloco", min_clients=2, min_per_round=2, min_updates=2,
                                 total_rounds=4, max_update_bytes=1 << 16)
    enc = h.config.encoding
    _start(h)
    manifest = wire.Manifest({n: wire.spec_of(n, a) for n, a in MODEL.items()})
    halves = fragments_of(manifest, 2)
    # strided across the layers: each fragment holds every other layer
    assert {n for n in halves[0] if n.startswith("layers.")} == {"layers.0.weight", "layers.2.weight"}
    rng = np.random.default_rng(0)
    for round_no in range(4):
        synced = round_fragment(manifest, 2, round_no)
        assert synced == halves[round_no % 2]
        base = h.global_model(round_no)
        decoded = []
        for pid in PIDS:
            trained = {n: base[n] + rng.normal(0, 0.05, base[n].shape).astype(np.float32) for n in synced}
            encoded, _ = encode_delta(trained, {n: base[n] for n in synced}, enc)
            reply = _send(h, pid, encoded, enc)
            assert reply["accepted"], reply
            decoded.append(decode_arrays(encoded, base, enc, synced))
        after = h.global_model(round_no + 1)
        for name in MODEL:
            if name in synced:  # an outer step (DiLoCo's Nesterov) on the mean of the decoded updates
                assert not np.array_equal(after[name], base[name])
            else:  # the round's global, byte for byte, though DiLoCo's momentum of earlier rounds is not zero
                assert after[name].tobytes() == base[name].tobytes(), (round_no, name)
        header = wire.parse_header(h.s3.get_object(Bucket=h.res.bucket, Key=h.global_key(round_no + 1))["Body"].read())
        assert header.metadata["fed.fragment"] == f"{round_no % 2}/2"
    # and anyone recomputes every fragment's global and optimizer state
    checks = verify_run(h.deps)
    assert [(c.round, c.ok) for c in checks] == [(r, True) for r in range(4)], checks


def test_an_update_of_the_whole_model_in_a_fragments_round_is_refused_with_the_reason(harness_factory) -> None:  # type: ignore[no-untyped-def]
    h: Harness = harness_factory(update_encoding="int8", quant_block=4, fragments=2, min_clients=2,
                                 min_per_round=2, min_updates=2, max_update_bytes=1 << 16)
    enc = h.config.encoding
    _start(h)
    base = h.global_model(0)
    whole, _ = encode_delta({n: v + 0.1 for n, v in base.items()}, base, enc)
    reply = _send(h, "alice", whole, enc)
    assert not reply["accepted"], reply
    assert "unexpected tensors" in reply["reason"] and "of this round's fragment" in reply["reason"], reply
    # and the run goes on: the fragment's update is accepted
    synced = round_fragment(wire.Manifest({n: wire.spec_of(n, a) for n, a in base.items()}), 2, 0)
    assert synced is not None
    part, _ = encode_delta({n: base[n] + 0.1 for n in synced}, {n: base[n] for n in synced}, enc)
    assert _send(h, "bob", part, enc)["accepted"]


def test_fragments_need_a_delta_encoding() -> None:
    from shared.config import RunConfig

    with pytest.raises(ValueError, match="fragments = 2 needs a delta update_encoding"):
        RunConfig(run_id="frag", fragments=2)


def test_a_participant_rebuilds_the_next_global_from_the_synced_fragments_bytes(harness_factory, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from participant.fragment_fetch import rebuild_from_fragment
    from tests.functional.test_compressed_downloads import Direct

    h: Harness = harness_factory(update_encoding="int8", quant_block=4, fragments=2, min_clients=2,
                                 min_per_round=2, min_updates=2, max_update_bytes=1 << 16)
    enc = h.config.encoding
    _start(h)
    base = h.global_model(0)
    synced = round_fragment(wire.Manifest({n: wire.spec_of(n, a) for n, a in base.items()}), 2, 0)
    assert synced is not None
    for pid in PIDS:
        part, _ = encode_delta({n: base[n] + 0.1 for n in synced}, {n: base[n] for n in synced}, enc)
        assert _send(h, pid, part, enc)["accepted"]
    stored = h.s3.get_object(Bucket=h.res.bucket, Key=h.global_key(1))["Body"].read()
    previous, out = tmp_path / "g0", tmp_path / "g1"
    previous.write_bytes(h.s3.get_object(Bucket=h.res.bucket, Key=h.global_key(0))["Body"].read())
    # When a participant holding round 0's global rebuilds round 1's from the fragment round 0 synced
    fetched = rebuild_from_fragment(Direct(h), h.global_key(1), h.global_digest(1), previous, 2, 1, out)  # type: ignore[arg-type]
    # Then it is the stored global byte for byte, for its header and the synced tensors' bytes alone
    assert out.read_bytes() == stored
    synced_bytes = sum(MODEL[n].nbytes for n in synced)
    assert fetched == len(stored) - (sum(a.nbytes for a in MODEL.values()) - synced_bytes)
    # And a held model that is not the previous global (a gap) gives nothing, leaving no file behind
    other = tmp_path / "other"
    other.write_bytes(wire.encode({n: a + 1 for n, a in base.items()}))
    assert rebuild_from_fragment(Direct(h), h.global_key(1), h.global_digest(1), other, 2, 1, out) is None  # type: ignore[arg-type]
    assert not out.exists()
