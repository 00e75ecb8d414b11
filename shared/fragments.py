"""Streaming DiLoCo's fragments: which tensors each round syncs (Douillard et al. 2025, "Streaming DiLoCo with
overlapping communication").

With `fragments` F > 1 the model's tensors are split into F fragments, and round r syncs fragment r mod F alone:
participants upload the delta of that fragment's tensors only, the round's aggregate (and server optimizer step)
changes only them, and every other tensor of the next global is the round's global, byte for byte. So a sync moves
about 1/F of the model, and each fragment takes one outer step every F rounds.

Tensors are grouped by layer: a tensor's group is its name up to its first dotted integer component
("model.layers.3.mlp.up.weight" -> "model.layers.3"), or up to its last dot where the name has none ("fc1.weight" ->
"fc1"). Layers are put in natural order (layer 10 after layer 9) and dealt out strided, layer i to fragment
i mod F, as the paper does: each fragment holds layers from the whole depth of the network, not one stretch. The
layers left over when F does not divide their count, and the tensors outside any layer (embeddings, the head, a
final norm), are dealt out tensor by tensor, the largest first, each to the lightest fragment: so a sync's peak is
close to 1/F of the model (a 5-layer LM at F = 4: 26 % of it, where whole layers would make 40 %).
"""

from __future__ import annotations

import re

from shared.wire import Manifest

_DIGITS = re.compile(r"(\d+)")


def _group(name: str) -> str:
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return ".".join(parts[:-1]) or name


def _natural(text: str) -> tuple[tuple[int, int | str], ...]:
    return tuple((0, int(p)) if p.isdigit() else (1, p) for p in _DIGITS.split(text) if p)


def fragments_of(manifest: Manifest, count: int) -> tuple[frozenset[str], ...]:
    """The tensor names of each of `count` fragments (pure: the same manifest gives the same split anywhere)."""
    if count < 1:
        raise ValueError(f"a model is split into at least one fragment, not {count}")
    groups: dict[str, list[str]] = {}
    for name in sorted(manifest.tensors, key=_natural):
        groups.setdefault(_group(name), []).append(name)
    layers = [g for g in sorted(groups, key=_natural) if g.rpartition(".")[2].isdigit()]
    whole = len(layers) // count * count  # layers dealt out whole, strided
    out: list[set[str]] = [set() for _ in range(count)]
    load = [0] * count
    for i, layer in enumerate(layers[:whole]):
        out[i % count].update(groups[layer])
        load[i % count] += sum(manifest.tensors[n].nbytes for n in groups[layer])
    dealt = {n for g in layers[:whole] for n in groups[g]}
    rest = sorted((n for n in manifest.tensors if n not in dealt), key=lambda n: (-manifest.tensors[n].nbytes,
                                                                                  _natural(n)))
    for name in rest:
        lightest = min(range(count), key=lambda j: (load[j], len(out[j]), j))
        out[lightest].add(name)
        load[lightest] += manifest.tensors[name].nbytes
    return tuple(frozenset(f) for f in out)


def synced_in(round_no: int, count: int) -> int:
    """The fragment round `round_no` syncs."""
    return round_no % count


def round_fragment(manifest: Manifest, count: int, round_no: int) -> frozenset[str] | None:
    """The tensors round `round_no` syncs; None when the run is not split (every tensor)."""
    if count <= 1:
        return None
    return fragments_of(manifest, count)[synced_in(round_no, count)]
