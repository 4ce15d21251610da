"""Shared by the Trainer and accelerate examples: a tiny Llama config (ds_upipe.tools.models), random-token
data that need no download, and the metrics report.  (Imported by path: the examples' own folder is on
sys.path when they run.)"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import LlamaConfig


def tiny_llama_config(seq_len: int) -> LlamaConfig:
    from ds_upipe.tools.models import tiny_config

    return tiny_config(max_position_embeddings=seq_len)


def report_metrics(result: dict[str, Any], path: str | None, main_process: bool) -> None:
    """The main process prints the run's metrics as one JSON line and, given a path, writes them there."""
    if not main_process:
        return
    print(json.dumps(result))
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)


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
