"""The UPipe stage plan: which heads each rank handles in each stage.

Pure and tiny on purpose: every other module follows this plan and nothing else re-derives head
indices.  Vocabulary (all counts are global, across the sequence-parallel group of size C):

- H query heads, Hkv key/value heads, GQA ratio g = H / Hkv.
- U = head_chunk_size: query heads processed per stage across the group, u = U / C per rank.
- A *round* is a run of stages during which every rank holds the same KV heads; KV heads are sent
  once at the start of a round and reused by all of its stages (the paper's GQA-aware order).
- When Hkv < C, each KV head is replicated to rep = C / Hkv ranks; the replicas' gradients are
  summed back into the one local KV head (index_add), nothing is rewritten.

With U = H the plan is a single stage equal to DeepSpeed-Ulysses' head split (rank p gets the
contiguous block of heads p*H/C ... (p+1)*H/C - 1), so plain Ulysses is the U = H special case.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache


@dataclass(frozen=True)
class Stage:
    """One stage: ``query_heads[p]`` are the u global query-head indices rank p attends over.

    The heads of one rank are listed KV-major, so head i of a rank's stage uses that rank's round
    KV head ``i // (u // kv_per_rank)`` (the usual repeat_interleave GQA convention)."""

    query_heads: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class Round:
    """KV heads held by each rank (``kv_heads[p]``) for the stages of this round."""

    kv_heads: tuple[tuple[int, ...], ...]
    stages: tuple[Stage, ...]


@dataclass(frozen=True)
class StagePlan:
    num_heads: int
    num_kv_heads: int
    group_size: int
    head_chunk_size: int
    rounds: tuple[Round, ...]

    @property
    def num_stages(self) -> int:
        return sum(len(r.stages) for r in self.rounds)


def check_head_counts(num_heads: int, num_kv_heads: int, group_size: int) -> None:
    """Raise ValueError unless H and Hkv can be split over a group of ``group_size`` ranks."""
    if group_size < 1:
        raise ValueError(f"sequence-parallel group size must be >= 1, got {group_size}")
    if num_heads < 1 or num_kv_heads < 1:
        raise ValueError(f"head counts must be positive, got num_heads={num_heads}, num_kv_heads={num_kv_heads}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(
            f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}; "
            "every query head must belong to exactly one KV group"
        )
    if num_heads % group_size != 0:
        raise ValueError(
            f"num_heads={num_heads} is not divisible by the sequence-parallel size {group_size}; "
            f"choose a sequence_parallel_size that divides {num_heads}"
        )
    if num_kv_heads % group_size != 0 and group_size % num_kv_heads != 0:
        raise ValueError(
            f"num_kv_heads={num_kv_heads} and sequence-parallel size {group_size}: one must divide the other "
            "(KV heads are split across ranks, or replicated when there are fewer KV heads than ranks)"
        )


def valid_group_sizes(num_heads: int, num_kv_heads: int) -> list[int]:
    """Every sequence-parallel size that ``check_head_counts`` accepts for these head counts."""
    valid = []
    for c in range(1, num_heads + 1):
        try:
            check_head_counts(num_heads, num_kv_heads, c)
        except ValueError:
            continue
        valid.append(c)
    return valid


def _head_chunk_problem(num_heads: int, num_kv_heads: int, group_size: int, head_chunk_size: int) -> str | None:
    """Why ``head_chunk_size`` is invalid for these head counts, or None when it is valid."""
    u_total, c = head_chunk_size, group_size
    if u_total < 1 or u_total % c != 0:
        return f"it must be a positive multiple of the sequence-parallel size {c}"
    if num_heads % u_total != 0:
        return f"it must divide num_heads={num_heads}"
    g = num_heads // num_kv_heads
    u = u_total // c
    if num_kv_heads < c:
        return None  # replicated KV: each rank owns a fraction of one group; any such u divides it
    if g % u != 0 and u % g != 0:
        return (
            f"each rank's {u} heads per stage must be a whole fraction of a KV group or whole KV groups "
            f"(GQA group size {g})"
        )
    return None


def valid_head_chunk_sizes(num_heads: int, num_kv_heads: int, group_size: int) -> list[int]:
    """All accepted head_chunk_size values for these head counts, smallest (least memory) first."""
    check_head_counts(num_heads, num_kv_heads, group_size)
    return [
        u
        for u in range(group_size, num_heads + 1, group_size)
        if _head_chunk_problem(num_heads, num_kv_heads, group_size, u) is None
    ]


def resolve_head_chunk_size(num_heads: int, num_kv_heads: int, group_size: int, head_chunk_size: int | None) -> int:
    """None means U = C (most memory saved). Anything invalid raises with the list of valid values."""
    check_head_counts(num_heads, num_kv_heads, group_size)
    if head_chunk_size is None:
        return group_size
    if isinstance(head_chunk_size, bool) or not isinstance(head_chunk_size, int):
        raise ValueError(f"head_chunk_size must be an int or None, got {head_chunk_size!r}")
    problem = _head_chunk_problem(num_heads, num_kv_heads, group_size, head_chunk_size)
    if problem is not None:
        valid = valid_head_chunk_sizes(num_heads, num_kv_heads, group_size)
        raise ValueError(
            f"invalid head_chunk_size={head_chunk_size} for num_heads={num_heads}, num_kv_heads={num_kv_heads}, "
            f"sequence-parallel size {group_size}: {problem}. Valid values: {valid}"
        )
    return head_chunk_size


@lru_cache(maxsize=256)
def build_plan(num_heads: int, num_kv_heads: int, group_size: int, head_chunk_size: int | None = None) -> StagePlan:
    """The stage plan for (H, Hkv, C, U); validates its arguments first."""
    u_total = resolve_head_chunk_size(num_heads, num_kv_heads, group_size, head_chunk_size)
    c = group_size
    g = num_heads // num_kv_heads
    u = u_total // c
    rep = max(1, c // num_kv_heads)
    if rep > 1:
        kv_per_rank = 1
        # KV head of rank p is p // rep; its g query heads are shared by rep ranks in equal slices.
        q_per_rank_round = g // rep
    else:
        kv_per_rank = max(1, u // g)
        q_per_rank_round = kv_per_rank * g
    num_rounds = num_kv_heads * rep // (c * kv_per_rank)

    rounds = []
    for j in range(num_rounds):
        kv_heads, owned_queries = [], []
        for p in range(c):
            if rep > 1:
                kv = (p // rep,)
                first_q = kv[0] * g + (p % rep) * q_per_rank_round
                queries = list(range(first_q, first_q + q_per_rank_round))
            else:
                first_kv = (j * c + p) * kv_per_rank
                kv = tuple(range(first_kv, first_kv + kv_per_rank))
                queries = [kv_head * g + i for kv_head in kv for i in range(g)]
            kv_heads.append(kv)
            owned_queries.append(queries)
        stages = tuple(
            Stage(query_heads=tuple(tuple(q[s * u : (s + 1) * u]) for q in owned_queries))
            for s in range(q_per_rank_round // u)
        )
        rounds.append(Round(kv_heads=tuple(kv_heads), stages=stages))
    return StagePlan(num_heads, num_kv_heads, c, u_total, tuple(rounds))
