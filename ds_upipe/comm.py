"""The two all-to-alls of a UPipe stage, on already-selected heads.

Local tensors are [b, s, n*C, d] (this rank's sequence shard; the n*C heads grouped by destination
rank, n per rank).  Heads to sequence: ``heads_send_buffer`` then ``start_heads_exchange``, which
returns a pending [b, n, S, d] (full sequence S = C*s of the n heads this rank attends over, in the
kernel layout), so the pipeline can fetch the next stage's heads while the current stage computes.
Sequence to heads: ``to_send_layout`` + ``exchange_send_layout`` + ``from_ranks``; the pipeline runs
the steps itself: a buffer allocated in the send layout is sent without a copy, and the
[C, b, s, n, d] result hands each source rank's heads over as contiguous [b, s, n, d] pieces, so a
caller that sums (or copies) per piece needs no final permute-copy.  Every all-to-all is even (the
stage plan guarantees equal head counts per rank), which gloo requires.

These are plain functions, not autograd nodes: the pipeline's autograd Function calls them in both
forward and backward, so nothing here is saved for backward.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

#: bound on the GIL yields spent waiting for gloo's worker thread to let go of an exchange's tensors
_RELEASE_SPINS = 1000


def _await_worker_release(tensors: tuple[Tensor, ...], counts: tuple[int, ...]) -> None:
    """Yield the GIL until no one but this thread references ``tensors`` (their use counts are back to
    ``counts``, taken before the exchange).

    gloo runs a collective on a worker thread, which wakes the caller before it drops its own
    references (the work object and its future) to the tensors.  Were the caller to drop its
    references first, the memory would be freed later, on that thread, once it gets the GIL: the next
    stage would allocate its buffers while this one's are still held.  CPU tensors only (NCCL's work
    objects keep theirs until the GPU is done: waiting for that would synchronize), and bounded."""
    if not tensors or tensors[0].device.type != "cpu":
        return
    for _ in range(_RELEASE_SPINS):
        if all(t._use_count() <= c for t, c in zip(tensors, counts)):
            return
        time.sleep(0)


class PendingExchange:
    """An all-to-all in flight; ``wait()`` returns its result in the requested layout."""

    def __init__(
        self,
        send: Tensor,
        recv: Tensor,
        work: dist.Work | None,
        counts: tuple[int, ...],
        finish: Callable[[Tensor], Tensor],
    ) -> None:
        # the send buffer must outlive an asynchronous exchange, so the handle owns it; a finished
        # (synchronous) exchange does not need it any more
        self._send = send if work is not None else None
        self._recv, self._work, self._counts, self._finish = recv, work, counts, finish

    def wait(self) -> Tensor:
        if self._work is not None:
            self._work.wait()
            # the work object references the send and receive buffers: drop it, then let gloo's
            # worker thread drop its own references, before the buffers are released below
            self._work = None
            _await_worker_release((self._send, self._recv), self._counts)
        result = self._finish(self._recv)
        self._send = self._recv = None  # release the buffers before the next stage allocates its own
        return result


def _exchange(
    send: Tensor, group: dist.ProcessGroup | None, group_size: int, async_op: bool
) -> tuple[Tensor, dist.Work | None, tuple[int, ...]]:
    """(recv, work or None when finished, the use counts of send and recv before the exchange)."""
    if group_size == 1:
        return send, None, ()
    recv = torch.empty_like(send)
    counts = (send._use_count(), recv._use_count())
    work = dist.all_to_all_single(recv, send, group=group, async_op=async_op)
    if work is None:
        _await_worker_release((send, recv), counts)
    return recv, work, counts


def heads_send_buffer(local: Tensor, group_size: int) -> Tensor:
    """[b, s, C*n, d] (heads grouped by destination) -> the contiguous [C, b, n, s, d] buffer that
    ``start_heads_exchange`` sends (a copy unless b = n = 1; the caller may free ``local`` after it)."""
    b, s, cn, d = local.shape
    return local.reshape(b, s, group_size, cn // group_size, d).permute(2, 0, 3, 1, 4).contiguous()


def start_heads_exchange(
    send: Tensor, group_size: int, group: dist.ProcessGroup | None, async_op: bool = True
) -> PendingExchange:
    """``heads_send_buffer``'s [C, b, n, s, d] -> pending [b, n, C*s, d] of n heads."""
    _, b, n, s, d = send.shape
    recv, work, counts = _exchange(send, group, group_size, async_op)
    # recv[src] holds peer src's sequence chunk: put it at position src of the sequence.
    return PendingExchange(
        send, recv, work, counts, lambda r: r.permute(1, 2, 0, 3, 4).reshape(b, n, group_size * s, d)
    )


def to_send_layout(full: Tensor, group_size: int) -> Tensor:
    """[b, n, C*s, d] -> the [C, b, s, n, d] view the sequence-to-heads exchange sends: element [dst] is peer
    dst's sequence chunk.  A buffer allocated in this layout and written through the inverse view can
    be sent as it is, without a copy."""
    return full.unflatten(2, (group_size, full.shape[2] // group_size)).permute(2, 0, 3, 1, 4)


def exchange_send_layout(send: Tensor, group_size: int, group: dist.ProcessGroup | None) -> Tensor:
    """All-to-all of a contiguous [C, b, s, n, d] send buffer; returns [C, b, s, n, d] where [src] is this
    rank's sequence chunk of the n heads that rank src attended over."""
    return _exchange(send, group, group_size, async_op=False)[0]


def from_ranks(by_rank: Tensor) -> Tensor:
    """[C, b, s, n, d] (``exchange_send_layout``'s result) -> [b, s, C*n, d] (a copy unless b = n = 1)."""
    c, b, s, n, d = by_rank.shape
    return by_rank.permute(1, 2, 0, 3, 4).reshape(b, s, c * n, d)
