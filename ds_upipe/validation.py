"""Input checks that fail identically on every rank.

A check that only some ranks fail would leave the others blocked in the next collective.  So the
shapes of all ranks are exchanged first (one tiny all_gather), and every rank evaluates the same
rules on the same gathered data, raising the same ValueError.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from .schedule import resolve_head_chunk_size

_FIELDS = 1 + 3 * 5  # batch_dim_idx, then (ndim, 4 dims) for q, k, v


def _describe(t: Tensor) -> list[int]:
    dims = list(t.shape) if t.dim() == 4 else [-1] * 4
    return [t.dim(), *dims]


def gather_shapes(
    query: Tensor, key: Tensor, value: Tensor, batch_dim_idx: int, group: dist.ProcessGroup | None
) -> list[list[int]]:
    """Every rank's [batch_dim_idx, q ndim, q dims, k ndim, k dims, v ndim, v dims]."""
    mine = torch.tensor(
        [batch_dim_idx, *_describe(query), *_describe(key), *_describe(value)], dtype=torch.long, device=query.device
    )
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    if world == 1:
        return [mine.tolist()]
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine, group=group)
    return [t.tolist() for t in everyone]


def check_inputs(shapes: list[list[int]], scatter_idx: int, head_chunk_size: int | None) -> tuple[int, int, int]:
    """Validate all ranks' shapes; returns (num_heads, num_kv_heads, resolved head_chunk_size)."""
    group_size = len(shapes)
    if scatter_idx != 2:
        raise ValueError(
            f"scatter_idx={scatter_idx} is not supported: heads must be dim 2 ([b, s, h, d] or [s, b, h, d])"
        )
    for rank, row in enumerate(shapes):
        batch_dim_idx = row[0]
        if batch_dim_idx not in (0, 1):
            raise ValueError(
                f"batch_dim_idx={batch_dim_idx} (rank {rank}): must be 0 for [b, s, h, d] or 1 for [s, b, h, d]"
            )
        q, k, v = row[1:6], row[6:11], row[11:16]
        for name, desc in (("query", q), ("key", k), ("value", v)):
            if desc[0] != 4:
                raise ValueError(f"{name} must be 4-D ([b, s, h, d] or [s, b, h, d]); rank {rank} got {desc[0]}-D")
        if k[1:] != v[1:]:
            raise ValueError(f"key shape {k[1:]} and value shape {v[1:]} differ on rank {rank}")
        if q[1:3] != k[1:3] or q[4] != k[4]:
            raise ValueError(f"query {q[1:]} and key {k[1:]} must agree on batch, sequence and head_dim (rank {rank})")
    if any(row[0] != shapes[0][0] for row in shapes):
        raise ValueError(f"batch_dim_idx differs across ranks: {[row[0] for row in shapes]}")
    # positions in a row: [batch_dim_idx, q ndim, q d0, q d1, ...]; layout 0 = [b, s, ...], 1 = [s, b, ...]
    seq_dim = 3 - shapes[0][0]
    batch_dim = 2 + shapes[0][0]
    seq_lens = [row[seq_dim] for row in shapes]
    if len(set(seq_lens)) != 1:
        raise ValueError(
            f"sequence shard lengths differ across ranks: {seq_lens}. Every rank must hold an equal shard "
            "(pad the sequence to a multiple of the sequence-parallel size), and batch_dim_idx must match "
            f"the tensor layout (batch_dim_idx={shapes[0][0]} means "
            f"{'[b, s, h, d]' if shapes[0][0] == 0 else '[s, b, h, d]'})"
        )
    batches = [row[batch_dim] for row in shapes]
    if len(set(batches)) != 1:
        raise ValueError(f"batch sizes differ across ranks: {batches} (or batch_dim_idx does not match the layout)")
    heads = {(row[4], row[9]) for row in shapes}
    if len(heads) != 1:
        raise ValueError(f"head counts differ across ranks: {sorted(heads)}")
    num_heads, num_kv_heads = heads.pop()
    u = resolve_head_chunk_size(num_heads, num_kv_heads, group_size, head_chunk_size)
    return num_heads, num_kv_heads, u
