"""Sequence-tiled compute of the per-token parts of a decoder: RMSNorm, MLP, lm_head + cross-entropy.

Each function runs its module on tiles of the sequence under ``torch.no_grad`` and recomputes one
tile at a time in backward, so at most one tile's intermediates (the norm's float32 copies, the
MLP's [tokens, intermediate] activations, the logits and their float32 upcast) exist at once.  The
math is per token, so outputs equal the untiled module's bit for bit; weight gradients are summed
over the tiles (a different summation order: float64 <= 1e-10, float32 <= 1e-5).

DeepSpeed's autograd Functions do the work (deepspeed.runtime.sequence_parallel.ulysses_sp):

- norm: ``TiledPerToken``, DeepSpeed's ``SequenceTiledCompute`` reduced to this case with its input saved by
  ``save_for_backward`` (released right after its backward; SequenceTiledCompute keeps it on the
  context for as long as the graph lives), output written tile by tile into one buffer.
- MLP: the same ``TiledPerToken`` Function over the flattened tokens (the MLP is per token too), not
  DeepSpeed's ``TiledMLP``: TiledMLP keeps every tile's output in a list and ``torch.cat``s them, so
  at the cat two MLP outputs (two hidden states) are alive at once; that cat set the peak of the
  Llama3-8B layer plan at 8M tokens.  The tile count is agreed across ZeRO-3 ranks and chosen so
  that every rank's tokens split into exactly that many tiles (``exact_chunk_tiles``: each tile is
  one ZeRO-3 gather per projection, on every rank alike).
- loss: ``TiledLossSum``, DeepSpeed's ``SequenceTiledCompute`` for a scalar output per tile, summed,
  with its inputs saved by ``save_for_backward`` as in TiledPerToken (released before the layers'
  backward).  Not DeepSpeed's
  ``TiledFusedLogitsLoss``: it runs the backward inside the forward with an assumed upstream
  gradient of 1.0 and only rescales the hidden-state gradient by the real one, so the lm_head weight
  gradient ignores every later scale (DeepSpeed's 1/gradient_accumulation_steps in
  ``engine.backward``, fp16 loss scaling, the sequence-parallel loss's 1/total-tokens), and the
  lm_head gradient is produced (and reduced by ZeRO) during the forward.

ZeRO: every tile that calls a module (MLP projections, lm_head) makes ZeRO-3 gather its weights, a
collective, so all ranks of the weights' ZeRO-3 group must run the same number of tiles; the tile
count is agreed with one small all_gather of the token counts (only for ZeRO-3 partitioned weights).
The tiled Functions set ``ds_grad_is_ready`` so ZeRO reduces a weight's gradient once, after its
last tile.  A tied lm_head / embedding weight must wait for the embedding's gradient too:
``tiled_loss_sum`` keeps it not-ready through the loss tiles and marks it ready again right after
the loss's backward (``_MarkGradReady``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

#: default norm tile bound: about 256 MiB per float32 copy of the tile (the layer norms of the
#: long-context stack, and fused Qwen3's per-head q/k norms)
NORM_TILE_BYTES = 1 << 28
#: default loss tile bound: about 1 GiB of float32 logits (ArcticTraining's choice)
LOSS_TILE_BYTES = 1 << 30
#: default tiles per shard: a part left at its default tile size is cut into at least this many
#: tiles of the rank's tokens (only at large shards does the byte bound make the tiles smaller).
#: With byte bounds alone a CPU- or main-job-sized shard (2,048 tokens) was one tile and the stack
#: did nothing: the loss tile bound is 8,388 tokens at vocab 32K.
MIN_TILES = 8


def default_tile_tokens(tokens: int, bound_tokens: int) -> int:
    """The one rule for a tile size left unset (every entry point: ``apply_long_context_stack``,
    the ds_config's ``true`` / ``{"tile_tokens": null}``, the planner, the benchmarks): at least
    ``MIN_TILES`` tiles of ``tokens`` (the longest rank's tokens where the ranks must agree), and at
    most ``bound_tokens`` tokens per tile (the part's byte bound)."""
    return max(1, min(bound_tokens, math.ceil(tokens / MIN_TILES)))


def loss_tile_bound(vocab: int) -> int:
    """Tokens of about ``LOSS_TILE_BYTES`` of float32 logits."""
    return max(1, LOSS_TILE_BYTES // (4 * vocab))


def norm_tile_bound(hidden: int) -> int:
    """Tokens of about ``NORM_TILE_BYTES`` per float32 copy of the hidden state."""
    return max(1, NORM_TILE_BYTES // (4 * hidden))


def mlp_tile_bound(hidden: int) -> int:
    """hidden_size tokens per MLP tile (ALST's choice)."""
    return max(1, hidden)


def tiles_for(tokens: int, tile_tokens: int) -> int:
    """Number of tiles of at most ``tile_tokens`` tokens for ``tokens`` tokens (at least 1)."""
    return max(1, math.ceil(tokens / tile_tokens))


def _zero3_params(params: Sequence[nn.Parameter]) -> list[nn.Parameter]:
    """The parameters DeepSpeed ZeRO-3 partitions (gathered per module call)."""
    return [p for p in params if hasattr(p, "ds_id") and hasattr(p, "ds_status")]


def token_counts(tokens: int, params: Sequence[nn.Parameter], device: torch.device) -> list[int]:
    """Every rank's token count when ``params`` are ZeRO-3 partitioned (their process group runs
    one all-gather per module call, so all its ranks must tile alike); else just this rank's."""
    zero3 = _zero3_params(params)
    if not zero3 or not dist.is_initialized():
        return [tokens]
    group = getattr(zero3[0], "ds_process_group", None)
    size = dist.get_world_size(group)
    if size == 1:
        return [tokens]
    mine = torch.tensor([tokens], dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(every, mine, group=group)
    return [int(t.item()) for t in every]


def _chunk_count(tokens: int, chunks: int) -> int:
    """How many pieces ``torch.chunk`` really makes of ``tokens`` rows asked for ``chunks``."""
    return chunks if tokens == 0 else math.ceil(tokens / math.ceil(tokens / chunks))


def exact_chunk_tiles(counts: Sequence[int], tile_tokens: int) -> int:
    """The largest tile count <= what the longest rank needs that splits every rank's tokens into
    exactly that many tiles of ceil(tokens / count) (``torch.chunk``'s and ``TiledPerToken``'s split;
    each tile gathers the ZeRO-3 weights once, so every rank must make as many)."""
    tiles = max(tiles_for(n, tile_tokens) for n in counts)
    while tiles > 1 and any(_chunk_count(n, tiles) != tiles for n in counts):
        tiles -= 1
    return tiles


def _grad_input(x: Tensor, params: Sequence[nn.Parameter]) -> Tensor:
    """x, made to require grad when only the module's weights do: a Function's output requires grad
    only through its tensor inputs, and the weights are not among them (e.g. frozen embeddings
    below a trained norm)."""
    if torch.is_grad_enabled() and not x.requires_grad and any(p.requires_grad for p in params):
        return x.detach().requires_grad_(True)
    return x


def _no_grad_detached(fn: Callable) -> Callable:
    """fn with its tensor arguments detached when it runs without grad (the tiled forwards).  There
    they are no-grad-mode views of tensors that require grad; a module hook that looks for their
    autograd node (torch's ModTracker / MemTracker) fails on those, and no gradient is wanted."""

    def call(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            args = tuple(a.detach() if isinstance(a, Tensor) else a for a in args)
            kwargs = {k: v.detach() if isinstance(v, Tensor) else v for k, v in kwargs.items()}
        return fn(*args, **kwargs)

    return call


def _forward_function(module: nn.Module) -> Callable:
    """The module's current forward as a plain function of (module, *args)."""
    forward = module.forward
    func = getattr(forward, "__func__", None)
    if func is None or getattr(forward, "__self__", None) is not module:
        raise ValueError(
            f"{type(module).__name__}.forward is a {type(forward).__name__} "
            f"({getattr(forward, '__qualname__', '?')}), not a method of the module (wrapped by another "
            "library?); the long-context stack replaces module methods"
        )
    return func


class TiledPerToken(torch.autograd.Function):
    """``fn(x)`` of a per-token module (RMSNorm, MLP, MoE block) on sequence tiles of [batch, seq, hidden]
    x (``fn(x, *extras)`` with per-token ``extras`` [batch, seq, ...] cut into the same tiles, e.g. the
    labels of ``hf_patches.logprobs``; no gradient flows into them), recomputed tile by tile in
    backward: DeepSpeed's ``SequenceTiledCompute`` for this one case, except that x is kept with
    ``save_for_backward`` instead of on the context.  A saved tensor is released as soon as this
    node's backward has run (and goes through saved-tensor hooks), while a context attribute lives as
    long as the graph: in a decoder layer that was the residual sum feeding the post-attention norm,
    one hidden state kept through the attention's backward (measured on the Llama3-8B plan).

    ``fn`` returns one [batch, t, ...] tensor or a tuple of them (a MoE block's hidden state and router
    logits, ``moe_tiling``); each output is written tile by tile into one buffer (no list + cat), and
    backward backpropagates every output that got a gradient (an output nobody used gets None).
    Parameter gradients accumulate into ``.grad`` through the per-tile backward (the parameters are not
    inputs of the Function), marked ready for ZeRO's reduction only at the last tile, as
    SequenceTiledCompute does."""

    @staticmethod
    def forward(
        ctx, fn: Callable, hidden_states: Tensor, tiles: int, params: Sequence[nn.Parameter], *extras: Tensor
    ) -> Tensor | tuple[Tensor, ...]:
        ctx.fn = fn
        ctx.params = [p for p in params if p.requires_grad]
        seq = hidden_states.shape[1]
        ctx.step = math.ceil(seq / tiles)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(hidden_states, *extras)
        source = hidden_states.detach()
        buffers: list[Tensor] = []
        with torch.no_grad():
            for start in range(0, seq, ctx.step):
                result = fn(source[:, start : start + ctx.step], *(e[:, start : start + ctx.step] for e in extras))
                many = isinstance(result, tuple)
                outs = result if many else (result,)
                if not buffers:
                    buffers = [o.new_empty((o.shape[0], seq, *o.shape[2:])) for o in outs]
                for buffer, out in zip(buffers, outs, strict=True):
                    buffer[:, start : start + ctx.step] = out
                del result, outs
        return tuple(buffers) if many else buffers[0]

    @staticmethod
    def backward(ctx, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        hidden_states, *extras = ctx.saved_tensors
        needs_x = ctx.needs_input_grad[1]
        source = hidden_states.detach()
        grad_x = torch.empty_like(source) if needs_x else None
        starts = list(range(0, source.shape[1], ctx.step))
        for i, start in enumerate(starts):
            for param in ctx.params:  # ZeRO reduces each weight's gradient once, after the last tile
                param.ds_grad_is_ready = i + 1 == len(starts)
            tile = source[:, start : start + ctx.step].detach().requires_grad_(needs_x)
            with torch.enable_grad():
                result = ctx.fn(tile, *(e[:, start : start + ctx.step] for e in extras))
            outs = result if isinstance(result, tuple) else (result,)
            pairs = [
                (out, grad[:, start : start + ctx.step])
                for out, grad in zip(outs, grads, strict=True)
                if grad is not None and out.requires_grad
            ]
            if pairs:
                torch.autograd.backward([out for out, _ in pairs], [grad for _, grad in pairs])
            del result, outs, pairs
            if grad_x is not None:
                if tile.grad is None:  # no used output depends on x
                    grad_x[:, start : start + ctx.step].zero_()
                else:
                    grad_x[:, start : start + ctx.step] = tile.grad
        return None, grad_x, None, None, *(None for _ in extras)


def tiled_norm(module: nn.Module, forward: Callable, hidden_states: Tensor, tile_tokens: int | None) -> Tensor:
    """``forward(module, hidden_states)`` of a per-token module (RMSNorm) on sequence tiles of
    [batch, seq, hidden] input, recomputed per tile in backward (``TiledPerToken``).  No collective runs
    inside (the module is not called through ``__call__``; ZeRO-3 has gathered its weight around the
    whole call), so the tile count is this rank's own.  ``tile_tokens`` None: ``default_tile_tokens``."""
    if hidden_states.dim() != 3:
        return forward(module, hidden_states)
    batch, seq = hidden_states.shape[:2]
    if tile_tokens is None:
        tile_tokens = default_tile_tokens(batch * seq, norm_tile_bound(hidden_states.shape[-1]))
    tiles = min(seq, tiles_for(batch * seq, tile_tokens))
    if tiles <= 1:
        return forward(module, hidden_states)
    params = list(module.parameters())
    hidden_states = _grad_input(hidden_states, params)
    return TiledPerToken.apply(functools.partial(forward, module), hidden_states, tiles, params)


def tiled_mlp(module: nn.Module, forward: Callable, x: Tensor, tile_tokens: int | None) -> Tensor:
    """``forward(module, x)`` of an MLP on token tiles (``TiledPerToken`` over x flattened to
    [1, tokens, hidden], so that every tile has the same tokens in forward and backward), the output
    written into one buffer.  ``tile_tokens`` None: ``default_tile_tokens`` of the longest rank
    (ZeRO-3 ranks agree on the tile count, ``exact_chunk_tiles``)."""
    params = list(module.parameters())
    flat = x.reshape(1, -1, x.shape[-1])
    counts = token_counts(flat.shape[1], params, x.device)
    if tile_tokens is None:
        tile_tokens = default_tile_tokens(max(counts), mlp_tile_bound(x.shape[-1]))
    tiles = exact_chunk_tiles(counts, tile_tokens)
    if tiles <= 1:
        return forward(module, x)
    out = TiledPerToken.apply(
        _no_grad_detached(functools.partial(forward, module)), _grad_input(flat, params), tiles, params
    )
    return out.view(*x.shape[:-1], out.shape[-1])


class _MarkGradReady(torch.autograd.Function):
    """Identity on the loss's hidden-state input whose backward (right after the tiled loss's)
    marks ``params`` ready for ZeRO's gradient reduction again."""

    @staticmethod
    def forward(ctx, hidden: Tensor, params: tuple[nn.Parameter, ...]) -> Tensor:
        ctx.params = params
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        for param in ctx.params:
            param.ds_grad_is_ready = True
        return grad, None


class TiledLossSum(torch.autograd.Function):
    """Sum of the scalar ``fn(hidden_tile, labels_tile)`` over ``tiles`` sequence tiles, each tile
    recomputed in backward.  DeepSpeed's ``SequenceTiledCompute`` (loss case) reduced to what the
    loss needs, with one change: the hidden state (and labels) are saved with ``save_for_backward``,
    so autograd releases them right after this node's backward, i.e. before the decoder layers'
    backward.  ``SequenceTiledCompute`` keeps them on ``ctx`` for as long as the graph lives: one
    full hidden state per rank held through every layer's backward (the planner's Llama3-8B plan
    measured +1 GiB per million tokens at 8 ranks).  Like it: always ``tiles`` calls (empty trailing
    tiles included, as every rank of a ZeRO-3 group must gather the lm_head alike), the per-tile
    scalars summed from one stack, parameters marked ready for ZeRO only at the last tile."""

    @staticmethod
    def forward(
        ctx, fn: Callable, hidden: Tensor, labels: Tensor, tiles: int, params: Sequence[nn.Parameter]
    ) -> Tensor:
        ctx.fn = fn
        ctx.params = [p for p in params if p.requires_grad]
        ctx.tiles = tiles
        ctx.step = math.ceil(hidden.shape[1] / tiles)
        ctx.save_for_backward(hidden, labels)
        source = hidden.detach()
        with torch.no_grad():
            parts = [fn(*_tile(ctx, i, source, labels)) for i in range(tiles)]
            return torch.stack(parts).sum()

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[None, Tensor | None, None, None, None]:
        hidden, labels = ctx.saved_tensors
        needs_x = ctx.needs_input_grad[1]
        source = hidden.detach()
        del hidden
        grad_x = torch.empty_like(source) if needs_x else None
        for i in range(ctx.tiles):
            for param in ctx.params:  # ZeRO reduces each weight's gradient once, after the last tile
                param.ds_grad_is_ready = i + 1 == ctx.tiles
            tile, tile_labels = _tile(ctx, i, source, labels)
            tile = tile.detach().requires_grad_(needs_x)
            with torch.enable_grad():
                out = ctx.fn(tile, tile_labels)
            torch.autograd.backward(out, grad)
            del out
            if grad_x is not None and tile.shape[1]:
                start = i * ctx.step
                grad_x[:, start : start + tile.shape[1]] = tile.grad
        return None, grad_x, None, None, None


def _tile(ctx: Any, i: int, hidden: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """Tile i of a ``TiledLossSum``'s inputs (trailing tiles past the end are empty)."""
    start = min(i * ctx.step, hidden.shape[1])
    return hidden[:, start : start + ctx.step], labels[:, start : start + ctx.step]


def tiled_loss_sum(
    lm_head: nn.Module,
    hidden: Tensor,
    labels: Tensor,
    *,
    tile_tokens: int | None,
    ignore_index: int,
    shared_params: Sequence[nn.Parameter] = (),
) -> Tensor:
    """Sum over this rank's tokens of cross_entropy(lm_head(hidden), labels), in sequence tiles.

    Like ``sequence_parallel_loss``, 16-bit logits are upcast to float32 (per tile here).  Only
    one tile's logits exist at a time, in forward and in backward (which recomputes them).
    ``shared_params``: lm_head parameters used elsewhere in the model (a tied embedding), whose
    ZeRO gradient reduction must wait for the other use's gradient.  ``tile_tokens`` None:
    ``default_tile_tokens`` of the longest rank of the lm_head's ZeRO-3 group.
    """
    batch, seq = labels.shape
    params = list(lm_head.parameters())
    counts = token_counts(batch * seq, params, hidden.device)
    if tile_tokens is None:
        vocab = getattr(lm_head, "out_features", None) or lm_head.weight.shape[0]
        tile_tokens = default_tile_tokens(max(counts), loss_tile_bound(vocab))
    # SequenceTiledCompute always runs `tiles` calls (empty trailing tiles allowed), as ZeRO-3 needs
    tiles = max(tiles_for(n, tile_tokens) for n in counts)
    # the other use (the embedding) adds its gradient later only if the gradient flows down through hidden
    shared = tuple(p for p in shared_params if p.requires_grad) if hidden.requires_grad else ()
    hidden = _grad_input(hidden, params)
    if shared and torch.is_grad_enabled():
        hidden = _MarkGradReady.apply(hidden, shared)

    def loss_sum(hidden_states: Tensor, labels: Tensor) -> Tensor:
        if torch.is_grad_enabled():  # the backward's recompute: a shared weight is not ready yet
            for param in shared:
                param.ds_grad_is_ready = False
        logits = lm_head(hidden_states)
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()
        return F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=ignore_index, reduction="sum"
        )

    return TiledLossSum.apply(_no_grad_detached(loss_sum), hidden, labels.to(hidden.device), tiles, params)
