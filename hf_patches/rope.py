"""RoPE frequencies chosen from the whole sequence, cos/sin computed for the local shard.

transformers' ``dynamic_rope_update`` picks a rotary embedding's frequencies from
``max(position_ids) + 1`` of the positions it is given (dynamic NTK: rescaled beyond
``max_position_embeddings``; longrope: the long factors beyond ``original_max_position_embeddings``).
Under sequence parallelism each rank holds only its shard's positions, so ranks whose shard stays
below the threshold would pick other frequencies than the single-process model.  The patched rotary
embedding's forward appends the global last position (found by the model-level input check, the
same on every rank) to the local positions, so the frequency update sees the whole sequence's
length, and drops that extra position from cos/sin.  This is independent of the RoPE type: static
types (default, linear, yarn, llama3) ignore the extra position, and any data-dependent update reads
the same global length on every rank, so its state evolves as in the single-process model.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import Tensor, nn

_LAST_POSITION = "_upipe_last_position"


def use_global_positions(base: nn.Module) -> None:
    """Make the base model's rotary embedding choose its frequencies from the global sequence."""
    rotary = _rotary(base)
    setattr(rotary, _LAST_POSITION, None)
    rotary.forward = types.MethodType(_global_rope_forward, rotary)


def set_last_position(base: nn.Module, last_position: Tensor) -> None:
    """The largest position of the whole sequence (all ranks), a 0-dim tensor, for the next forward (nothing
    for models without RoPE, e.g. Nemotron-H, as ``apply_upipe`` patches none)."""
    rotary = rotary_embedding(base)
    if rotary is not None:
        setattr(rotary, _LAST_POSITION, last_position)


#: the base model's attribute holding its rotary embedding (LFM2-MoE names it ``pos_emb``)
ROTARY_ATTRIBUTES = ("rotary_emb", "pos_emb")


def rotary_embedding(base: nn.Module) -> nn.Module | None:
    """The base model's rotary embedding module (None: the model has none)."""
    for name in ROTARY_ATTRIBUTES:
        rotary = getattr(base, name, None)
        if isinstance(rotary, nn.Module):
            return rotary
    return None


def _rotary(base: nn.Module) -> nn.Module:
    rotary = rotary_embedding(base)
    if rotary is None:
        raise ValueError(
            f"{type(base).__name__} has no rotary embedding module ({' or '.join(ROTARY_ATTRIBUTES)}); UPipe patches "
            "Llama-family RoPE models"
        )
    return rotary


def _global_rope_forward(self: nn.Module, x: Tensor, position_ids: Tensor, *args: Any, **kwargs: Any):
    last = getattr(self, _LAST_POSITION, None)
    setattr(self, _LAST_POSITION, None)  # one forward's value: never reused by a later call
    if last is None:  # called outside the patched model's forward: the positions are all there is
        return type(self).forward(self, x, position_ids, *args, **kwargs)
    extra = last.to(device=position_ids.device, dtype=position_ids.dtype).expand(*position_ids.shape[:-1], 1)
    out = type(self).forward(self, x, torch.cat([position_ids, extra], dim=-1), *args, **kwargs)
    if isinstance(out, Tensor):  # DeepSeek-V2's complex freqs_cis ([b, s, d / 2]) in place of (cos, sin)
        return out[..., :-1, :].contiguous()
    cos, sin = out
    return cos[..., :-1, :].contiguous(), sin[..., :-1, :].contiguous()
