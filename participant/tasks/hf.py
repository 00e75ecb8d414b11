"""A Hugging Face causal language model as a task: `task = "participant.tasks.hf:task"`, configured by `[run.hf]`.

The model is what `AutoModelForCausalLM` and `AutoTokenizer` load from `hf.model` (a local directory, or a hub id
already in this host's cache: nothing is downloaded). The run's initial global model is the model's own weights
(every participant offers the same ones). The run records the model's config and tokenizer by digest
(`model_digests`); a host holding others refuses to start, and every update names them (`identity`), so ingest
refuses an update trained from anything else.

Data (`participant.tasks.hf_data`): documents tokenized with the model's tokenizer and packed into sequences of
`hf.sequence_length` tokens, the last tenth held out. In assigned mode every host reads the same `hf.text` (default:
Python's help text) and the coordinator assigns sequence indices; in local mode each host's `--data` (files or
directories, comma-separated) is its own, private training set, and the held-out set stays the run's.

Training: AdamW (betas 0.9/0.95, no weight decay, a fresh optimizer every round) on the trainable weights, micro-
batches of `batch_size` sequences in an order drawn from the round's seed, gradients accumulated to
`hf.tokens_per_step` tokens a step, clipped to norm 1, at `learning_rate` x a schedule spanning the run's rounds
(`lr_factor`: linear warmup over `hf.warmup_rounds`, then cosine to a tenth). On CUDA the daemon runs training under
bf16 autocast with float32 master weights. Evaluation: the held-out loss (mean cross-entropy per predicted token,
nats), its perplexity and next-token accuracy.

Adapters (`hf.adapter = "lora"`): PEFT's LoRA on `hf.lora_targets` of a frozen base. The task's model is then
`Adapters`, whose state dict is the adapter weights alone: they are the initial global model, the update and what
aggregation, witnesses and compression see; the base never leaves the host. Its weights' digest (`weights_digest`) is
part of the identity, so an adapter trained on another base is refused.

`python -m participant.tasks.hf describe SOURCE` prints the `[run.hf]` digests and the training set size of a model
(what `fed run start --from` and `fed demo --task hf` record).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import warnings
from collections.abc import Mapping, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from participant.splits import parse_split, partition
from participant.task import Progress, TaskError, gradient_sync, local_batches
from participant.tasks import hf_data, hf_meta
from shared.config import Adapter, HfOptions, RunConfig

TASK = hf_meta.TASK
MODEL_ENV = "FED_HF_MODEL"  # a host whose copy of the run's model lives elsewhere than `hf.model` says
# config.json entries that name where and by which library version a model was saved, not what it is
VOLATILE_CONFIG = ("_name_or_path", "transformers_version", "_commit_hash", "_attn_implementation_autoset")
EVAL_BATCH = 16
BETAS = (0.9, 0.95)
GRAD_CLIP = 1.0
MIN_LR_FACTOR = 0.1


def canonical_digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _quiet() -> None:
    """No progress bars or advisory warnings from transformers in a daemon's log."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    hf_logging.set_verbosity_error()  # type: ignore[no-untyped-call]


def load_tokenizer(source: str) -> Any:
    from transformers import AutoTokenizer

    _quiet()
    return AutoTokenizer.from_pretrained(source, local_files_only=True)


def load_model(source: str) -> nn.Module:
    """The model's own weights, float32 (the optimizer's master weights; CUDA trains under bf16 autocast)."""
    from transformers import AutoModelForCausalLM

    _quiet()
    model: nn.Module = AutoModelForCausalLM.from_pretrained(source, local_files_only=True, dtype=torch.float32)
    return tied_once(model)


def tied_once(model: nn.Module) -> nn.Module:
    """`model`, its tied weights (one parameter under several names: the input embedding and the output head of
    most small LMs) in its state dict once, under the first name. The update, the global model and every transfer
    hold the weight once (a quarter of a 0.5 B model with a large vocabulary is its embedding); loading a state dict
    gives the other names the same weight."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        aliases.update({name: first[id(param)]} if id(param) in first else {})
        first.setdefault(id(param), name)
    if aliases:
        def drop(module: nn.Module, state: dict[str, Any], prefix: str, metadata: Any) -> None:
            for alias in aliases:
                state.pop(prefix + alias, None)

        def fill(module: nn.Module, state: dict[str, Any], prefix: str, *rest: Any) -> None:
            for alias, name in aliases.items():
                if prefix + name in state:
                    state.setdefault(prefix + alias, state[prefix + name])

        model.register_state_dict_post_hook(drop)  # type: ignore[no-untyped-call]  # (untyped in torch)
        model.register_load_state_dict_pre_hook(fill)  # type: ignore[no-untyped-call]
    return model


def model_digests(source: str) -> dict[str, str]:
    """{"config": ..., "tokenizer": ...}: SHA-256 of the model's config and of its tokenizer, each as canonical JSON
    (the config without the entries naming where and with which transformers version it was saved)."""
    from transformers import AutoConfig

    _quiet()
    config = AutoConfig.from_pretrained(source, local_files_only=True).to_dict()
    for name in VOLATILE_CONFIG:
        config.pop(name, None)
    tokenizer = load_tokenizer(source)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise TaskError(f"{source}: the tokenizer has no fast (tokenizers) form to record by digest")
    return {"config": canonical_digest(config), "tokenizer": canonical_digest(json.loads(backend.to_str()))}


def weights_digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 over every tensor's name, dtype, shape and bytes, in name order: a base model's identity."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{list(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def lr_factor(round_no: int | None, total_rounds: int, warmup_rounds: int) -> float:
    """The learning rate's factor in round `round_no`: linear from a tenth to 1 over the warmup rounds, then a cosine
    to a tenth at the run's last round; 1 when the round is unknown."""
    if round_no is None:
        return 1.0
    if round_no < warmup_rounds:
        return MIN_LR_FACTOR + (1 - MIN_LR_FACTOR) * round_no / warmup_rounds
    span = max(1, total_rounds - 1 - warmup_rounds)
    progress = min(1.0, (round_no - warmup_rounds) / span)
    return MIN_LR_FACTOR + (1 - MIN_LR_FACTOR) * 0.5 * (1 + math.cos(math.pi * progress))


class Adapters(nn.Module):
    """A PEFT model whose state dict is its adapter weights only (PEFT's names, those `adapter_model.safetensors`
    uses): what is loaded into it, uploaded and aggregated. The frozen base is in the module, never in its state."""

    def __init__(self, peft_model: nn.Module) -> None:
        super().__init__()
        self.peft: Any = peft_model

    def forward(self, **inputs: Any) -> Any:
        return self.peft(**inputs)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:  # type: ignore[override]
        from peft import get_peft_model_state_dict

        return {name: t.detach() for name, t in get_peft_model_state_dict(self.peft).items()}

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """Copy adapter weights in (the names `state_dict` gives); with `strict`, exactly those names."""
        own = self.state_dict()
        missing, unexpected = sorted(set(own) - set(state_dict)), sorted(set(state_dict) - set(own))
        if strict and (missing or unexpected):
            raise RuntimeError(f"adapter weights do not fit: missing {missing[:5]}, unexpected {unexpected[:5]}")
        with torch.no_grad():
            for name in set(own) & set(state_dict):
                own[name].copy_(state_dict[name])
        return nn.modules.module._IncompatibleKeys(missing, unexpected)


class HfTask:
    """A Hugging Face causal LM under one run's `[run.hf]` (see the module's docstring)."""

    def __init__(self, options: HfOptions, source: str, total_rounds: int = 1) -> None:
        self.options, self.source, self.total_rounds = options, source, total_rounds
        self.tokenizer = load_tokenizer(source)
        self._own: np.ndarray | None = None  # local data mode: this host's sequences
        self.identity = self._checked_identity()
        self.train_size = len(self._shared[0])

    def __repr__(self) -> str:
        return f"HfTask({self.source!r}, adapter={self.options.adapter.value})"

    def _checked_identity(self) -> dict[str, str]:
        """The digests every update names; TaskError where the run recorded others."""
        named = model_digests(self.source)
        if self.options.adapter is Adapter.LORA:
            named["base"] = weights_digest(load_model(self.source).state_dict())
        for part, recorded in self.options.identity().items():
            if named[part] != recorded:
                raise TaskError(f"{self.source}: its {part} digest is {named[part][:12]}, but the run recorded "
                                f"{recorded[:12]}: every participant must hold the run's model "
                                f"(set {MODEL_ENV} to your copy of it)")
        return named

    def _encode(self, docs: list[str]) -> list[list[int]]:
        encoded: list[list[int]] = self.tokenizer(docs, add_special_tokens=False)["input_ids"]
        return encoded

    def _sequences(self, docs: Sequence[str]) -> np.ndarray:
        return hf_data.pack(docs, self._encode, self.tokenizer.eos_token_id, self.options.sequence_length)

    @cached_property
    def _shared(self) -> tuple[np.ndarray, np.ndarray]:
        """(training, held-out evaluated) sequences of the run's text."""
        opts = self.options
        docs = hf_data.read_documents(opts.text, opts.text_field) if opts.text else hf_data.python_help()
        train, test = hf_data.split(self._sequences(docs))
        return train, hf_data.evenly_spaced(test, opts.eval_sequences)

    def local_data(self, spec: str) -> np.ndarray:
        """Local data mode: this host's files (comma-separated paths), all of them for training; or `iid:I/N`, part I
        of N of the run's own training text (to try local mode without files: `fed demo --task hf --split iid`)."""
        if spec.startswith(("iid:", "dirichlet:")):
            split = parse_split(spec)
            if split.alpha is not None:
                raise ValueError(f"{spec}: text has no labels to skew by; give iid:I/N or files")
            train = self._shared[0]
            self._own = train[partition(np.zeros(len(train)), split.parts, None)[split.part]]
        else:
            self._own = self._sequences(hf_data.read_documents(spec.split(","), self.options.text_field))
        self.train_size = len(self._own)
        return np.arange(len(self._own))

    def build_model(self, seed: int) -> nn.Module:
        """The model's own weights; with adapters, the frozen base wrapped in LoRA adapters drawn from `seed` (the
        same on every host)."""
        model = load_model(self.source)
        if self.options.adapter is Adapter.NONE:
            return model
        from peft import LoraConfig, get_peft_model

        opts = self.options
        lora = LoraConfig(r=opts.lora_rank, lora_alpha=opts.lora_alpha, target_modules=list(opts.lora_targets),
                          lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
        with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # (peft asks transformers a deprecated question)
            torch.manual_seed(seed)
            try:
                return Adapters(get_peft_model(model, lora))
            except ValueError as exc:  # e.g. target modules the model does not have
                raise TaskError(f"{self.source}: cannot add LoRA adapters: {exc}") from None

    def train(self, model: nn.Module, indices: Sequence[int], config: RunConfig, device: torch.device,
              progress: Progress | None = None, seed: int = 0, round_no: int | None = None) -> dict[str, float]:
        rows = self._own if self._own is not None else self._shared[0]
        idx = np.asarray(indices, dtype=np.int64)
        if len(idx) == 0:
            raise ValueError("no samples to train on")
        if int(idx.min()) < 0 or int(idx.max()) >= len(rows):
            raise ValueError(f"sample indices must lie in [0, {len(rows)})")
        data = torch.from_numpy(rows[idx]).to(device)
        model.to(device).train()
        trainable = [p for p in model.parameters() if p.requires_grad]
        lr = config.learning_rate * lr_factor(round_no, config.total_rounds, self.options.warmup_rounds)
        opt = torch.optim.AdamW(trainable, lr=lr, betas=BETAS, weight_decay=0.0)
        tokens = config.batch_size * self.options.sequence_length
        accumulate = max(1, self.options.tokens_per_step // tokens)
        total, batches = local_batches(len(idx), config, torch.Generator().manual_seed(seed))
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        seen = 0
        for done, positions in enumerate(batches, 1):
            batch = data[positions.to(device)]
            step = done % accumulate == 0 or done == total
            with gradient_sync(model, step):
                loss = model(input_ids=batch, labels=batch).loss
                torch.autograd.backward(loss / accumulate)
            if step:
                nn.utils.clip_grad_norm_(trainable, GRAD_CLIP)
                opt.step()
                opt.zero_grad(set_to_none=True)
            loss_sum += loss.detach().double() * len(batch)
            seen += len(batch)
            if progress is not None:
                progress(done, total)
        return {"loss": float(loss_sum) / seen, "learning_rate": lr}

    @torch.no_grad()
    def evaluate(self, model: nn.Module, device: torch.device) -> dict[str, float]:
        test = torch.from_numpy(self._shared[1])
        model.to(device).eval()
        loss_sum, correct, count = 0.0, 0, 0
        autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
        for start in range(0, len(test), EVAL_BATCH):
            batch = test[start : start + EVAL_BATCH].to(device)
            with autocast:
                logits = model(input_ids=batch).logits
            logits = logits[:, :-1].float().reshape(-1, logits.shape[-1])
            targets = batch[:, 1:].reshape(-1)
            loss_sum += float(F.cross_entropy(logits, targets, reduction="sum"))
            correct += int((logits.argmax(-1) == targets).sum())
            count += targets.numel()
        loss = loss_sum / count
        return {"test_loss": loss, "test_perplexity": math.exp(min(loss, 700.0)), "test_accuracy": correct / count}


class HfFactory:
    """`participant.tasks.hf:task`: configured by the run (`for_run`), since the model is the run's."""

    def for_run(self, config: RunConfig) -> HfTask:
        source = os.environ.get(MODEL_ENV) or config.hf.model
        if not source:
            raise TaskError(f"run {config.run_id} names no Hugging Face model: set [run.hf] model (a directory or "
                            f"a cached hub id), or {MODEL_ENV} on this host")
        try:
            return HfTask(config.hf, source, config.total_rounds)
        except OSError as exc:  # transformers' "not a directory, not in the cache"
            raise TaskError(f"{source}: cannot load the model or tokenizer ({exc})") from None
        except hf_data.TextError as exc:
            raise TaskError(f"[run.hf] text: {exc}") from None


task = HfFactory()


def describe(source: str, options: HfOptions | None = None) -> dict[str, Any]:
    """What a run of this model records: `[run.hf]` digests (and the base's, with adapters), the training set's size
    and the initial model's schema, and the digest of the initial model a participant builds from these files and
    seed 0 (the bytes it offers: `initial_model_digest`)."""
    import tempfile

    from participant.tensors import save_model, specs_of
    from shared.digest import digest, digest_file
    from shared.wire import TensorSpec, encode_header

    opts = (options or HfOptions()).model_copy(update={"model": source})
    hf_task = HfTask(opts, source)
    model = hf_task.build_model(0)
    specs = specs_of(model)
    with tempfile.TemporaryDirectory() as scratch:
        initial = digest_file(save_model(model, Path(scratch) / "init.safetensors"))
    header = {name: TensorSpec(_dtype_name(dtype), shape) for name, (shape, dtype) in specs.items()}
    named = hf_task.identity
    return {"hf": {"model": source, "config_digest": named["config"], "tokenizer_digest": named["tokenizer"],
                   "base_digest": named.get("base", "")},
            "dataset_size": hf_task.train_size, "initial_model_schema": digest(encode_header(header)),
            "initial_model_digest": initial,
            "parameters": sum(math.prod(shape) for shape, _ in specs.values())}


EXPORT_SHARD = "2GB"  # save_pretrained's max_shard_size: a model over it is written in several safetensors files


def export_hf(config: RunConfig, global_file: Path, out: Path, merged: bool = True,
              source: str | None = None) -> list[str]:
    """Write the run's global model (a file the coordinator wrote) as a Hugging Face model directory that
    `from_pretrained` loads: config, tokenizer, sharded safetensors. With adapters, the base with the adapters merged
    in (`merged`), or the adapters alone (adapter_config.json, adapter_model.safetensors) for PEFT to load on the
    base. `source` (default: the run's `hf.model`, or FED_HF_MODEL) must be the run's model by digest. Returns the
    files written."""
    from participant.tensors import load_into

    if source:
        config = config.model_copy(update={"hf": config.hf.model_copy(update={"model": source})})
    hf_task = HfFactory().for_run(config)
    model: Any = load_into(hf_task.build_model(config.seed), global_file)
    if isinstance(model, Adapters) and not merged:
        model.peft.save_pretrained(out)
    else:
        if isinstance(model, Adapters):
            model = model.peft.merge_and_unload()
        model.save_pretrained(out, max_shard_size=EXPORT_SHARD)
    hf_task.tokenizer.save_pretrained(out)
    return sorted(p.name for p in out.iterdir())


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}[dtype]


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m participant.tasks.hf", description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["describe"])
    parser.add_argument("source", help="a model directory or a cached hub id")
    parser.add_argument("--options", default="{}", help="[run.hf] settings as JSON (e.g. the adapter's)")
    args = parser.parse_args(argv)
    try:
        described = describe(args.source, HfOptions.model_validate_json(args.options))
    except (TaskError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(described))
    return 0


if __name__ == "__main__":
    sys.exit(main())
