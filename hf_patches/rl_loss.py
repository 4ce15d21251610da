"""DPO and GRPO losses under UPipe sequence parallelism, equal to TRL's non-SP definitions.

TRL's DPOTrainer and GRPOTrainer compute their losses from whole sequences, which a rank's shard is
not; ds_upipe refuses them under SP (``integration.trainer_sp``) and offers these functions for a
training loop (or a small Trainer subclass) instead.  What is per token and what is per sequence:

- per token, on each rank's own tokens: log-probs (``logprobs.model_token_logprobs``), GRPO's ratio
  exp(logp - old_logp), its clipped surrogate, the k3 KL estimate against the reference;
- per sequence, summed over the group (``logprobs.group_sum``): DPO's summed log-probs of the chosen and
  rejected completions (and the reference's), GRPO's per-row token-loss sums and token counts (loss
  "grpo"), the batch's token-loss sum and count ("bnpo", "dapo", "dr_grpo"), the sequence-level
  importance weight.  Everything after the group sums is computed alike on every rank.

Batches: TRL's preference collator gives [chosen rows; rejected rows] with a ``completion_mask``;
GRPO has a left-padded prompt and a right-padded completion, which ``completion_rows`` turns into
right-padded rows (UPipe refuses left padding; RoPE depends only on relative positions, so the scores
are the same).  ``shard_completions`` makes the labels (the completion tokens, -100 elsewhere) and
shards them like any batch (shifted in sequence order, then cut).  Generation (GRPO) runs without
sequence parallelism: on an unpatched copy of the weights or a generation backend (a patched model's
``generate`` is refused).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from .data import IGNORE_INDEX, shard_batch
from .logprobs import (
    GradReduction,
    group_count,
    group_sum,
    model_token_logprobs,
    scale_for_grad_reduction,
    sequence_logprobs,
)

DPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo")
GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")


def completion_labels(input_ids: Tensor, completion_mask: Tensor, attention_mask: Tensor | None = None) -> Tensor:
    """The tokens scored: ``input_ids`` where ``completion_mask`` (and ``attention_mask``) is 1, -100 elsewhere."""
    keep = completion_mask != 0
    if attention_mask is not None:
        keep = keep & (attention_mask != 0)
    return input_ids.masked_fill(~keep, IGNORE_INDEX)


def shard_completions(
    batch: dict[str, Any], group: dist.ProcessGroup | None, *, pad_token_id: int = 0, ring_size: int = 1
) -> dict[str, Any]:
    """This rank's shard of a batch with ``input_ids`` and ``completion_mask`` [batch, seq] (right
    padded; ``attention_mask`` optional): input_ids, position_ids and shift_labels of the completion
    tokens (``shard_batch``), attention_mask when given."""
    for key in ("input_ids", "completion_mask"):
        if key not in batch:
            raise ValueError(f"the batch needs {key} (got keys {sorted(batch)})")
    mask = batch.get("attention_mask")
    labels = completion_labels(batch["input_ids"], batch["completion_mask"], mask)
    keep = {"input_ids": batch["input_ids"], "labels": labels}
    if mask is not None:
        keep["attention_mask"] = mask
    if batch.get("position_ids") is not None:
        keep["position_ids"] = batch["position_ids"]
    return shard_batch(keep, group, pad_token_id=pad_token_id, ring_size=ring_size)


def completion_rows(
    prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor, completion_mask: Tensor, *, pad_token_id: int = 0
) -> dict[str, Tensor]:
    """GRPO's (left-padded prompt, right-padded completion) as right-padded rows: each row is its real
    prompt tokens then its completion tokens up to the end of its completion mask (TRL's mask is 0 after
    the EOS); returns input_ids, attention_mask and completion_mask [batch, longest row]."""
    rows, masks = [], []
    for p_ids, p_mask, c_ids, c_mask in zip(prompt_ids, prompt_mask, completion_ids, completion_mask):
        prompt = p_ids[p_mask.bool()]
        kept = int(c_mask.nonzero().max()) + 1 if bool(c_mask.any()) else 0
        rows.append(torch.cat([prompt, c_ids[:kept]]))
        masks.append(torch.cat([torch.zeros_like(prompt), c_mask[:kept].to(prompt.dtype)]))
    length = max(len(r) for r in rows)
    input_ids = prompt_ids.new_full((len(rows), length), pad_token_id)
    attention = torch.zeros_like(input_ids)
    completion = torch.zeros_like(input_ids)
    for i, (row, mask) in enumerate(zip(rows, masks)):
        input_ids[i, : len(row)] = row
        attention[i, : len(row)] = 1
        completion[i, : len(row)] = mask
    return {"input_ids": input_ids, "attention_mask": attention, "completion_mask": completion}


def completion_logps(
    model: nn.Module, shard: dict[str, Any], group: dist.ProcessGroup | None, *, tile_tokens: int | None = None
) -> tuple[Tensor, Tensor]:
    """(every row's summed log-prob of its completion tokens [batch], their count [batch]) of ``model``
    on this rank's shard (``shard_completions``), over the whole rows: the same on every rank (one
    all_reduce; run it under ``torch.no_grad()`` for a reference or to precompute)."""
    return sequence_logprobs(model_token_logprobs(model, shard, tile_tokens=tile_tokens), shard["shift_labels"], group)


# ---------------------------------------------------------------------------------------------------
# DPO


@dataclass
class DPOOutput:
    """``sequence_parallel_dpo_loss``'s result; the same on every rank of the group."""

    loss: Tensor
    chosen_logps: Tensor  # [pairs], summed over each chosen completion
    rejected_logps: Tensor
    ref_chosen_logps: Tensor
    ref_rejected_logps: Tensor

    @property
    def chosen_logratios(self) -> Tensor:
        """log pi(chosen) - log pi_ref(chosen) per pair, detached (TRL's ``rewards/chosen`` is beta times it)."""
        return (self.chosen_logps - self.ref_chosen_logps).detach()

    @property
    def rejected_logratios(self) -> Tensor:
        return (self.rejected_logps - self.ref_rejected_logps).detach()


def dpo_loss(
    chosen_logps: Tensor,
    rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    *,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    chosen_tokens: Tensor | None = None,
    rejected_tokens: Tensor | None = None,
) -> Tensor:
    """TRL's DPO loss (``DPOTrainer._compute_loss`` with ``f_divergence_type="reverse_kl"``, no
    ``ld_alpha``, no weighting) from whole sequences' summed log-probs, mean over the pairs:
    "sigmoid" -logsigmoid(beta * delta), "hinge" relu(1 - beta * delta), "ipo" ((the log-ratios per
    completion token) difference - 1 / (2 beta))^2 (needs ``chosen_tokens`` / ``rejected_tokens``)."""
    chosen_logratios = chosen_logps - ref_chosen_logps
    rejected_logratios = rejected_logps - ref_rejected_logps
    delta = chosen_logratios - rejected_logratios
    if loss_type == "sigmoid":
        per_pair = -F.logsigmoid(beta * delta)
    elif loss_type == "hinge":
        per_pair = torch.relu(1 - beta * delta)
    elif loss_type == "ipo":
        if chosen_tokens is None or rejected_tokens is None:
            raise ValueError("loss_type='ipo' needs chosen_tokens and rejected_tokens (completion token counts)")
        chosen_avg = chosen_logratios / chosen_tokens.clamp(min=1).to(delta.dtype)
        rejected_avg = rejected_logratios / rejected_tokens.clamp(min=1).to(delta.dtype)
        per_pair = (chosen_avg - rejected_avg - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"DPO loss_type={loss_type!r} is not supported under sequence parallelism: {DPO_LOSS_TYPES}")
    return per_pair.mean()


def sequence_parallel_dpo_loss(
    model: nn.Module,
    shard: dict[str, Any],
    group: dist.ProcessGroup | None,
    *,
    ref_model: nn.Module | None = None,
    ref_logps: tuple[Tensor, Tensor] | None = None,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    grad_reduction: GradReduction = "mean",
    tile_tokens: int | None = None,
) -> DPOOutput:
    """DPO on this rank's shard of a preference batch (rows [chosen; rejected], ``shard_completions``).

    The policy's per-row summed completion log-probs come from the shards (``model_token_logprobs``,
    ``sequence_logprobs``: one all_reduce); the reference's the same way from ``ref_model`` (a frozen
    copy patched alike, e.g. ``copy.deepcopy`` of the patched policy before training) without grad, or
    given as ``ref_logps`` = (ref_chosen_logps, ref_rejected_logps) [pairs] (precomputed).  Every rank
    of ``group`` must call it; the loss is the same on every rank, its gradients are those of TRL's
    loss on the whole rows once the parameter gradients are combined over the ranks per
    ``grad_reduction`` ("mean": averaged, as DeepSpeed and the HF Trainer do; "sum": summed)."""
    if (ref_model is None) == (ref_logps is None):
        raise ValueError("pass exactly one of ref_model (a frozen reference) and ref_logps (precomputed)")
    labels = shard["shift_labels"]
    if labels.shape[0] % 2:
        raise ValueError(f"a preference batch has [chosen; rejected] rows, an even number; got {labels.shape[0]}")
    logps, tokens = completion_logps(model, shard, group, tile_tokens=tile_tokens)
    if ref_model is not None:
        with torch.no_grad():
            ref_chosen, ref_rejected = completion_logps(ref_model, shard, group, tile_tokens=tile_tokens)[0].chunk(2)
    else:
        ref_chosen, ref_rejected = (t.to(logps) for t in ref_logps)
    chosen, rejected = logps.chunk(2)
    chosen_tokens, rejected_tokens = tokens.chunk(2)
    loss = dpo_loss(
        chosen,
        rejected,
        ref_chosen,
        ref_rejected,
        beta=beta,
        loss_type=loss_type,
        chosen_tokens=chosen_tokens,
        rejected_tokens=rejected_tokens,
    )
    loss = scale_for_grad_reduction(loss, group, grad_reduction)
    return DPOOutput(loss, chosen, rejected, ref_chosen, ref_rejected)


# ---------------------------------------------------------------------------------------------------
# GRPO


def sequence_parallel_grpo_loss(
    token_logps: Tensor,
    shift_labels: Tensor,
    advantages: Tensor,
    group: dist.ProcessGroup | None,
    *,
    old_token_logps: Tensor | None = None,
    ref_token_logps: Tensor | None = None,
    beta: float = 0.0,
    epsilon_low: float = 0.2,
    epsilon_high: float | None = None,
    delta: float | None = None,
    loss_type: str = "dapo",
    importance_sampling_level: str = "token",
    max_completion_length: int | None = None,
    num_items_in_batch: Tensor | float | None = None,
    grad_reduction: GradReduction = "mean",
) -> Tensor:
    """TRL's GRPO loss (``GRPOTrainer._compute_loss`` for one micro-batch without accumulation: the
    clipped importance-weighted surrogate, optional k3 KL to the reference) from this rank's shard.

    Args:
        token_logps: the policy's per-token log-probs of this shard [batch, local_seq]
            (``model_token_logprobs`` on ``shard_completions``' shard), with grad.
        shift_labels: the shard's labels; the scored tokens (TRL's completion mask) are those != -100.
        advantages: one per row [batch] (or per token [batch, local_seq], in the shard's layout).
        old_token_logps: the sampling policy's log-probs (shard layout); None: ``token_logps`` detached
            (ratio 1, TRL's case with one iteration per generation).
        ref_token_logps: the reference's log-probs (needed when ``beta`` != 0).
        epsilon_low, epsilon_high, delta, beta, importance_sampling_level ("token" / "sequence"): TRL's.
        loss_type: the normalisation, as TRL's: "grpo" mean over rows of each row's token mean, "bnpo"
            token mean over the batch, "dr_grpo" token sum / (rows x ``max_completion_length``), "dapo"
            token sum / ``num_items_in_batch`` (TRL: the scored tokens of the generation batch over all
            processes / the number of processes; default: this batch's scored tokens, as "bnpo").
    Every rank of ``group`` must call it; the loss is the same on every rank.
    """
    if loss_type not in GRPO_LOSS_TYPES:
        raise ValueError(f"GRPO loss_type={loss_type!r} is not supported under sequence parallelism: {GRPO_LOSS_TYPES}")
    if importance_sampling_level not in ("token", "sequence"):
        raise ValueError(f"importance_sampling_level must be 'token' or 'sequence', got {importance_sampling_level!r}")
    if beta != 0.0 and ref_token_logps is None:
        raise ValueError(f"beta={beta} needs ref_token_logps (the reference model's per-token log-probs)")
    epsilon_high = epsilon_low if epsilon_high is None else epsilon_high
    mask = (shift_labels.to(token_logps.device) != IGNORE_INDEX).to(token_logps.dtype)
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    advantages = advantages.to(token_logps)
    old = token_logps.detach() if old_token_logps is None else old_token_logps
    log_ratio = (token_logps - old) * mask  # masked: shard padding holds zeros anyway
    if importance_sampling_level == "token":
        log_weights = log_ratio
    else:  # a row's mean log-ratio over its scored tokens: a group reduction inside the loss's
        counts = group_count(mask, group).clamp(min=1).to(log_ratio.dtype)
        log_weights = (group_sum(log_ratio.sum(dim=1), group) / counts).unsqueeze(1)
    coef_1 = torch.exp(log_weights)
    coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
    if delta is not None:
        coef_1 = torch.clamp(coef_1, max=delta)
    per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    if beta != 0.0:
        diff = ref_token_logps.to(token_logps) - token_logps
        per_token_loss = per_token_loss + beta * (torch.exp(diff) - diff - 1)
    masked = per_token_loss * mask
    if loss_type == "grpo":
        counts = group_count(mask, group).clamp(min=1).to(masked.dtype)
        loss = (group_sum(masked.sum(dim=1), group) / counts).mean()
    else:
        total = group_sum(masked.sum().reshape(1), group)[0]
        if loss_type == "bnpo" or (loss_type == "dapo" and num_items_in_batch is None):
            loss = total / group_count(mask.reshape(1, -1), group)[0].clamp(min=1).to(total.dtype)
        elif loss_type == "dr_grpo":
            if max_completion_length is None:
                raise ValueError("loss_type='dr_grpo' needs max_completion_length (TRL's normaliser)")
            loss = total / (mask.shape[0] * max_completion_length)
        else:
            loss = total / torch.as_tensor(num_items_in_batch, dtype=total.dtype, device=total.device).clamp(min=1)
    return scale_for_grad_reduction(loss, group, grad_reduction)
