"""Token-tiled sparse mixture-of-experts blocks (Qwen3-MoE, Mixtral, GPT-OSS, and any block whose
router the model records as ``router_logits``), for the long-context stack's ``tiled_mlp``.

Routing is per token (router logits, softmax, top-k, the experts' weighted sum), so running the
whole block (router and experts) on token tiles gives every token the same experts and the same
output as the untiled block; weight gradients are summed over the tiles (float64 <= 1e-10).

What the dense tiled MLP (``tiling.TiledPerToken``) does not cover, and this module adds:

- Router logits.  transformers 5.x collects them with an ``OutputRecorder`` forward hook on the
  router module (``_can_record_outputs["router_logits"]``), appending one [tokens, experts] tensor
  per layer; the load-balancing aux loss (``load_balancing_loss_func``) consumes that tuple and its
  gradient reaches the router weight through it.  Tiled, the hook would fire once per tile, under
  ``no_grad``.  Here the recorder is silenced inside the tiles, each tile's router logits are taken
  by a hook of our own and written into one [tokens, experts] output of the autograd Function
  (with gradient: backward recomputes the tile and backpropagates the logits' gradient through its
  router), and that tensor is appended to transformers' collector once per layer, where the
  untiled hook would have put it.
- Several outputs (GPT-OSS's block returns ``(hidden, router_scores)``).
- ZeRO-3: the block is marked a DeepSpeed z3 leaf module (``deepspeed.utils.set_z3_leaf_module``,
  what accelerate's ``transformer_moe_cls_names`` does for MoE blocks, and what DeepSpeed's own
  ``zero_optimization.leaf_module`` defaults do at engine start for Mixtral's, Qwen2-MoE's and
  Qwen3-MoE's blocks, not GPT-OSS's) when the stack is applied before the engine registers its hooks:
  the block's parameters (all experts) are gathered once when
  the block is called and once for its backward, not once per tile, and their gradients are reduced
  after the block's backward.  Applied to a model whose ZeRO-3 hooks already exist, the block stays
  as it is and each tile's router / experts call gathers their weights (correct, more traffic); the
  ranks then agree on the tile count as the dense MLP does.

Refused (ValueError naming the layer): a block with random routing (Mixtral's router jitter noise: the
backward's recompute would route differently), a block with an ``experts`` module but no recorded
router, a block with more than one recorded router, recorders other than the router inside it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch import Tensor, nn

from .tiling import TiledPerToken, _grad_input, _no_grad_detached, _zero3_params, exact_chunk_tiles, token_counts


def _recorders(model: nn.Module) -> list[tuple[str, type | None, str | None, int]]:
    """(key, target class, class-name suffix, output index) of the model's ``_can_record_outputs``,
    normalized as transformers' ``install_all_output_capturing_hooks`` does (a bare class or name
    records output 1, except for hidden states)."""
    from transformers.utils.output_capturing import OutputRecorder

    found = []
    for key, specs in (getattr(model, "_can_record_outputs", None) or {}).items():
        for spec in specs if isinstance(specs, list) else [specs]:
            if isinstance(spec, OutputRecorder):
                found.append((key, spec.target_class, spec.class_name, spec.index))
            else:
                index = 0 if "hidden_states" in key else 1
                found.append(
                    (key, None if isinstance(spec, str) else spec, spec if isinstance(spec, str) else None, index)
                )
    return found


def find_router(model: nn.Module, name: str, block: nn.Module) -> tuple[nn.Module, int] | None:
    """(router module, index of the router logits in its output) of an MoE block, None for a dense
    MLP.  ``model``: the PreTrainedModel whose recorders apply (the base model); ``name``: the block's
    qualified name, for errors.  Raises for a block that cannot be tiled exactly."""
    routers: list[tuple[nn.Module, int]] = []
    others: list[str] = []
    for sub_name, sub in block.named_modules():
        full = f"{name}.{sub_name}" if sub_name else name
        for key, target, class_name, index in _recorders(model):
            if (target is not None and isinstance(sub, target)) or (class_name and full.endswith(class_name)):
                if key == "router_logits" and sub is not block:
                    routers.append((sub, index))
                else:
                    others.append(f"{key} ({type(sub).__name__})")
    where = f"{name} ({type(block).__name__})"
    if others:
        raise ValueError(
            f"tiled_mlp cannot tile {where}: the model records {', '.join(others)} inside it, which the tiled "
            "MLP would record once per tile; turn tiled_mlp off for this model"
        )
    if len(routers) > 1:
        raise ValueError(
            f"tiled_mlp cannot tile {where}: it holds {len(routers)} recorded routers; one per block is supported"
        )
    if not routers:
        if hasattr(block, "experts"):
            raise ValueError(
                f"tiled_mlp cannot tile {where}: a mixture-of-experts block whose router output the model does not "
                "record (no router_logits OutputRecorder), so its router logits could not be kept; turn tiled_mlp off"
            )
        return None
    jitter = getattr(block, "jitter_noise", 0.0) or 0.0
    if jitter:
        raise ValueError(
            f"tiled_mlp cannot tile {where}: router jitter noise {jitter} draws random numbers on every call in "
            "training, so the backward's recompute of a tile would route its tokens differently; set "
            "config.router_jitter_noise=0.0 or turn tiled_mlp off"
        )
    return routers[0]


def mark_zero3_leaf(block: nn.Module) -> bool:
    """Make ZeRO-3 gather the whole block once per call (a z3 leaf module), when its hooks are not
    registered yet (a module gets ``ds_id`` when they are).  True when the block is a leaf."""
    if getattr(block, "_z3_leaf", False):
        return True
    if hasattr(block, "ds_id"):
        return False  # DeepSpeed already walked into it: changing it now would leave its hooks inconsistent
    from deepspeed.utils import set_z3_leaf_module

    set_z3_leaf_module(block, True)
    return True


def _collector() -> Any:
    # transformers' per-forward output collector (a ContextVar): the dict of lists its recorder hooks
    # append to, None outside a capturing forward.  Private in transformers 5.x; the model-level
    # parity test of router_logits fails if it changes.
    from transformers.utils.output_capturing import _active_collector

    return _active_collector


def _tile_call(
    block: nn.Module, forward: Callable, router: nn.Module, index: int, want_logits: bool, x: Tensor
) -> tuple[Tensor, ...]:
    """The block on one tile x [1, t, hidden] with transformers' recorders silenced: its outputs as
    [1, t, ...] tensors (the tile layout of ``tiling.TiledPerToken``), then the router logits
    [1, t, experts] when wanted."""
    captured: list[Tensor] = []

    def keep(module: nn.Module, args: Any, output: Any) -> None:
        captured.append(output[index] if isinstance(output, (tuple, list)) else output)

    handle = router.register_forward_hook(keep) if want_logits else None
    collector = _collector()
    token = collector.set(None)
    try:
        result = forward(block, x)
    finally:
        collector.reset(token)
        if handle is not None:
            handle.remove()
    parts = list(result) if isinstance(result, (tuple, list)) else [result]
    tokens = x.shape[1]
    outs = [parts[0].reshape(1, tokens, *parts[0].shape[2:])]
    for part in parts[1:]:
        if not isinstance(part, Tensor) or part.shape[:1] != (tokens,):
            raise RuntimeError(
                f"{type(block).__name__} returned an output of shape {getattr(part, 'shape', type(part))} for "
                f"{tokens} tokens; the tiled MLP needs one row per token"
            )
        outs.append(part.unsqueeze(0))
    if want_logits:
        if len(captured) != 1 or captured[0].shape[:1] != (tokens,):
            raise RuntimeError(
                f"{type(block).__name__}'s router ran {len(captured)} times on a tile of {tokens} tokens; the tiled "
                "MLP needs one call with one row of logits per token"
            )
        outs.append(captured[0].unsqueeze(0))
    return tuple(outs)


def tiled_moe(
    block: nn.Module, forward: Callable, router: nn.Module, index: int, x: Tensor, tile_tokens: int | None
) -> Any:
    """``forward(block, x)`` of a sparse MoE block on token tiles (``tiling.TiledPerToken``), with the same
    outputs, the same router logits recorded for transformers' collector and the same gradients as
    the untiled block.  ``tile_tokens`` None: ``tiling.default_tile_tokens`` of the longest rank."""
    from .tiling import default_tile_tokens, mlp_tile_bound

    params = list(block.parameters())
    flat = x.reshape(1, -1, x.shape[-1])
    # a z3 leaf block runs no collective per tile, so each rank may tile its own tokens
    per_tile_gathers = [] if getattr(block, "_z3_leaf", False) else _zero3_params(params)
    counts = token_counts(flat.shape[1], per_tile_gathers, x.device)
    if tile_tokens is None:
        tile_tokens = default_tile_tokens(max(counts), mlp_tile_bound(x.shape[-1]))
    tiles = exact_chunk_tiles(counts, tile_tokens)
    if tiles <= 1:
        return forward(block, x)
    collected = _collector().get()
    want_logits = collected is not None and "router_logits" in collected
    call = _no_grad_detached(functools.partial(_tile_call, block, forward, router, index, want_logits))
    outs = [out.squeeze(0) for out in TiledPerToken.apply(call, _grad_input(flat, params), tiles, params)]
    if want_logits:
        collected["router_logits"].append(outs.pop())
    first = outs[0].view(*x.shape[:-1], outs[0].shape[-1])
    return first if len(outs) == 1 else (first, *outs[1:])
