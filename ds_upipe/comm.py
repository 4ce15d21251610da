"""The two all-to-alls of a UPipe stage, on already-selected heads.

Local tensors are [b, s, n*C, d] (this rank's sequence shard; the n*C heads grouped by destination
rank, n per rank).  ``heads_to_sequence`` returns [b, n, S, d] (full sequence S = C*s of the n heads
this rank attends over, in the kernel layout); ``sequence_to_heads`` is its inverse.  Every
all-to-all is even (the stage plan guarantees equal head counts per rank), which gloo requires.

``start_heads_to_sequence`` issues the exchange asynchronously and returns a handle, so the pipeline
can fetch the next stage's heads while the current stage computes.

These are plain functions, not autograd nodes: the pipeline's autograd Function calls them in both
forward and backward, so nothing here is saved for backward.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor


class PendingExchange:
    """An all-to-all in flight; ``wait()`` returns its result in the requested layout."""

    def __init__(self, send: Tensor, recv: Tensor, work: dist.Work | None, finish: Callable[[Tensor], Tensor]) -> None:
        # the send buffer must outlive an asynchronous exchange, so the handle owns it; a finished
        # (synchronous) exchange does not need it any more
        self._send = send if work is not None else None
        self._recv, self._work, self._finish = recv, work, finish

    def wait(self) -> Tensor:
        if self._work is not None:
            self._work.wait()
        result = self._finish(self._recv)
        self._send = self._recv = None  # release the buffers before the next stage allocates its own
        return result


def _exchange(send: Tensor, group: dist.ProcessGroup | None, group_size: int, async_op: bool):
    if group_size == 1:
        return send, None
    recv = torch.empty_like(send)
    work = dist.all_to_all_single(recv, send, group=group, async_op=async_op)
    return recv, work


def start_heads_to_sequence(
    local: Tensor, group_size: int, group: dist.ProcessGroup | None, async_op: bool = True
) -> PendingExchange:
    """[b, s, C*n, d] (heads grouped by destination) -> pending [b, n, C*s, d] of n heads."""
    b, s, cn, d = local.shape
    n = cn // group_size
    send = local.reshape(b, s, group_size, n, d).permute(2, 0, 3, 1, 4).contiguous()  # [C, b, n, s, d]
    recv, work = _exchange(send, group, group_size, async_op)
    # recv[src] holds peer src's sequence chunk: put it at position src of the sequence.
    return PendingExchange(send, recv, work, lambda r: r.permute(1, 2, 0, 3, 4).reshape(b, n, group_size * s, d))


def heads_to_sequence(local: Tensor, group_size: int, group: dist.ProcessGroup | None) -> Tensor:
    """Blocking ``start_heads_to_sequence``."""
    return start_heads_to_sequence(local, group_size, group, async_op=False).wait()


def sequence_to_heads(full: Tensor, group_size: int, group: dist.ProcessGroup | None) -> Tensor:
    """[b, n, C*s, d] -> [b, s, C*n, d]: this rank's sequence chunk of every rank's n heads."""
    b, n, seq, d = full.shape
    s = seq // group_size
    send = full.reshape(b, n, group_size, s, d).permute(2, 0, 3, 1, 4).contiguous()  # [C, b, s, n, d]
    recv, _ = _exchange(send, group, group_size, async_op=False)
    del send
    # recv[src] holds the n heads that rank src attended over, for this rank's sequence chunk.
    return recv.permute(1, 2, 0, 3, 4).reshape(b, s, group_size * n, d)
