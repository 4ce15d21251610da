"""The exchanges of head-sharded sequence mixers, as autograd functions (each one's backward is the
inverse exchange of the gradient).

Softmax attention has its own buffered stage loop (``ds_upipe.pipeline``); a mixer stage moves a few
small per-head tensors, so plain autograd exchanges are enough: ``sequence_to_heads`` gives this rank
the whole sequence of its heads, ``heads_to_sequence`` gives the result back to the ranks holding the
tokens, and ``previous_tokens`` hands each rank the last tokens of the rank before it (the halo a causal
convolution over a sequence shard needs).  Ranks hold contiguous shards in rank order.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


def _all_to_all(send: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """all_to_all_single over dim 0 of a contiguous [C, ...] tensor: block j goes to rank j."""
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv


def _to_heads(x: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    b, s, c = x.shape[:3]
    recv = _all_to_all(x.movedim(2, 0).contiguous(), group)  # [C, B, s, h, ...]: rank j's tokens of my heads
    return recv.movedim(0, 1).reshape(b, c * s, *x.shape[3:])


def _to_sequence(y: Tensor, group: dist.ProcessGroup | None, group_size: int) -> Tensor:
    b, full = y.shape[:2]
    send = y.reshape(b, group_size, full // group_size, *y.shape[2:]).movedim(1, 0).contiguous()
    recv = _all_to_all(send, group)  # [C, B, s, h, ...]: my tokens of rank j's heads
    return recv.movedim(0, 2)


class _SequenceToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup | None) -> Tensor:  # noqa: ANN001
        ctx.group, ctx.group_size = group, x.shape[2]
        return _to_heads(x, group)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # noqa: ANN001
        return _to_sequence(grad, ctx.group, ctx.group_size), None


class _HeadsToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y: Tensor, group: dist.ProcessGroup | None, group_size: int) -> Tensor:  # noqa: ANN001
        ctx.group = group
        return _to_sequence(y, group, group_size)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:  # noqa: ANN001
        return _to_heads(grad, ctx.group), None, None


def sequence_to_heads(x: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """[B, s, C, h, ...] (this rank's s tokens; block j holds rank j's h heads) -> [B, C*s, h, ...] (every
    token, in rank order, of this rank's h heads).  C = x.shape[2] must be the group's size."""
    if x.shape[2] == 1:
        return x.squeeze(2)
    return _SequenceToHeads.apply(x, group)


def heads_to_sequence(y: Tensor, group: dist.ProcessGroup | None, group_size: int) -> Tensor:
    """``sequence_to_heads``' inverse: [B, C*s, h, ...] (this rank's heads) -> [B, s, C, h, ...] (this
    rank's tokens; block j holds rank j's heads)."""
    if group_size == 1:
        return y.unsqueeze(2)
    return _HeadsToSequence.apply(y, group, group_size)


def _gather(t: Tensor, group: dist.ProcessGroup | None, group_size: int) -> list[Tensor]:
    parts = [torch.empty_like(t) for _ in range(group_size)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return parts


class _PreviousTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, width: int, group: dist.ProcessGroup | None) -> Tensor:  # noqa: ANN001
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        ctx.group, ctx.rank, ctx.size, ctx.seq = group, rank, size, x.shape[1]
        tails = _gather(x[:, x.shape[1] - width :], group, size)  # a few tokens a rank: an all-gather is cheap
        return tails[rank - 1] if rank > 0 else torch.zeros_like(tails[0])

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:  # noqa: ANN001
        grads = _gather(grad, ctx.group, ctx.size)  # rank r + 1's gradient of the tokens it read from this rank
        out = grad.new_zeros(grad.shape[0], ctx.seq, *grad.shape[2:])
        if ctx.rank + 1 < ctx.size:
            out[:, ctx.seq - grad.shape[1] :] = grads[ctx.rank + 1]
        return out, None, None


def previous_tokens(x: Tensor, width: int, group: dist.ProcessGroup | None) -> Tensor:
    """The last ``width`` tokens [B, width, ...] of the previous rank's shard of x [B, s, ...] (zeros on the
    first rank); gradients go back to that rank.  Needs s >= width (the caller refuses shorter shards)."""
    if width > x.shape[1]:
        raise ValueError(f"previous_tokens: width {width} exceeds the shard's {x.shape[1]} tokens")
    if dist.get_world_size(group) == 1:
        return x.new_zeros(x.shape[0], width, *x.shape[2:])
    return _PreviousTokens.apply(x, width, group)
