"""The two all-to-alls of a UPipe stage, on already-selected heads.

Local tensors are [b, s, n*C, d] (this rank's sequence shard; the n*C heads grouped by destination
rank, n per rank).  ``heads_to_sequence`` returns [b, n, S, d] (full sequence S = C*s of the n heads
this rank attends over, in the kernel layout); ``sequence_to_heads`` is its inverse.  Every
all-to-all is even (the stage plan guarantees equal head counts per rank), which gloo requires.

These are plain functions, not autograd nodes: the pipeline's autograd Function calls them in both
forward and backward, so nothing here is saved for backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


def _all_to_all(send: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv


def heads_to_sequence(local: Tensor, group_size: int, group: dist.ProcessGroup | None) -> Tensor:
    """[b, s, C*n, d] (heads grouped by destination) -> [b, n, C*s, d] full sequence of n heads."""
    b, s, cn, d = local.shape
    n = cn // group_size
    send = local.reshape(b, s, group_size, n, d).permute(2, 0, 3, 1, 4).contiguous()  # [C, b, n, s, d]
    if group_size == 1:
        recv = send
    else:
        recv = _all_to_all(send, group)
    del send
    # recv[src] holds peer src's sequence chunk: put it at position src of the sequence.
    return recv.permute(1, 2, 0, 3, 4).reshape(b, n, group_size * s, d)


def sequence_to_heads(full: Tensor, group_size: int, group: dist.ProcessGroup | None) -> Tensor:
    """[b, n, C*s, d] -> [b, s, C*n, d]: this rank's sequence chunk of every rank's n heads."""
    b, n, seq, d = full.shape
    s = seq // group_size
    send = full.reshape(b, n, group_size, s, d).permute(2, 0, 3, 1, 4).contiguous()  # [C, b, s, n, d]
    if group_size == 1:
        recv = send
    else:
        recv = _all_to_all(send, group)
    del send
    # recv[src] holds the n heads that rank src attended over, for this rank's sequence chunk.
    return recv.permute(1, 2, 0, 3, 4).reshape(b, s, group_size * n, d)
