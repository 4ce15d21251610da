"""``apply_long_context_stack``: the per-token parts of a Llama-family model in sequence tiles.

With UPipe (or ALST) the attention's memory shrinks with the head chunk; what is left of a training
step's peak at long sequences is per-token work that holds several hidden-state-sized (or
vocabulary-sized) tensors at once: the lm_head logits and their float32 upcast in the loss,
transformers' RMSNorm's float32 copies of the hidden state, and the MLP's intermediate
activations.  This module replaces, per instance (other models in the process are unaffected):

- each decoder layer's ``input_layernorm`` / ``post_attention_layernorm`` and the final ``norm``
  ``forward`` with a sequence-tiled one (``tiled_norm``),
- each decoder layer's ``mlp.forward`` with a token-tiled one (``tiled_mlp``; not DeepSpeed's
  ``TiledMLP``, whose list + cat of the tile outputs holds two outputs, see ``tiling``),
- the causal LM's ``forward``, when it is given ``labels`` or ``shift_labels``, with one that
  computes the loss from the last hidden state in tiles and returns ``logits=None``
  (``tiled_loss``); without labels it is the original forward (full logits, for inference), and
  so it is with ``fused_lm_head=True`` (TRL's own tiled LM head, which its trainers call).

The attention is untouched, so the stack works the same on a UPipe-patched model, on one whose
attention ALST registered, and on a plain model.  See docs/hf_patches.md.
"""

from __future__ import annotations

import copy
import functools
import inspect
import sys
import types
from dataclasses import dataclass, field, fields
from typing import Any, Literal

import torch.distributed as dist
from torch import nn

from .architectures import POSITIONWISE_LAYER_TYPES, _unwrap, decoder_stack, layer_type
from .data import IGNORE_INDEX
from .loss import tiled_causal_lm_loss, tiled_sequence_parallel_loss
from .moe_tiling import find_router, mark_zero3_leaf, tiled_moe
from .patch import supported_model_classes
from .tiling import _forward_function, tiled_mlp, tiled_norm
from .vlm import (
    check_same_sample,
    check_shift_labels,
    under_upipe,
    vision_language_parts,
    whole_sample_shift_labels,
)

ForwardLoss = Literal["local", "sequence_parallel"]
_LAYER_NORMS = ("input_layernorm", "post_attention_layernorm")
#: the decoder's final norm: ``norm`` (transformers' usual name), ``norm_f`` (Nemotron-H)
_FINAL_NORMS = ("norm", "norm_f")
#: the two layouts ``_per_token_modules`` reads, for its errors
_LAYOUTS = "layers[i].mlp with the layer norms, or layers[i].norm before layers[i].mixer (Nemotron-H), and a final norm"


@dataclass
class LongContextStack:
    """What ``apply_long_context_stack`` did to one model (read it with ``long_context_stack``)."""

    tiled_loss: bool
    tiled_norm: bool
    tiled_mlp: bool
    #: tokens (batch rows x positions) per tile; None where the component is off or where the size is
    #: derived from each call's shard (``hf_patches.tiling.default_tile_tokens``: >= 8 tiles per shard,
    #: bounded in bytes)
    loss_tile_tokens: int | None
    norm_tile_tokens: int | None
    mlp_tile_tokens: int | None
    #: "local": the forward's loss is this rank's mean (transformers' ForCausalLMLoss);
    #: "sequence_parallel": the token-weighted mean over ``loss_group`` (tiled_sequence_parallel_loss)
    forward_loss: ForwardLoss = "local"
    loss_group: Any = None
    grad_reduction: Literal["mean", "sum"] = "mean"
    ignore_index: int = IGNORE_INDEX
    #: the modules whose forward was replaced, by name in the model
    patched: list[str] = field(default_factory=list)

    def __deepcopy__(self, memo: dict[int, Any]) -> LongContextStack:
        """A copy of the model shares the loss's process group (a process group cannot be copied)."""
        memo.setdefault(id(self.loss_group), self.loss_group)
        clone = object.__new__(type(self))
        memo[id(self)] = clone
        for f in fields(self):
            setattr(clone, f.name, copy.deepcopy(getattr(self, f.name), memo))
        return clone


def long_context_stack(model: nn.Module) -> LongContextStack | None:
    """The ``LongContextStack`` of a model (None when ``apply_long_context_stack`` was not applied)."""
    return getattr(_unwrap(model), "_long_context_stack", None)


def _positive(name: str, value: int | None) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int (tokens per tile) or None, got {value!r}")
    return value


def _check_options(
    hf_model: nn.Module, tiled_loss: bool, forward_loss: str, grad_reduction: str, ignore_index: int
) -> None:
    if forward_loss not in ("local", "sequence_parallel"):
        raise ValueError(f"forward_loss must be 'local' or 'sequence_parallel', got {forward_loss!r}")
    if forward_loss != "local" and not tiled_loss:
        raise ValueError(f"forward_loss={forward_loss!r} is a setting of the tiled loss; it needs tiled_loss=True")
    if grad_reduction not in ("mean", "sum"):
        raise ValueError(f"grad_reduction must be 'mean' or 'sum', got {grad_reduction!r}")
    if not isinstance(ignore_index, int):
        raise ValueError(f"ignore_index must be an int, got {ignore_index!r}")
    if tiled_loss:
        head = hf_model.get_output_embeddings() if hasattr(hf_model, "get_output_embeddings") else None
        if head is None:
            raise ValueError(
                f"tiled_loss=True needs a causal LM with an lm_head; {type(hf_model).__name__} has none "
                "(pass the *ForCausalLM model, not the base model)"
            )
        # a vision-language model's is its text config's
        softcap = getattr(hf_model.config.get_text_config(), "final_logit_softcapping", None)
        if softcap:
            raise ValueError(f"tiled_loss does not apply final_logit_softcapping={softcap}; it must be None")


def _layout_error(what: str) -> ValueError:
    return ValueError(
        f"apply_long_context_stack: {what} is not laid out as transformers' decoders are ({_LAYOUTS}), which the "
        "stack's tiled norms and MLPs replace; the family registry's models are: "
        + ", ".join(supported_model_classes())
    )


def _per_token_modules(base: nn.Module) -> tuple[list[tuple[str, nn.Module]], list[tuple[str, nn.Module]]]:
    """(norms, MLPs) the stack tiles, as (qualified name, module), in one of the two layouts of transformers'
    decoders: a layer holding ``input_layernorm``, ``post_attention_layernorm`` and ``mlp`` (Llama, Qwen3.5,
    and most others), or a one-mixer block (Nemotron-H: ``norm`` before ``mixer``, the mixer an MLP or MoE
    block where the config's layer type is position-wise, ``architectures.POSITIONWISE_LAYER_TYPES``); then
    the final norm (``norm``, Nemotron-H's ``norm_f``).  ValueError naming a layer of neither layout."""
    norms: list[tuple[str, nn.Module]] = []
    mlps: list[tuple[str, nn.Module]] = []
    for index, layer in enumerate(base.layers):
        where = f"layers.{index}"
        if all(isinstance(getattr(layer, n, None), nn.Module) for n in (*_LAYER_NORMS, "mlp")):
            norms += [(f"{where}.{n}", getattr(layer, n)) for n in _LAYER_NORMS]
            mlps.append((f"{where}.mlp", layer.mlp))
        elif all(isinstance(getattr(layer, n, None), nn.Module) for n in ("norm", "mixer")):
            norms.append((f"{where}.norm", layer.norm))
            if layer_type(base.config, index) in POSITIONWISE_LAYER_TYPES:
                mlps.append((f"{where}.mixer", layer.mixer))
        else:
            raise _layout_error(f"decoder layer {index} ({type(layer).__name__})")
    final = next((n for n in _FINAL_NORMS if isinstance(getattr(base, n, None), nn.Module)), None)
    if final is None:
        raise ValueError(
            f"apply_long_context_stack: {type(base).__name__} has no final norm ({' or '.join(_FINAL_NORMS)}), "
            "which the stack's tiled norm replaces"
        )
    return norms + [(final, getattr(base, final))], mlps


def _decoder_of(hf_model: nn.Module) -> nn.Module:
    """The decoder stack the stack tiles (``architectures.decoder_stack``: the rule ``apply_upipe`` uses; a
    vision-language model's text model, its vision tower untouched, as ``apply_upipe`` finds it), with its
    layers in an ``nn.ModuleList`` (their norms and MLPs: ``_per_token_modules``)."""
    vlm = vision_language_parts(hf_model, "apply_long_context_stack")
    base = decoder_stack(hf_model if vlm is None else vlm.text, "apply_long_context_stack")
    if not isinstance(getattr(base, "layers", None), nn.ModuleList):
        raise _layout_error(f"{type(hf_model).__name__}'s decoder ({type(base).__name__})")
    return base


def _norm_forward(self: nn.Module, hidden_states: Any) -> Any:
    return tiled_norm(self, self._long_context_forward, hidden_states, self._long_context_tile_tokens)


def _mlp_forward(self: nn.Module, x: Any) -> Any:
    return tiled_mlp(self, self._long_context_forward, x, self._long_context_tile_tokens)


def _moe_forward(self: nn.Module, x: Any, *, router: str, index: int) -> Any:
    # the router by name: a module attribute would register it as a second parent's submodule
    return tiled_moe(
        self, self._long_context_forward, self.get_submodule(router), index, x, self._long_context_tile_tokens
    )


def _replace_forward(module: nn.Module, forward: Any, tile_tokens: int | None) -> None:
    module._long_context_forward = _forward_function(module)  # checked before anything is replaced
    module._long_context_tile_tokens = tile_tokens
    module.forward = types.MethodType(forward, module)


_AUX_ATTRIBUTES = ("router_aux_loss_coef", "num_experts", "num_experts_per_tok")


def _aux_loss_function(hf_model: nn.Module) -> Any:
    """The modeling file's ``load_balancing_loss_func`` of an MoE causal LM (None for a dense one)."""
    if not hasattr(hf_model, "router_aux_loss_coef"):
        return None
    return getattr(sys.modules[type(hf_model).__module__], "load_balancing_loss_func", None)


def _check_aux_loss(hf_model: nn.Module) -> None:
    """The tiled loss adds an MoE model's load-balancing loss as its own forward does (transformers'
    Mixtral / Qwen3-MoE / GPT-OSS pattern); refuse an MoE causal LM that does it another way."""
    if not hasattr(hf_model, "router_aux_loss_coef"):
        text = hf_model.config.get_text_config()
        if text is not hf_model.config and getattr(text, "router_aux_loss_coef", None) is not None:
            raise ValueError(
                f"tiled_loss cannot add {type(hf_model).__name__}'s router aux loss: a vision-language model with a "
                "mixture-of-experts text model (config.text_config.router_aux_loss_coef) adds it in its own forward, "
                "which the tiled loss replaces; turn tiled_loss off for this model"
            )
        return
    missing = [a for a in _AUX_ATTRIBUTES if not hasattr(hf_model, a)]
    if _aux_loss_function(hf_model) is None:
        missing.append(f"{type(hf_model).__module__}.load_balancing_loss_func")
    if missing:
        raise ValueError(
            f"tiled_loss cannot add {type(hf_model).__name__}'s router aux loss: it lacks {', '.join(missing)} "
            "(the tiled loss follows transformers' MoE causal LMs); turn tiled_loss off for this model"
        )


def _loss_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The causal LM's forward with the tiled loss: with ``labels`` or ``shift_labels``, the base
    model's last hidden state goes to the tiled loss and no logits are made.  An MoE model's router
    aux loss (``output_router_logits``) is added as its own forward adds it.  A vision-language model's
    inner model (``self.model``: encoders, merge, text model) gives the last hidden state; under UPipe
    its whole sample's ``labels`` give this rank's shard of the shifted labels and the loss over the
    UPipe group, as its patched forward does (``hf_patches.vlm``)."""
    from transformers.modeling_outputs import (
        CausalLMOutputWithPast,
        MoeCausalLMOutputWithPast,
        MultimodalBaseModelOutputWithPast,
        MultimodalCausalLMOutputWithPast,
    )

    original = self._long_context_forward
    signature = inspect.signature(original)
    bound = signature.bind(self, *args, **kwargs)
    arguments = dict(bound.arguments)
    arguments.pop(next(iter(arguments)))  # self
    for name, param in signature.parameters.items():
        if param.kind is inspect.Parameter.VAR_KEYWORD:
            arguments.update(arguments.pop(name, {}))
    labels, shift_labels = arguments.pop("labels", None), arguments.pop("shift_labels", None)
    if (labels is None and shift_labels is None) or arguments.get("fused_lm_head"):
        # TRL's fused LM head (trl.trainer.utils.add_fused_lm_head, what its trainers call with
        # fused_lm_head=True) returns per-token log-probs, entropy and accuracy for TRL's loss and
        # metrics; it is itself tiled (4096 tokens x 32768 vocabulary entries per tile, online
        # logsumexp, no [tokens, vocab] logits), so it runs as TRL ships it
        return original(self, *args, **kwargs)
    num_items = arguments.pop("num_items_in_batch", None)
    arguments.pop("logits_to_keep", None)
    aux_function = _aux_loss_function(self)
    want_aux = False
    if aux_function is not None:  # as the MoE forward: the argument, else the config
        want_aux = arguments.get("output_router_logits")
        want_aux = bool(self.config.output_router_logits if want_aux is None else want_aux)
        arguments["output_router_logits"] = want_aux
    stack: LongContextStack = self._long_context_stack
    loss_group = stack.loss_group if stack.forward_loss == "sequence_parallel" else None
    whole_sample = under_upipe(self) and shift_labels is None
    if under_upipe(self):  # the patched VLM forward's check, before the tower's collectives
        sample = {**arguments, "labels": labels, "shift_labels": shift_labels}
        check_same_sample(type(self).__name__, sample, self._upipe_state)
    if under_upipe(self) and shift_labels is not None:
        check_shift_labels(self, shift_labels, arguments)  # this rank's shard: the stack's forward_loss applies
    elif whole_sample:  # the whole sample's labels: the VLM's loss over its UPipe group
        shift_labels = whole_sample_shift_labels(self, labels, arguments.get("attention_mask"))
        loss_group = self._upipe_state.group
    outputs = self.model(**arguments)
    hidden = outputs.last_hidden_state
    if shift_labels is None:  # transformers' ForCausalLMLoss shift: label of the next token, -100 at the end
        shift_labels = nn.functional.pad(labels, (0, 1), value=stack.ignore_index)[..., 1:]
    if stack.forward_loss == "sequence_parallel" or whole_sample:
        loss = tiled_sequence_parallel_loss(
            self,
            hidden,
            shift_labels,
            loss_group,
            grad_reduction=stack.grad_reduction,
            ignore_index=stack.ignore_index,
            tile_tokens=stack.loss_tile_tokens,
        )
    else:
        loss = tiled_causal_lm_loss(
            self,
            hidden,
            shift_labels,
            num_items_in_batch=num_items,
            ignore_index=stack.ignore_index,
            tile_tokens=stack.loss_tile_tokens,
        )
    rest = {k: v for k, v in outputs.items() if k != "last_hidden_state"}
    if isinstance(outputs, MultimodalBaseModelOutputWithPast):  # a VLM's: its encoders' outputs too
        return MultimodalCausalLMOutputWithPast(loss=loss, logits=None, **rest)
    if aux_function is None:
        return CausalLMOutputWithPast(loss=loss, logits=None, **rest)
    aux_loss = None
    if want_aux:
        aux_loss = aux_function(
            outputs.router_logits, self.num_experts, self.num_experts_per_tok, arguments.get("attention_mask")
        )
        loss = loss + self.router_aux_loss_coef * aux_loss.to(loss.device)
    return MoeCausalLMOutputWithPast(loss=loss, aux_loss=aux_loss, logits=None, **rest)


def check_long_context_stack(model: nn.Module, **options: Any) -> None:
    """Every check of ``apply_long_context_stack(model, **options)`` without changing the model: it
    reads only the model's structure and the options, so a caller can refuse a bad combination
    alike on every rank before any collective (``ds_upipe.initialize`` does)."""
    _plan(model, **options)


def _plan(
    model: nn.Module,
    *,
    tiled_loss: bool = False,
    tiled_norm: bool = False,
    tiled_mlp: bool = False,
    loss_tile_tokens: int | None = None,
    norm_tile_tokens: int | None = None,
    mlp_tile_tokens: int | None = None,
    forward_loss: ForwardLoss = "local",
    loss_group: dist.ProcessGroup | None = None,
    grad_reduction: Literal["mean", "sum"] = "mean",
    ignore_index: int = IGNORE_INDEX,
) -> tuple[nn.Module, LongContextStack, list[tuple[str, nn.Module, Any, int | None]]]:
    """(the HF model, its LongContextStack, the modules to patch): all checks, no change."""
    hf_model = _unwrap(model)
    base = _decoder_of(hf_model)
    if getattr(hf_model, "_long_context_stack", None) is not None:
        raise ValueError(f"{type(hf_model).__name__} already has the long-context stack")
    _check_options(hf_model, tiled_loss, forward_loss, grad_reduction, ignore_index)
    loss_tiles = _positive("loss_tile_tokens", loss_tile_tokens)
    norm_tiles = _positive("norm_tile_tokens", norm_tile_tokens)
    mlp_tiles = _positive("mlp_tile_tokens", mlp_tile_tokens)
    stack = LongContextStack(
        tiled_loss=bool(tiled_loss),
        tiled_norm=bool(tiled_norm),
        tiled_mlp=bool(tiled_mlp),
        loss_tile_tokens=loss_tiles if tiled_loss else None,
        norm_tile_tokens=norm_tiles if tiled_norm else None,
        mlp_tile_tokens=mlp_tiles if tiled_mlp else None,
        forward_loss=forward_loss,
        loss_group=loss_group,
        grad_reduction=grad_reduction,
        ignore_index=ignore_index,
    )
    targets: list[tuple[str, nn.Module, Any, int | None]] = []
    norms, mlps = _per_token_modules(base)
    if tiled_norm:
        targets += [(name, m, _norm_forward, stack.norm_tile_tokens) for name, m in norms]
    if tiled_mlp:
        for name, mlp in mlps:
            found = find_router(base, name, mlp)  # a sparse MoE block's router (or a ValueError naming the layer)
            forward = _mlp_forward
            if found is not None:
                router = next(n for n, m in mlp.named_modules() if m is found[0])
                forward = functools.partial(_moe_forward, router=router, index=found[1])
            targets.append((name, mlp, forward, stack.mlp_tile_tokens))
    if tiled_loss:
        _check_aux_loss(hf_model)
    for _, module, _, _ in targets:  # every check before the first change
        _forward_function(module)
    if tiled_loss:
        _forward_function(hf_model)
    return hf_model, stack, targets


def apply_long_context_stack(
    model: nn.Module,
    *,
    tiled_loss: bool = False,
    tiled_norm: bool = False,
    tiled_mlp: bool = False,
    loss_tile_tokens: int | None = None,
    norm_tile_tokens: int | None = None,
    mlp_tile_tokens: int | None = None,
    forward_loss: ForwardLoss = "local",
    loss_group: dist.ProcessGroup | None = None,
    grad_reduction: Literal["mean", "sum"] = "mean",
    ignore_index: int = IGNORE_INDEX,
) -> nn.Module:
    """Tile the loss, the RMSNorms and/or the MLPs of a Llama/Mistral/Qwen2/Qwen3 model in place.

    Args:
        model: a ``*ForCausalLM`` or base ``*Model`` (also wrapped by PEFT or a DeepSpeed engine),
            patched by ``apply_upipe``, registered with ALST, or plain.
        tiled_loss: the causal LM's forward computes the loss from labels / shift_labels in tiles
            (needs a ``*ForCausalLM``); training loops can also call ``tiled_sequence_parallel_loss``.
        tiled_norm: the decoder layers' input / post-attention RMSNorms and the final norm in tiles.
        tiled_mlp: the decoder layers' MLPs in token tiles (``tiling.tiled_mlp``).
        loss_tile_tokens: tokens per loss tile (None: derived from each call's shard by
            ``tiling.default_tile_tokens``: at least 8 tiles, at most about 1 GiB of float32 logits).
        norm_tile_tokens: tokens per norm tile (None: the same rule, at most 256 MiB per float32 copy).
        mlp_tile_tokens: tokens per MLP tile (None: the same rule, at most hidden_size, ALST's choice).
        forward_loss: what the forward's loss is: "local" (this rank's mean, transformers'
            ForCausalLMLoss: the HF Trainer / accelerate sequence-parallel path combines it over the
            ranks) or "sequence_parallel" (``tiled_sequence_parallel_loss`` over ``loss_group`` with
            ``grad_reduction``: the global mean, for loops that call ``engine(..., shift_labels=...)``).
    Returns the same model.  Refused (ValueError, before any change and any collective, alike on
    every rank): unsupported classes, a second application, tiled_loss without an lm_head, bad
    tile sizes or loss settings.
    """
    hf_model, stack, targets = _plan(
        model,
        tiled_loss=tiled_loss,
        tiled_norm=tiled_norm,
        tiled_mlp=tiled_mlp,
        loss_tile_tokens=loss_tile_tokens,
        norm_tile_tokens=norm_tile_tokens,
        mlp_tile_tokens=mlp_tile_tokens,
        forward_loss=forward_loss,
        loss_group=loss_group,
        grad_reduction=grad_reduction,
        ignore_index=ignore_index,
    )
    for name, module, forward, tile_tokens in targets:
        if getattr(forward, "func", None) is _moe_forward:
            mark_zero3_leaf(module)  # ZeRO-3 gathers the experts once per block call, not per tile
        _replace_forward(module, forward, tile_tokens)
        stack.patched.append(name)
    if tiled_loss:
        hf_model._long_context_forward = _forward_function(hf_model)
        hf_model.forward = types.MethodType(_loss_forward, hf_model)
        stack.patched.append("forward")
    hf_model._long_context_stack = stack
    return model
