"""Ring attention across nodes under UPipe's head-chunked Ulysses inside a node.

Layout.  ``sequence_parallel_size = C_u x R``: sequence-parallel rank ``r = ring_index * C_u +
ulysses_index``.  The C_u ranks of one ring index (contiguous, so within a node) form a Ulysses group
and run UPipe's all-to-alls; the R ranks of one Ulysses index form a ring group.  The global sequence
is cut into 2R chunks; ring rank i owns chunks i and 2R-1-i (zigzag), concatenated into its *ring
block*, which its Ulysses group shards contiguously (each rank holds S / (C_u R) tokens).

Attention.  After a UPipe stage's all-to-all, each rank holds its ring block for U/C_u heads.
``RingAttentionKernel`` is an ``AttentionKernel`` (the pipeline runs unchanged) that attends over the
whole sequence by passing K/V blocks around the ring group and merging the per-block results exactly
through their log-sum-exp (online softmax); its backward passes dK/dV accumulators around the ring
back to their owners.  With zigzag blocks every ring rank computes one causal diagonal block and R-1
half blocks, the same work on every rank (ring-flash-attention's zigzag and torch's context-parallel
round-robin balancing are this split).  Which part of a block pair is computed, and whether causally,
follows from the chunk indices (``block_pair``).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from .kernels import AttentionKernel, CallableKernel, KernelAux, lse_block
from .layout import SequenceLayout, sequence_layout  # also imported from here by callers
from .windows import band_backward, band_forward, visible_products, window_of

# -- the two-level layout (``ds_upipe.layout``; re-exported here) ---------------------------------------


def sequence_group_ranks(
    world_size: int, sequence_parallel_size: int, ring_size: int
) -> tuple[list[list[int]], list[list[int]]]:
    """Global ranks of every Ulysses group and every ring group.

    Sequence-parallel groups are contiguous blocks of ``sequence_parallel_size`` ranks (as DeepSpeed
    builds them); inside one, rank ``base + ring_index * C_u + ulysses_index``.  So a Ulysses group is
    C_u consecutive ranks (one node when C_u divides the GPUs per node) and a ring group strides by C_u
    (across nodes)."""
    layout = sequence_layout(sequence_parallel_size, ring_size)
    if world_size % sequence_parallel_size:
        raise ValueError(
            f"world size {world_size} is not a multiple of sequence_parallel_size={sequence_parallel_size}"
        )
    ulysses, ring = [], []
    for base in range(0, world_size, layout.sp_size):
        ulysses += [[base + layout.sp_rank(i, j) for j in range(layout.ulysses_size)] for i in range(ring_size)]
        ring += [[base + layout.sp_rank(i, j) for i in range(ring_size)] for j in range(layout.ulysses_size)]
    return ulysses, ring


def build_sequence_groups(sequence_parallel_size: int, ring_size: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(ulysses_group, ring_group) of the calling rank.  Every rank of the world must call it (torch's
    ``new_group`` is collective), with the same arguments; invalid sizes raise before any group is made."""
    ulysses_ranks, ring_ranks = sequence_group_ranks(dist.get_world_size(), sequence_parallel_size, ring_size)
    me = dist.get_rank()
    mine: dict[str, dist.ProcessGroup] = {}
    for kind, all_ranks in (("ulysses", ulysses_ranks), ("ring", ring_ranks)):
        for ranks in all_ranks:
            group = dist.new_group(ranks)
            if me in ranks:
                mine[kind] = group
    return mine["ulysses"], mine["ring"]


# -- zigzag sharding of a global sequence -------------------------------------------------------------


def zigzag_positions(seq_len: int, layout: SequenceLayout, sp_rank: int) -> Tensor:
    """Global positions held by ``sp_rank``: its Ulysses slice of ring block (chunks i, 2R-1-i).
    With R = 1 this is the contiguous shard ``sp_rank * s ... (sp_rank + 1) * s - 1``."""
    r, cu = layout.ring_size, layout.ulysses_size
    chunks = 2 * r if r > 1 else 1
    if seq_len % chunks or (seq_len // r) % cu:
        multiple = layout.sequence_multiple
        raise ValueError(
            f"sequence length {seq_len} cannot be sharded over Ulysses degree {cu} x ring size {r}: each ring "
            f"rank's block (S / {r} tokens) is split into two zigzag chunks and over {cu} Ulysses ranks; pad "
            f"the sequence to a multiple of {multiple}"
        )
    ring_index, ulysses_index = layout.coordinates(sp_rank)
    chunk = seq_len // chunks
    firsts = (ring_index, 2 * r - 1 - ring_index) if r > 1 else (0,)
    block = torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in firsts])
    shard = seq_len // layout.sp_size
    return block[ulysses_index * shard : (ulysses_index + 1) * shard]


def zigzag_shard(t: Tensor, dim: int, layout: SequenceLayout, sp_rank: int) -> Tensor:
    """``sp_rank``'s sequence shard of a tensor holding the global sequence along ``dim``."""
    return t.index_select(dim, zigzag_positions(t.shape[dim], layout, sp_rank).to(t.device))


def zigzag_unshard(shards: Sequence[Tensor], dim: int, layout: SequenceLayout) -> Tensor:
    """Inverse of ``zigzag_shard``: the global sequence from all ranks' shards (in SP rank order)."""
    seq_len = sum(s.shape[dim] for s in shards)
    order = torch.cat([zigzag_positions(seq_len, layout, r) for r in range(layout.sp_size)])
    stacked = torch.cat(list(shards), dim=dim)
    return stacked.index_select(dim, torch.argsort(order).to(stacked.device))


# -- which part of a block pair is computed ------------------------------------------------------------


@dataclass(frozen=True)
class BlockPair:
    """Rows of the query block and of the key block that attend to each other, and whether causally."""

    query: slice
    key: slice
    causal: bool


def block_pair(query_rank: int, key_rank: int, ring_size: int, causal: bool, block_len: int) -> BlockPair:
    """The computation between ring rank ``query_rank``'s queries and ``key_rank``'s keys/values.

    Chunk a sees chunk b fully when b < a (or without a causal mask), causally when a == b, not at all
    when b > a.  A rank's own block is one causal call (its two chunks are in increasing order, so the
    block's lower triangle is exactly the chunk rule); any other pair of zigzag blocks has a rectangle
    of fully visible chunks (the first key chunk for an earlier key rank, the second query chunk for
    a later one), computed without a mask."""
    if causal and ring_size > 1 and block_len % 2:
        raise ValueError(f"zigzag ring blocks hold two equal chunks; got a block of {block_len} tokens")
    whole = slice(0, block_len)
    if query_rank == key_rank or not causal:
        return BlockPair(whole, whole, causal and query_rank == key_rank)
    chunk = block_len // 2
    q_chunks = (query_rank, 2 * ring_size - 1 - query_rank)
    k_chunks = (key_rank, 2 * ring_size - 1 - key_rank)
    rows = [i for i, a in enumerate(q_chunks) if any(b < a for b in k_chunks)]
    cols = [j for j, b in enumerate(k_chunks) if any(b < a for a in q_chunks)]
    if not rows or any(k_chunks[j] >= q_chunks[i] for i in rows for j in cols):
        raise AssertionError(f"zigzag blocks {q_chunks} x {k_chunks} have no rectangle of visible chunks")
    return BlockPair(
        slice(rows[0] * chunk, (rows[-1] + 1) * chunk), slice(cols[0] * chunk, (cols[-1] + 1) * chunk), False
    )


@dataclass(frozen=True)
class ChunkPair:
    """Under a sliding window: query rows and key rows of one zigzag chunk pair that see each other,
    and the global positions of their first rows."""

    query: slice
    key: slice
    query_start: int
    key_start: int


def window_chunk_pairs(query_rank: int, key_rank: int, ring_size: int, block_len: int, window: int) -> list[ChunkPair]:
    """The chunk pairs of a block pair that a causal window of ``window`` tokens leaves any visible
    key in (diagonal chunks first, so the rank's own block starts its running output with every query
    row): a key chunk after the query chunk, or wholly before the window of its first query, is skipped."""
    chunk = block_len // 2
    q_chunks = (query_rank, 2 * ring_size - 1 - query_rank)
    k_chunks = (key_rank, 2 * ring_size - 1 - key_rank)
    pairs = []
    for i, a in enumerate(q_chunks):
        for j, b in enumerate(k_chunks):
            q0, k0 = a * chunk, b * chunk
            # visible keys exist iff the key chunk starts at or before the last query and ends after the
            # first query's window start (k > q0 - W for some key k <= k0 + chunk - 1)
            if k0 <= q0 + chunk - 1 and k0 + chunk - 1 > q0 - window:
                pairs.append(ChunkPair(slice(i * chunk, (i + 1) * chunk), slice(j * chunk, (j + 1) * chunk), q0, k0))
    pairs.sort(key=lambda p: p.query_start != p.key_start)
    return pairs


def unmasked_products(pair: BlockPair, block_len: int) -> int:
    """Query-key products a block pair's call keeps (per batch row and head)."""
    rows = len(range(block_len)[pair.query])
    cols = len(range(block_len)[pair.key])
    return rows * (rows + 1) // 2 if pair.causal else rows * cols


# -- point-to-point exchange around the ring ------------------------------------------------------------


class PendingRing:
    """Tensors in flight to the next ring rank and from the previous one; ``wait()`` returns the received."""

    def __init__(self, sends: list[Tensor], recvs: list[Tensor], works: list[dist.Work]) -> None:
        self._sends, self._recvs, self._works = sends, recvs, works  # send buffers live until sent

    def wait(self) -> list[Tensor]:
        for work in self._works:
            work.wait()
        recvs = self._recvs
        self._sends, self._recvs, self._works = [], [], []
        return recvs


#: tags keep the K, V and the backward's dK, dV messages between the same two ranks apart (gloo matches
#: point-to-point messages by peer and tag; NCCL orders them)
_KV_TAGS = (0, 1)
_GRAD_TAGS = (2, 3)


def start_ring_exchange(tensors: Sequence[Tensor], group: dist.ProcessGroup | None, tags: Sequence[int]) -> PendingRing:
    """Send ``tensors`` to ring rank + 1 and receive as many of the same shapes from ring rank - 1."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    # point-to-point messages need contiguous memory: a token-major [b, h, L, d] view (the pipeline's
    # K/V, ``reads_strided_inputs``) is sent as its [b, L, h, d] storage and received the same way
    token_major = [t.dim() == 4 and not t.is_contiguous() and t.transpose(1, 2).is_contiguous() for t in tensors]
    sends = [t.transpose(1, 2) if tm else t.contiguous() for t, tm in zip(tensors, token_major)]
    recvs = [torch.empty_like(t) for t in sends]
    ops = [dist.P2POp(dist.isend, t, group=group, tag=tag, group_peer=(rank + 1) % size) for t, tag in zip(sends, tags)]
    ops += [
        dist.P2POp(dist.irecv, t, group=group, tag=tag, group_peer=(rank - 1) % size) for t, tag in zip(recvs, tags)
    ]
    works = dist.batch_isend_irecv(ops)
    return PendingRing(sends, [r.transpose(1, 2) if tm else r for r, tm in zip(recvs, token_major)], works)


# -- the kernel -------------------------------------------------------------------------------------------


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class RingAttentionKernel(AttentionKernel):
    """Attention over the whole (zigzag) sequence from this rank's ring block, by ring attention over
    ``ring_group``, with the kernel contract (``forward -> (out, lse, aux)``, ``backward(dout, q, k,
    v, out, lse, aux) -> (dq, dk, dv)`` on [b, h, L, d] ring blocks).

    ``inner`` computes each block pair (any ``AttentionKernel``; a copy with ``causal=False`` runs the
    unmasked pairs).  The returned lse is the merged one, in the inner kernel's lse dtype; ``aux`` is
    the inner kernel's aux of every ring step, in order (fixed length: R times the inner's).

    ``overlap=True`` issues the next K/V block's send/recv before computing the current block (two K/V
    blocks alive instead of one during compute); the backward then also lets dK/dV travel while the
    next block computes.

    ``work`` counts the query-key products the inner calls keep, summed over batch rows and heads,
    forward and backward, so tests can check the load balance on what ran."""

    name = "ring"
    # its K/V blocks travel point-to-point, which needs each in storage of its own
    reads_strided_inputs = False

    def __init__(self, inner: AttentionKernel, ring_group: dist.ProcessGroup | None, overlap: bool = False) -> None:
        if not isinstance(inner, AttentionKernel) or isinstance(inner, (RingAttentionKernel, CallableKernel)):
            # CallableKernel returns no lse (its backward recomputes), and the ring merges blocks by lse
            raise ValueError(
                f"ring attention needs an AttentionKernel with an lse (not a ring, not a plain callable) inside, "
                f"got {inner!r}"
            )
        super().__init__(inner.causal, inner.softmax_scale)
        self.inner = inner
        self.unmasked = copy.copy(inner)  # same kernel and scale, no mask: the off-diagonal pairs
        self.unmasked.causal = False
        self.ring_group = ring_group
        self.overlap = overlap
        self.work = [0]
        #: sliding window of the inner kernel (``ds_upipe.windows``): chunk pairs wholly outside it are
        #: not computed, the others by banded tiles at their global positions
        self.window = window_of(inner)
        if self.window is not None and not inner.causal:
            raise ValueError(f"a sliding window is causal; got a non-causal kernel {inner!r}")

    @property
    def ring_rank(self) -> int:
        return dist.get_rank(self.ring_group)

    @property
    def ring_size(self) -> int:
        return dist.get_world_size(self.ring_group)

    def _pair(self, step: int, block_len: int) -> tuple[BlockPair, AttentionKernel]:
        rank, size = self.ring_rank, self.ring_size
        pair = block_pair(rank, (rank - step) % size, size, self.causal, block_len)
        return pair, self.inner if pair.causal else self.unmasked

    def _count(self, q: Tensor, pair: BlockPair, block_len: int) -> None:
        self.work[0] += q.shape[0] * q.shape[1] * unmasked_products(pair, block_len)

    def _steps(
        self, k: Tensor, v: Tensor, block_len: int
    ) -> Iterator[tuple[int, Tensor, Tensor, BlockPair, AttentionKernel]]:
        """Per ring step: (step, the K/V block held now, its block pair, the kernel for it).  With
        ``overlap`` the next block's send/recv is issued before the step is handed out, otherwise
        after the caller is done with it (and with whatever it sent meanwhile)."""
        size = self.ring_size
        pending = None
        for step in range(size):
            if step > 0:
                k, v = pending.wait()
            has_next = step + 1 < size
            if has_next and self.overlap:
                pending = start_ring_exchange((k, v), self.ring_group, _KV_TAGS)
            yield (step, k, v, *self._pair(step, block_len))
            if has_next and not self.overlap:
                pending = start_ring_exchange((k, v), self.ring_group, _KV_TAGS)

    def _window_pairs(self, step: int, block_len: int) -> list[ChunkPair]:
        rank, size = self.ring_rank, self.ring_size
        if block_len % 2:
            raise ValueError(f"zigzag ring blocks hold two equal chunks; got a block of {block_len} tokens")
        return window_chunk_pairs(rank, (rank - step) % size, size, block_len, self.window)

    def _count_window(self, q: Tensor, pair: ChunkPair) -> None:
        rows = pair.query.stop - pair.query.start
        products = visible_products(rows, pair.key.stop - pair.key.start, self.window, pair.query_start, pair.key_start)
        self.work[0] += q.shape[0] * q.shape[1] * products

    def _forward_windowed(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, KernelAux]:
        """Every chunk pair a window leaves visible, by banded tiles at global positions, merged by lse;
        steps whose pairs are all outside the window compute nothing (the K/V block still passes on)."""
        block_len = q.shape[2]
        scale = self.scale_for(q.shape[-1])
        out = torch.zeros(q.shape, dtype=_accumulation_dtype(q.dtype), device=q.device)
        lse = None
        for step, k_block, v_block, _, _ in self._steps(k, v, block_len):
            for pair in self._window_pairs(step, block_len):
                block_out, block_lse = band_forward(
                    q[:, :, pair.query],
                    k_block[:, :, pair.key],
                    v_block[:, :, pair.key],
                    self.window,
                    scale,
                    pair.query_start,
                    pair.key_start,
                )
                self._count_window(q, pair)
                if lse is None:
                    lse = torch.full(q.shape[:3], float("-inf"), dtype=block_lse.dtype, device=q.device)
                rows_lse = lse[:, :, pair.query]
                if step == 0 and pair.query_start == pair.key_start:  # a diagonal: the rows' first block
                    out[:, :, pair.query] = block_out.to(out.dtype)
                    rows_lse.copy_(block_lse)
                else:
                    _merge(out[:, :, pair.query], rows_lse, block_out, block_lse)
        return out.to(q.dtype), lse, ()

    def _backward_windowed(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        block_len = q.shape[2]
        scale = self.scale_for(q.shape[-1])
        acc = _accumulation_dtype(q.dtype)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        pending_grad = None
        for step, k_block, v_block, _, _ in self._steps(k, v, block_len):
            if step == 0:
                dk = torch.zeros(k.shape, dtype=acc, device=k.device)
                dv = torch.zeros(v.shape, dtype=acc, device=v.device)
            else:
                dk, dv = pending_grad.wait()
            for pair in self._window_pairs(step, block_len):
                rows = pair.query
                dq_b, dk_b, dv_b = band_backward(
                    dout[:, :, rows],
                    q[:, :, rows],
                    k_block[:, :, pair.key],
                    v_block[:, :, pair.key],
                    out[:, :, rows],
                    lse[:, :, rows],
                    self.window,
                    scale,
                    pair.query_start,
                    pair.key_start,
                )
                self._count_window(q, pair)
                dq[:, :, rows] += dq_b
                dk[:, :, pair.key] += dk_b
                dv[:, :, pair.key] += dv_b
            pending_grad = start_ring_exchange((dk, dv), self.ring_group, _GRAD_TAGS)
            del dk, dv
            if not self.overlap:
                pending_grad = _Done(pending_grad.wait())
        dk, dv = pending_grad.wait()
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, KernelAux]:
        if self.window is not None:
            return self._forward_windowed(q, k, v)
        block_len = q.shape[2]
        out = lse = None
        aux: list[Tensor | None] = []
        for _, k_block, v_block, pair, kernel in self._steps(k, v, block_len):
            block_out, block_lse, block_aux = kernel.forward(
                q[:, :, pair.query], k_block[:, :, pair.key], v_block[:, :, pair.key]
            )
            self._count(q, pair, block_len)
            aux += block_aux
            rows = block_out.shape[2]
            if out is None:  # step 0 is the rank's own block: every query row
                out, lse = block_out.to(_accumulation_dtype(q.dtype)), block_lse[..., :rows].clone()
            else:
                _merge(out[:, :, pair.query], lse[:, :, pair.query], block_out, block_lse[..., :rows])
            del block_out, block_lse
        return out.to(q.dtype), lse, tuple(aux)

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, aux: KernelAux
    ) -> tuple[Tensor, Tensor, Tensor]:
        if self.window is not None:
            return self._backward_windowed(dout, q, k, v, out, lse)
        size, block_len = self.ring_size, q.shape[2]
        per_step = len(aux) // size
        acc = _accumulation_dtype(q.dtype)
        pending_grad = None
        for step, k_block, v_block, pair, kernel in self._steps(k, v, block_len):
            rows = q[:, :, pair.query]
            dq_b, dk_b, dv_b = kernel.backward(
                dout[:, :, pair.query],
                rows,
                k_block[:, :, pair.key],
                v_block[:, :, pair.key],
                out[:, :, pair.query],
                _lse_for(kernel, rows, lse[:, :, pair.query]),
                tuple(aux[step * per_step : (step + 1) * per_step]),
            )
            self._count(q, pair, block_len)
            if step == 0:  # the rank's own block, all rows and columns: its gradients start the sums
                dq, dk, dv = (g.to(acc) for g in (dq_b, dk_b, dv_b))
            else:
                dq[:, :, pair.query] += dq_b
                # the dK/dV of the K/V block held now, as summed by the ranks that held it before
                dk, dv = pending_grad.wait()
                dk[:, :, pair.key] += dk_b
                dv[:, :, pair.key] += dv_b
            del dq_b, dk_b, dv_b
            # the K/V block moves on to the next rank now, so its gradient does too (after the last
            # step the block's own rank is next: it receives the complete sum)
            pending_grad = start_ring_exchange((dk, dv), self.ring_group, _GRAD_TAGS)
            del dk, dv
            if not self.overlap:
                pending_grad = _Done(pending_grad.wait())
        dk, dv = pending_grad.wait()
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, *args, **kwargs) -> Tensor:
        raise TypeError(
            "RingAttentionKernel runs inside UPipeDistributedAttention (it needs ring blocks, not a sequence)"
        )

    def __repr__(self) -> str:
        return f"RingAttentionKernel({self.inner!r}, ring_size={self.ring_size}, overlap={self.overlap})"


class _Done:
    """A finished exchange's result behind ``PendingRing``'s interface."""

    def __init__(self, result: list[Tensor]) -> None:
        self._result = result

    def wait(self) -> list[Tensor]:
        return self._result


def _merge(out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor) -> None:
    """Fold a block's (out, lse) into the running (out, lse) views in place: the exact softmax over the
    union of their keys.  sigmoid/logsigmoid form of exp(l_i - l) weights (ring-flash-attention's):
    no exp of a large difference, and a block lse of -inf contributes nothing."""
    weight = torch.sigmoid(block_lse - lse).unsqueeze(-1)
    # out + w (block_out - out), reusing the block's buffer (a copy only when it is lower precision)
    out.addcmul_(block_out.to(out.dtype).sub_(out), weight)
    lse.sub_(F.logsigmoid(lse - block_lse))


def _lse_for(kernel: AttentionKernel, q: Tensor, lse: Tensor) -> Tensor:
    """The merged lse of these query rows in the layout the kernel's backward reads: contiguous (the
    fused backward ops read it by raw strides), padded to 32 rows for torch's memory-efficient op,
    whose forward returns it so."""
    block = lse_block(kernel, q)
    if block > 1:
        padded = math.ceil(q.shape[2] / block) * block
        return F.pad(lse, (0, padded - q.shape[2]))
    return lse.contiguous()
