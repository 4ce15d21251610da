"""Shared by the Trainer and accelerate examples: a tiny Llama config (ds_upipe.tools.models), random-token
data that need no download, and the metrics report.  (Imported by path: the examples' own folder is on
sys.path when they run.)"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import LlamaConfig


def tiny_llama_config(seq_len: int) -> LlamaConfig:
    from ds_upipe.tools.models import tiny_config

    return tiny_config(max_position_embeddings=seq_len)


def sequence_parallelism(sp_size: int, attn_implementation: str = "sdpa") -> Any:
    """accelerate's ``ParallelismConfig(sp_backend="deepspeed", sp_size=...)`` for the Trainer (None at
    sp_size 1).  ``attn_implementation``, the model's: ALST wraps it, UPipe checks it the same way and
    replaces it."""
    if sp_size == 1:
        return None
    from accelerate.utils import DeepSpeedSequenceParallelConfig, ParallelismConfig

    sp_handler = DeepSpeedSequenceParallelConfig(sp_attn_implementation="sdpa")
    # accelerate 1.x accepts only sdpa, flash_attention_2/3 and hub flash kernels here; a name registered
    # with register_own_eager_attention (GPT-OSS on CPU) is set after that check
    sp_handler.sp_attn_implementation = attn_implementation
    return ParallelismConfig(sp_backend="deepspeed", sp_size=sp_size, sp_handler=sp_handler)


def register_own_eager_attention(model_path: str, name: str) -> None:
    """Register the eager attention of the checkpoint's model type (``eager_attention_forward`` of its
    transformers modeling file) in transformers' attention registry under ``name``, with eager's mask
    (without a mask function of its own name transformers builds no mask at all).  For a model without
    sdpa support (GPT-OSS: its eager applies the attention sinks) on CPU: accelerate refuses
    ``sp_attn_implementation="eager"`` under sequence parallelism, a registered name it accepts."""
    import importlib

    from transformers import AttentionInterface, AttentionMaskInterface, AutoConfig
    from transformers.masking_utils import eager_mask

    model_type = AutoConfig.from_pretrained(model_path).model_type
    modeling = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    AttentionInterface.register(name, modeling.eager_attention_forward)
    AttentionMaskInterface.register(name, eager_mask)


def stage_runs_per_rank(train_stages: int, all_stages: int) -> dict[str, list[int]]:
    """Every rank's UPipe stage count in training and in evaluation (a collective: all ranks call it)."""
    gathered: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, [train_stages, all_stages - train_stages])
    return {"stage_runs_train": [s[0] for s in gathered], "stage_runs_eval": [s[1] for s in gathered]}


def report_metrics(result: dict[str, Any], path: str | None, main_process: bool) -> None:
    """The main process prints the run's metrics as one JSON line and, given a path, writes them there."""
    if not main_process:
        return
    print(json.dumps(result))
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)


def watch_long_context(model: torch.nn.Module) -> Callable[[], dict[str, Any] | None]:
    """Record the logits of the model's outputs with a loss; the returned function reports the
    long-context stack (None without it) and ``"logits": None`` when no such output had logits
    (the tiled loss) or ``"full"`` otherwise."""
    full: list[bool] = []

    def hook(module: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if getattr(output, "loss", None) is not None:
            full.append(output.logits is not None)

    model.register_forward_hook(hook, with_kwargs=True)

    def report() -> dict[str, Any] | None:
        from hf_patches import long_context_stack

        stack = long_context_stack(model)
        if stack is None:
            return None
        parts = {k: getattr(stack, k) for k in ("tiled_loss", "tiled_norm", "tiled_mlp")}
        return {**parts, "logits": "full" if any(full) or not full else None}

    return report


class RandomTokens(torch.utils.data.Dataset):
    """Random token sequences; labels = input_ids (the model shifts them), global position_ids."""

    def __init__(self, num_samples: int, seq_len: int, vocab_size: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab_size, (num_samples, seq_len), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.ids[i]
        return {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.arange(len(ids))}


class RandomDocuments(torch.utils.data.Dataset):
    """Random-token documents of random lengths (1 to ``max_len`` tokens), for packing: the collator
    (``PackedRows``) puts several into one row and numbers their positions."""

    def __init__(self, num_docs: int, max_len: int, vocab_size: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        lengths = torch.randint(1, max_len + 1, (num_docs,), generator=g).tolist()
        self.docs = [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in lengths]

    def __len__(self) -> int:
        return len(self.docs)

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        return {"input_ids": self.docs[i], "labels": list(self.docs[i])}


class PackedRows:
    """transformers' ``DataCollatorWithFlattening`` (a batch of documents -> one row, position_ids
    restarting at each document, -100 at each document's first label), then padded at the end to
    ``seq_len`` tokens (ignored labels, positions counting on).  A fixed row length keeps every row a
    multiple of the sequence-parallel size, as DeepSpeed's ``UlyssesSPDataLoaderAdapter`` needs (and
    equally long on every rank, as its all_gather needs on gloo)."""

    def __init__(self, seq_len: int) -> None:
        from transformers import DataCollatorWithFlattening

        self.flatten = DataCollatorWithFlattening()
        self.seq_len = seq_len

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        batch = self.flatten(features)
        pad = self.seq_len - batch["input_ids"].shape[1]
        if pad < 0:
            raise ValueError(
                f"{len(features)} documents of {batch['input_ids'].shape[1]} tokens exceed seq_len={self.seq_len}"
            )
        tail = batch["position_ids"][:, -1:] + torch.arange(1, pad + 1)
        return {
            "input_ids": torch.nn.functional.pad(batch["input_ids"], (0, pad), value=0),
            "labels": torch.nn.functional.pad(batch["labels"], (0, pad), value=-100),
            "position_ids": torch.cat([batch["position_ids"], tail], dim=1),
        }
