"""Streaming DiLoCo's fragments (`shared.fragments`): layers dealt out strided in natural order, the rest balanced
by bytes, every tensor in exactly one fragment, no fragment empty while there are tensors enough, and round r
syncing fragment r mod F."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.fragments import fragments_of, round_fragment, synced_in
from shared.wire import Manifest, TensorSpec


def transformer(layers: int, d: int = 16) -> Manifest:
    tensors = {"tok.weight": TensorSpec("F32", (100, d)), "head.weight": TensorSpec("F32", (100, d)),
               "ln_f.weight": TensorSpec("F32", (d,))}
    for i in range(layers):
        tensors |= {f"blocks.{i}.qkv.weight": TensorSpec("F32", (3 * d, d)),
                    f"blocks.{i}.proj.weight": TensorSpec("F32", (d, d)),
                    f"blocks.{i}.fc.weight": TensorSpec("F32", (4 * d, d)),
                    f"blocks.{i}.out.weight": TensorSpec("F32", (d, 4 * d)),
                    f"blocks.{i}.ln.weight": TensorSpec("BF16", (d,))}
    return Manifest(tensors)


def share(manifest: Manifest, names: frozenset[str]) -> float:
    return sum(manifest.tensors[n].nbytes for n in names) / manifest.nbytes


def test_layers_are_dealt_out_strided_in_natural_order() -> None:
    m = transformer(12)
    fragments = fragments_of(m, 4)
    for i in range(12):  # (layer 10 after layer 9, not after layer 1)
        assert f"blocks.{i}.fc.weight" in fragments[i % 4]
        assert all(n in fragments[i % 4] for n in m.tensors if n.startswith(f"blocks.{i}."))


def test_layers_left_over_and_the_rest_are_balanced_by_bytes() -> None:
    m = transformer(5)  # five layers at F = 4: whole layers would put two in one fragment
    fragments = fragments_of(m, 4)
    assert max(share(m, f) for f in fragments) < 0.3
    assert all(n in fragments[i] for i in range(4) for n in m.tensors if n.startswith(f"blocks.{i}."))


@settings(max_examples=50, deadline=None)
@given(layers=st.integers(0, 9), count=st.integers(1, 8), d=st.sampled_from([2, 8]))
def test_every_tensor_is_in_exactly_one_fragment(layers: int, count: int, d: int) -> None:
    m = transformer(layers, d)
    fragments = fragments_of(m, count)
    assert len(fragments) == count
    assert sorted(n for f in fragments for n in f) == sorted(m.tensors)
    if len(m.tensors) >= count:
        assert all(fragments)
    assert fragments == fragments_of(Manifest(dict(reversed(list(m.tensors.items())))), count)  # order-free


def test_round_r_syncs_fragment_r_mod_f() -> None:
    m = transformer(4)
    assert round_fragment(m, 1, 7) is None
    assert [synced_in(r, 3) for r in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert round_fragment(m, 3, 5) == fragments_of(m, 3)[2]
    with pytest.raises(ValueError, match="at least one fragment"):
        fragments_of(m, 0)
