"""``accumulate_in_input_dtype``: which dtype UPipe sums bf16 stage gradients in (no process group:
the fused source and the round's dK/dV accumulator are built directly)."""

from __future__ import annotations

import pytest
import torch

from ds_upipe.pipeline import PipelineContext, PlanIndices, RoundKeyValueGrads
from ds_upipe.schedule import build_plan
from hf_patches.fused import FusedProjections, FusedProjectionSource
from tests.hf_cases import build_model


def _context(accumulate_in_input_dtype: bool) -> PipelineContext:
    plan = build_plan(8, 2, 2, None)
    return PipelineContext(
        plan=plan,
        indices=PlanIndices.build(plan, torch.device("cpu")),
        group=None,
        attention=lambda q, k, v: q,
        accumulate_in_input_dtype=accumulate_in_input_dtype,
    )


@pytest.mark.parametrize("on, want", [(False, torch.float32), (True, torch.bfloat16)])
def test_round_dkdv_accumulator_dtype(on, want):
    k_full = torch.zeros(1, 2, 8, 4, dtype=torch.bfloat16)  # [b, n, S, d]
    grads = RoundKeyValueGrads(_context(on), object(), torch.arange(2), k_full, torch.bfloat16)
    assert [a.dtype for a in grads.acc] == [want, want]


@pytest.mark.parametrize("on, want", [(False, torch.float32), (True, torch.bfloat16)])
def test_fused_dx_and_weight_accumulators_dtype(on, want):
    model = build_model("llama", torch.bfloat16)
    proj = FusedProjections.of(model.model.layers[0].self_attn)
    x = torch.randn(1, 6, model.config.hidden_size, dtype=torch.bfloat16)
    cos = sin = torch.ones(1, 6, proj.head_dim, dtype=torch.bfloat16)
    needs = (True,) * (1 + len(proj.params()))
    source = FusedProjectionSource(x, cos, sin, proj, backward=True, needs_grad=needs, accumulate_in_input_dtype=on)
    heads = torch.tensor([0, 1])
    with torch.no_grad():  # as in FusedUPipeAttention.backward
        source.add_query_grad(heads, source.query(heads).float())  # a stage's gradient comes back in float32
    grad_p = [g for g in source.grad_p if g is not None]
    assert source.grad_x.dtype == want and grad_p and all(g.dtype == want for g in grad_p)
    grad_x, grads = source.results()  # handed to autograd in the inputs' dtype either way
    assert grad_x.dtype == torch.bfloat16 and all(g.dtype == torch.bfloat16 for g in grads if g is not None)


def test_float64_is_unchanged():
    assert _context(True).accumulate_dtype(torch.float64) == torch.float64
    assert _context(True).accumulate_dtype(torch.float32) == torch.float32
