"""``apply_upipe``: patch a transformers causal decoder in place for UPipe sequence parallelism
(which models: ``hf_patches.architectures``)."""

from __future__ import annotations

import logging
import types
from typing import Any

import torch.distributed as dist
from torch import nn

from ds_upipe.heads import head_counts
from ds_upipe.options import UPipeOptions

from .architectures import _unwrap, find_decoder, fused_blocker_of
from .attention import ATTN_IMPLEMENTATION, fused_attention_forward, mask_window, register_attention_function
from .families import FAMILIES
from .fused import FusedProjections
from .inputs import GENERATION_UNSUPPORTED, check_and_prepare
from .mixers import check_mixers, mixer_kind_of, patch_mixers
from .rope import rotary_embedding, use_global_positions
from .state import UPipeState
from .vlm import check_vision_language, patch_vision_language, vision_language_parts

logger = logging.getLogger("hf_patches")

#: why ``overlap_comm`` leaves the mixers' stages sequential (said once per group when a hybrid is patched with it)
MIXER_OVERLAP_NOTE = (
    "overlap_comm overlaps softmax attention's stages only; the sequence mixers (gated delta net, Mamba-2) run "
    "their stages one after another: each stage's exchange is inside that stage's checkpoint (replayed in "
    "backward), so prefetching the next stage's exchange would keep a second stage's full-sequence buffers alive "
    "outside the checkpoint, and the mixer's time is its recurrence, not the small per-head exchange"
)


def supported_model_classes() -> list[str]:
    """The causal LM classes of the family registry (``hf_patches.families``: fused per-stage projections,
    tested per family).  ``apply_upipe`` also takes any other causal decoder whose attention calls
    transformers' attention registry (unfused), and the long-context stack any decoder laid out as
    transformers' are."""
    return [family.causal_lm for family in FAMILIES.values()]


def apply_upipe(
    model: nn.Module,
    process_group: dist.ProcessGroup | None,
    options: UPipeOptions | None = None,
    *,
    ring_group: dist.ProcessGroup | None = None,
    **settings: Any,
) -> nn.Module:
    """Patch a causal LM or its base model in place for UPipe: any transformers decoder whose attention
    modules call the attention-function registry, and the sequence mixers of ``hf_patches.mixers``
    (``hf_patches.architectures``; refusals name the layer).

    Args:
        model: the model (also accepted wrapped by PEFT or a DeepSpeed engine).
        process_group: the sequence-parallel group (None: the default group).
        options: the run's ``ds_upipe.options.UPipeOptions`` (None: the defaults); ``settings`` replace
            single fields by their names (``apply_upipe(model, group, head_chunk_size=4)``):
            ``head_chunk_size`` (U, query heads per stage across the group; None: U = group size),
            ``mixer_head_chunk_size``, ``kernel``, ``fused_projections`` (where the attention is one the
            family registry knows, ``hf_patches.families``; others, and projections that are not plain
            ``nn.Linear`` (PEFT LoRA, quantized), fall back to unfused mode with one warning),
            ``overlap_comm``, ``accumulate_in_input_dtype`` (bf16/fp16 gradients summed over the stages in
            that dtype: docs/config.md, ``accumulate_dtype``, has the measured error),
            ``recompute_attention_output`` (fused mode keeps no attention output; where fused mode falls
            back, the warning says it is off too), ``share_exchanged_kv`` (KV-shared layers attend with their
            producer's exchanged K/V: ``ds_upipe.exchanged_kv``).  Each field's meaning: ``UPipeOptions``.
        ring_group: UPipe x Ring (None: no ring).  ``process_group`` is then the Ulysses group
            (C_u ranks) and each stage attends over the whole sequence by ring attention over this
            group (R ranks); both come from ``ds_upipe.ring.build_sequence_groups``.  The heads are
            split over C_u only.

    Returns the same model.  Every rank must then pass its sequence shard and the matching global
    ``position_ids`` (see ``shard_batch``): the contiguous shard of its rank without a ring, its
    zigzag shard (``ds_upipe.ring.zigzag_positions``) with one; logits come back per shard.
    """
    options = UPipeOptions.of(options, **settings)
    if not dist.is_initialized():
        raise ValueError("apply_upipe needs torch.distributed to be initialized (the sequence-parallel group)")
    hf_model = _unwrap(model)
    if getattr(hf_model, "_upipe_state", None) is not None:
        raise ValueError(f"{type(hf_model).__name__} is already patched by apply_upipe")
    vlm = vision_language_parts(hf_model)  # a vision-language model: UPipe runs its text model (hf_patches.vlm)
    if vlm is not None:
        check_vision_language(hf_model, ring=ring_group is not None)
    text_model = hf_model if vlm is None else vlm.text
    found = find_decoder(text_model)
    arch, base, attentions = found.model_type, found.base, found.attentions
    config = base.config

    fallback = fused_blocker_of(attentions) if options.fused_projections else None
    fused = options.fused_projections and fallback is None
    if fallback is not None and dist.get_rank(process_group) == 0:  # one line per group
        logger.warning(
            "hf_patches: fused projections off (%s); using unfused UPipe attention%s",
            fallback,
            " (recompute_attention_output has no effect unfused)" if options.recompute_attention_output else "",
        )
    check_mixers(
        found.mixers, dist.get_world_size(process_group), options.mixer_head_chunk_size, ring=ring_group is not None
    )
    # the one runtime builder of every route (ds_upipe.runtime); validates U, H, Hkv against C_u, one plan per
    # layers' head counts (Gemma 4's full-attention layers may have their own key/value heads)
    state = UPipeState.build(
        options,
        group=process_group,
        # 1/sqrt(head_dim) here; each call runs with the scale its module passes (``UPipeState.attention``'s
        # ``scale``: Gemma's query_pre_attn_scalar, Granite's attention_multiplier), layer by layer
        softmax_scale=None,
        layer_heads=head_counts(config),
        ring_group=ring_group,
        fused_projections=fused,
        fallback_reason=fallback,
        architecture=arch,
        kwargs_dropped_by=found.kwargs_dropped_by,
    )
    register_attention_function()
    for attn in attentions:
        attn._upipe_state = state
        attn._upipe_mask_window = mask_window(base, attn)
        if fused:
            attn.forward = types.MethodType(fused_attention_forward, attn)
            _register_zero3_external(attn, FusedProjections.of(attn).zero3_params())
    if options.overlap_comm and found.mixers and dist.get_rank(process_group) == 0:  # one line per group
        logger.warning("hf_patches: %s", MIXER_OVERLAP_NOTE)
    for mixer, params in patch_mixers(found.mixers, state):
        _register_zero3_external(mixer, params)
    text_model.set_attn_implementation(ATTN_IMPLEMENTATION)  # a vision tower's attention keeps its own
    if rotary_embedding(base) is not None:  # models without RoPE have nothing to make global
        use_global_positions(base)
    base._upipe_state = hf_model._upipe_state = state
    base._upipe_input_hook = base.register_forward_pre_hook(_check_inputs, with_kwargs=True)
    if vlm is not None:
        patch_vision_language(hf_model, vlm, state)
    if hasattr(hf_model, "router_aux_loss_coef"):  # a mixture-of-experts causal LM (Qwen3-MoE, Mixtral, GPT-OSS)
        hf_model._upipe_aux_loss_hook = hf_model.register_forward_pre_hook(_refuse_shard_aux_loss, with_kwargs=True)
    if hasattr(hf_model, "generate"):
        hf_model.generate = types.MethodType(_refuse_generate, hf_model)
    return model


def fused_fallback(model: nn.Module) -> str | None:
    """Why ``apply_upipe`` with ``fused_projections=True`` would run this model unfused (None: fused),
    the rule apply_upipe applies (``architectures.fused_blocker_of``): ``"auto"`` measures the
    attention the model will run.  A model apply_upipe refuses has no fallback (it raises there)."""
    try:
        found = find_decoder(_unwrap(model))
    except ValueError:
        return None
    return fused_blocker_of(found.attentions)


def check_mixer_settings(model: nn.Module, group_size: int, mixer_head_chunk_size: int | None, ring: bool) -> None:
    """``apply_upipe``'s refusals of the model's sequence mixers (``hf_patches.mixers``: a ring, a
    ``mixer_head_chunk_size`` a kind cannot run over ``group_size`` ranks), without patching anything: it reads
    the model's modules only, so the ds_config routes run it on every rank before their first collective.  A
    model without a registered mixer is left to ``apply_upipe``'s own checks."""
    hf_model = _unwrap(model)
    if not any(mixer_kind_of(type(m).__name__) is not None for m in hf_model.modules()):
        return
    check_mixers(find_decoder(hf_model).mixers, group_size, mixer_head_chunk_size, ring=ring)


def _refuse_generate(self: nn.Module, *args: Any, **kwargs: Any) -> None:
    """``generate`` of a patched model: refused at once, before any collective, so every rank that
    calls it raises the same error and no rank waits for another."""
    raise ValueError(f"{type(self).__name__}.generate(): {GENERATION_UNSUPPORTED}")


def _refuse_shard_aux_loss(model: nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook of a patched MoE causal LM: its load-balancing aux loss (``output_router_logits``)
    would be computed from this rank's sequence shard (each rank's token counts and router
    probabilities), not from the whole sequence as without sequence parallelism, so it is refused
    rather than computed wrong.  Raised on every rank (same config, same call) before any collective."""
    wanted = kwargs.get("output_router_logits")
    if wanted is None:
        wanted = getattr(model.config, "output_router_logits", False)
    if wanted:
        raise ValueError(
            f"{type(model).__name__}: output_router_logits=True under UPipe sequence parallelism: the router's "
            f"load-balancing aux loss (router_aux_loss_coef={model.router_aux_loss_coef}) would be computed from this "
            "rank's sequence shard only, not from the whole sequence as without sequence parallelism. Pass "
            "output_router_logits=False (and set config.output_router_logits=False), or train without sequence "
            "parallelism"
        )


def _check_inputs(base: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Forward pre-hook of the base model.  It reads the state from the module it runs on, so a
    ``copy.deepcopy`` of the model (whose hooks are the same functions) runs with its own state."""
    return check_and_prepare(base, args, kwargs, base._upipe_state)


def _register_zero3_external(module: nn.Module, params: list[nn.Parameter]) -> None:
    """Fused attention and sharded mixers read weights of their submodules (q/k/v, norms, input projections)
    in the module's own forward and backward, outside those submodules: ZeRO-3 must gather them with it."""
    from deepspeed.runtime.zero import register_external_parameter

    for param in params:
        register_external_parameter(module, param)


def upipe_state(model: nn.Module) -> UPipeState | None:
    """The ``UPipeState`` of a patched model (None when not patched)."""
    return getattr(_unwrap(model), "_upipe_state", None)
