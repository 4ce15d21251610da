"""``accumulate_in_input_dtype``: which dtype UPipe sums bf16 stage gradients in (no process group:
the fused source and the round's dK/dV accumulator are built directly)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ds_upipe.pipeline import Piece, PipelineContext, PlanIndices, RoundKeyValueGrads, Slot
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
    # a source taking dK/dV once per round: the pipeline sums the stages' in the round's accumulator
    source = SimpleNamespace(grads_per_source_rank=True, key_value_grads_per_stage=False, value_head_dim=4)
    grads = RoundKeyValueGrads(
        _context(on), source, Slot("key_value", 0, None, torch.arange(2)), k_full, torch.bfloat16
    )
    assert grads.acc.dtype == want and [a.dtype for a in grads.acc_views] == [want, want]


@pytest.mark.parametrize("on, want", [(False, torch.float32), (True, torch.bfloat16)])
def test_fused_dx_and_weight_accumulators_dtype(on, want):
    model = build_model("llama", torch.bfloat16)
    proj = FusedProjections.of(model.model.layers[0].self_attn)
    x = torch.randn(1, 6, model.config.hidden_size, dtype=torch.bfloat16)
    cos = sin = torch.ones(1, 6, proj.head_dim, dtype=torch.bfloat16)
    needs = (True,) * (1 + len(proj.params()))
    source = FusedProjectionSource(x, cos, sin, proj, backward=True, needs_grad=needs, accumulate_in_input_dtype=on)
    slot = Slot("query", 0, 0, torch.tensor([0, 1]))
    with torch.no_grad():  # as in FusedUPipeAttention.backward
        # a stage's gradient comes back in float32
        chunk = torch.empty(1, 6, 1, 2, proj.head_dim, dtype=torch.bfloat16)  # [b, s, C, n, d]: one rank
        source.query(slot, chunk)
        source.add_query_grad(slot, Piece(None, 0, 2), chunk.float())  # whole: [b, s, C, n, d]
        source.finish(slot)
    grad_p = [g for g in source.grad_p if g is not None]
    assert source.grad_x.dtype == want and grad_p and all(g.dtype == want for g in grad_p)
    grad_x, grads = source.results()  # handed to autograd in the inputs' dtype either way
    assert grad_x.dtype == torch.bfloat16 and all(g.dtype == torch.bfloat16 for g in grads if g is not None)


def test_float64_is_unchanged():
    assert _context(True).accumulate_dtype(torch.float64) == torch.float64
    assert _context(True).accumulate_dtype(torch.float32) == torch.float32


class _DxGemms(torch.utils._python_dispatch.TorchDispatchMode):
    """The dtype of every matrix product whose output has dx's [tokens, hidden] shape."""

    def __init__(self, shape: tuple[int, int]) -> None:
        super().__init__()
        self.shape, self.dtypes = shape, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        res = func(*args, **(kwargs or {}))
        if func.__name__.split(".")[0] in ("mm", "addmm", "addmm_") and tuple(res.shape) == self.shape:
            self.dtypes.append(res.dtype if func.__name__.startswith("mm") else args[1].dtype)
        return res


@pytest.mark.parametrize("tiles", [1, 3])
def test_fused_dx_is_one_input_dtype_gemm_per_stage(monkeypatch, tiles):
    """A stage's query gradient arriving as one piece per source rank (here 2) makes one dx GEMM, in
    bf16 (tensor cores), added to the float32 accumulator (per tile of DX_TILE_BYTES of product, so no
    x-sized temporary); dx equals the float64 product."""
    from hf_patches import fused

    model = build_model("llama", torch.bfloat16)
    if tiles > 1:  # 2 tokens of product a tile: 3 tiles of the 6 tokens
        monkeypatch.setattr(fused, "DX_TILE_BYTES", 2 * model.config.hidden_size * 2)
    proj = FusedProjections.of(model.model.layers[0].self_attn)
    x = torch.randn(1, 6, model.config.hidden_size, dtype=torch.bfloat16)
    cos = sin = torch.ones(1, 6, proj.head_dim, dtype=torch.bfloat16)
    needs = (True,) * (1 + len(proj.params()))
    source = FusedProjectionSource(x, cos, sin, proj, backward=True, needs_grad=needs)
    heads = torch.tensor([0, 1])
    slot = Slot("query", 0, 0, heads)
    with torch.no_grad(), _DxGemms((6 // tiles, model.config.hidden_size)) as gemms:
        grad = torch.empty(1, 6, 1, 2, proj.head_dim, dtype=torch.bfloat16)  # [b, s, C, n, d]: one rank
        source.query(slot, grad)
        grad = grad.flatten(2, 3).float()
        for h in (0, 1):  # one piece per source rank
            source.add_query_grad(slot, Piece(h, h, 1), grad[:, :, h : h + 1])
        source.finish(slot)  # the stage's pieces are all in: one dx product
    assert gemms.dtypes == [torch.bfloat16] * tiles and source.grad_x.dtype == torch.float32
    w = source.head_rows(proj.params()[0], heads).double()
    # cos = sin = 1: RoPE's backward of g is rotate-half's transpose applied to g, as the source computes it
    from hf_patches.fused import rope_backward

    g = rope_backward(grad, source.cos, source.sin).reshape(6, -1).to(torch.bfloat16).double()
    torch.testing.assert_close(source.results()[0].reshape(6, -1).double(), g @ w, rtol=2e-2, atol=2e-2)
