"""The causal-LM loss across sequence-parallel ranks.

Each rank holds the logits of its shard and the matching ``shift_labels``.  The loss is the
token-weighted mean over all ranks: sum of every rank's token losses / number of non-ignored
tokens in the whole sequence, which is exactly the unsharded model's mean loss.  Its value is the
same on every rank.

Its gradient on a rank covers only that rank's tokens (the attention all-to-alls carry the
cross-rank terms), scaled for how the caller combines parameter gradients over the ranks:
``grad_reduction="mean"`` (DeepSpeed ZeRO-3 with its default reduce-scatter, DDP, and the
ALST / HF Trainer loss, which all average over the sequence-parallel ranks) multiplies by the group
size; ``"sum"`` does not.  Either way the combined gradient equals the unsharded one.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from .data import IGNORE_INDEX


def sequence_parallel_loss(
    logits: Tensor,
    shift_labels: Tensor,
    group: dist.ProcessGroup | None,
    *,
    grad_reduction: Literal["mean", "sum"] = "mean",
    ignore_index: int = IGNORE_INDEX,
) -> Tensor:
    """Token-weighted mean cross-entropy over all ranks of ``group``.

    Args:
        logits: this rank's [batch, local_seq, vocab] logits.
        shift_labels: this rank's [batch, local_seq] next-token labels (``shard_batch`` makes them).
        group: the sequence-parallel group.
        grad_reduction: how parameter gradients are combined over the ranks afterwards.
    """
    if grad_reduction not in ("mean", "sum"):
        raise ValueError(f"grad_reduction must be 'mean' or 'sum', got {grad_reduction!r}")
    if logits.shape[:-1] != shift_labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and shift_labels {tuple(shift_labels.shape)} do not match")
    # like transformers' ForCausalLMLoss: 16-bit logits are upcast; float32/float64 stay as they are
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    labels = shift_labels.to(logits.device).reshape(-1)
    local_sum = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels, ignore_index=ignore_index, reduction="sum"
    )
    stats = torch.stack([local_sum.detach().double(), (labels != ignore_index).sum().double()])
    size = 1
    if dist.is_initialized():
        size = dist.get_world_size(group)
        if size > 1:
            dist.all_reduce(stats, group=group)
    total = stats[1].clamp_min(1.0)
    value = (stats[0] / total).to(local_sum.dtype)
    scale = size if grad_reduction == "mean" else 1
    local = local_sum * (scale / total.item())
    return value + (local - local.detach())  # value of the global mean, gradient of the local part
