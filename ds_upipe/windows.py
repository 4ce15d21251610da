"""Sliding-window (local) causal attention with the kernels' ``(out, lse, aux)`` contract.

Convention (transformers' ``masking_utils.sliding_window_causal_mask_function``, used by Mistral,
Qwen2/3, Gemma 2/3, GPT-OSS): query position ``i`` sees key position ``j`` iff ``i - W < j <= i``,
that is the W tokens ending at (and including) itself.  flash-attn spells the same mask
``causal=True, window_size=(W - 1, 0)`` (transformers' flash integration passes ``(W - 1, W - 1)``
with ``causal=True``, whose right half the causal mask makes moot).  ``W = 1`` attends to itself only;
a window of at least the sequence length is plain causal attention.

How each kernel runs it:

- ``FlashAttnKernel(window=W)`` (CUDA, flash-attn installed): flash-attn's own window, in the
  release's argument names; ``DocumentKernel`` keeps its single varlen call (the window applies per
  document, as flash-attn's varlen mask is per sequence).  ``FA3Kernel(window=W)`` (flash-attn 3):
  its own ``window_size=(W - 1, 0)`` likewise (``DocumentKernel`` calls it per document).
- every other kernel (torch's CPU flash and CUDA ops, the math reference): ``SlidingWindowKernel``,
  banded query tiles.  torch's fused ops take only ``is_causal`` (no band, no offset), so each tile of
  ``tile`` queries is computed against its key band of at most ``tile + W - 1`` keys with an explicit
  band mask, in float32 (float64 for float64 inputs), and its exact lse kept; the backward recomputes
  each tile's probabilities from the saved lse (no attention recompute of other tiles).  Memory beyond
  the inputs and outputs: one tile's ``b x h x tile x (tile + W - 1)`` scores, never S x S; compute
  ``S x (tile + W)`` per head instead of ``S^2 / 2``.

``band_forward`` / ``band_backward`` take position offsets for the queries and the keys, which is what
ring attention needs for its zigzag chunk pairs (``ds_upipe.ring``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import Tensor

from .kernels import (
    AttentionKernel,
    CallableKernel,
    FlashWindowKernel,
    KernelAux,
    TorchSDPAKernel,
    kernel_autograd,
    lse_block,
)

#: queries per tile of the banded path: one tile's scores are tile x (tile + W - 1) per head on the
#: band-mask path; on the fused-op path tiles hold min(tile, W - 1) queries and no scores
DEFAULT_TILE = 128
#: the fused-op path needs tiles of W - 1 >= this many queries (smaller windows: the band mask)
MIN_FUSED_TILE = 8


def check_window(window: object, where: str = "window") -> int | None:
    """``window`` itself when it is None or a positive int; ValueError naming the value otherwise."""
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(
            f"{where} must be a positive int (the W tokens a query sees, itself included: key j is visible to "
            f"query i iff i - W < j <= i, transformers' sliding_window) or None for full causal attention, "
            f"got {window!r}"
        )
    return window


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def visible_products(q_len: int, k_len: int, window: int, q_start: int = 0, k_start: int = 0) -> int:
    """Query-key pairs of a (q_len x k_len) block that the window mask keeps (per row and head)."""
    q_pos = torch.arange(q_start, q_start + q_len)
    hi = torch.clamp(q_pos - k_start, max=k_len - 1)  # last visible key index (inclusive)
    lo = torch.clamp(q_pos - window + 1 - k_start, min=0)
    return int(torch.clamp(hi - lo + 1, min=0).sum())


def key_band(rows: tuple[int, int], q_start: int, k_start: int, k_len: int, window: int) -> tuple[int, int]:
    """[lo, hi) key indices that query rows [rows[0], rows[1]) may see (empty when lo >= hi)."""
    lo = max(0, q_start + rows[0] - window + 1 - k_start)
    hi = min(k_len, q_start + rows[1] - k_start)
    return lo, hi


def _band_mask(rows: tuple[int, int], band: tuple[int, int], q_start: int, k_start: int, window: int, device) -> Tensor:
    q_pos = torch.arange(q_start + rows[0], q_start + rows[1], device=device)[:, None]
    k_pos = torch.arange(k_start + band[0], k_start + band[1], device=device)[None, :]
    return (k_pos <= q_pos) & (k_pos > q_pos - window)


def _tile_probs(q: Tensor, k: Tensor, mask: Tensor, scale: float, lse: Tensor | None) -> tuple[Tensor, Tensor]:
    """Probabilities of one tile ([b, hkv, g, T, n]) from q [b, hkv, g, T, d] and k [b, hkv, 1, n, d], and
    the tile's lse ([b, hkv, g, T]): computed when ``lse`` is None, else taken (backward)."""
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale).masked_fill_(~mask, float("-inf"))
    if lse is None:
        lse = torch.logsumexp(scores, dim=-1)
    # rows with no visible key have lse -inf: subtract 0 there, so their probabilities are exp(-inf) = 0
    safe = lse.masked_fill(torch.isinf(lse), 0.0)
    return scores.sub_(safe.unsqueeze(-1)).exp_(), lse


def _grouped(t: Tensor, hkv: int) -> Tensor:
    """[b, hq, S, d] -> [b, hkv, g, S, d] (a view): query head i uses KV head i // g."""
    b, hq = t.shape[:2]
    return t.view(b, hkv, hq // hkv, *t.shape[2:])


def band_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    window: int,
    scale: float,
    q_start: int = 0,
    k_start: int = 0,
    tile: int = DEFAULT_TILE,
) -> tuple[Tensor, Tensor]:
    """Sliding-window causal attention of q [b, hq, Sq, d] (positions ``q_start + i``) over k, v
    [b, hkv, Sk, d] (positions ``k_start + j``), GQA-native: (out [b, hq, Sq, d] in q's dtype,
    lse [b, hq, Sq] in float32, float64 for float64 inputs; -inf and a zero output for a row that sees
    no key)."""
    b, hq, seq_q, d = q.shape
    hkv = k.shape[1]
    ct = _compute_dtype(q.dtype)
    out = torch.zeros((*q.shape[:-1], v.shape[-1]), dtype=q.dtype, device=q.device)
    lse = torch.full((b, hq, seq_q), float("-inf"), dtype=ct, device=q.device)
    qg, og, lg = _grouped(q, hkv), _grouped(out, hkv), _grouped(lse, hkv)
    for r0 in range(0, seq_q, tile):
        rows = (r0, min(seq_q, r0 + tile))
        band = key_band(rows, q_start, k_start, k.shape[2], window)
        if band[0] >= band[1]:
            continue
        mask = _band_mask(rows, band, q_start, k_start, window, q.device)
        kb, vb = (t[:, :, band[0] : band[1]].to(ct).unsqueeze(2) for t in (k, v))
        probs, tile_lse = _tile_probs(qg[:, :, :, rows[0] : rows[1]].to(ct), kb, mask, scale, None)
        og[:, :, :, rows[0] : rows[1]] = torch.matmul(probs, vb).to(q.dtype)
        lg[:, :, :, rows[0] : rows[1]] = tile_lse
    return out, lse


def band_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    window: int,
    scale: float,
    q_start: int = 0,
    k_start: int = 0,
    tile: int = DEFAULT_TILE,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of ``band_forward`` given the final ``out`` and ``lse`` of these query rows (which may
    cover more keys than k, v: ring attention passes the merged ones, so each block's share is exact).
    dq in q's dtype; dk, dv in float32 (float64 for float64 inputs) for the caller to sum or cast."""
    b, hq, seq_q, d = q.shape
    hkv = k.shape[1]
    ct = _compute_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.zeros(k.shape, dtype=ct, device=k.device)
    dv = torch.zeros(v.shape, dtype=ct, device=v.device)
    qg, dqg, og, dog, lg = (_grouped(t, hkv) for t in (q, dq, out, dout, lse))
    for r0 in range(0, seq_q, tile):
        rows = (r0, min(seq_q, r0 + tile))
        band = key_band(rows, q_start, k_start, k.shape[2], window)
        if band[0] >= band[1]:
            continue
        mask = _band_mask(rows, band, q_start, k_start, window, q.device)
        sl = slice(*rows)
        kb, vb = (t[:, :, band[0] : band[1]].to(ct).unsqueeze(2) for t in (k, v))
        q_t, do_t = qg[:, :, :, sl].to(ct), dog[:, :, :, sl].to(ct)
        probs, _ = _tile_probs(q_t, kb, mask, scale, lg[:, :, :, sl].to(ct))
        dv[:, :, band[0] : band[1]] += torch.matmul(probs.transpose(-1, -2), do_t).sum(dim=2)
        delta = (do_t * og[:, :, :, sl].to(ct)).sum(dim=-1, keepdim=True)
        dscores = torch.matmul(do_t, vb.transpose(-1, -2)).sub_(delta).mul_(probs).mul_(scale)
        del probs
        dqg[:, :, :, sl] = torch.matmul(dscores, kb).to(q.dtype)
        dk[:, :, band[0] : band[1]] += torch.matmul(dscores.transpose(-1, -2), q_t).sum(dim=2)
    return dq, dk, dv


# -- banded tiles on torch's fused ops (no score matrix at all) ----------------------------------------
#
# A tile of n <= W - 1 queries at rows [a, a + n) sees keys [a - W + 1, a + n), split in three pieces
# that torch's ops express with ``is_causal`` on equal lengths or no mask:
#   A = keys [a - W + 1, a - W + 1 + n): row i sees key j iff j >= i, which is causal once the rows and
#       the keys are both reversed (i' = n-1-i, j' = n-1-j: j' <= i');
#   B = keys [a - W + 1 + n, a): visible to every row of the tile (no mask; empty when n = W - 1);
#   C = keys [a, a + n): causal.
# The pieces' (out, lse) merge exactly through their lse (as ring attention merges blocks), and each
# piece's backward runs on the merged out and lse.  Tiles near the start (keys clipped at 0): A is
# dropped when the window reaches before position 0 for every row, and the one tile where it is clipped
# part-way runs the float32 band mask (``band_forward``) instead.


@dataclass(frozen=True)
class _Piece:
    """One op call of a tile: key rows [k0, k1); ``kind`` "causal", "flipped" (A) or "full" (B)."""

    kind: str
    k0: int
    k1: int


def _tile_pieces(a: int, n: int, window: int) -> list[_Piece] | None:
    """The pieces of the tile of rows [a, a + n), None for the tile that needs the band mask."""
    lo = a - window + 1
    if lo < 0 < lo + n:
        return None
    pieces = [_Piece("causal", a, a + n)]
    if lo >= 0:
        pieces.append(_Piece("flipped", lo, lo + n))
    b0 = max(0, lo + n)
    if b0 < a:
        pieces.append(_Piece("full", b0, a))
    return pieces


def _flip(t: Tensor) -> Tensor:
    return t.flip(2)


def _lse_rows(lse: Tensor, rows: int) -> Tensor:
    return lse[..., :rows]


def _padded_lse(kernel: AttentionKernel, q: Tensor, lse: Tensor) -> Tensor:
    """The merged lse of ``q``'s rows in the layout the kernel's backward reads (torch's memory-efficient
    op reads it padded to 32 rows, as its forward returns it), contiguous."""
    pad = -q.shape[2] % lse_block(kernel, q)
    return torch.nn.functional.pad(lse, (0, pad)).contiguous() if pad else lse.contiguous()


def _fused_tile_plan(seq: int, window: int, tile: int) -> list[tuple[int, int, list[_Piece] | None]]:
    n_max = min(tile, window - 1)
    return [(a, min(seq, a + n_max), _tile_pieces(a, min(seq, a + n_max) - a, window)) for a in range(0, seq, n_max)]


class _FusedBand:
    """Forward and backward of the banded tiles on a kernel's own ops (``causal`` and ``unmasked`` copies)."""

    def __init__(self, kernel: AttentionKernel, window: int, tile: int) -> None:
        self.causal, self.unmasked = kernel, copy.copy(kernel)
        self.unmasked.causal = False
        self.window, self.tile = window, tile

    def _kernel(self, piece: _Piece) -> AttentionKernel:
        return self.unmasked if piece.kind == "full" else self.causal

    def _inputs(self, piece: _Piece, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        kp, vp = k[:, :, piece.k0 : piece.k1], v[:, :, piece.k0 : piece.k1]
        if piece.kind == "flipped":
            return _flip(q), _flip(kp), _flip(vp)
        return q, kp, vp

    def forward(self, q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor, KernelAux]:
        seq = q.shape[2]
        acc = _compute_dtype(q.dtype)
        out = torch.empty((*q.shape[:-1], v.shape[-1]), dtype=q.dtype, device=q.device)
        lse = torch.empty(q.shape[:3], dtype=acc, device=q.device)
        aux: list[Tensor | None] = []
        for a, e, pieces in _fused_tile_plan(seq, self.window, self.tile):
            rows = slice(a, e)
            if pieces is None:
                o, l_ = band_forward(q[:, :, rows], k, v, self.window, scale, q_start=a)
                out[:, :, rows], lse[:, :, rows] = o, l_
                continue
            tile_out = tile_lse = None
            for piece in pieces:
                po, pl, paux = self._kernel(piece).forward(*self._inputs(piece, q[:, :, rows], k, v))
                aux += paux
                pl = _lse_rows(pl, e - a).to(acc)
                if piece.kind == "flipped":
                    po, pl = _flip(po), pl.flip(-1)
                if tile_out is None:
                    tile_out, tile_lse = po.to(acc), pl.clone()
                else:
                    weight = torch.sigmoid(pl - tile_lse).unsqueeze(-1)
                    tile_out.addcmul_(po.to(acc) - tile_out, weight)
                    tile_lse.sub_(torch.nn.functional.logsigmoid(tile_lse - pl))
            out[:, :, rows], lse[:, :, rows] = tile_out.to(q.dtype), tile_lse
        return out, lse, tuple(aux)

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, aux: KernelAux, scale: float
    ) -> tuple[Tensor, Tensor, Tensor]:
        seq = q.shape[2]
        acc = _compute_dtype(q.dtype)
        dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        dk = torch.zeros(k.shape, dtype=acc, device=k.device)
        dv = torch.zeros(v.shape, dtype=acc, device=v.device)
        plan = _fused_tile_plan(seq, self.window, self.tile)
        calls = sum(len(pieces) for _, _, pieces in plan if pieces is not None)
        per_call = len(aux) // calls if calls else 0  # every op call of one kernel returns as many aux entries
        aux_at = 0
        for a, e, pieces in plan:
            rows = slice(a, e)
            if pieces is None:
                g_q, g_k, g_v = band_backward(
                    dout[:, :, rows], q[:, :, rows], k, v, out[:, :, rows], lse[:, :, rows], self.window, scale, a
                )
                dq[:, :, rows] = g_q
                dk += g_k
                dv += g_v
                continue
            tile_dq = None
            for piece in pieces:
                kernel = self._kernel(piece)
                piece_aux = tuple(aux[aux_at : aux_at + per_call])
                aux_at += per_call
                qp, kp, vp = self._inputs(piece, q[:, :, rows], k, v)
                o_t, do_t, l_t = out[:, :, rows], dout[:, :, rows], lse[:, :, rows]
                if piece.kind == "flipped":
                    o_t, do_t, l_t = _flip(o_t), _flip(do_t), l_t.flip(-1)
                # torch's ops return (and read) the lse in float32, float64 for float64 inputs: ``acc``
                l_t = _padded_lse(kernel, qp, l_t)
                g_q, g_k, g_v = kernel.backward(do_t.contiguous(), qp, kp, vp, o_t.contiguous(), l_t, piece_aux)
                if piece.kind == "flipped":
                    g_q, g_k, g_v = _flip(g_q), _flip(g_k), _flip(g_v)
                tile_dq = g_q.to(acc) if tile_dq is None else tile_dq.add_(g_q)
                dk[:, :, piece.k0 : piece.k1] += g_k
                dv[:, :, piece.k0 : piece.k1] += g_v
            dq[:, :, rows] = tile_dq.to(q.dtype)
        return dq, dk, dv


class SlidingWindowKernel(AttentionKernel):
    """Causal attention over the last ``window`` tokens (itself included) by banded query tiles (see
    the module docstring); the inner kernel gives only the scale (its own ops have no band mask).

    ``forward -> (out, lse, ())``; lse [b, h, S] in float32 (float64 for float64 inputs)."""

    name = "sliding_window"

    def __init__(
        self, inner: AttentionKernel, window: int, tile: int = DEFAULT_TILE, fused: bool | None = None
    ) -> None:
        check_window(window)
        if window is None:
            raise ValueError("SlidingWindowKernel needs a window (None is plain causal: use the kernel itself)")
        if isinstance(inner, CallableKernel) or not inner.causal:
            raise ValueError(
                f"a sliding window is causal (key j visible to query i iff i - W < j <= i): it needs a causal "
                f"AttentionKernel, got {inner!r}"
            )
        if tile < 1:
            raise ValueError(f"tile must be a positive int, got {tile!r}")
        super().__init__(True, inner.softmax_scale)
        self.inner, self.window, self.tile = inner, window, tile
        if fused is None:
            fused = isinstance(inner, TorchSDPAKernel) and window - 1 >= MIN_FUSED_TILE
        if fused and (not isinstance(inner, TorchSDPAKernel) or window < 2):
            raise ValueError(
                f"the fused-op tiles need a TorchSDPAKernel and a window of at least 2, got {inner!r}, {window}"
            )
        #: tiles on the inner kernel's own ops (no score matrix) rather than the float32 band mask
        self.fused = fused
        self._band = _FusedBand(inner, window, tile) if fused else None

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, KernelAux]:
        if self._band is not None:
            return self._band.forward(q, k, v, self.scale_for(q.shape[-1]))
        out, lse = band_forward(q, k, v, self.window, self.scale_for(q.shape[-1]), tile=self.tile)
        return out, lse, ()

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, aux: KernelAux
    ) -> tuple[Tensor, Tensor, Tensor]:
        scale = self.scale_for(q.shape[-1])
        if self._band is not None:
            dq, dk, dv = self._band.backward(dout, q, k, v, out, lse, aux, scale)
        else:
            dq, dk, dv = band_backward(dout, q, k, v, out, lse, self.window, scale, tile=self.tile)
        return dq, dk.to(k.dtype), dv.to(v.dtype)

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, *args, **kwargs) -> Tensor:
        """DistributedAttention's contract ([b, S, h, d]), windowed, autograd through this kernel."""
        return kernel_autograd(self, q, k, v)

    def __repr__(self) -> str:
        return f"SlidingWindowKernel({self.inner!r}, window={self.window}, tile={self.tile}, fused={self.fused})"


def windowed(kernel: AttentionKernel, window: int | None, tile: int = DEFAULT_TILE) -> AttentionKernel:
    """``kernel`` restricted to a sliding window of ``window`` tokens (None: ``kernel`` itself):
    flash-attn's own window for ``FlashAttnKernel`` and ``FA3Kernel`` (``FlashWindowKernel``), banded tiles
    (``SlidingWindowKernel``) otherwise."""
    window = check_window(window)
    if window is None:
        return kernel
    if isinstance(kernel, FlashWindowKernel):
        if not kernel.causal:
            raise ValueError(f"a sliding window is causal: it needs a causal kernel, got {kernel!r}")
        if kernel.window == window:
            return kernel
        flash = copy.copy(kernel)
        flash.window = window
        return flash
    if isinstance(kernel, SlidingWindowKernel):
        return kernel if kernel.window == window else SlidingWindowKernel(kernel.inner, window, tile)
    return SlidingWindowKernel(kernel, window, tile)


def window_of(kernel: AttentionKernel) -> int | None:
    """The sliding window a kernel applies (None: none)."""
    return getattr(kernel, "window", None)


def dense_products(seq: int) -> int:
    """Causal query-key pairs of a sequence (per row and head), for comparisons with a window."""
    return seq * (seq + 1) // 2


__all__ = [
    "DEFAULT_TILE",
    "SlidingWindowKernel",
    "band_backward",
    "band_forward",
    "check_window",
    "dense_products",
    "key_band",
    "visible_products",
    "window_of",
    "windowed",
]
