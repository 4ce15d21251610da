"""TRL's DPOTrainer under DeepSpeed sequence parallelism: ``SequenceParallelDPOTrainer``.

A drop-in subclass of ``trl.DPOTrainer`` (same arguments).  Without sequence parallelism it is
``DPOTrainer``.  Under ``ParallelismConfig(sp_backend="deepspeed", sp_size > 1)`` with
``hf_integration.enable()``:

- its collator adds ``labels`` (the completion tokens, -100 elsewhere) to TRL's preference batches, so
  that the sequence-parallel loader (``UlyssesSPDataLoaderAdapter`` over ds_upipe's checked loader)
  shards them with global ``position_ids`` and shifts the labels before sharding;
- its loss is ``hf_patches.rl_loss.sequence_parallel_dpo_loss`` on each micro-batch's shards: the
  policy's and the reference model's summed completion log-probs from the shards (one all_reduce each),
  then TRL's per-pair loss, the same on every rank; the gradients averaged over the ranks (as the
  engine does) are TRL's;
- it logs TRL's reward and log-prob metrics (``rewards/*``, ``logps/*``) from the whole rows.

What it refuses under SP (ValueError at construction, naming the setting): a reference model other
than an explicit ``ref_model`` (PEFT adapters as reference), ``precompute_ref_log_probs`` (the
reference columns are 1-D and cannot go through DeepSpeed's sequence loader), several or other loss
types than ``rl_loss.DPO_LOSS_TYPES``, ``ld_alpha``, ``use_weighting``, f-divergences other than
"reverse_kl", MoE router losses.  Evaluation under SP is refused by ``trainer_sp`` (DPO's
``prediction_step`` is its own).  The metrics TRL computes from per-token outputs (``entropy``,
``logits/*``, ``mean_token_accuracy``, ``num_tokens``) are not logged under SP.
"""

from __future__ import annotations

from typing import Any

import torch
from trl import DPOTrainer

from hf_patches import upipe_state
from hf_patches.data import IGNORE_INDEX
from hf_patches.rl_loss import DPO_LOSS_TYPES, sequence_parallel_dpo_loss

from .trainer_sp import _sp_group, deepspeed_sp

#: the shard's keys the loss reads (the adapter adds position_ids and shift_labels)
_SHARD_KEYS = ("input_ids", "position_ids", "attention_mask", "shift_labels")


class _WithCompletionLabels:
    """TRL's preference collator, plus ``labels``: input_ids where the completion mask is 1."""

    def __init__(self, collator: Any) -> None:
        self.collator = collator

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        batch = self.collator(examples)
        keep = batch["completion_mask"] != 0
        if batch.get("attention_mask") is not None:
            keep = keep & (batch["attention_mask"] != 0)
        batch["labels"] = batch["input_ids"].masked_fill(~keep, IGNORE_INDEX)
        return batch


class SequenceParallelDPOTrainer(DPOTrainer):
    """``trl.DPOTrainer`` whose loss is exact under DeepSpeed sequence parallelism (module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        pc = deepspeed_sp(self)
        if pc is None:
            return
        unsupported = self._unsupported_under_sp()
        if unsupported:
            raise ValueError(
                f"{type(self).__name__} under sequence parallelism (sp_size={pc.sp_size}) does not support "
                + "; ".join(unsupported)
            )
        self.data_collator = _WithCompletionLabels(self.data_collator)

    def _unsupported_under_sp(self) -> list[str]:
        problems = []
        if self.ref_model is None:
            problems.append("a reference model other than an explicit ref_model (pass ref_model=...)")
        if self.precompute_ref_logps:
            problems.append("precompute_ref_log_probs=True (set it to False and pass ref_model)")
        if len(self.loss_types) != 1 or self.loss_types[0] not in DPO_LOSS_TYPES:
            problems.append(f"loss_type={self.loss_types} (one of {list(DPO_LOSS_TYPES)})")
        if self.ld_alpha is not None:
            problems.append(f"ld_alpha={self.ld_alpha} (None)")
        if self.use_weighting:
            problems.append("use_weighting=True (False)")
        if self.f_divergence_type != "reverse_kl":
            problems.append(f"f_divergence_type={self.f_divergence_type!r} ('reverse_kl')")
        if self.aux_loss_enabled:
            problems.append("MoE router aux loss (output_router_logits)")
        return problems

    def _patch_reference(self, sp_size: int) -> None:
        """The reference model patched with the policy's UPipe settings, once (the groups exist only once
        the Trainer has prepared the policy).  Unpatched, it would run UPipe's unfused stage loop through
        the registered attention function: the same values, but another float32 rounding than the
        policy's fused path, which shows in DPO's rewards (policy minus reference) at the first step."""

        from .hf_integration import ds_config_from_accelerate, upipe_settings
        from .sp_setup import prepare_for_run

        policy = upipe_state(self.model)
        if policy is None or upipe_state(self.ref_model) is not None:
            return  # ALST, or patched already
        settings = upipe_settings(ds_config_from_accelerate(), sp_size)
        prepare_for_run(
            self.ref_model,
            settings,
            sequence_group=_sp_group(),
            head_chunk_size=policy.head_chunk_size,
            forward_loss="local",
            loss_group=None,
            long_context=False,  # the reference model's log-probs only: UPipe as the policy's, no stack needed
        )

    def _compute_loss(self, model: torch.nn.Module, inputs: dict[str, Any], return_outputs: bool) -> Any:
        if deepspeed_sp(self) is None or "shift_labels" not in inputs:
            return super()._compute_loss(model, inputs, return_outputs)
        self._patch_reference(deepspeed_sp(self).sp_size)
        mode = "train" if self.model.training else "eval"
        shard = {k: inputs[k] for k in _SHARD_KEYS if inputs.get(k) is not None}
        out = sequence_parallel_dpo_loss(
            model, shard, _sp_group(), ref_model=self.ref_model, beta=self.beta, loss_type=self.loss_types[0]
        )
        loss = out.loss * self.loss_weights[0]
        # TRL's metrics of whole rows: every rank of a group holds the same values, so the means gathered
        # over all processes are the non-SP run's
        chosen_rewards, rejected_rewards = self.beta * out.chosen_logratios, self.beta * out.rejected_logratios
        gather = self.accelerator.gather
        metrics = self._metrics[mode]
        metrics["rewards/chosen"].append(gather(chosen_rewards).mean().item())
        metrics["rewards/rejected"].append(gather(rejected_rewards).mean().item())
        metrics["rewards/accuracies"].append(gather((chosen_rewards > rejected_rewards).float()).mean().item())
        metrics["rewards/margins"].append(gather(chosen_rewards - rejected_rewards).mean().item())
        metrics["logps/chosen"].append(gather(out.chosen_logps.detach()).mean().item())
        metrics["logps/rejected"].append(gather(out.rejected_logps.detach()).mean().item())
        return (loss, None) if return_outputs else loss
