"""The C_u x R layout of a sequence-parallel group (pure arithmetic, no torch: the planner uses it).

``sequence_parallel_size = C_u x R``: sequence-parallel rank ``r = ring_index * C_u + ulysses_index``;
``ds_upipe.ring`` has the groups, the zigzag sharding and ring attention over this layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class SequenceLayout:
    """``ulysses_size`` (C_u) x ``ring_size`` (R) ranks of one sequence-parallel group."""

    ulysses_size: int
    ring_size: int

    @property
    def sp_size(self) -> int:
        return self.ulysses_size * self.ring_size

    @property
    def sequence_multiple(self) -> int:
        """What a global sequence length must be a multiple of: C without a ring; with one, R x lcm(2, C_u)
        (2R equal zigzag chunks, each ring block split evenly over its C_u Ulysses ranks)."""
        if self.ring_size == 1:
            return self.ulysses_size
        return self.ring_size * math.lcm(2, self.ulysses_size)

    def sp_rank(self, ring_index: int, ulysses_index: int) -> int:
        return ring_index * self.ulysses_size + ulysses_index

    def coordinates(self, sp_rank: int) -> tuple[int, int]:
        """(ring_index, ulysses_index) of a sequence-parallel rank."""
        return divmod(sp_rank, self.ulysses_size)


def sequence_layout(sequence_parallel_size: int, ring_size: int) -> SequenceLayout:
    """C_u = sequence_parallel_size / ring_size; ValueError naming both unless R divides the SP size."""
    for name, value in (("sequence_parallel_size", sequence_parallel_size), ("ring_size", ring_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if sequence_parallel_size % ring_size:
        raise ValueError(
            f"ring_size={ring_size} does not divide sequence_parallel_size={sequence_parallel_size}: the "
            "sequence-parallel group is Ulysses degree x ring size, so choose a ring_size that divides it "
            f"({[r for r in range(1, sequence_parallel_size + 1) if sequence_parallel_size % r == 0]})"
        )
    return SequenceLayout(sequence_parallel_size // ring_size, ring_size)
