"""UPipe inside transformers models.

``apply_upipe`` patches a causal decoder in place (any whose attention calls transformers' attention
registry; fused per-stage projections for the families of ``families``); ``shard_batch`` /
``sequence_parallel_dataloader`` give each sequence-parallel rank its shard of the inputs, and
``sequence_parallel_loss`` turns per-shard logits into the loss of the whole sequence;
``apply_long_context_stack`` / ``tiled_sequence_parallel_loss`` tile the loss, norms and MLPs;
``rl_loss`` (``sequence_parallel_dpo_loss``, ``sequence_parallel_grpo_loss``) and ``logprobs`` give
preference and RL losses of whole sequences from the shards.
See docs/hf_patches.md.
"""

from .attention import ATTN_IMPLEMENTATION
from .data import IGNORE_INDEX, gather_sequence, pad_batch, sequence_parallel_dataloader, shard_batch, shift_labels
from .logprobs import model_token_logprobs, sequence_logprobs
from .long_context import LongContextStack, apply_long_context_stack, check_long_context_stack, long_context_stack
from .loss import sequence_parallel_loss, tiled_causal_lm_loss, tiled_sequence_parallel_loss
from .patch import apply_upipe, check_mixer_settings, fused_fallback, supported_model_classes, upipe_state
from .rl_loss import (
    completion_logps,
    completion_rows,
    sequence_parallel_dpo_loss,
    sequence_parallel_grpo_loss,
    shard_completions,
)
from .state import UPipeState

__all__ = [
    "ATTN_IMPLEMENTATION",
    "IGNORE_INDEX",
    "LongContextStack",
    "UPipeState",
    "apply_long_context_stack",
    "apply_upipe",
    "check_long_context_stack",
    "check_mixer_settings",
    "fused_fallback",
    "completion_logps",
    "completion_rows",
    "gather_sequence",
    "long_context_stack",
    "model_token_logprobs",
    "pad_batch",
    "sequence_parallel_dataloader",
    "sequence_logprobs",
    "sequence_parallel_dpo_loss",
    "sequence_parallel_grpo_loss",
    "sequence_parallel_loss",
    "shard_batch",
    "shard_completions",
    "shift_labels",
    "supported_model_classes",
    "tiled_causal_lm_loss",
    "tiled_sequence_parallel_loss",
    "upipe_state",
]
