"""Built-in task: a small decoder-only transformer language model over bytes, trained on Python's help text.

Data (`lm_meta`): the text of `pydoc_data.topics` (ships with Python, no download) as UTF-8 bytes, cut into
non-overlapping chunks of `context + 1` bytes; the last tenth of the chunks is held out. `train_size` is the
number of training chunks and the indices the coordinator assigns are chunk indices. Evaluation reports the mean
cross-entropy per byte (`test_loss`, nats), its `test_perplexity` and the next-byte `test_accuracy` on the held-out
chunks (the default size evaluates a fixed, evenly spaced subset of 64 of them, so that it stays well under a
second on one CPU thread; the larger presets evaluate them all).

Model: vocabulary of 256 bytes, learned token and position embeddings, `n_layers` pre-LayerNorm blocks (causal
self-attention through `torch.nn.functional.scaled_dot_product_attention`, then a 4x GELU MLP, each added to the
residual stream), a final LayerNorm and an untied linear head. No dropout. Weights are drawn from a
`torch.Generator` seeded with the run's seed (normal, std 0.02; the residual projections 0.02 / sqrt(2 n_layers)).

Training: AdamW (betas 0.9/0.95, no weight decay, a fresh optimizer every round) at `config.learning_rate`, batches
of `config.batch_size` chunks in an order drawn from the round's seed, `config.local_epochs` passes (or
`config.local_steps` inner steps, DiLoCo's H), gradient norm
clipped to 1. On CUDA the forward and backward passes run under bf16 autocast with float32 master weights (the
update stays float32); on the CPU everything is float32.

Choosing a size: the task spec names it. Every participant of a run must name the same one (the model's tensors
and the data set size must agree), so put it in the run config's `task`:

| `task =` | parameters | d_model x layers, heads, context | for |
|---|---|---|---|
| `participant.tasks.lm:task` (also `:small`) | 1.07 M | 128 x 5, 4 heads, 128 bytes | CPU hosts, `fed demo --task lm` |
| `participant.tasks.lm:medium` | 10.9 M | 384 x 6, 6 heads, 256 bytes | one GPU, or patient CPUs |
| `participant.tasks.lm:large` | 101.6 M | 1024 x 8, 16 heads, 256 bytes | GPU hosts |

An update is the float32 model, 4 bytes a parameter: `large` is about 406 MB, so the run's `max_update_bytes`
must admit that. The corpus is about 0.47 MB, so the larger models mostly memorise it: they
are there to exercise the coordinator at scale, not to make a better model.

Any other size: a module of your own with `my_task = lm_task(d_model=..., n_layers=..., n_heads=..., context=...)`
and `task = "my_module:my_task"`; set the run's `dataset_size` to `lm_meta.split_sizes(context)[0]` (or 0, to take
it from the task).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from functools import cached_property

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from participant.task import Progress, local_batches
from participant.tasks import lm_meta
from shared.config import RunConfig

VOCAB = 256  # bytes
INIT_STD = 0.02


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, d_model: int, n_heads: int, mlp_ratio: int = 4, device: torch.device | None = None) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d_model, device=device)
        self.qkv = nn.Linear(d_model, 3 * d_model, device=device)
        self.proj = nn.Linear(d_model, d_model, device=device)
        self.ln2 = nn.LayerNorm(d_model, device=device)
        self.fc = nn.Linear(d_model, mlp_ratio * d_model, device=device)
        self.out = nn.Linear(mlp_ratio * d_model, d_model, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (b, heads, t, d / heads)
        x = x + self.proj(attended.transpose(1, 2).reshape(b, t, d))
        out: torch.Tensor = x + self.out(F.gelu(self.fc(self.ln2(x))))
        return out


class ByteTransformer(nn.Module):
    """Bytes (batch, time) -> next-byte logits (batch, time, 256)."""

    def __init__(self, d_model: int, n_layers: int, n_heads: int, context: int,
                 device: torch.device | None = None) -> None:
        super().__init__()
        self.context = context
        self.tok = nn.Embedding(VOCAB, d_model, device=device)
        self.pos = nn.Embedding(context, d_model, device=device)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, device=device) for _ in range(n_layers))
        self.ln = nn.LayerNorm(d_model, device=device)
        self.head = nn.Linear(d_model, VOCAB, bias=False, device=device)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        if t > self.context:
            raise ValueError(f"{t} bytes of input, but the model's context is {self.context}")
        h = self.tok(tokens) + self.pos.weight[:t]
        for block in self.blocks:
            h = block(h)
        logits: torch.Tensor = self.head(self.ln(h))
        return logits


def _autocast(device: torch.device) -> contextlib.AbstractContextManager[object]:
    """bf16 autocast on CUDA (the weights stay float32); plain float32 elsewhere."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


class ByteLM:
    """The byte-level LM task at one size; `task`, `small`, `medium` and `large` below are the built-in ones."""

    def __init__(self, d_model: int = 128, n_layers: int = 5, n_heads: int = 4, context: int = lm_meta.CONTEXT,
                 eval_sequences: int = 64, eval_batch: int = 64, betas: tuple[float, float] = (0.9, 0.95),
                 grad_clip: float = 1.0) -> None:
        if d_model < 1 or n_layers < 1 or n_heads < 1 or d_model % n_heads:
            raise ValueError(f"d_model ({d_model}) must be a positive multiple of n_heads ({n_heads}), "
                             f"and n_layers ({n_layers}) positive")
        self.d_model, self.n_layers, self.n_heads, self.context = d_model, n_layers, n_heads, context
        self.eval_sequences = eval_sequences  # 0: the whole held-out set
        self.eval_batch = eval_batch
        self.betas = betas
        self.grad_clip = grad_clip
        self.train_size, self.test_size = lm_meta.split_sizes(context)

    def __repr__(self) -> str:
        return (f"ByteLM(d_model={self.d_model}, n_layers={self.n_layers}, n_heads={self.n_heads}, "
                f"context={self.context})")

    @cached_property
    def _data(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(training chunks, held-out chunks evaluated), uint8 tensors of shape (n, context + 1)."""
        raw = lm_meta.corpus()
        width = self.context + 1
        chunks = torch.frombuffer(bytearray(raw[: (len(raw) // width) * width]), dtype=torch.uint8).view(-1, width)
        train, test = chunks[: self.train_size], chunks[self.train_size :]
        if len(test) != self.test_size:
            raise RuntimeError(f"the corpus gives {len(test)} held-out chunks, expected {self.test_size}")
        if 0 < self.eval_sequences < len(test):  # a fixed, evenly spaced subset
            test = test[torch.linspace(0, len(test) - 1, self.eval_sequences).round().long()]
        return train.clone(), test.clone()

    def parameter_count(self) -> int:
        model = ByteTransformer(self.d_model, self.n_layers, self.n_heads, self.context, device=torch.device("meta"))
        return sum(p.numel() for p in model.parameters())

    def build_model(self, seed: int) -> nn.Module:
        """Weights drawn from a generator of their own: the same model for the same seed on every host, and the
        global RNG untouched."""
        generator = torch.Generator().manual_seed(seed)
        meta = torch.device("meta")  # no storage and no draws until initialised below
        model = ByteTransformer(self.d_model, self.n_layers, self.n_heads, self.context, device=meta)
        model = model.to_empty(device="cpu")
        residual_std = INIT_STD / math.sqrt(2 * self.n_layers)
        with torch.no_grad():
            for name, module in model.named_modules():
                if isinstance(module, nn.Linear):
                    std = residual_std if name.endswith((".proj", ".out")) else INIT_STD
                    nn.init.normal_(module.weight, 0.0, std, generator=generator)
                    if module.bias is not None:
                        nn.init.zeros_(module.bias)
                elif isinstance(module, nn.Embedding):
                    nn.init.normal_(module.weight, 0.0, INIT_STD, generator=generator)
                elif isinstance(module, nn.LayerNorm):
                    nn.init.ones_(module.weight)
                    nn.init.zeros_(module.bias)
        return model

    def train(
        self,
        model: nn.Module,
        indices: Sequence[int],
        config: RunConfig,
        device: torch.device,
        progress: Progress | None = None,
        seed: int = 0,
    ) -> dict[str, float]:
        train_chunks, _ = self._data
        idx = torch.as_tensor(np.asarray(indices, dtype=np.int64))
        if len(idx) == 0:
            raise ValueError("no samples to train on")
        if int(idx.min()) < 0 or int(idx.max()) >= self.train_size:
            raise ValueError(f"sample indices must lie in [0, {self.train_size})")
        chunks = train_chunks[idx].to(device=device, dtype=torch.long)
        model.to(device).train()
        opt = torch.optim.AdamW(model.parameters(), lr=config.learning_rate, betas=self.betas, weight_decay=0.0)
        total, batches = local_batches(len(idx), config, torch.Generator().manual_seed(seed))
        done, seen = 0, 0
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)  # summed on the device: no sync a step
        for positions in batches:
            batch = chunks[positions.to(device)]
            opt.zero_grad(set_to_none=True)
            with _autocast(device):
                logits = model(batch[:, :-1])
            loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
            torch.autograd.backward(loss)
            if self.grad_clip > 0:
                nn.utils.clip_grad_norm_(model.parameters(), self.grad_clip)
            opt.step()
            loss_sum += loss.detach().double() * len(batch)
            seen += len(batch)
            done += 1
            if progress is not None:
                progress(done, total)
        return {"loss": float(loss_sum) / seen}

    @torch.no_grad()
    def evaluate(self, model: nn.Module, device: torch.device) -> dict[str, float]:
        _, test = self._data
        model.to(device).eval()
        loss_sum, correct, count = 0.0, 0, 0
        for start in range(0, len(test), self.eval_batch):
            batch = test[start : start + self.eval_batch].to(device=device, dtype=torch.long)
            targets = batch[:, 1:].reshape(-1)
            with _autocast(device):
                logits = model(batch[:, :-1])
            logits = logits.float().reshape(-1, VOCAB)
            loss_sum += float(F.cross_entropy(logits, targets, reduction="sum"))
            correct += int((logits.argmax(-1) == targets).sum())
            count += targets.numel()
        loss = loss_sum / count
        return {"test_loss": loss, "test_perplexity": math.exp(min(loss, 700.0)), "test_accuracy": correct / count}


def lm_task(d_model: int = 128, n_layers: int = 5, n_heads: int = 4, context: int = lm_meta.CONTEXT,
            eval_sequences: int = 64) -> ByteLM:
    """A byte-level LM task of your own size (see the module's docstring); `eval_sequences=0` evaluates the whole
    held-out set."""
    return ByteLM(d_model, n_layers, n_heads, context, eval_sequences)


task = lm_task()  # `participant.tasks.lm:task` (lm_meta.TASK): ~1.07 M parameters, trains on a CPU in minutes
small = task
medium = lm_task(d_model=384, n_layers=6, n_heads=6, context=256, eval_sequences=0)  # ~10.9 M parameters
large = lm_task(d_model=1024, n_layers=8, n_heads=16, context=256, eval_sequences=0)  # ~101.6 M parameters
