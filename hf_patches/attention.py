"""The two patched attention paths of an HF Llama-family attention module.

- Fused: the module's ``forward`` is replaced (on the instance) by ``fused_attention_forward``,
  which runs ``FusedUPipeAttention``: from the module input to o_proj's output in one node.
- Unfused: the module's own forward runs unchanged (its q/k/v projections, norms and RoPE, so
  PEFT/quantized projections keep working) and transformers' attention-function registry sends
  the core attention to ``upipe_attention_function`` under the name ``"upipe"``, the same hook
  ALST uses, but under its own name so that unpatched models in the process keep plain SDPA.

Both paths ignore nothing silently: a mask, a KV cache or attention dropout reaching them is
refused (the model-level input check has already turned an honourable mask into None).
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import torch
from torch import Tensor, nn

from ds_upipe.exchanged_kv import ExchangedKeyValueAttention, KeyValueExchange
from ds_upipe.pipeline import PipelineContext, UPipeAttentionFunction, apply_eagerly
from ds_upipe.sinks import check_sinks
from ds_upipe.windows import check_window

from .fused import FusedProjections, FusedUPipeAttention
from .state import DOCUMENTS_KWARG, EXCHANGED_KV_KWARG, SPANS_KWARG, ExchangedKeyValues, UPipeState

ATTN_IMPLEMENTATION = "upipe"
logger = logging.getLogger("hf_patches")


def _state(module: nn.Module) -> UPipeState:
    state = getattr(module, "_upipe_state", None)
    if state is None:
        raise ValueError(
            f"{type(module).__name__} runs attention implementation {ATTN_IMPLEMENTATION!r} but was not patched by "
            "hf_patches.apply_upipe (patch the whole model, not a copy of its config)"
        )
    return state


def _check_call(module: nn.Module, attention_mask: Any, cache: Any, dropout: float) -> None:
    if attention_mask is not None:
        raise ValueError(
            f"{type(module).__name__}: an attention_mask of type {type(attention_mask).__name__} reached UPipe "
            "attention, which is causal over the whole sequence and cannot honour other masks. Pass "
            "attention_mask=None (or a 2-D right-padding mask to the model, which the model-level check accepts)"
        )
    if cache is not None:
        raise ValueError(
            f"{type(module).__name__}: a KV cache ({type(cache).__name__}) is not supported under UPipe sequence "
            "parallelism (training forward/backward only); call the model with use_cache=False"
        )
    if dropout:
        raise ValueError(f"{type(module).__name__}: attention dropout {dropout} is not supported by UPipe (must be 0)")


def fused_attention_forward(
    self: nn.Module,
    hidden_states: Tensor,
    position_embeddings: tuple[Tensor, Tensor] | None = None,
    attention_mask: Tensor | None = None,
    cache: Any = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """Replacement ``forward`` of a Llama/Mistral/Qwen2/Qwen3 attention module (fused projections)."""
    state = _state(self)
    if torch.is_autocast_enabled(hidden_states.device.type):
        # the fused node recomputes projections in backward, outside the forward's autocast region;
        # the module's own forward (HF projections + the "upipe" core function) is autocast-safe
        if not state.autocast_warned:
            state.autocast_warned = True
            logger.warning("hf_patches: torch.autocast is on: fused projections off, using unfused UPipe attention")
        return type(self).forward(self, hidden_states, position_embeddings, attention_mask, cache=cache, **kwargs)
    _check_call(self, attention_mask, cache if cache is not None else kwargs.get("past_key_values"), 0.0)
    if position_embeddings is None:
        raise ValueError(f"{type(self).__name__}: position_embeddings (cos, sin) are required")
    cos, sin = position_embeddings
    proj = FusedProjections.of(self)
    if cos.shape[-1] * 2 == proj.head_dim:
        # GPT-OSS's RoPE: cos/sin of half the head dim, (x1 cos - x2 sin, x2 cos + x1 sin) on the two halves,
        # which is rotate-half RoPE with cos/sin repeated over both halves (the same products and sums)
        cos, sin = torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)
    heads = (proj.q_proj.out_features // proj.head_dim, proj.k_proj.out_features // proj.head_dim)
    ctx = state.context(
        hidden_states.device,
        kwargs.get(DOCUMENTS_KWARG),
        module_sliding_window(self),
        proj.sinks,
        spans=kwargs.get(SPANS_KWARG),
        scale=getattr(self, "scaling", None),
        plan=state.plan_for(*heads),  # this layer's heads' plan (``UPipeRuntime.plans``)
    )
    out = apply_eagerly(FusedUPipeAttention, hidden_states, cos, sin, ctx, proj, *proj.params())
    return out, None


def module_sliding_window(module: nn.Module) -> int | None:
    """The sliding window an attention module passes to its attention function: its own
    ``sliding_window`` where it has one (Qwen2/Qwen3 set it per layer from ``config.layer_types``, None on
    full-attention layers), else its config's (Mistral reads ``config.sliding_window`` at call time)."""
    if hasattr(module, "sliding_window"):
        window = module.sliding_window
    else:
        window = getattr(getattr(module, "config", None), "sliding_window", None)
    return check_window(window, f"{type(module).__name__}.sliding_window")


def _code_names(fn: Any) -> set[str]:
    """The global, attribute and keyword names and the string constants of a function's code."""
    code = getattr(inspect.unwrap(fn), "__code__", None)
    if code is None:
        return set()
    consts = [c for t in code.co_consts if isinstance(t, tuple) for c in t] + list(code.co_consts)
    return {*code.co_names, *(c for c in consts if isinstance(c, str))}


def mask_window(base: nn.Module, module: nn.Module) -> int | None:
    """The sliding window a module's model applies through its mask alone: a model whose forward builds a
    sliding-window mask (``create_sliding_window_causal_mask``) while the module's forward passes no
    ``sliding_window`` to its attention function (PhiMoE) means the module's window, which UPipe's kernels,
    taking no mask, apply themselves."""
    if "create_sliding_window_causal_mask" not in _code_names(type(base).forward):
        return None
    return None if "sliding_window" in _code_names(type(module).forward) else module_sliding_window(module)


def upipe_attention_function(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers attention-interface function: [b, h, s, d] local q/k/v in, [b, s, h, d] out.

    Honoured per call: ``scaling`` (the kernel runs with the module's scale: Gemma's
    ``query_pre_attn_scalar``, Granite's ``attention_multiplier``), ``sliding_window`` and GPT-OSS's
    ``s_aux`` sinks.  Refused: a mask, dropout, ``is_causal=False`` and any other attention-changing
    argument a model may pass (``UNHONOURED_KWARGS``: logit softcapping, position biases, sparse indices)."""
    state = _state(module)
    _check_call(module, attention_mask, None, dropout)
    _check_unhonoured(module, kwargs)
    _check_heads(module, state, query, key, value)
    _check_shared_kv(module, query, key)
    # one dtype for the kernel: under autocast RoPE promotes q/k to float32 while v stays 16-bit, and
    # the kernel's aten op is not autocast-listed, so cast as autocast would for transformers' sdpa
    device_type = query.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else query.dtype
    # [b, h, s, d] -> [b, s, h, d] views: the layout UPipeAttentionFunction takes (batch_dim_idx=0)
    q, k, v = (t.transpose(1, 2).to(dtype) for t in (query, key, value))
    # the layer's sliding window as the module passes it (Mistral: config.sliding_window; Qwen2/3: per layer),
    # and attention sinks as GPT-OSS passes them (s_aux: module.sinks, one logit per query head): an input
    # of the autograd node, so their gradient reaches the module's parameter through autograd
    sinks = kwargs.get("s_aux")
    if sinks is not None:
        check_sinks(sinks, query.shape[1])
    if sliding_window is None:  # a window its model means through the mask UPipe drops (``mask_window``)
        sliding_window = getattr(module, "_upipe_mask_window", None)
    window = check_window(sliding_window, "sliding_window")
    # the plan of this layer's heads (``UPipeRuntime.plan_for``: built per head counts at patch time)
    plan = state.plan_for(query.shape[1], key.shape[1])
    documents, spans = kwargs.get(DOCUMENTS_KWARG), kwargs.get(SPANS_KWARG)
    ctx = state.context(q.device, documents, window, sinks, spans=spans, scale=scaling, plan=plan)
    exchanged = _exchanged_key_value(module, key, value, k, v, ctx, kwargs.get(EXCHANGED_KV_KWARG))
    if exchanged is not None:
        out = apply_eagerly(ExchangedKeyValueAttention, q, *exchanged, ctx, sinks)
    elif sinks is None:
        out = apply_eagerly(UPipeAttentionFunction, q, k, v, ctx)
    else:
        out = apply_eagerly(UPipeAttentionFunction, q, k, v, ctx, 0, sinks)
    return out, None


def _exchanged_key_value(
    module: nn.Module,
    key: Tensor,
    value: Tensor,
    k: Tensor,
    v: Tensor,
    ctx: PipelineContext,
    exchanges: ExchangedKeyValues | None,
) -> tuple[Tensor, Tensor] | None:
    """The keys and values of this call exchanged once for its forward (``ds_upipe.exchanged_kv``), or None (the
    call exchanges its own: ``share_exchanged_kv`` off, or a layer neither producing nor sharing K/V).  A KV-shared
    layer, given its producer's very ``key`` and ``value``, gets what the producer's exchange gave; a producer
    (transformers' ``store_full_length_kv``) exchanges ``k``, ``v`` (``key``, ``value`` in the kernel's dtype,
    [b, s, h, d]) once for itself and its sharing layers."""
    if exchanges is None:
        return None
    held = exchanges.find(key, value, ctx.plan)
    if held is None and getattr(module, "store_full_length_kv", False):
        held = apply_eagerly(KeyValueExchange, k, v, ctx)
        exchanges.keep(module, key, value, ctx.plan, held)
    return held


#: attention-function arguments some transformers models pass that UPipe's kernels do not implement
#: (refused when not None / not the default): Gemma 2's logit ``softcap``, T5-style ``position_bias``,
#: other models' ``sinks`` (GPT-OSS passes ``s_aux``, honoured), sparse-attention ``indices`` /
#: ``block_indices``
UNHONOURED_KWARGS = ("softcap", "position_bias", "sinks", "indices", "block_indices")


def _check_heads(module: nn.Module, state: UPipeState, query: Tensor, key: Tensor, value: Tensor) -> None:
    """Heads a stage plan was built for (the config's layers'), grouped-query, queries and keys of one head dim
    (values may have their own: multi-head latent attention's v_head_dim): JetMoE's mixture of attention heads
    hands the function another head count than its config's."""
    h, hkv = query.shape[1], key.shape[1]
    planned = not state.plans or (h, hkv) in state.plans
    if not planned or value.shape[1] != hkv or hkv > h or h % hkv or key.shape[-1] != query.shape[-1]:
        counts = ", ".join(f"{p} query and {k} key/value heads" for p, k in state.plans)
        want = f" (the plan{'s' * (len(state.plans) > 1)}: {counts})" if state.plans else ""
        raise ValueError(
            f"{type(module).__name__}: query {tuple(query.shape)}, key {tuple(key.shape)}, value "
            f"{tuple(value.shape)} ([batch, heads, tokens, head_dim]) reached UPipe attention{want}: UPipe runs "
            "grouped-query attention with the config's heads (num_attention_heads, num_key_value_heads), the query "
            "heads a multiple of the key/value heads, queries and keys of one head dim"
        )


def _check_shared_kv(module: nn.Module, query: Tensor, key: Tensor) -> None:
    """A KV-shared layer (``architectures.SHARED_KV_KWARG``) whose keys carry no gradient while its queries do: its
    producing layer ran without autograd (reentrant activation checkpointing keeps what a layer leaves in
    ``shared_kv_states`` from its no-grad forward), so the producer would miss this layer's gradient, unpatched
    too.  Refused rather than trained wrong (same on every rank, before this call's collectives)."""
    if getattr(module, "is_kv_shared_layer", False) and torch.is_grad_enabled() and query.requires_grad:
        if not key.requires_grad:
            raise ValueError(
                f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')}) is a KV-shared layer whose "
                "keys and values, taken from its producing layer, carry no gradient while its queries do: they were "
                "computed without autograd (reentrant activation checkpointing: gradient_checkpointing_kwargs="
                "{'use_reentrant': True}, DeepSpeed's activation checkpointing), so the producing layer's projections "
                "would miss this layer's gradient. Use non-reentrant checkpointing (use_reentrant=False) or none"
            )


def _check_unhonoured(module: nn.Module, kwargs: dict[str, Any]) -> None:
    if kwargs.get("is_causal", True) is False:
        raise ValueError(
            f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')}) calls its attention with "
            "is_causal=False (bidirectional): UPipe's kernels are causal"
        )
    for name in UNHONOURED_KWARGS:
        if kwargs.get(name) is not None:
            raise ValueError(
                f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')}) passes {name}="
                f"{type(kwargs[name]).__name__} to its attention function, which UPipe's kernels do not implement"
            )


def register_attention_function() -> None:
    """Register ``"upipe"`` with transformers' attention registry (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, upipe_attention_function)
