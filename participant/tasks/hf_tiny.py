"""A tiny Llama-architecture model directory, built offline: what `fed demo --task hf` and the tests train.

The tokenizer is a byte-level BPE (`tokenizers`) trained on Python's help text (`hf_data.python_help`), so it
covers any text; the model is `LlamaForCausalLM` from a config (2 layers, width 64, embeddings untied unless
`tied`: ~0.2 M parameters at a vocabulary of 1,024), its weights drawn from a seed and pre-trained for a few seconds on
standard-library source, so that the help text is new to it. The directory is what `save_pretrained` writes
(config.json, model.safetensors, tokenizer.json, tokenizer_config.json): any Hugging Face model directory of a causal
LM can take its place.

`python -m participant.tasks.hf_tiny DIR` builds one (if DIR has no config.json yet) and prints DIR.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from participant.tasks import hf_data

EOS = "<|endoftext|>"
VOCAB, WIDTH, LAYERS, HEADS, CONTEXT = 1024, 64, 2, 4, 256
# Steps of pre-training on standard-library source (batches of 16 x 128 tokens, AdamW at 3e-3): a few seconds that
# give adapters a base worth adapting. On the random base, LoRA on q/v could barely move the held-out loss
# (measured: 6.875 -> 6.859 over 4 rounds); full fine-tuning works from either.
PRETRAIN_STEPS, PRETRAIN_BATCH, PRETRAIN_LENGTH, PRETRAIN_LR = 150, 16, 128, 3e-3
PRETRAIN_MODULES = ("argparse", "textwrap", "string", "json.decoder", "json.encoder", "fractions", "shlex", "heapq",
                    "bisect", "calendar", "dataclasses", "enum")


def pretraining_text() -> list[str]:
    """The base's pre-training text: the source of a few standard-library modules (it ships with Python), so that
    fine-tuning on the help text (the run's default) is adapting a model to text it has not seen."""
    import importlib.util

    docs = []
    for name in PRETRAIN_MODULES:
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            raise RuntimeError(f"the standard library's {name} has no source file here")
        docs.append(Path(spec.origin).read_text(encoding="utf-8"))
    return docs


def _pretrain(model: Any, tokenizer: Any, steps: int) -> None:
    """`steps` AdamW steps on random batches of the pre-training text's sequences, drawn from torch's global
    generator (seeded by the caller)."""
    import torch

    if steps <= 0:
        return
    encode = lambda docs: tokenizer(docs, add_special_tokens=False)["input_ids"]  # noqa: E731
    rows = torch.from_numpy(hf_data.pack(pretraining_text(), encode, tokenizer.eos_token_id, PRETRAIN_LENGTH))
    opt = torch.optim.AdamW(model.parameters(), lr=PRETRAIN_LR, betas=(0.9, 0.95), weight_decay=0.0)
    model.train()
    for _ in range(steps):
        batch = rows[torch.randint(len(rows), (PRETRAIN_BATCH,))]
        torch.autograd.backward(model(input_ids=batch, labels=batch).loss)
        opt.step()
        opt.zero_grad(set_to_none=True)


def build(directory: str | Path, seed: int = 0, vocab: int = VOCAB, width: int = WIDTH, layers: int = LAYERS,
          heads: int = HEADS, pretrain_steps: int = PRETRAIN_STEPS, tied: bool = False) -> Path:
    """Write the model directory (atomically: a crash leaves none or a whole one); an existing one is kept."""
    directory = Path(directory)
    if (directory / "config.json").is_file():
        return directory
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from participant.tasks.hf import _quiet

    _quiet()
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(hf_data.python_help(), trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS, bos_token=EOS, pad_token=EOS)  # type: ignore[no-untyped-call]
    config = LlamaConfig(vocab_size=bpe.get_vocab_size(), hidden_size=width, intermediate_size=2 * width,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                         max_position_embeddings=CONTEXT, tie_word_embeddings=tied,
                         bos_token_id=bpe.token_to_id(EOS), eos_token_id=bpe.token_to_id(EOS))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
        _pretrain(model, tokenizer, pretrain_steps)
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}-", dir=directory.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        os.replace(staging, directory)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not (directory / "config.json").is_file():  # (not another process that built it meanwhile)
            raise
    return directory


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        sys.exit(2)
    print(build(sys.argv[1]))
