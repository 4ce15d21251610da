"""The all-to-alls of a UPipe stage, several tensors packed into one exchange.

Every exchange sends a contiguous [C, X] buffer: row dst holds, one segment per tensor, what peer
dst gets of that tensor; ``all_to_all_single`` splits dim 0 evenly, so one collective carries a
stage's (or round's) tensors together (K with V; q with dout and out; dK with dV).  The stage
plan guarantees equal head counts per rank, so every exchange is even, which gloo requires.

- Heads to sequence (``heads_send_buffer`` + ``start_heads_exchange``): the caller writes its local
  [b, s, C*n_j, d] tensors (this rank's sequence shard, the C*n_j heads grouped by destination rank,
  seen as [b, s, C, n_j, d]) straight into strided views of the send buffer, whose row per
  destination is token-major ([s, b, P, d], every tensor's heads side by side per token:
  ``HeadsLayout``), so a stage's heads are selected (or projected) into the send buffer itself: no
  select-then-permute temporary; the pending result is one [b, n_j, S, d] tensor per packed tensor
  (full sequence S = C*s of the n_j heads this rank attends over, in the kernel layout), a strided
  view of the receive buffer (no copy: the kernels read any strides with a contiguous last dim), so
  the pipeline can fetch the next stage's heads while the current stage computes.
- Sequence to heads (``scatter_buffer`` + ``start_scatter``): full [b, n_j, S, d] tensors are
  written into their segments as [b, s, n_j, d] per destination; the result is one [C, b, s, n_j, d]
  view per segment ([src] is this rank's sequence chunk of the heads rank src attended over), handed
  over per source rank as contiguous pieces, with no final permute-copy.

These are plain functions, not autograd nodes: the pipeline's autograd Function calls them in both
forward and backward, so nothing here is saved for backward.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

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
    """An all-to-all in flight; ``wait()`` returns its result, one tensor per packed segment."""

    def __init__(
        self,
        send: Tensor,
        recv: Tensor,
        work: dist.Work | None,
        counts: tuple[int, ...],
        finish: Callable[[Tensor], tuple[Tensor, ...]],
    ) -> None:
        # the send buffer must outlive an asynchronous exchange, so the handle owns it; a finished
        # (synchronous) exchange does not need it any more
        self._send = send if work is not None else None
        self._recv, self._work, self._counts, self._finish = recv, work, counts, finish

    def wait(self) -> tuple[Tensor, ...]:
        if self._work is not None:
            self._work.wait()
            # the work object references the send and receive buffers: drop it, then let gloo's
            # worker thread drop its own references, before the buffers are released below
            self._work = None
            _await_worker_release((self._send, self._recv), self._counts)
        self._send = None
        recv, self._recv = self._recv, None
        return self._finish(recv)  # the last reference to recv: freed once its segments are copied out


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


def _segments(buffer: Tensor, shapes: Sequence[tuple[int, ...]]) -> list[Tensor]:
    """Views of consecutive segments of each row of a [C, X] buffer, segment j as [C, *shapes[j]]."""
    out, offset = [], 0
    for shape in shapes:
        n = 1
        for dim in shape:
            n *= dim
        # a buffer of one segment is viewed as it is (no narrow: one op less per exchange)
        segment = buffer if n == buffer.shape[1] else buffer.narrow(1, offset, n)
        out.append(segment.view(buffer.shape[0], *shape))
        offset += n
    return out


def _packed_send(
    parts: Iterable[Tensor],
    shapes_of: Callable[[Tensor], Sequence[tuple[int, ...]]],
    group_size: int,
    write: Callable[[Tensor, Tensor], None],
) -> tuple[Tensor, list[tuple[int, ...]]]:
    """(the [C, X] send buffer of ``parts``, its segments' shapes).  Parts are taken one at a time, so
    the caller's generator can free each once it is written; ``shapes_of(first part)`` gives every
    segment's per-destination shape, ``write(segment, part)`` copies a part into its [C, ...] segment."""
    send: Tensor | None = None
    shapes: list[tuple[int, ...]] = []
    segments: list[Tensor] = []
    for j, part in enumerate(parts):
        if send is None:
            shapes = [tuple(shape) for shape in shapes_of(part)]
            total = sum(torch.Size(shape).numel() for shape in shapes)
            send = torch.empty((group_size, total), dtype=part.dtype, device=part.device)
            segments = _segments(send, shapes)
        if part.dtype != send.dtype:
            raise TypeError(f"packed exchange: part {j} is {part.dtype}, the buffer {send.dtype}")
        write(segments[j], part)
        del part
    assert send is not None and len(segments) == len(shapes)
    return send, shapes


@dataclass(frozen=True)
class HeadsLayout:
    """The row layout of a heads-to-sequence buffer: [s, b, W] per destination (or source) rank, tensor j's
    n_j heads of d_j each side by side per token at offset sum(n_<j * d_<j) of the W = sum(n_j * d_j)
    elements of every token (the d_j differ where values have their own head dim: latent attention)."""

    b: int
    s: int
    dims: tuple[int, ...]
    counts: tuple[int, ...]

    @property
    def width(self) -> int:
        return sum(n * d for n, d in zip(self.counts, self.dims))

    def tensors(self, buffer: Tensor) -> list[Tensor]:
        """Tensor j's [C, s, b, n_j, d_j] view of a [C, X] buffer in this layout."""
        rows = buffer.view(buffer.shape[0], self.s, self.b, self.width)
        if len(self.counts) == 1:
            return [rows.view(*rows.shape[:3], self.counts[0], self.dims[0])]  # the whole row: no narrow
        out, offset = [], 0
        for n, d in zip(self.counts, self.dims):
            out.append(rows.narrow(3, offset, n * d).unflatten(3, (n, d)))
            offset += n * d
        return out


def heads_send_buffer(
    write: Callable[[list[Tensor]], None],
    heads: Sequence[int],
    local_shape: tuple[int, int, int],
    dtype: torch.dtype,
    device: torch.device,
    group_size: int,
    dims: Sequence[int] | None = None,
) -> tuple[Tensor, HeadsLayout]:
    """(the contiguous [C, X] buffer ``start_heads_exchange`` sends, its layout).  ``write(views)``
    fills it: views[j] is tensor j seen as this rank's local heads, [b, s, C, n_j, d] (``heads[j]`` =
    C*n_j heads grouped by destination; ``local_shape`` = (b, s, d); tensor j's head dim ``dims[j]``,
    d for every tensor when None), a strided view into which the caller writes its heads directly (no
    select-then-permute temporary; e.g. ``select_heads``).

    Row dst is token-major, [s, b, P, d] with the P = sum(n_j) heads of every tensor side by side per
    token: received, the C source rows are consecutive token blocks of the full sequence, so each
    tensor is a strided [b, n_j, C*s, d] view of the receive buffer (``start_heads_exchange``), no
    rearranging copy (a head-major row, [n_j, b, s, d] per tensor, would need one per tensor)."""
    b, s, d = local_shape
    c = group_size
    layout = HeadsLayout(b, s, tuple(dims or (d,) * len(heads)), tuple(h // c for h in heads))
    send = torch.empty((c, s * b * layout.width), dtype=dtype, device=device)
    # [C, s, b, n_j, d] per tensor, seen as [b, s, C, n_j, d]
    write([seg.permute(2, 1, 0, 3, 4) for seg in layout.tensors(send)])
    return send, layout


def start_heads_exchange(
    send: Tensor,
    layout: HeadsLayout,
    group_size: int,
    group: dist.ProcessGroup | None,
    async_op: bool = True,
    own_storage: bool = False,
) -> PendingExchange:
    """``heads_send_buffer``'s buffer and layout -> pending ([b, n_j, C*s, d] per tensor: views of the
    receive buffer, whose row src holds peer src's token block of the sequence; with ``own_storage``
    each copied to a contiguous [b, C*s, n_j, d] of its own, seen as [b, n_j, C*s, d], for a kernel
    that does not read strided inputs)."""
    recv, work, counts = _exchange(send, group, group_size, async_op)
    b, s = layout.b, layout.s

    def finish(r: Tensor) -> tuple[Tensor, ...]:
        # [C, s, b, n, d] -> [b, C, s, n, d] -> [b, C*s, n, d]: C's stride is s times s's, so a view
        tokens = [seg.permute(2, 0, 1, 3, 4).reshape(b, group_size * s, *seg.shape[3:]) for seg in layout.tensors(r)]
        if own_storage:
            tokens = [t.contiguous() for t in tokens]  # the last reference to r: freed once copied out
        return tuple(t.transpose(1, 2) for t in tokens)

    return PendingExchange(send, recv, work, counts, finish)


def scatter_buffer(
    parts: Iterable[Tensor], heads: Sequence[tuple[int, int]], group_size: int
) -> tuple[Tensor, list[tuple[int, ...]]]:
    """Full [b, n_j, C*s, d_j] tensors (``heads[j]`` = (n_j, d_j)) -> (the contiguous [C, X] buffer whose
    row dst holds peer dst's sequence chunk of each as [b, s, n_j, d_j], those shapes).  A single tensor
    already laid out so is the buffer itself (a view of it: no copy)."""
    c = group_size
    if len(heads) == 1:
        # a single tensor whose send layout is already contiguous (b = 1 and one head per rank, as at
        # U = C) is sent as it is: copying it into a buffer of its own would only reproduce it
        (part,) = parts
        send = to_send_layout(part, c)
        if send.is_contiguous():
            return send.reshape(c, -1), [tuple(send.shape[1:])]
        del send
        parts = iter([part])
        del part

    def shapes_of(first: Tensor) -> list[tuple[int, ...]]:
        b, _, seq, _ = first.shape
        return [(b, seq // c, n, d) for n, d in heads]

    def write(segment: Tensor, part: Tensor) -> None:
        segment.copy_(to_send_layout(part, c))

    return _packed_send(parts, shapes_of, c, write)


def scatter_segments(buffer: Tensor, shapes: Sequence[tuple[int, ...]]) -> list[Tensor]:
    """The [C, b, s, n_j, d] segment views of a [C, X] sequence-to-heads buffer (for writing a
    buffer in place: an accumulator allocated in the send layout is sent without a copy)."""
    return _segments(buffer, shapes)


def start_scatter(
    send: Tensor,
    shapes: Sequence[tuple[int, ...]],
    group_size: int,
    group: dist.ProcessGroup | None,
    async_op: bool = False,
) -> PendingExchange:
    """All-to-all of a sequence-to-heads [C, X] buffer; the handle's ``wait()`` gives, per tensor, a
    [C, b, s, n_j, d] view where [src] is this rank's sequence chunk of the heads rank src attended over."""
    recv, work, counts = _exchange(send, group, group_size, async_op)
    return PendingExchange(send, recv, work, counts, lambda r: tuple(_segments(r, shapes)))


def select_heads(src: Tensor, heads: Tensor, out: Tensor) -> None:
    """out[b, s, c, i] = src[b, s, heads[c * n + i]] for a [b, s, C, n, d] ``out`` (a send buffer's
    strided view): one indexing op writing straight into it, no [b, s, C*n, d] temporary."""
    c, n = out.shape[2], out.shape[3]
    torch.ops.aten.index.Tensor_out(src, [None, None, heads.view(c, n)], out=out)


def put_heads(dst: Tensor, heads: Tensor, src: Tensor) -> None:
    """dst[..., heads[c * n + i], :] = src[..., c, i, :] for a [..., C, n, d] ``src`` (e.g. a received
    buffer's strided view): ``select_heads``' inverse, one indexing op for every source rank's heads
    (``heads`` without repeats) instead of one select and one index_copy per rank."""
    c, n = src.shape[-3], src.shape[-2]
    index: list[Tensor | None] = [None] * (dst.dim() - 2)
    torch.ops.aten.index_put_(dst, [*index, heads.view(c, n)], src)


def to_send_layout(full: Tensor, group_size: int) -> Tensor:
    """[b, n, C*s, d] -> the [C, b, s, n, d] view the sequence-to-heads exchange sends: element [dst] is peer
    dst's sequence chunk.  A buffer allocated in this layout and written through the inverse view can
    be sent as it is, without a copy."""
    return full.unflatten(2, (group_size, full.shape[2] // group_size)).permute(2, 0, 3, 1, 4)
