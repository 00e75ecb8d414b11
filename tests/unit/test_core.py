"""Key layout, wire format, config validation, selection and data assignment, aggregation."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared import keys
from shared.aggregate import ArraySource, PieceAggregator, WeightedInput, aggregate_file, round_plan
from shared.config import ConfigError, parse_config
from shared.selection import assigned_count, assignment, round_seed, select, selection_size
from shared.wire import Manifest, UpdateMeta, WireError, decode, encode, parse_header

# --- key layout ----------------------------------------------------------------------------------------


def test_keys_contain_round_global_and_round_participant() -> None:
    assert keys.global_key("r1x", 3, "ab" * 32).endswith("000003/global/" + "ab" * 32)
    assert keys.update_key("r1x", 3, "alice").endswith("000003/alice")
    parsed = keys.parse_key(keys.update_key("r1x", 3, "alice"))
    assert parsed == keys.ParsedKey(keys.ObjectKind.UPDATE, "r1x", "alice", 3)
    assert keys.parse_key(keys.global_key("r1x", 7, "ab" * 32)).kind is keys.ObjectKind.GLOBAL
    with pytest.raises(keys.KeyError_):
        keys.global_key("r1x", 7, "not-a-digest")


@pytest.mark.parametrize("bad", ["../x", "a/b", "a%2Fb", "", "global", "Config", "x" * 64, "-lead", "sp ace", "é"])
def test_participant_ids_with_path_characters_or_reserved_names_are_refused(bad: str) -> None:
    with pytest.raises(keys.KeyError_):
        keys.validate_participant_id(bad)


@given(st.text(max_size=80))
def test_any_key_parses_or_is_refused_never_crashes(key: str) -> None:
    try:
        parsed = keys.parse_key(key)
    except keys.KeyError_:
        return
    assert key.startswith("runs/")
    if parsed.participant is not None:
        assert "/" not in parsed.participant and ".." not in parsed.participant


_KEY_PARTS = st.sampled_from(["runs", "r1x", "rounds", "000003", "000000", "global", "witness", "health", "join",
                              "heartbeat", "init", "checkpoints", "latest.json", "state.json", "manifest.json",
                              "config.json", "roster", "alice", "ab" * 32, "", "\n", "alice\n", "000003\n", "٠٠٠٠٠٣",
                              "ａlice"])


@given(st.one_of(st.text(max_size=120), st.lists(st.one_of(_KEY_PARTS, st.text(max_size=8)), max_size=6).map("/".join)))
def test_every_key_the_parser_accepts_formats_back_to_itself(key: str) -> None:
    # Given any Unicode text, including near-misses of real keys (trailing newlines, non-ASCII digits)
    try:
        parsed = keys.parse_key(key)
    except keys.KeyError_ as exc:
        assert len(str(exc)) < 400  # a refusal reason never echoes unbounded attacker text
        return
    # Then the parser accepted only ASCII, printable text that is the exact key of what it parsed
    assert key.isascii() and key.isprintable()
    assert keys.format_key(parsed) == key


@pytest.mark.parametrize("key", [
    "runs/r1x/rounds/000003/alice\n",  # `$` tolerates a trailing newline
    "runs/r1x/rounds/٠٠٠٠٠٣/alice",  # `\d` matches Arabic-Indic digits and int() reads them
    "runs/r1x/rounds/000003/ａlice",  # a full-width letter
    "runs/r1x\n/join/alice",
    "runs/R1X/join/alice",  # not a run id
    "runs/r1x/checkpoints/anything",
    "runs/r1x/rounds/000003/global/not-a-digest",
    "runs/r1x/roster/not-a-digest",
    "runs/r1x/roster/" + "ab" * 32 + "/x",
    "runs/r1x/join/" + "a" * 2000,
])
def test_near_miss_keys_are_refused(key: str) -> None:
    with pytest.raises(keys.KeyError_):
        keys.parse_key(key)


def test_every_layout_key_round_trips() -> None:
    made = [keys.join_key("r1x", "a"), keys.init_key("r1x", "a"), keys.heartbeat_key("r1x", "a"),
            keys.global_key("r1x", 2, "ab" * 32), keys.update_key("r1x", 2, "a"), keys.witness_key("r1x", 2, "a"),
            keys.health_key("r1x", 2, "a"), keys.checkpoint_global_key("r1x", 1), keys.checkpoint_state_key("r1x", 1),
            keys.latest_checkpoint_key("r1x"), keys.manifest_key("r1x"), keys.config_key("r1x"),
            keys.roster_key("r1x", "ab" * 32), keys.delta_key("r1x", 2, "ab" * 32),
            keys.optimizer_key("r1x", 2, "ab" * 32), keys.shard_result_key("r1x", 2, "ab" * 32, 5)]
    for key in made:
        assert keys.format_key(keys.parse_key(key)) == key


# --- wire format ---------------------------------------------------------------------------------------

ARRAYS = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.zeros(3, np.float32)}


def test_round_trip_and_manifest() -> None:
    data = encode(ARRAYS, {"k": "v"})
    arrays, header = decode(data)
    assert header.metadata == {"k": "v"}
    np.testing.assert_array_equal(arrays["w"], ARRAYS["w"])
    manifest = Manifest.of(header)
    assert Manifest.from_json(manifest.to_json()) == manifest
    assert manifest.mismatch(header) is None
    assert manifest.nbytes == 36


@pytest.mark.parametrize(
    "data, words",
    [
        (b"", "shorter"),
        (struct.pack("<Q", 10**12) + b"{}", "exceeds"),
        (struct.pack("<Q", 100) + b"{}", "truncated"),
        (struct.pack("<Q", 2) + b"[]", "not a JSON object"),
        (b"PK\x03\x04" + b"\x00" * 40, "safetensors"),
    ],
)
def test_framing_errors_are_named(data: bytes, words: str) -> None:
    with pytest.raises(WireError, match=words):
        parse_header(data)


def test_header_and_data_lengths_must_agree() -> None:
    data = encode(ARRAYS)
    with pytest.raises(WireError, match="disagree"):
        parse_header(data + b"\x00\x00\x00\x00")
    with pytest.raises(WireError):
        parse_header(data[:-4])



def test_update_meta_round_trip_and_errors() -> None:
    meta = UpdateMeta("r1x", 2, "alice", 12, {"loss": 0.5})
    assert UpdateMeta.from_metadata(meta.to_metadata()) == meta
    broken = dict(meta.to_metadata(), **{"fed.metrics": '{"loss": "high"}'})
    with pytest.raises(WireError, match="metrics"):
        UpdateMeta.from_metadata(broken)


# --- config --------------------------------------------------------------------------------------------


def test_config_errors_name_every_bad_field() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"run": {"run_id": "Bad Id", "min_clients": 0, "unknown": 1}}, "run.toml")
    text = str(info.value)
    assert "run_id" in text and "min_clients" in text and "unknown" in text and "run.toml" in text


def test_config_cross_field_rules() -> None:
    with pytest.raises(ConfigError, match="min_per_round"):
        parse_config({"run_id": "abc", "min_clients": 2, "min_per_round": 3})


# --- selection and data assignment ---------------------------------------------------------------------


def test_selection_size_rule() -> None:
    assert selection_size(10, 0.1, 3) == 3
    assert selection_size(10, 0.5, 1) == 5
    assert selection_size(2, 1.0, 5) == 2
    assert selection_size(0, 1.0, 1) == 0


@given(
    seed=st.integers(0, 2**32),
    epoch=st.integers(0, 50),
    rnd=st.integers(0, 500),
    n=st.integers(1, 3000),
    k=st.integers(1, 12),
)
def test_assignments_of_a_round_are_disjoint_deterministic_and_cover(
    seed: int, epoch: int, rnd: int, n: int, k: int
) -> None:
    s = round_seed(seed, epoch, rnd)
    members = [f"p{i}" for i in range(k)]
    chosen = select(s, members, 1.0, 1)
    parts = [assignment(s, n, chosen, p) for p in chosen]
    joined = np.concatenate(parts)
    assert len(joined) == n and len(np.unique(joined)) == n  # disjoint, and together they cover the data
    assert all(len(part) == assigned_count(n, chosen, p) for part, p in zip(parts, chosen, strict=True))
    again = assignment(round_seed(seed, epoch, rnd), n, select(s, list(reversed(members)), 1.0, 1), chosen[0])
    np.testing.assert_array_equal(again, parts[0])


def test_assignment_is_fixed_across_processes() -> None:
    # A fixed expectation: any process, any machine, computes these same indices.
    s = round_seed(7, 1, 3)
    assert s.startswith(round_seed(7, 1, 3)[:8])
    assert assignment(s, 10, ("a", "b"), "a").tolist() == assignment(s, 10, ("a", "b"), "a").tolist()
    assert assignment(s, 10, ("a", "b"), "zz").size == 0


# --- aggregation ---------------------------------------------------------------------------------------


def test_fedavg_weights_by_samples_to_float32_precision() -> None:
    manifest = Manifest.of(parse_header(encode(ARRAYS)))
    a = {"w": np.full((2, 3), 1.0, np.float32), "b": np.full(3, 1e8, np.float32)}
    b = {"w": np.full((2, 3), 4.0, np.float32), "b": np.full(3, 1.0, np.float32)}
    ins = [WeightedInput("a", 1, "", ArraySource(manifest, a)), WeightedInput("b", 2, "", ArraySource(manifest, b))]
    out, _ = decode(aggregate_file(parse_config({"run_id": "r1x", "strategy": "fedavg"}), manifest, 1, ins, None))
    np.testing.assert_allclose(out["w"], 3.0)
    np.testing.assert_allclose(out["b"], (1e8 + 2) / 3, rtol=3e-7)
    assert out["w"].dtype == np.float32


def test_aggregate_bytes_do_not_depend_on_input_order() -> None:
    manifest = Manifest.of(parse_header(encode(ARRAYS)))
    ins = [WeightedInput(p, i + 1, p, ArraySource(manifest, {k: v + i for k, v in ARRAYS.items()}))
           for i, p in enumerate("abc")]
    config = parse_config({"run_id": "r1x"})
    ref = ArraySource(manifest, ARRAYS)
    assert aggregate_file(config, manifest, 1, ins, ref) == aggregate_file(config, manifest, 1, ins[::-1], ref)


class _Counting:
    """A source whose ranges stream (as S3's do), counting the streams open at once; one may fail mid-range."""

    open_now = 0
    most_open = 0

    def __init__(self, inner: ArraySource, fail_at: int = -1) -> None:
        self.inner, self.fail_at = inner, fail_at

    def readinto(self, begin: int, buf: memoryview) -> None:
        self.inner.readinto(begin, buf)

    def stream(self, begin: int, end: int) -> _CountingStream:
        _Counting.open_now += 1
        _Counting.most_open = max(_Counting.most_open, _Counting.open_now)
        return _CountingStream(self, begin)


class _CountingStream:
    def __init__(self, source: _Counting, at: int) -> None:
        self.source, self.at, self.closed = source, at, False

    def readinto(self, buf: memoryview) -> None:
        if 0 <= self.source.fail_at < self.at + len(buf):
            raise OSError("connection reset mid-range")
        self.source.readinto(self.at, buf)
        self.at += len(buf)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            _Counting.open_now -= 1


class _Whole:
    """A source that does not stream (read by whole ranges, as a compressed update is)."""

    def __init__(self, inner: ArraySource) -> None:
        self.inner = inner

    def readinto(self, begin: int, buf: memoryview) -> None:
        self.inner.readinto(begin, buf)


def _big_model(seed: int) -> dict[str, np.ndarray]:
    """~9.5 MB over four dtypes with odd sizes: the data crosses a piece boundary and many slices, and tensors
    start and end inside slices."""
    import ml_dtypes

    rng = np.random.default_rng(seed)
    return {"a.f64": rng.standard_normal(100_003), "b.f32": rng.standard_normal(1_500_001).astype(np.float32),
            "c.bf16": rng.standard_normal(700_001).astype(ml_dtypes.bfloat16),
            "d.f16": rng.standard_normal(300_001).astype(np.float16), "e.step": np.arange(5, dtype=np.int64) + seed}


def test_fedavg_over_many_inputs_in_slices_matches_an_independent_sum() -> None:
    # Given 11 inputs (a group of 8 streamed, one read whole, two streamed) of a model of several pieces
    models = [_big_model(seed) for seed in range(11)]
    manifest = Manifest.of(parse_header(encode(models[0])))
    samples = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]
    sources = [ArraySource(manifest, m) for m in models]
    ins = [WeightedInput(f"p{i:02d}", s, "", _Whole(src) if i == 8 else _Counting(src))
           for i, (s, src) in enumerate(zip(samples, sources, strict=True))]
    _Counting.open_now = _Counting.most_open = 0
    out, _ = decode(aggregate_file(parse_config({"run_id": "r1x", "strategy": "fedavg"}), manifest, 1, ins, None))
    # Then every float element is x0 w0 + x1 w1 + ... summed in participant order in float32 (float64 for
    # float64 tensors) and rounded to the tensor's dtype once; the integer tensor is the first input's
    total = sum(samples)
    for name, ref in models[0].items():
        if name == "e.step":
            np.testing.assert_array_equal(out[name], ref)
            continue
        wide = np.float64 if ref.dtype == np.float64 else np.float32
        acc = models[0][name].astype(wide) * wide(samples[0] / total)
        for m, s in zip(models[1:], samples[1:], strict=True):
            acc = acc + m[name].astype(wide) * wide(s / total)
        assert out[name].dtype == ref.dtype
        assert out[name].tobytes() == acc.astype(ref.dtype).tobytes(), name
    # And every stream was closed; at most two groups' were open at once (one summed, the next opened)
    assert _Counting.open_now == 0
    assert 8 <= _Counting.most_open <= 16


@pytest.mark.parametrize("settings", [{"strategy": "fedavg"}, {}, {"strategy": "median"},
                                      {"server_optimizer": "fedadam"}, {"download_encoding": "int8"}])
def test_a_piece_written_into_a_reused_buffer_is_the_piece_written_into_a_fresh_one(settings: dict) -> None:
    # Given a model of several pieces over four float dtypes and an integer tensor, and each way a piece is made
    models = [_big_model(seed) for seed in range(3)]
    manifest = Manifest.of(parse_header(encode(models[0])))
    config = parse_config({"run_id": "r1x", **settings})
    ins = [WeightedInput(f"p{i}", i + 1, "", ArraySource(manifest, m)) for i, m in enumerate(models[1:])]
    plan = round_plan(config, manifest, 1, ins)
    assert plan.pieces >= 2

    def made(reuse: bool) -> list[bytes]:
        worker = PieceAggregator(config, plan, ins, ArraySource(manifest, models[0]))
        return [bytes(worker.piece_output(i, bytearray(b"\xab" * len(worker.piece(i))) if reuse else None).data)
                for i in range(plan.pieces)]

    # When each piece is written into a buffer of its size full of other bytes
    # Then every byte of it is overwritten: the pieces are those written into fresh buffers
    assert made(reuse=True) == made(reuse=False)


def test_a_stream_failing_mid_piece_closes_every_stream_and_raises() -> None:
    models = [_big_model(seed) for seed in range(10)]
    manifest = Manifest.of(parse_header(encode(models[0])))
    sources = [ArraySource(manifest, m) for m in models]
    ins = [WeightedInput(f"p{i:02d}", 1, "", _Counting(src, fail_at=3_000_000 if i == 4 else -1))
           for i, src in enumerate(sources)]
    _Counting.open_now = 0
    with pytest.raises(OSError, match="mid-range"):
        aggregate_file(parse_config({"run_id": "r1x", "strategy": "fedavg"}), manifest, 1, ins, None)
    assert _Counting.open_now == 0
