"""Facts about the built-in byte-level language-model task that must be importable without torch (run configs,
the demo).

The corpus is the text of `pydoc_data.topics.topics` (Python's own help topics; it ships with the interpreter, so
nothing is downloaded): the topics in sorted key order, joined by a newline, encoded as UTF-8. It is cut into
non-overlapping chunks of `context + 1` bytes (a chunk's first `context` bytes are the input, its last `context`
bytes the targets); the last tenth of the chunks (at least one) is the held-out set, the rest the training set.

The text differs between Python releases, so every participant of a run must have the same corpus. The run's
`dataset_size` (the training chunks) catches most differences: a participant whose count differs refuses the run.
`CORPUS_SHA256` names this interpreter's corpus, to compare hosts by hand.
"""

from __future__ import annotations

import hashlib
from functools import cache

from shared.digest import digest
from shared.wire import TensorSpec, encode_header

TASK = "participant.tasks.lm:task"  # the ~1M-parameter default; see participant.tasks.lm for the other sizes
CONTEXT = 128  # bytes of context of the built-in presets
D_MODEL, N_LAYERS = 128, 5  # the default preset's width and depth (`TASK`)
VOCAB = 256  # bytes
MLP_RATIO = 4
TEST_DIVISOR = 10  # the last 1/10 of the chunks are held out
# What `fed demo --task lm` reports per round: the held-out loss (mean cross-entropy per byte, nats; lower is
# better), and its perplexity beside it.
METRIC = "test_loss"


@cache
def corpus() -> bytes:
    """The corpus, the same bytes for the same Python release on every host."""
    from pydoc_data.topics import topics

    return "\n".join(topics[key] for key in sorted(topics)).encode("utf-8")


def corpus_sha256() -> str:
    return hashlib.sha256(corpus()).hexdigest()


def split_sizes(context: int = CONTEXT) -> tuple[int, int]:
    """(training chunks, held-out chunks) for a context length."""
    if context < 1:
        raise ValueError(f"context must be at least 1 byte, got {context}")
    chunks = len(corpus()) // (context + 1)
    test = max(1, chunks // TEST_DIVISOR)
    if chunks - test < 1:
        raise ValueError(f"a context of {context} bytes leaves no training chunk in a {len(corpus())}-byte corpus")
    return chunks - test, test


TRAIN_SIZE, TEST_SIZE = split_sizes(CONTEXT)
CORPUS_SHA256 = corpus_sha256()


def model_tensors(d_model: int = D_MODEL, n_layers: int = N_LAYERS, context: int = CONTEXT,
                  dtype: str = "F32") -> dict[str, TensorSpec]:
    """The tensors of the byte-level transformer at one size, as its state dict names them (the heads split
    d_model: their number changes no tensor)."""
    d, wide = d_model, MLP_RATIO * d_model
    tensors = {"tok.weight": (VOCAB, d), "pos.weight": (context, d), "ln.weight": (d,), "ln.bias": (d,),
               "head.weight": (VOCAB, d)}
    for i in range(n_layers):
        block = {"ln1.weight": (d,), "ln1.bias": (d,), "qkv.weight": (3 * d, d), "qkv.bias": (3 * d,),
                 "proj.weight": (d, d), "proj.bias": (d,), "ln2.weight": (d,), "ln2.bias": (d,),
                 "fc.weight": (wide, d), "fc.bias": (wide,), "out.weight": (d, wide), "out.bias": (d,)}
        tensors.update({f"blocks.{i}.{name}": shape for name, shape in block.items()})
    return {name: TensorSpec(dtype, shape) for name, shape in tensors.items()}


# The run's `initial_model_schema` for the default preset: ingest refuses an initial-model offer with other tensors
MODEL_SCHEMA = digest(encode_header(model_tensors()))
