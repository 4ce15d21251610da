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

``tiled_sequence_parallel_loss`` is the same loss from the last hidden state instead of the logits:
the lm_head projection and the cross-entropy run in sequence tiles (``hf_patches.tiling``), so the
full logits never exist.  ``tiled_causal_lm_loss`` is transformers' per-rank ``ForCausalLMLoss``
computed the same way (what the HF Trainer / accelerate sequence-parallel path combines over ranks).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from .architectures import _unwrap
from .data import IGNORE_INDEX
from .tiling import tiled_loss_sum


def _check_grad_reduction(grad_reduction: str) -> None:
    if grad_reduction not in ("mean", "sum"):
        raise ValueError(f"grad_reduction must be 'mean' or 'sum', got {grad_reduction!r}")


def _combine(
    local_sum: Tensor, labels: Tensor, group: dist.ProcessGroup | None, grad_reduction: str, ignore_index: int
) -> Tensor:
    """The global token-weighted mean from this rank's loss sum: its value on every rank, the
    gradient of this rank's part scaled for ``grad_reduction``."""
    stats = torch.stack([local_sum.detach().double(), (labels != ignore_index).sum().double()])
    size = 1
    if dist.is_initialized():
        size = dist.get_world_size(group)
        if size > 1:
            dist.all_reduce(stats, group=group)
    total = stats[1].clamp_min(1.0)
    value = (stats[0] / total).to(local_sum.dtype)
    scale = size if grad_reduction == "mean" else 1
    # a tensor, not .item(): no host sync on the GPU, and the fake-tensor planner can run it
    local = local_sum * (scale / total).to(local_sum.dtype)
    return value + (local - local.detach())  # value of the global mean, gradient of the local part


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
    _check_grad_reduction(grad_reduction)
    if logits.shape[:-1] != shift_labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and shift_labels {tuple(shift_labels.shape)} do not match")
    # like transformers' ForCausalLMLoss: 16-bit logits are upcast; float32/float64 stay as they are
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    labels = shift_labels.to(logits.device).reshape(-1)
    local_sum = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels, ignore_index=ignore_index, reduction="sum"
    )
    return _combine(local_sum, labels, group, grad_reduction, ignore_index)


def _lm_head_and_shared(model: nn.Module) -> tuple[nn.Module, tuple[nn.Parameter, ...]]:
    """The causal LM's output projection and its parameters that the input embedding shares."""
    hf_model = _unwrap(model)
    get_head = getattr(hf_model, "get_output_embeddings", None)
    lm_head = get_head() if callable(get_head) else None
    if lm_head is None:
        raise ValueError(
            f"{type(hf_model).__name__} has no lm_head (get_output_embeddings() is None): the tiled loss needs a "
            "causal LM (e.g. LlamaForCausalLM), not a base model"
        )
    get_embed = getattr(hf_model, "get_input_embeddings", None)
    embed = get_embed() if callable(get_embed) else None
    embed_ids = {id(p) for p in embed.parameters()} if embed is not None else set()
    return lm_head, tuple(p for p in lm_head.parameters() if id(p) in embed_ids)


def _tile_tokens(tile_tokens: int | None) -> int | None:
    """The tile size as given (validated), or None: the shared default rule (``tiling.default_tile_tokens``),
    applied to the shard in ``tiled_loss_sum``.  The caller passes it (the long-context stack its own
    setting): the loss never looks it up on the model."""
    if tile_tokens is None:
        return None
    if not isinstance(tile_tokens, int) or isinstance(tile_tokens, bool) or tile_tokens < 1:
        raise ValueError(f"loss tile_tokens must be a positive int, got {tile_tokens!r}")
    return tile_tokens


def _local_tiled_sum(
    model: nn.Module, hidden: Tensor, shift_labels: Tensor, tile_tokens: int | None, ignore_index: int
) -> Tensor:
    if hidden.shape[:-1] != shift_labels.shape or hidden.dim() != 3:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} must be [batch, seq, hidden], matching "
            f"shift_labels {tuple(shift_labels.shape)}"
        )
    lm_head, shared = _lm_head_and_shared(model)
    tokens = _tile_tokens(tile_tokens)
    return tiled_loss_sum(
        lm_head, hidden, shift_labels, tile_tokens=tokens, ignore_index=ignore_index, shared_params=shared
    )


def tiled_sequence_parallel_loss(
    model: nn.Module,
    hidden: Tensor,
    shift_labels: Tensor,
    group: dist.ProcessGroup | None,
    *,
    grad_reduction: Literal["mean", "sum"] = "mean",
    ignore_index: int = IGNORE_INDEX,
    tile_tokens: int | None = None,
) -> Tensor:
    """``sequence_parallel_loss(model.lm_head(hidden), shift_labels, group)`` without the full logits.

    Args:
        model: the causal LM (also wrapped by a DeepSpeed engine or PEFT); its output embedding
            (``get_output_embeddings()``, the lm_head) is applied per tile.
        hidden: this rank's [batch, local_seq, hidden] last hidden state (after the final norm).
        shift_labels, group, grad_reduction, ignore_index: as ``sequence_parallel_loss``.
        tile_tokens: tokens per tile (batch rows x sequence positions); None: ``tiling.default_tile_tokens``
            of the shard (at least 8 tiles, at most about 1 GiB of float32 logits per tile).  The
            long-context stack's forward passes its own ``loss_tile_tokens``.
    Every rank of ``group`` must call it (one all_reduce of two numbers, plus under ZeRO-3 one
    all_gather of the token counts).  Same value and gradients as ``sequence_parallel_loss``.
    """
    _check_grad_reduction(grad_reduction)
    local_sum = _local_tiled_sum(model, hidden, shift_labels, tile_tokens, ignore_index)
    return _combine(local_sum, shift_labels.to(hidden.device).reshape(-1), group, grad_reduction, ignore_index)


def tiled_causal_lm_loss(
    model: nn.Module,
    hidden: Tensor,
    shift_labels: Tensor,
    *,
    num_items_in_batch: Tensor | int | None = None,
    ignore_index: int = IGNORE_INDEX,
    tile_tokens: int | None = None,
) -> Tensor:
    """transformers' ``ForCausalLMLoss`` of this rank's tokens without the full logits: the sum of
    the token losses divided by ``num_items_in_batch`` when given, else their mean over the
    non-ignored tokens (no collective besides ZeRO-3's tile agreement)."""
    local_sum = _local_tiled_sum(model, hidden, shift_labels, tile_tokens, ignore_index)
    if num_items_in_batch is None:
        return local_sum / (shift_labels != ignore_index).sum().to(local_sum.device)
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(local_sum.device)
    return local_sum / num_items_in_batch
