"""The fake run's stand-in for FLA's chunk gated delta rule (``fake_run.fla``), pinned against flash-linear-attention
0.5.2 (commit bc3b101dcb71): what ``ChunkGatedDeltaRuleFunction`` saves for backward and what its forward and
backward allocate, in order; and the planner's GPU target running it (a CPU target running transformers' torch
fallback)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from ds_upipe.integration import fake_run
from ds_upipe.integration.fake_run import fla
from ds_upipe.tools import planner
from ds_upipe.tools.planner.models import MIXER_LAYER
from tests.test_planner_hybrid import SEQ, WORLD, bench_dims

BF, F32 = torch.bfloat16, torch.float32
#: grouped value heads (HV = 2 H) and a length that is no multiple of the chunk: NT = ceil(200 / 64) = 4
B, T, H, HV, K, V, NT = 1, 200, 2, 4, 16, 8, 4
#: views, detaches and in-place ops allocate nothing
_NOT_ALLOCATING = ("aten.view.", "aten.detach.", "aten.add_.")


class _Allocations(TorchDispatchMode):
    """The (shape, dtype) of every op output that is a new tensor, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[tuple[tuple[int, ...], torch.dtype]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and not str(func).startswith(_NOT_ALLOCATING):
            self.made.append((tuple(out.shape), out.dtype))
        return out


def test_stand_in_saves_and_allocates_what_fla_does():
    """transformers' call (bf16 q, k [B, T, H, K], v [B, T, HV, V], float32 gate, bf16 beta, the l2 norm in the
    kernel): the saved tensors are ``ctx.save_for_backward``'s of FLA 0.5.2 (fla/ops/gated_delta_rule/chunk.py;
    None entries dropped: initial_state, cu_seqlens, chunk_indices, g_input, A_log, dt_bias), and the forward and
    backward allocate what the source's functions allocate, in order (shapes as those functions return them)."""
    with FakeTensorMode():
        q, k = (torch.empty(B, T, H, K, dtype=BF).requires_grad_() for _ in range(2))
        v = torch.empty(B, T, HV, V, dtype=BF).requires_grad_()
        g = torch.empty(B, T, HV, dtype=F32).requires_grad_()
        beta = torch.empty(B, T, HV, dtype=BF).requires_grad_()
        do = torch.empty(B, T, HV, V, dtype=BF)
        with _Allocations() as forward:
            o, state = fla.chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
        saved = [(tuple(t.shape), t.dtype) for t in o.grad_fn.saved_tensors]
        with _Allocations() as backward:
            o.backward(do)
        grads = [(tuple(x.grad.shape), x.grad.dtype) for x in (q, k, v, g, beta)]
    qk, rstd, vs, gate = ((B, T, H, K), BF), ((B, T, H), F32), ((B, T, HV, V), BF), ((B, T, HV), F32)
    hv_k, state_chunks = ((B, T, HV, K), BF), ((B, NT, HV, K, V), BF)
    # q, q_rstd, k, k_rstd (l2norm_fwd), v, g (chunk_local_cumsum: float32), beta_raw, beta, A (fwd_intra)
    assert saved == [qk, rstd, qk, rstd, vs, gate, ((B, T, HV), BF), ((B, T, HV), BF), ((B, T, HV, 64), BF)]
    assert o.shape == (B, T, HV, V) and o.dtype == BF and state is None
    assert forward.made == [
        *(qk, rstd, qk, rstd),  # l2norm_fwd(q), l2norm_fwd(k)
        gate,  # chunk_local_cumsum
        ((B, T, HV, 64), BF),  # A (chunk_gated_delta_rule_fwd_intra, zeros)
        hv_k,  # w (recompute_w_u_fwd)
        vs,  # u
        state_chunks,  # h (chunk_gated_delta_rule_fwd_h)
        vs,  # v_new
        vs,  # o (chunk_fwd_o)
    ]
    assert backward.made == [
        hv_k,  # w, recomputed
        vs,  # u
        state_chunks,  # h, recomputed
        vs,  # v_new
        vs,  # dv (chunk_bwd_dv_local)
        state_chunks,  # dh (chunk_gated_delta_rule_bwd_dhu)
        vs,  # dv2
        hv_k,  # dq (chunk_bwd_dqkwg)
        hv_k,  # dk
        ((1, B, T, HV), F32),  # dg [NK, B, T, HV] float32 (K=16: one key tile)
        hv_k,  # dw
        qk,  # dq summed over the value heads of a key head
        qk,  # dk
        gate,  # dg.sum(0)
        hv_k,  # dk2 (prepare_wy_repr_bwd)
        vs,  # dv
        gate,  # dg2
        ((B, T, HV), BF),  # db
        qk,  # dk2 summed over the value heads of a key head
        gate,  # dg (chunk_local_cumsum, reverse)
        qk,  # dq (l2norm_bwd)
        qk,  # dk (l2norm_bwd)
    ]
    assert grads == [qk, qk, vs, gate, ((B, T, HV), BF)]


def test_gpu_target_plans_the_fla_kernel():
    """The planner's GPU target (kernel "fa2") runs the gated delta mixers through the stand-in (the peak of a
    mixer layer with all heads in one stage is in its backward), and transformers' recurrence is put back."""
    setup = replace(planner.measured_layer_setup(WORLD, "float32", tiled_mlp=False), kernel="fa2")
    scheme = planner.AttentionScheme.upipe(None, mixer_head_chunk_size=8)
    peak = fake_run.layer_step(planner.step_spec(bench_dims("gated_delta"), setup, scheme, SEQ, MIXER_LAYER))
    assert peak.at.startswith("backward ChunkGatedDeltaRuleStandInBackward"), peak.at
    from transformers.models.qwen3_5 import modeling_qwen3_5

    assert modeling_qwen3_5.torch_chunk_gated_delta_rule is not fla.chunk_gated_delta_rule
