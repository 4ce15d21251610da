"""FLA's chunk gated delta rule, as memory: what the fake run of a GPU target calls instead of transformers' torch
fallback (``torch_chunk_gated_delta_rule``).

Why a stand-in (and not the fallback, nor an analytic term): on a CUDA target with flash-linear-attention
installed, transformers' ``torch_chunk_gated_delta_rule`` (``use_kernel_func_from_hub_with_fallback``) runs FLA's
``chunk_gated_delta_rule``, whose memory is not the fallback's: the fallback's autograd keeps its own per-chunk
tensors, FLA saves a few token-sized tensors and recomputes the chunk states in backward.  Fake tensors run on
the CPU, where the fallback would run, and it loops in Python over S / 64 chunks a stage (minutes a prediction at
a million tokens).  So the fake run of a GPU target calls ``ChunkGatedDeltaRuleStandIn``: the same allocations, in
the same order and with the same lifetimes, as FLA's Triton path (its kernels replaced by nothing: fake tensors
have no data), and the same tensors saved for backward.  The rest of the mixer (projections, exchanges, conv,
stage checkpoints) runs as it is.

Modelled on flash-linear-attention 0.5.2 (commit bc3b101dcb71, fla/ops/gated_delta_rule/chunk.py:
``ChunkGatedDeltaRuleFunction``, ``chunk_gated_delta_rule_fwd`` / ``_bwd``; fla/ops/gated_delta_rule/chunk_fwd.py,
wy_fast.py; fla/ops/common/chunk_delta_h.py, chunk_o.py; fla/modules/l2norm.py; fla/ops/utils/cumsum.py), for the
call transformers makes: q/l2-norm in the kernel, no initial or final state, no cu_seqlens, chunk 64, the gate and
beta given (not computed in the kernel).  tests/test_planner_fla.py pins the saved tensors.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

#: FLA's chunk size (``chunk_gated_delta_rule``'s default, what transformers passes)
CHUNK = 64
#: ``chunk_bwd_dqkwg``'s key tile: 128 on Hopper, 64 on Ada / Ampere-class shared memory (A100), 32 else; its dg
#: is [ceil(K / tile), B, T, HV] float32.  64: the A100's (the larger dg of the 80 GB GPUs)
DQKWG_KEY_TILE = 64


def _l2norm_fwd(x: Tensor) -> tuple[Tensor, Tensor]:
    """``l2norm_fwd``: y like x, rstd float32 per row."""
    return torch.empty_like(x), torch.empty(x.shape[:-1], dtype=torch.float32)


def _chunks(t: int) -> int:
    return -(-t // CHUNK)


def _w_u(k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """``recompute_w_u_fwd``: w [B, T, HV, K] in k's dtype, u like v."""
    b, t, _, dk = k.shape
    return k.new_empty(b, t, v.shape[2], dk), torch.empty_like(v)


def _h(k: Tensor, u: Tensor) -> tuple[Tensor, Tensor]:
    """``chunk_gated_delta_rule_fwd_h``: the chunk states h [B, NT, HV, K, V] in k's dtype, v_new like u."""
    b, t, _, dk = k.shape
    return k.new_empty(b, _chunks(t), u.shape[2], dk, u.shape[3]), torch.empty_like(u)


def _forward(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``chunk_gated_delta_rule_fwd``: (g's chunk cumsum, o, A); w, u, h, v_new die on return."""
    b, t, _, _ = k.shape
    g = torch.empty_like(g, dtype=torch.float32)  # chunk_local_cumsum (output float32)
    a = torch.zeros(b, t, v.shape[2], CHUNK, dtype=k.dtype)  # chunk_gated_delta_rule_fwd_intra (fused kkt+solve)
    w, u = _w_u(k, v)
    h, v_new = _h(k, u)
    o = torch.empty_like(v_new)  # chunk_fwd_o
    return g, o, a


def _backward(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, a: Tensor, do: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``chunk_gated_delta_rule_bwd``: (dq, dk, dv, db, dg); its locals die on return, as there."""
    b, t, h_k, dk_ = k.shape
    hv = v.shape[2]
    w, u = _w_u(k, v)  # recomputed
    h, v_new = _h(k, u)  # recomputed
    dv = torch.empty_like(do)  # chunk_bwd_dv_local
    dh = q.new_empty(b, _chunks(t), hv, dk_, v.shape[3])  # chunk_gated_delta_rule_bwd_dhu: dh, dv2
    dv = torch.empty_like(dv)
    # chunk_bwd_dqkwg
    dq, dk = q.new_empty(b, t, hv, dk_), k.new_empty(b, t, hv, dk_)
    dg = torch.empty(-(-dk_ // DQKWG_KEY_TILE), *g.shape, dtype=torch.float32)
    dw = torch.empty_like(w)
    if h_k != hv:  # grouped value heads: summed to the key heads
        dq = dq.view(b, t, h_k, hv // h_k, dk_).sum(3)
        dk = dk.view(b, t, h_k, hv // h_k, dk_).sum(3)
    dg = dg.sum(0)
    # prepare_wy_repr_bwd
    dk2, dv, dg2, db = k.new_empty(b, t, hv, dk_), torch.empty_like(v), torch.empty_like(g), torch.empty_like(beta)
    if h_k != hv:
        dk2 = dk2.view(b, t, h_k, hv // h_k, dk_).sum(3)
    dk.add_(dk2)
    dg.add_(dg2)
    dg = torch.empty_like(dg, dtype=torch.float32)  # chunk_local_cumsum(reverse=True)
    del w, u, h, v_new, dh, dw
    return dq, dk, dv, db, dg


class ChunkGatedDeltaRuleStandIn(torch.autograd.Function):
    """``ChunkGatedDeltaRuleFunction`` as memory (fake tensors only): its allocations and its saved tensors
    (q, k l2-normed with their rstd, v, the gate's chunk cumsum g, beta twice (raw and used: the same tensor
    without ``use_beta_sigmoid_in_kernel``), the intra-chunk matrix A [B, T, HV, 64])."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> Tensor:
        q, q_rstd = _l2norm_fwd(q)
        k, k_rstd = _l2norm_fwd(k)
        g, o, a = _forward(q, k, v, g, beta)
        ctx.save_for_backward(q, q_rstd, k, k_rstd, v, g, beta, beta, a)
        return o.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, do: Tensor) -> tuple[Tensor, ...]:
        q, q_rstd, k, k_rstd, v, g, beta_raw, beta, a = ctx.saved_tensors
        dq, dk, dv, db, dg = _backward(q, k, v, g, beta, a, do)
        dq, dk = torch.empty_like(q), torch.empty_like(k)  # l2norm_bwd
        return dq.to(q), dk.to(k), dv.to(v), dg.to(g), db.to(beta_raw)


def chunk_gated_delta_rule(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    g: Tensor,
    beta: Tensor,
    chunk_size: int = CHUNK,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """The stand-in with transformers' recurrence signature, for the call ``hf_patches.mixers.gated_delta`` makes
    (anything else is refused: the stand-in models that call only)."""
    call = (chunk_size, initial_state, output_final_state, use_qk_l2norm_in_kernel, kwargs)
    if call != (CHUNK, None, False, True, {}):
        raise ValueError(
            f"FLA stand-in: models chunk_size={CHUNK}, no states, use_qk_l2norm_in_kernel=True only; got "
            f"chunk_size={chunk_size}, initial_state={initial_state is not None}, "
            f"output_final_state={output_final_state}, use_qk_l2norm_in_kernel={use_qk_l2norm_in_kernel}, {kwargs}"
        )
    return ChunkGatedDeltaRuleStandIn.apply(query, key, value, g, beta), None


@contextlib.contextmanager
def on_gated_delta_mixers(model: nn.Module) -> Iterator[None]:
    """For the duration, the gated delta mixers of ``model`` call the stand-in: the recurrence their modeling file
    defines (``gated_delta._RECURRENCE_NAMES``, looked up at call time) replaced there, then restored."""
    from hf_patches.mixers import mixer_kind_of
    from hf_patches.mixers.gated_delta import _RECURRENCE_NAMES

    replaced: dict[tuple[Any, str], Any] = {}
    for module in model.modules():
        kind = mixer_kind_of(type(module).__name__)
        if kind is None or kind.name != "gated_delta":
            continue
        source = sys.modules[type(module).__module__]
        for name in _RECURRENCE_NAMES:
            if hasattr(source, name):
                replaced.setdefault((source, name), getattr(source, name))
    try:
        for source, name in replaced:
            setattr(source, name, chunk_gated_delta_rule)
        yield
    finally:
        for (source, name), original in replaced.items():
            setattr(source, name, original)
