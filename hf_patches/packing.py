"""Packed rows under DeepSpeed ALST (``"upipe": {"enabled": false}``): per-document core attention.

ALST gathers the global ``position_ids`` and hands them to the core attention function with the
gathered sequence of its local heads, but drops the attention mask.  transformers' flash-attention
functions detect packed rows from those positions (varlen); its ``sdpa`` function does not, so under
ALST with SDPA the documents of a packed row attend to each other.  ``per_document_attention`` wraps
a core function so that it runs once per document (the boundaries from the positions, transformers'
rule, as UPipe uses them), which makes ALST + SDPA exact on packed rows and keeps UPipe-vs-ALST
comparisons fair.  Rows without a restart take the core function unchanged.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from ds_upipe.packing import documents_from_positions


def per_document_attention(core: Callable[..., tuple[Tensor, Any]]) -> Callable[..., tuple[Tensor, Any]]:
    """A transformers attention function (``[b, h, S, d]`` q/k/v in, ``[b, S, h, d]`` out) that calls
    ``core`` per document when ``position_ids`` covering the sequence restart and no mask is given."""

    @functools.wraps(core)
    def attention(
        module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Any, *args: Any, **kwargs: Any
    ) -> tuple[Tensor, Any]:
        pos = kwargs.get("position_ids")
        if attention_mask is not None or pos is None or pos.shape[-1] != query.shape[2]:
            return core(module, query, key, value, attention_mask, *args, **kwargs)
        pos = pos.reshape(-1, pos.shape[-1]).expand(query.shape[0], -1)
        documents = documents_from_positions(pos)
        if documents is None:
            return core(module, query, key, value, attention_mask, *args, **kwargs)
        rest = {k: v for k, v in kwargs.items() if k != "position_ids"}
        rows = []
        for r, cu in enumerate(documents.for_batch(query.shape[0])):
            parts = [
                core(module, *(t[r : r + 1, :, s:e] for t in (query, key, value)), None, *args, **rest)[0]
                for s, e in zip(cu, cu[1:])
            ]
            rows.append(torch.cat(parts, dim=1))  # [1, S, h, d]
        return torch.cat(rows), None

    attention.upipe_per_document = True  # type: ignore[attr-defined]
    return attention
