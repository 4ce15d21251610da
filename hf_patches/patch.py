"""``apply_upipe``: patch a Llama/Mistral/Qwen2/Qwen3 model in place for UPipe sequence parallelism."""

from __future__ import annotations

import logging
import types
from typing import Any

import torch.distributed as dist
from torch import nn

from ds_upipe.heads import HeadLayout

from .attention import (
    ATTN_IMPLEMENTATION,
    fused_attention_forward,
    module_sliding_window,
    register_attention_function,
)
from .fused import FusedProjections
from .inputs import GENERATION_UNSUPPORTED, check_and_prepare
from .rope import use_global_positions
from .state import UPipeState

logger = logging.getLogger("hf_patches")

#: architecture -> (causal LM class, base model class, attention class), names in transformers
_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "LlamaModel", "LlamaAttention"),
    "mistral": ("MistralForCausalLM", "MistralModel", "MistralAttention"),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Model", "Qwen2Attention"),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Model", "Qwen3Attention"),
}


def _classes() -> dict[str, tuple[type, type, type]]:
    """The supported transformers classes, imported lazily (transformers is heavy)."""
    import transformers.models.llama.modeling_llama as llama
    import transformers.models.mistral.modeling_mistral as mistral
    import transformers.models.qwen2.modeling_qwen2 as qwen2
    import transformers.models.qwen3.modeling_qwen3 as qwen3

    mods = {"llama": llama, "mistral": mistral, "qwen2": qwen2, "qwen3": qwen3}
    return {arch: tuple(getattr(mods[arch], name) for name in names) for arch, names in _ARCHITECTURES.items()}


def supported_model_classes() -> list[str]:
    return [name for names in _ARCHITECTURES.values() for name in names[:2]]


def _unwrap(model: nn.Module) -> nn.Module:
    """The HF model inside a DeepSpeed engine or a PEFT wrapper (or the model itself)."""
    inner = model
    for _ in range(4):
        if type(inner).__name__ == "DeepSpeedEngine" and hasattr(inner, "module"):
            inner = inner.module
            continue
        get_base = getattr(inner, "get_base_model", None)
        if callable(get_base) and type(inner).__module__.startswith("peft"):
            inner = get_base()
            continue
        break
    return inner


def _find_architecture(hf_model: nn.Module, caller: str = "apply_upipe") -> tuple[str, nn.Module, type]:
    """(arch, base model, attention class) or a ValueError naming the supported classes."""
    for arch, (causal_lm, base, attention) in _classes().items():
        if type(hf_model) is causal_lm:
            return arch, hf_model.model, attention
        if type(hf_model) is base:
            return arch, hf_model, attention
    raise ValueError(
        f"unsupported model class {type(hf_model).__name__}: {caller} supports "
        f"{', '.join(supported_model_classes())} (optionally wrapped by PEFT or a DeepSpeed engine)"
    )


def _check_config(arch: str, config: Any, attentions: list[nn.Module]) -> None:
    if not getattr(config, "is_causal", True):
        raise ValueError("config.is_causal=False (bidirectional attention) is not supported: UPipe's kernel is causal")
    dropout = getattr(config, "attention_dropout", 0.0) or 0.0
    if dropout:
        raise ValueError(f"config.attention_dropout={dropout} is not supported by UPipe; it must be 0.0")
    # sliding windows (Mistral's config.sliding_window, Qwen2/Qwen3 per layer) are honoured layer by layer:
    # each call's window reaches the kernel (hf_patches.attention.module_sliding_window, ds_upipe.windows)
    for attn in attentions:
        module_sliding_window(attn)  # a bad value is refused here, before any collective


def _fused_blocker(attentions: list[nn.Module], norm_class: type | None) -> str | None:
    """Why fused projections cannot be used (None when they can)."""
    for attn in attentions:
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            proj = getattr(attn, name)
            if type(proj) is not nn.Linear:
                return f"{name} is {type(proj).__module__}.{type(proj).__name__}, not torch.nn.Linear"
        for name in ("q_norm", "k_norm"):
            norm = getattr(attn, name, None)
            if norm is not None and type(norm) is not norm_class:
                return f"{name} is {type(norm).__name__}, not {norm_class.__name__ if norm_class else 'absent'}"
    return None


def apply_upipe(
    model: nn.Module,
    process_group: dist.ProcessGroup | None,
    *,
    head_chunk_size: int | None = None,
    fused_projections: bool = True,
    kernel: str = "sdpa",
    overlap_comm: bool = False,
    ring_group: dist.ProcessGroup | None = None,
    accumulate_in_input_dtype: bool = False,
    recompute_attention_output: bool = False,
) -> nn.Module:
    """Patch a Llama/Mistral/Qwen2/Qwen3 ``*ForCausalLM`` or base ``*Model`` in place for UPipe.

    Args:
        model: the model (also accepted wrapped by PEFT or a DeepSpeed engine).
        process_group: the sequence-parallel group (None: the default group).
        head_chunk_size: U, query heads per stage across the group (None: U = group size).
        fused_projections: project q/k/v per stage from the layer input (least memory); projections
            that are not plain ``nn.Linear`` (PEFT LoRA, quantized) fall back to unfused mode.
        kernel: local attention kernel name for ``ds_upipe.make_kernel`` ('sdpa', 'math', 'flash_attn').
        overlap_comm: issue the next stage's all-to-alls while the current stage computes (two
            stages' buffers alive instead of one); with a ring also the next K/V block's send/recv.
        ring_group: UPipe x Ring (None: no ring).  ``process_group`` is then the Ulysses group
            (C_u ranks) and each stage attends over the whole sequence by ring attention over this
            group (R ranks); both come from ``ds_upipe.ring.build_sequence_groups``.  The heads are
            split over C_u only.
        accumulate_in_input_dtype: with bf16/fp16 inputs, sum the gradients over the stages (dK/dV
            per round; in fused mode also dx and the q/k/v weight gradients) in that dtype, as the
            UPipe paper does, instead of float32: those accumulators take half the memory, and each
            stage adds one rounding (docs/config.md, ``accumulate_dtype``, has the measured error).
            No effect on float32/float64 inputs.
        recompute_attention_output: fused mode keeps no attention output (one hidden state per layer)
            from forward to backward: backward runs each stage's attention forward again, then its
            backward, and takes o_proj's weight gradient stage by stage.  Less memory for one more
            kernel forward per stage.  Needs fused projections (ValueError with
            ``fused_projections=False``; where fused mode falls back, the warning says it is off too).

    Returns the same model.  Every rank must then pass its sequence shard and the matching global
    ``position_ids`` (see ``shard_batch``): the contiguous shard of its rank without a ring, its
    zigzag shard (``ds_upipe.ring.zigzag_positions``) with one; logits come back per shard.
    """
    if not dist.is_initialized():
        raise ValueError("apply_upipe needs torch.distributed to be initialized (the sequence-parallel group)")
    hf_model = _unwrap(model)
    arch, base, attention_class = _find_architecture(hf_model)
    if getattr(hf_model, "_upipe_state", None) is not None:
        raise ValueError(f"{type(hf_model).__name__} is already patched by apply_upipe")
    config = hf_model.config
    attentions = [m for m in base.modules() if isinstance(m, attention_class)]
    if not attentions:
        raise ValueError(f"no {attention_class.__name__} modules found in {type(hf_model).__name__}")
    _check_config(arch, config, attentions)

    if recompute_attention_output and not fused_projections:
        raise ValueError(
            "recompute_attention_output=True needs fused_projections=True: unfused, o_proj (the model's own "
            "nn.Linear) keeps the attention output for its weight gradient anyway; set fused_projections=True "
            "or recompute_attention_output=False"
        )
    fallback = (
        _fused_blocker(attentions, _qwen3_norm_class() if arch == "qwen3" else None) if fused_projections else None
    )
    fused = fused_projections and fallback is None
    if fallback is not None and dist.get_rank(process_group) == 0:  # one line per group
        logger.warning(
            "hf_patches: fused projections off (%s); using unfused UPipe attention%s",
            fallback,
            " (recompute_attention_output has no effect unfused)" if recompute_attention_output else "",
        )

    heads = HeadLayout.from_config(config)
    # the one runtime builder of every route (ds_upipe.runtime); validates U, H, Hkv against C_u
    state = UPipeState.build(
        group=process_group,
        kernel=kernel,
        softmax_scale=attentions[0].scaling,
        head_chunk_size=head_chunk_size,
        num_heads=heads.num_heads,
        num_kv_heads=heads.num_kv_heads,
        ring_group=ring_group,
        overlap_comm=overlap_comm,
        accumulate_in_input_dtype=accumulate_in_input_dtype,
        fused=fused,
        recompute_attention_output=recompute_attention_output,
        fallback_reason=fallback,
        architecture=arch,
    )
    register_attention_function()
    for attn in attentions:
        attn._upipe_state = state
        if fused:
            attn.forward = types.MethodType(fused_attention_forward, attn)
            _register_zero3_external(attn)
    hf_model.set_attn_implementation(ATTN_IMPLEMENTATION)
    use_global_positions(base)
    base._upipe_state = hf_model._upipe_state = state
    base._upipe_input_hook = base.register_forward_pre_hook(_check_inputs, with_kwargs=True)
    if hasattr(hf_model, "generate"):
        hf_model.generate = types.MethodType(_refuse_generate, hf_model)
    return model


def _refuse_generate(self: nn.Module, *args: Any, **kwargs: Any) -> None:
    """``generate`` of a patched model: refused at once, before any collective, so every rank that
    calls it raises the same error and no rank waits for another."""
    raise ValueError(f"{type(self).__name__}.generate(): {GENERATION_UNSUPPORTED}")


def _check_inputs(base: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Forward pre-hook of the base model.  It reads the state from the module it runs on, so a
    ``copy.deepcopy`` of the model (whose hooks are the same functions) runs with its own state."""
    return check_and_prepare(base, args, kwargs, base._upipe_state)


def _qwen3_norm_class() -> type:
    import transformers.models.qwen3.modeling_qwen3 as qwen3

    return qwen3.Qwen3RMSNorm


def _register_zero3_external(attn: nn.Module) -> None:
    """Fused mode reads q/k/v (and norm) weights in the attention module's forward and backward,
    outside their own modules: ZeRO-3 must gather them with the attention module."""
    from deepspeed.runtime.zero import register_external_parameter

    for param in FusedProjections.of(attn).zero3_params():
        register_external_parameter(attn, param)


def upipe_state(model: nn.Module) -> UPipeState | None:
    """The ``UPipeState`` of a patched model (None when not patched)."""
    return getattr(_unwrap(model), "_upipe_state", None)
