"""Bidirectional spans (Gemma 3's and Gemma 4's image tokens): causal attention plus, inside each span, every token
of the span.

transformers' Gemma 3 VLM masks (``masking_utils.blockwise_overlay`` on ``causal_mask_function``, and for the
sliding layers ``AND(sliding_window_overlay, OR(causal, blockwise))``) let query i of a span [s, e) see key j iff

    j <= i (causal, or inside the window: i - W < j <= i)   or   i < j < e (the rest of its own span).

The second term lies right of the diagonal, where the window's left edge never bites, so one decomposition is
exact for full and sliding layers alike: the kernel's own (causal or windowed) attention over the whole sequence,
merged through the lse with, per span, the strictly-future keys of each row: rows [s, e - 1) against keys
[s + 1, e), row i seeing keys j >= i + 1, which is causal attention once rows and keys are both reversed (as
``windows``' flipped pieces).  Every call is a causal call of equal q/k lengths, which every kernel takes
(flash-attn included); the backward runs each piece's own backward on the merged out and lse.

After a UPipe stage's all-to-all a rank holds the whole sequence for its heads, so the spans of the global
sequence (``BidirectionalSpans``, one tuple per batch row) apply to every stage unchanged, as packed documents'
boundaries do (``packing``).

Gemma 4 (``create_masks_for_vision_model``) overlays its full-attention layers with nothing (causal only) and its
sliding layers as above: spans made ``sliding_only`` apply to windowed calls alone (``for_window``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .kernels import AttentionKernel, CallableKernel, KernelAux, lse_block


@dataclass(frozen=True)
class BidirectionalSpans:
    """Per batch row, the [start, end) spans of the global sequence whose tokens see each other both ways."""

    rows: tuple[tuple[tuple[int, int], ...], ...]
    #: the spans overlay sliding-window layers only, full-attention layers stay causal (Gemma 4's mask)
    sliding_only: bool = False

    @staticmethod
    def of_block_ids(block_ids: Tensor, sliding_only: bool = False) -> BidirectionalSpans | None:
        """From [b, S] block ids (transformers' ``block_sequence_ids``: -1 outside, one id per span): each run of
        one id >= 0 is a span; None when no span holds two tokens (plain causal attention)."""
        ids = block_ids.long()
        starts = torch.ones_like(ids, dtype=torch.bool)
        starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
        rows = []
        for row_ids, row_starts in zip(ids, starts):
            bounds = (*row_starts.nonzero().flatten().tolist(), ids.shape[1])
            rows.append(tuple((s, e) for s, e in zip(bounds, bounds[1:]) if e - s > 1 and int(row_ids[s]) >= 0))
        return BidirectionalSpans(tuple(rows), sliding_only) if any(rows) else None

    def for_window(self, window: int | None) -> BidirectionalSpans | None:
        """The spans a layer of sliding ``window`` (None: full attention) attends with: None on a full layer of
        ``sliding_only`` spans."""
        return None if self.sliding_only and window is None else self

    def for_batch(self, batch: int) -> tuple[tuple[tuple[int, int], ...], ...]:
        """One row of spans per batch row (a single row is shared by all)."""
        return self.rows * batch if len(self.rows) == 1 else self.rows

    def check(self, batch: int, seq_len: int) -> None:
        """ValueError unless there is one row or one per batch row, each of ascending spans inside the sequence."""
        if len(self.rows) not in (1, batch):
            raise ValueError(f"bidirectional spans have {len(self.rows)} rows for a batch of {batch}")
        for r, row in enumerate(self.rows):
            ends = [x for span in row for x in span]
            if any(b < a for a, b in zip(ends, ends[1:])) or (ends and (ends[0] < 0 or ends[-1] > seq_len)):
                raise ValueError(f"bidirectional spans of row {r} {list(row)[:8]} must ascend within [0, {seq_len}]")

    def pieces(self, batch: int) -> list[tuple[int, int, int]]:
        """(row, start, end) of every span, row-major."""
        return [(r, s, e) for r, row in enumerate(self.for_batch(batch)) for s, e in row]


def _flip(t: Tensor) -> Tensor:
    return t.flip(2)


class SpanKernel(AttentionKernel):
    """``inner`` (causal, or a sliding window) plus each span's strictly-future keys, by ``causal`` (the same
    kernel without a window) on the reversed rows and keys of the span (module docstring)."""

    name = "spans"

    def __init__(self, inner: AttentionKernel, causal: AttentionKernel, spans: BidirectionalSpans) -> None:
        if isinstance(inner, CallableKernel) or not (inner.causal and causal.causal):
            raise ValueError(f"bidirectional spans need causal AttentionKernels with an lse, got {inner!r}, {causal!r}")
        super().__init__(True, inner.softmax_scale)
        self.inner, self.causal, self.spans = inner, causal, spans
        #: aux entries of the inner call (the pieces' follow), as forward found them
        self._inner_aux: int | None = None

    @property
    def reads_strided_inputs(self) -> bool:  # type: ignore[override]
        return self.inner.reads_strided_inputs and self.causal.reads_strided_inputs

    def _inputs(self, q: Tensor, k: Tensor, v: Tensor, r: int, s: int, e: int) -> tuple[Tensor, Tensor, Tensor]:
        """Rows [s, e - 1) and keys [s + 1, e) of batch row r, reversed: row i sees key j >= i + 1 as causal."""
        return _flip(q[r : r + 1, :, s : e - 1]), _flip(k[r : r + 1, :, s + 1 : e]), _flip(v[r : r + 1, :, s + 1 : e])

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, KernelAux]:
        self.spans.check(q.shape[0], q.shape[2])
        out, lse, aux = self.inner.forward(q, k, v)
        self._inner_aux = len(aux)
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        pieces_aux: list[Tensor | None] = []
        for r, s, e in self.spans.pieces(q.shape[0]):
            po, pl, paux = self.causal.forward(*self._inputs(q, k, v, r, s, e))
            pieces_aux += paux
            rows = (slice(r, r + 1), slice(None), slice(s, e - 1))
            pl = pl[..., : e - 1 - s].flip(-1).to(acc)
            now_o, now_l = out[rows].to(acc), lse[rows].to(acc)
            weight = torch.sigmoid(pl - now_l).unsqueeze(-1)  # the piece's share of the merged softmax
            out[rows] = now_o.add_((_flip(po).to(acc) - now_o).mul_(weight)).to(out.dtype)
            lse[rows] = torch.logaddexp(now_l, pl).to(lse.dtype)
        return out, lse, (*aux, *pieces_aux)

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, aux: KernelAux
    ) -> tuple[Tensor, Tensor, Tensor]:
        pieces = self.spans.pieces(q.shape[0])
        if pieces and self._inner_aux is None:
            raise RuntimeError("SpanKernel.backward runs on the aux of its own forward: call forward first")
        n = self._inner_aux if pieces else len(aux)
        dq, dk, dv = self.inner.backward(dout, q, k, v, out, lse, aux[:n])
        if not pieces:
            return dq, dk, dv
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        grads = [g.to(acc) for g in (dq, dk, dv)]
        per_piece = (len(aux) - n) // len(pieces)
        for i, (r, s, e) in enumerate(pieces):
            qp, kp, vp = self._inputs(q, k, v, r, s, e)
            rows = (slice(r, r + 1), slice(None), slice(s, e - 1))
            l_t = lse[rows].flip(-1).to(acc)
            pad = -l_t.shape[-1] % lse_block(self.causal, qp)  # torch's memory-efficient op reads it padded
            l_t = torch.nn.functional.pad(l_t, (0, pad)).contiguous()
            piece_aux = tuple(aux[n + i * per_piece : n + (i + 1) * per_piece])
            g_q, g_k, g_v = self.causal.backward(
                _flip(dout[rows]).contiguous(), qp, kp, vp, _flip(out[rows]).contiguous(), l_t, piece_aux
            )
            grads[0][rows] += _flip(g_q)
            grads[1][r : r + 1, :, s + 1 : e] += _flip(g_k)
            grads[2][r : r + 1, :, s + 1 : e] += _flip(g_v)
        return grads[0].to(q.dtype), grads[1].to(k.dtype), grads[2].to(v.dtype)

    def __repr__(self) -> str:
        return f"SpanKernel({self.inner!r}, spans per row {[len(r) for r in self.spans.rows]})"
