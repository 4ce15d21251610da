"""Which transformers models ``apply_upipe`` patches, found from the model's own modules.

No class table decides whether a model runs: any causal decoder whose attention modules call
transformers' attention-function registry (``ALL_ATTENTION_FUNCTIONS``, the hook through which every
such model lets another implementation run its core attention) runs unfused UPipe under the module's
own projections, norms and RoPE.  The modules are recognised by what they are (their class's
``forward`` reads the registry; the base model and its decoder layers pass the forward's ``**kwargs`` on to
them, ``passes_kwargs``).  A layer holds one
such module, or a sequence mixer of a kind ``hf_patches.mixers`` shards by heads (linear attention,
state-space, short convolutions), or, where its config says so, only position-wise blocks.  What UPipe
cannot honour is refused here, naming the layer and the reason, before any collective: mixers of other
kinds, bidirectional and
encoder-decoder models, cross-attention, chunked attention, KV-shared layers other than transformers'
``shared_kv_states`` ones, logit softcapping, attention dropout.  Multi-head
latent attention (DeepSeek-V2/V3, MiniCPM3, GLM-4.7-Flash) runs unfused: after its own up-projections it calls the
registry with values narrower than its queries and keys, which the stage loop carries at their own head dim.

Fused per-stage projections replace the module's ``forward`` by one that must compute exactly what it
did, so they are limited to the forwards known to be Llama-shaped (``FUSED_ATTENTIONS``: plain
``nn.Linear`` q/k/v/o with optional bias, rotate-half RoPE, an optional per-head q/k norm of a kind in
``families.NORM_KINDS``, optional sinks); a structural check alone cannot see what a forward
does between its projections (SmolLM3 skips RoPE on some layers, OLMo 2 normalizes all heads together,
Phi-3 fuses q/k/v into one matrix, GLM-4 rotates part of each head).  Other models run unfused with one
warning naming the reason.
"""

from __future__ import annotations

import dis
import inspect
import re
from dataclasses import dataclass
from typing import Any

from torch import nn

from .families import FUSED_ATTENTIONS, NORM_KINDS, UNFUSED_ATTENTIONS, latent_unfused
from .mixers import MIXER_LAYER_TYPES, mixer_kind_of

#: ``config.layer_types`` entries UPipe runs (each module's ``sliding_window`` gives the window)
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")
#: layer types without a token mixer (Nemotron-H's MLP and MoE layers): position-wise, nothing to exchange
POSITIONWISE_LAYER_TYPES = ("mlp", "moe")


#: class names of sequence mixers that are not softmax attention (state-space, linear attention); "SSM" / "Ssm"
#: case-sensitive as a CamelCase word (GptOssMLP is an MLP)
_NON_ATTENTION_MIXER = re.compile(
    r"(?i:mamba|deltanet|deltaattention|linearattention|lightningattention|rwkv|recurrent)|(?:SSM|Ssm)(?![a-z])"
)


@dataclass
class DecoderModel:
    """What ``find_decoder`` found: the model type, the decoder stack (base model), its softmax attention
    modules and its other sequence mixers (``hf_patches.mixers``; (layer index, module)), in layer order."""

    model_type: str
    base: nn.Module
    attentions: list[nn.Module]
    mixers: list[tuple[int, nn.Module]]
    #: the first decoder layer whose forward does not pass its ``**kwargs`` on (None: every layer does): packed
    #: documents' boundaries cannot reach its attention, so such a model runs unpacked rows only (the forward's
    #: input check refuses restarting positions, ``hf_patches.inputs``)
    kwargs_dropped_by: str | None = None


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


def calls_attention_registry(module: nn.Module) -> bool:
    """Whether the module's class forward looks its attention function up in transformers' registry."""
    forward = inspect.unwrap(type(module).forward)  # through decorators such as deprecate_kwarg
    code = getattr(forward, "__code__", None)
    return code is not None and "ALL_ATTENTION_FUNCTIONS" in code.co_names


def decoder_stack(hf_model: nn.Module, caller: str) -> nn.Module:
    """The base model holding the decoder layers: the model itself or its ``base_model_prefix`` child (the
    one rule: ``apply_upipe`` and the long-context stack both ask here)."""
    from transformers import PreTrainedModel

    if not isinstance(hf_model, PreTrainedModel):
        raise ValueError(
            f"{caller} patches a transformers PreTrainedModel (a causal LM or its base model), got "
            f"{type(hf_model).__module__}.{type(hf_model).__name__}"
        )
    if getattr(hf_model.config, "is_encoder_decoder", False):
        raise ValueError(
            f"{type(hf_model).__name__} is an encoder-decoder model: UPipe runs causal decoder-only models "
            "(its kernels are causal self-attention over one sequence)"
        )
    prefix = getattr(hf_model, "base_model_prefix", "") or "model"
    candidates = [hf_model, getattr(hf_model, prefix, None), getattr(hf_model, "model", None)]
    for base in candidates:
        if isinstance(base, nn.Module) and hasattr(base, "language_model") and not hasattr(base, "layers"):
            raise ValueError(
                f"{caller}: {type(hf_model).__name__} is a vision-language model: {caller} does not run one yet "
                "(apply_upipe does: docs/vlm.md)"
            )
        if isinstance(base, PreTrainedModel) and _layers(base) is not None:
            return base
    for module in hf_model.modules():
        if calls_attention_registry(module) and getattr(module, "is_causal", True) is False:
            raise ValueError(
                f"{caller}: {type(hf_model).__name__} is bidirectional ({type(module).__name__}.is_causal=False): "
                "UPipe runs causal decoders (its kernels are causal)"
            )
    raise ValueError(
        f"{caller}: {type(hf_model).__name__} has no decoder layers (an nn.ModuleList of "
        "config.num_hidden_layers layers) in itself or its base model"
    )


def _layers(base: nn.Module) -> nn.ModuleList | None:
    """The decoder layers: the base model's ModuleList of ``config.num_hidden_layers`` modules."""
    count = getattr(base.config, "num_hidden_layers", None)
    for child in base.children():
        if isinstance(child, nn.ModuleList) and len(child) == count:
            return child
    return None


def _refuse(layer: int, module: nn.Module, why: str) -> ValueError:
    return ValueError(f"apply_upipe: decoder layer {layer} ({type(module).__name__}): {why}")


def _check_config(config: Any) -> None:
    """Model-wide refusals read from the (text) config."""
    chunk = getattr(config, "attention_chunk_size", None)
    if chunk:
        raise ValueError(
            f"apply_upipe: config.attention_chunk_size={chunk} (chunked attention, Llama 4) is not supported: "
            "UPipe's kernels are causal or sliding-window"
        )
    runs = (*ATTENTION_LAYER_TYPES, "attention", *MIXER_LAYER_TYPES, *POSITIONWISE_LAYER_TYPES)
    for key in ("layer_types", "layers_block_type"):
        for i, kind in enumerate(getattr(config, key, None) or ()):
            if kind not in runs:
                raise ValueError(
                    f"apply_upipe: decoder layer {i} is {kind!r} (config.{key}): UPipe runs the layer types "
                    f"{', '.join(runs)} (hf_patches.mixers lists the sequence mixers it shards by heads)"
                )
    softcap = getattr(config, "attn_logit_softcapping", None)
    if softcap is not None:
        raise ValueError(
            f"apply_upipe: config.attn_logit_softcapping={softcap} (tanh capping of the attention logits) is not "
            "supported by UPipe's kernels (none computes it)"
        )


#: the forward argument through which transformers' KV-shared layers (Gemma 3n, Gemma 4) take the keys and values
#: of their layer type's producing layer: the producer's local (sequence-shard) keys and values, after its norms and
#: RoPE on global positions, as autograd tensors.  The sharing layer's UPipe call exchanges them like its own, so it
#: attends over the same keys and values as unpatched and their gradients reach the producer's projections
SHARED_KV_KWARG = "shared_kv_states"


def takes_shared_kv(module: nn.Module) -> bool:
    """Whether the attention module's forward takes another layer's keys and values (``SHARED_KV_KWARG``)."""
    return SHARED_KV_KWARG in inspect.signature(inspect.unwrap(type(module).forward)).parameters


def _dropout(module: nn.Module, config: Any) -> float:
    for value in (getattr(module, "attention_dropout", None), getattr(module, "attn_dropout", None)):
        if isinstance(value, nn.Dropout):
            value = value.p
        if isinstance(value, (int, float)) and value:
            return float(value)
    return float(getattr(config, "attention_dropout", 0.0) or 0.0)


def _dropout_key(config: Any, value: float) -> str:
    """The config key holding the attention dropout ``value`` (attention_dropout, attn_pdrop, ...), to name it."""
    keys = [k for k, v in config.to_dict().items() if "drop" in k and "att" in k and v == value]
    return f"config.{keys[0]}" if keys else "the attention module's dropout"


def _check_attention(layer: int, module: nn.Module, config: Any) -> None:
    from .attention import module_sliding_window

    if getattr(module, "is_causal", True) is False:
        raise _refuse(layer, module, "is_causal=False (bidirectional attention): UPipe's kernels are causal")
    if getattr(module, "is_cross_attention", False):
        raise _refuse(layer, module, "cross-attention is not supported (self-attention over one sequence only)")
    if getattr(module, "is_kv_shared_layer", False) and not takes_shared_kv(module):
        raise _refuse(
            layer,
            module,
            "a KV-shared layer that does not take the keys and values of another layer through its forward "
            f"({SHARED_KV_KWARG}) is not supported",
        )
    if getattr(module, "attn_logit_softcapping", None) is not None:
        raise _refuse(layer, module, "attention logit softcapping is not supported by UPipe's kernels")
    dropout = _dropout(module, config)
    if dropout:
        key = _dropout_key(config, dropout)
        raise _refuse(layer, module, f"attention dropout {dropout} ({key}) is not supported by UPipe: set {key}=0.0")
    try:
        module_sliding_window(module)  # a bad window is refused here, before any collective
    except ValueError as err:
        raise _refuse(layer, module, str(err)) from None


def find_decoder(hf_model: nn.Module, caller: str = "apply_upipe") -> DecoderModel:
    """The decoder stack and its attention modules, or a ValueError naming the layer and the reason."""
    config = getattr(hf_model, "config", None)
    if config is not None:  # model-wide refusals first: they name the rule, whatever the module layout
        _check_config(config.get_text_config() if hasattr(config, "get_text_config") else config)
    base = decoder_stack(hf_model, caller)
    config = base.config
    _check_config(config)
    attentions, mixers = [], []
    run: set[int] = set()  # the layers UPipe runs (an attention module or a mixer)
    for i, layer in enumerate(_layers(base)):
        layer_mixers = [m for m in layer.modules() if mixer_kind_of(type(m).__name__) is not None]
        inside = {id(sub) for mixer in layer_mixers for sub in mixer.modules()}  # a mixer's own norms and convs
        if layer_mixers:  # the layer holding a registered mixer (OlmoHybridLinearAttentionDecoderLayer) is no mixer
            inside.add(id(layer))
        unknown = sorted(
            {
                type(m).__name__
                for m in layer.modules()
                if id(m) not in inside and _NON_ATTENTION_MIXER.search(type(m).__name__)
            }
        )
        if unknown:
            raise _refuse(
                i,
                layer,
                f"{', '.join(unknown)} is a sequence mixer UPipe does not shard (it runs softmax attention and the "
                "mixers of hf_patches.mixers)",
            )
        mixers.extend((i, m) for m in layer_mixers)
        if layer_mixers:
            run.add(i)
        found = [m for m in layer.modules() if calls_attention_registry(m)]
        if not found:
            if layer_mixers or layer_type(config, i) in POSITIONWISE_LAYER_TYPES:
                continue
            raise _refuse(
                i, layer, "no attention module that calls transformers' attention registry (a non-attention layer)"
            )
        if len(found) > 1:
            names = ", ".join(type(m).__name__ for m in found)
            raise _refuse(i, layer, f"{len(found)} attention modules ({names}): cross-attention is not supported")
        _check_attention(i, found[0], config)
        attentions.append(found[0])
        run.add(i)
    dropped_by = _check_kwargs_path(
        base, caller, [(i, layer) for i, layer in enumerate(_layers(base)) if i in run], attentions
    )
    return DecoderModel(getattr(config, "model_type", "") or type(base).__name__, base, attentions, mixers, dropped_by)


def passes_kwargs(module: nn.Module) -> bool:
    """Whether the module's class ``forward`` takes ``**kwargs`` and hands them on to a call (``f(..., **kwargs)``):
    read from its bytecode (through decorators), the varkw name loaded straight into a keyword merge."""
    code = getattr(inspect.unwrap(type(module).forward), "__code__", None)
    if code is None or not code.co_flags & inspect.CO_VARKEYWORDS:
        return False
    varkw = code.co_varnames[code.co_argcount + code.co_kwonlyargcount + bool(code.co_flags & inspect.CO_VARARGS)]
    ops = list(dis.get_instructions(code))
    return any(
        a.opname == "LOAD_FAST" and a.argval == varkw and b.opname in ("DICT_MERGE", "CALL_FUNCTION_EX")
        for a, b in zip(ops, ops[1:])
    )


def _takes_kwargs(module: nn.Module) -> bool:
    code = getattr(inspect.unwrap(type(module).forward), "__code__", None)
    return code is not None and bool(code.co_flags & inspect.CO_VARKEYWORDS)


def _check_kwargs_path(
    base: nn.Module, caller: str, layers: list[tuple[int, nn.Module]], attentions: list[nn.Module]
) -> str | None:
    """The one rule beside the registry call: the per-call inputs UPipe threads through the forward's kwargs
    (packed-sequence boundaries, as transformers threads its own ``cu_seq_lens_*``) must reach every attention
    module and mixer, so the base model passes its ``**kwargs`` on and each attention module takes them (else
    refused).  A decoder layer that drops them (StableLM, Nemotron: their layers name each argument of the
    attention call) still runs one document per row exactly, since nothing else travels there: the first such
    layer is returned, and a forward with packed documents is refused by name (``hf_patches.inputs``) instead of
    attending across documents without an error."""
    if not passes_kwargs(base):
        raise ValueError(
            f"{caller}: {type(base).__name__} does not pass its forward's **kwargs on to its layers: {_KWARGS_RULE}"
        )
    for attn in attentions:
        if not _takes_kwargs(attn):
            raise ValueError(f"{caller}: {type(attn).__name__}.forward takes no **kwargs: {_KWARGS_RULE}")
    for i, layer in layers:
        if not passes_kwargs(layer):
            return f"decoder layer {i} ({type(layer).__name__})"
    return None


_KWARGS_RULE = (
    "UPipe runs models whose attention modules call transformers' attention registry and whose decoder layers pass "
    "the forward's kwargs through to them (per-call inputs such as packed-sequence boundaries travel there)"
)


def layer_type(config: Any, layer: int) -> str | None:
    """The layer's type in ``config.layer_types`` or ``config.layers_block_type`` (None: not listed)."""
    for key in ("layer_types", "layers_block_type"):
        kinds = getattr(config, key, None) or ()
        if layer < len(kinds):
            return kinds[layer]
    return None


def fused_blocker(attn: nn.Module) -> str | None:
    """Why fused per-stage projections cannot reproduce this attention module (None when they can)."""
    cls = type(attn)
    name = cls.__name__
    if name in UNFUSED_ATTENTIONS:
        return UNFUSED_ATTENTIONS[name]
    if getattr(attn, "kv_lora_rank", None):  # latent attention of a family without an entry (Sarvam-MLA, Youtu)
        return latent_unfused(name)
    if name not in FUSED_ATTENTIONS or not cls.__module__.startswith("transformers.models."):
        return (
            f"{name} is not one of the Llama-shaped attention forwards fused mode reproduces "
            f"({', '.join(FUSED_ATTENTIONS)})"
        )
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        module = getattr(attn, proj, None)
        if type(module) is not nn.Linear:
            return f"{proj} is {type(module).__module__}.{type(module).__name__}, not torch.nn.Linear"
    kind = FUSED_ATTENTIONS[name]
    for norm_name in ("q_norm", "k_norm"):
        norm = getattr(attn, norm_name, None)
        if (norm is None) != (kind is None) or (norm is not None and NORM_KINDS.get(type(norm).__name__) != kind):
            return f"{norm_name} is {type(norm).__name__}, not a {kind or 'absent'} per-head norm"
    return None


def fused_blocker_of(attentions: list[nn.Module]) -> str | None:
    """The first module's reason fused mode cannot run (None when every module can)."""
    for attn in attentions:
        reason = fused_blocker(attn)
        if reason is not None:
            return reason
    return None
