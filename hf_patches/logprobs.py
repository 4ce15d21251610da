"""Per-token and per-sequence log-probabilities of completion tokens from sequence shards.

Preference and RL losses (DPO, GRPO, ``hf_patches.rl_loss``) score whole sequences: a row's summed
log-probability of its completion tokens, its number of completion tokens.  Under UPipe each rank
holds S/C tokens of every row with the pre-shifted labels of its shard (``shard_batch``: labels shifted
in sequence order before sharding, -100 where a token is not scored: prompt, padding).  So each rank
computes its shard's per-token log-probs and per-row partial sums, and one all_reduce over the
sequence-parallel group gives every rank the whole rows' sums.

Gradients: ``group_sum`` is torch.distributed.nn's differentiable all_reduce, whose backward sums the
ranks' gradients as well.  Every rank computes the same loss from the group sums, so each rank's
tokens get the gradient of the C identical losses, C x the non-SP gradient: parameter gradients
*averaged* over the ranks (DeepSpeed ZeRO, DDP, the HF Trainer: ``grad_reduction="mean"``) equal the
non-SP ones; ``scale_for_grad_reduction(loss, group, "sum")`` divides the gradient by C for callers that
sum.  Why not the value-of-the-sum, gradient-of-the-local-part trick of ``loss.py``: a loss may reduce
twice in a row (GRPO's sequence-level importance weight is a group mean inside a group sum), and the
inner reduction's gradient then has a term from every rank's tokens, which only a backward all_reduce
collects.  It costs one all_reduce of [batch] numbers per reduction in backward.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from .architectures import _unwrap
from .data import IGNORE_INDEX
from .loss import _check_grad_reduction, _lm_head_and_shared
from .tiling import (
    TiledPerToken,
    _grad_input,
    _MarkGradReady,
    _no_grad_detached,
    default_tile_tokens,
    exact_chunk_tiles,
    loss_tile_bound,
    token_counts,
)


def group_size(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def group_sum(values: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """The sum of every rank's ``values`` (same shape on every rank), on every rank; differentiable
    (backward: the ranks' gradients summed, module docstring)."""
    if group_size(group) == 1:
        return values
    from torch.distributed.nn.functional import all_reduce

    return all_reduce(values, group=group)


def group_count(mask: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """Per-row count of ``mask`` [batch, local_seq] over the group's shards (int64, no gradient)."""
    counts = mask.sum(dim=1, dtype=torch.int64)
    if group_size(group) > 1:
        dist.all_reduce(counts, group=group)
    return counts


def scale_for_grad_reduction(loss: Tensor, group: dist.ProcessGroup | None, grad_reduction: str) -> Tensor:
    """``loss`` (built from ``group_sum``s) with its gradient made right for how parameter gradients are
    combined over the ranks: as is for "mean" (averaged), divided by the group size for "sum"."""
    _check_grad_reduction(grad_reduction)
    size = group_size(group)
    if grad_reduction == "mean" or size == 1:
        return loss
    return loss.detach() + (loss - loss.detach()) / size


def token_logprobs(
    logits: Tensor, shift_labels: Tensor, *, temperature: float = 1.0, ignore_index: int = IGNORE_INDEX
) -> Tensor:
    """log p(label) of each token, [batch, local_seq], 0 where the label is ``ignore_index``, from the
    shard's [batch, local_seq, vocab] logits divided by ``temperature`` (16-bit logits upcast to float32,
    as TRL's fused LM head and the loss do)."""
    if logits.shape[:-1] != shift_labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and shift_labels {tuple(shift_labels.shape)} do not match")
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    labels = shift_labels.to(logits.device)
    nll = F.cross_entropy(logits.flatten(0, 1), labels.reshape(-1), ignore_index=ignore_index, reduction="none")
    return -nll.view(labels.shape)


def model_token_logprobs(
    model: nn.Module,
    shard: dict[str, Any],
    *,
    temperature: float = 1.0,
    tile_tokens: int | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> Tensor:
    """``token_logprobs`` of a causal LM on this rank's shard without the shard's full logits: the base
    model runs on the shard (``input_ids``, ``position_ids``, and ``attention_mask`` when given), then
    the lm_head and the log-softmax run in token tiles, each recomputed in backward (``TiledPerToken``;
    only one tile's [tokens, vocab] logits exist at a time).

    Args:
        model: the causal LM (also wrapped by a DeepSpeed engine or PEFT), patched by ``apply_upipe``
            (or not, for the one-process run: then ``shard`` is the whole batch).
        shard: ``shard_batch``'s output (or ``rl_loss.shard_completions``'): needs ``shift_labels``.
        tile_tokens: tokens per tile; None: ``tiling.default_tile_tokens`` (at least 8 tiles, at most
            about 1 GiB of float32 logits per tile); under ZeRO-3 the ranks agree on the tile count.
    """
    hf_model = _unwrap(model)
    lm_head, shared = _lm_head_and_shared(model)
    base = getattr(hf_model, "base_model", None)
    if base is None or base is hf_model:
        raise ValueError(f"{type(hf_model).__name__} has no base model under its lm_head (a causal LM is needed)")
    labels = shard["shift_labels"]
    inputs = {k: shard[k] for k in ("input_ids", "position_ids", "attention_mask") if shard.get(k) is not None}
    hidden = base(**inputs, use_cache=False).last_hidden_state
    batch, seq, width = hidden.shape
    if labels.shape != (batch, seq):
        raise ValueError(f"shift_labels {tuple(labels.shape)} must be [batch, seq] of the shard {(batch, seq)}")

    params = list(lm_head.parameters())
    flat = hidden.reshape(1, batch * seq, width)  # tiles of tokens, equal in forward and backward
    # a tied lm_head / embedding weight waits for the embedding's gradient too (as in tiled_loss_sum)
    shared_ready = tuple(p for p in shared if p.requires_grad) if flat.requires_grad else ()

    def logprobs(h: Tensor, lab: Tensor) -> Tensor:
        if torch.is_grad_enabled():  # the backward's recompute: a tied weight is not ready yet (tiling.py)
            for param in shared_ready:
                param.ds_grad_is_ready = False
        return token_logprobs(lm_head(h), lab, temperature=temperature, ignore_index=ignore_index)

    counts = token_counts(batch * seq, params, hidden.device)
    if tile_tokens is None:
        vocab = getattr(lm_head, "out_features", None) or lm_head.weight.shape[0]
        tile_tokens = default_tile_tokens(max(counts), loss_tile_bound(vocab))
    tiles = exact_chunk_tiles(counts, tile_tokens)
    if tiles <= 1:
        return token_logprobs(lm_head(hidden), labels, temperature=temperature, ignore_index=ignore_index)
    flat = _grad_input(flat, params)
    if shared_ready and torch.is_grad_enabled():
        flat = _MarkGradReady.apply(flat, shared_ready)
    out = TiledPerToken.apply(
        _no_grad_detached(logprobs), flat, tiles, params, labels.to(hidden.device).reshape(1, batch * seq)
    )
    return out.view(batch, seq)


def sequence_logprobs(
    token_logps: Tensor, shift_labels: Tensor, group: dist.ProcessGroup | None, *, ignore_index: int = IGNORE_INDEX
) -> tuple[Tensor, Tensor]:
    """(every row's summed log-prob of its scored tokens [batch], their count [batch]) over the whole
    rows, from this rank's [batch, local_seq] ``token_logps`` (0 where not scored) and shift_labels; the
    same on every rank (every rank of ``group`` must call it).  The sums are differentiable
    (``group_sum``)."""
    mask = shift_labels.to(token_logps.device) != ignore_index
    sums = group_sum((token_logps * mask).sum(dim=1), group)
    return sums, group_count(mask, group)


GradReduction = Literal["mean", "sum"]
