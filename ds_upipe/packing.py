"""Packed sequences: many documents in one row, each attending causally to itself only.

Padding-free packing (HF ``DataCollatorWithFlattening``, TRL's padding-free mode) concatenates
documents into one row and restarts ``position_ids`` at each document.  After a UPipe stage's
all-to-all a rank holds the whole sequence for its heads, so the document boundaries of the global
sequence apply unchanged to every stage: ``DocumentKernel`` wraps the stage's local kernel and runs
it once per document segment (exact; cost the sum of the squared document lengths instead of the
square of the row), keeping the ``(out, lse, aux)`` contract, so the stage loop does not change.
Around ``FlashAttnKernel`` it makes one flash-attn varlen call per stage for all documents instead.

Boundaries are *cumulative sequence lengths* of the global sequence (flash-attn's ``cu_seqlens``):
``(0, l1, l1 + l2, ..., S)``, one tuple per batch row (``DocumentBoundaries``).
``documents_from_positions`` derives them from the global position_ids with transformers' rule
(``masking_utils.find_packed_sequence_indices``: a token whose position is not its predecessor's + 1
starts a new document), so a UPipe model and the single-process HF model split a row identically.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .kernels import AttentionKernel, FlashAttnKernel, KernelAux

_HASH_MODULUS = (1 << 61) - 1  # a Mersenne prime: the fingerprint fits an int64 and mixes well


@dataclass(frozen=True)
class DocumentBoundaries:
    """Per batch row, the cumulative document lengths ``(0, ..., S)`` of the global sequence."""

    rows: tuple[tuple[int, ...], ...]

    @staticmethod
    def of(cu_seqlens: Sequence[int] | Sequence[Sequence[int]] | Tensor | DocumentBoundaries) -> DocumentBoundaries:
        """From one ``cu_seqlens`` (shared by every row; a 1-D tensor or list) or one per row (a list of
        lists, or a 2-D tensor when every row has as many documents).  Not validated: see ``check``."""
        if isinstance(cu_seqlens, DocumentBoundaries):
            return cu_seqlens
        if isinstance(cu_seqlens, Tensor):
            cu_seqlens = cu_seqlens.tolist()
        values = list(cu_seqlens)
        if values and isinstance(values[0], Sequence):
            return DocumentBoundaries(tuple(tuple(int(x) for x in row) for row in values))
        return DocumentBoundaries((tuple(int(x) for x in values),))

    def for_batch(self, batch: int) -> tuple[tuple[int, ...], ...]:
        """One row of boundaries per batch row (a single row is shared by all)."""
        return self.rows * batch if len(self.rows) == 1 else self.rows

    @property
    def is_trivial(self) -> bool:
        """Every row is one document (plain causal attention over the row)."""
        return all(len(row) <= 2 for row in self.rows)

    def fingerprint(self) -> list[int]:
        """[rows, boundaries in all, hash]: equal on every rank iff (practically) the boundaries are."""
        h = 0
        for row in self.rows:
            for x in (*row, -1):  # -1 separates rows
                h = (h * 1_000_003 + x + 2) % _HASH_MODULUS
        return [len(self.rows), sum(len(r) for r in self.rows), h]

    def check(self, batch: int, seq_len: int) -> None:
        """ValueError unless each row is ``0 < ... < seq_len`` ascending (starting at 0, ending at the
        global sequence length) and there is one row or one per batch row."""
        if len(self.rows) not in (1, batch):
            raise ValueError(
                f"cu_seqlens has {len(self.rows)} rows for a batch of {batch}: pass one (shared by every row) or "
                "one per batch row"
            )
        for r, row in enumerate(self.rows):
            steps_ok = all(b > a for a, b in zip(row, row[1:]))
            if len(row) < 2 or row[0] != 0 or row[-1] != seq_len or not steps_ok:
                raise ValueError(
                    f"cu_seqlens row {r} = {list(row)[:16]}{' ...' if len(row) > 16 else ''} must ascend strictly "
                    f"from 0 to the global sequence length {seq_len} (cumulative document lengths)"
                )


def documents_from_positions(position_ids: Tensor, keep: Tensor | None = None) -> DocumentBoundaries | None:
    """Document boundaries of [b, S] global position_ids (in sequence order), None when no row restarts.

    A real token whose position is not its predecessor's + 1 starts a document (transformers'
    ``find_packed_sequence_indices``).  ``keep`` ([b, S], 0 = padding; right padding only) leaves the
    padding out: it joins the last document, which no real token attends past under causal attention."""
    pos = position_ids.long()
    starts = pos[:, 1:] != pos[:, :-1] + 1
    if keep is not None:
        starts &= keep[:, 1:].bool()
    if not bool(starts.any()):
        return None
    seq = pos.shape[1]
    rows = []
    for row in starts:  # the start indices only (nonzero), not a Python list of every token
        rows.append((0, *(row.nonzero().flatten() + 1).tolist(), seq))
    return DocumentBoundaries(tuple(rows))


class DocumentKernel(AttentionKernel):
    """``inner`` run per document segment of the [b, h, S, d] stage tensors (the global sequence of a
    stage's heads): tokens attend (causally, when ``inner`` is causal) within their own document only.

    With ``FlashAttnKernel`` inside (CUDA), each stage is one call of flash-attn's varlen functions
    over the b*S tokens of all rows concatenated (``FlashAttnKernel.forward_varlen``): ``cu_seqlens``
    of every document of every row, the longest document as ``max_seqlen``; the lse is flash-attn's
    varlen [h, b*S] and ``aux`` is (cu_seqlens, rng_state).  Every other inner kernel (torch's CPU
    flash and CUDA ops, the math kernel) runs once per document segment: forward concatenates the
    segments' outputs, and their lse along the last dim (flat, [1, h, sum]), since a kernel's lse may
    be longer than its segment (CUDA memory-efficient attention pads it); ``aux`` is the per-segment
    lse lengths (a CPU tensor) followed by each segment's inner aux.  Either way ``aux`` has the same
    length for every stage of a call, as the pipeline needs."""

    name = "documents"

    def __init__(self, inner: AttentionKernel, boundaries: DocumentBoundaries) -> None:
        if isinstance(inner, DocumentKernel):
            raise ValueError("DocumentKernel cannot wrap another DocumentKernel")
        super().__init__(inner.causal, inner.softmax_scale)
        self.inner = inner
        self.boundaries = boundaries
        # the varlen path's (batch, seq, device) -> (cu_seqlens, max_seqlen): built once, not per stage
        self._varlen_cache: dict[tuple[int, int, torch.device], tuple[Tensor, int]] = {}
        # (batch, seq) -> each segment's lse length, as forward found it (a function of the segments and
        # the inner kernel only): backward splits the lse by these Python ints, no ``.tolist()`` of
        # ``aux``'s lengths tensor (which fake tensors, ``ds-upipe plan`` and ``"auto"``, cannot run)
        self._lse_lengths: dict[tuple[int, int], list[int]] = {}

    @property
    def per_head(self) -> bool:  # type: ignore[override]
        return self.inner.per_head

    @property
    def reads_strided_inputs(self) -> bool:  # type: ignore[override]
        return self.inner.reads_strided_inputs

    def for_heads(self, heads: Tensor) -> AttentionKernel:
        """Per-head state (attention sinks) of the inner kernel bound to a stage's heads, per document."""
        inner = self.inner.for_heads(heads)
        if inner is self.inner:
            return self
        bound = DocumentKernel(inner, self.boundaries)
        bound._varlen_cache = self._varlen_cache  # shared: built once per call, not per stage
        bound._lse_lengths = self._lse_lengths
        return bound

    @property
    def varlen(self) -> bool:
        """Whether each stage is one flash-attn varlen call (else one inner call per document)."""
        return isinstance(self.inner, FlashAttnKernel)

    def segments(self, batch: int) -> list[tuple[int, int, int]]:
        """(row, start, end) of every document, row-major."""
        return [(r, s, e) for r, row in enumerate(self.boundaries.for_batch(batch)) for s, e in zip(row, row[1:])]

    def flat_cu_seqlens(self, batch: int, seq: int, device: torch.device) -> tuple[Tensor, int]:
        """flash-attn's varlen ``cu_seqlens`` (int32, on ``device``) of every document over the
        ``batch * seq`` tokens of the rows concatenated, and the longest document's length."""
        key = (batch, seq, torch.device(device))
        if key not in self._varlen_cache:
            rows = self.boundaries.for_batch(batch)
            flat = [0] + [r * seq + x for r, row in enumerate(rows) for x in row[1:]]
            longest = max(e - s for row in rows for s, e in zip(row, row[1:]))
            self._varlen_cache[key] = (torch.tensor(flat, dtype=torch.int32, device=device), longest)
        return self._varlen_cache[key]

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, KernelAux]:
        self.boundaries.check(q.shape[0], q.shape[2])
        if isinstance(self.inner, FlashAttnKernel):  # == self.varlen, spelled out for type narrowing
            cu_seqlens, longest = self.flat_cu_seqlens(q.shape[0], q.shape[2], q.device)
            out, lse, aux = self.inner.forward_varlen(q, k, v, cu_seqlens, longest)
            return out, lse, (cu_seqlens, *aux)
        out = torch.empty((*q.shape[:-1], v.shape[-1]), dtype=q.dtype, device=q.device)
        lses, lengths, aux_all = [], [], []
        for r, s, e in self.segments(q.shape[0]):
            o, lse, aux = self.inner.forward(*(t[r : r + 1, :, s:e] for t in (q, k, v)))
            out[r : r + 1, :, s:e] = o
            lses.append(lse)
            lengths.append(lse.shape[-1])
            aux_all += aux
        self._lse_lengths[(q.shape[0], q.shape[2])] = lengths
        lse = torch.cat(lses, dim=-1)
        return out, lse, (torch.tensor(lengths, dtype=torch.long), *aux_all)

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, aux: KernelAux
    ) -> tuple[Tensor, Tensor, Tensor]:
        if isinstance(self.inner, FlashAttnKernel):
            cu_seqlens, *inner_aux = aux
            _, longest = self.flat_cu_seqlens(q.shape[0], q.shape[2], q.device)
            return self.inner.backward_varlen(dout, q, k, v, out, lse, tuple(inner_aux), cu_seqlens, longest)
        lengths, *inner_aux = aux
        segments = self.segments(q.shape[0])
        per_segment = len(inner_aux) // len(segments)
        known = self._lse_lengths.get((q.shape[0], q.shape[2]))
        lses = lse.split(known if known is not None else lengths.tolist(), dim=-1)
        dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
        dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
        for i, (r, s, e) in enumerate(segments):
            pieces = (t[r : r + 1, :, s:e] for t in (dout, q, k, v, out))
            seg_aux = tuple(inner_aux[i * per_segment : (i + 1) * per_segment])
            # the split is a strided view ([1, h, n] of the [1, h, sum] lse): torch's CUDA flash backward
            # (mha_bwd) reads its lse by raw pointer as (b * h + head) * seqlen, so with h >= 2 heads a
            # view would hand heads >= 1 another head's rows; contiguous, every op reads it right
            g_q, g_k, g_v = self.inner.backward(*pieces, lses[i].contiguous(), seg_aux)
            dq[r : r + 1, :, s:e] = g_q
            dk[r : r + 1, :, s:e] = g_k
            dv[r : r + 1, :, s:e] = g_v
        return dq, dk, dv

    def __repr__(self) -> str:
        per_row = [len(r) - 1 for r in self.boundaries.rows]
        return f"DocumentKernel({self.inner!r}, documents per row {per_row}{', varlen' if self.varlen else ''})"
