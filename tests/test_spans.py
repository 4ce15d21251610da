"""Bidirectional spans (ds_upipe/spans.py, Gemma 3's image overlay) in one process: the spans read from
transformers' own block ids, ``SpanKernel`` on every CPU kernel (causal and windowed: the band mask and the
fused-op tiles) against the explicit mask, and what spans do not run with, refused by name.  The model-level
parity (Gemma 3's VLM at C = 2 and 4) is in tests/test_vlm.py."""

from __future__ import annotations

import pytest
import torch

from ds_upipe.kernels import MathKernel, TorchSDPAKernel, kernel_autograd
from ds_upipe.options import UPipeOptions
from ds_upipe.packing import DocumentBoundaries
from ds_upipe.runtime import UPipeRuntime
from ds_upipe.spans import BidirectionalSpans, SpanKernel
from ds_upipe.windows import SlidingWindowKernel, windowed
from tests.core_cases import masked_reference

#: two rows of 40 tokens: row 0 a 12-token span, a 2-token one and a 4-token one right after it; row 1 spans
#: at the very start and the very end
BLOCKS = [[(3, 15, 0), (16, 18, 1), (18, 22, 2)], [(0, 5, 0), (36, 40, 1)]]
SPANS = [[(s, e) for s, e, _ in row] for row in BLOCKS]


def _block_ids(seq: int = 40) -> torch.Tensor:
    ids = torch.full((len(BLOCKS), seq), -1)
    for r, row in enumerate(BLOCKS):
        for s, e, n in row:
            ids[r, s:e] = n
    return ids


def test_spans_are_transformers_blocks():
    """Gemma 3's own ``get_block_sequence_ids_for_mask``: a run of image tokens is one block (two images back to
    back are one), text is -1; a one-token block has no other token to see and is left out."""
    from transformers.models.gemma3.modeling_gemma3 import get_block_sequence_ids_for_mask

    marks = torch.zeros(2, 12, dtype=torch.long)
    marks[0, 1:4] = marks[0, 5:9] = marks[1, 0:1] = marks[1, 10:12] = 1
    spans = BidirectionalSpans.of_block_ids(get_block_sequence_ids_for_mask(marks))
    assert spans == BidirectionalSpans((((1, 4), (5, 9)), ((10, 12),)))
    assert BidirectionalSpans.of_block_ids(get_block_sequence_ids_for_mask(torch.zeros(1, 8, dtype=torch.long))) is None
    assert BidirectionalSpans.of_block_ids(_block_ids()).rows == tuple(tuple(row) for row in SPANS)


def _inputs(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(2, n, 40, 8, generator=gen, dtype=torch.float64) for n in (4, 2, 2, 4)]  # GQA 4:2


@pytest.mark.parametrize("window", [None, 3, 12, 100])
@pytest.mark.parametrize("base", [TorchSDPAKernel(), MathKernel()], ids=["sdpa", "math"])
def test_span_kernel_is_the_overlay_mask(base, window):
    """Causal (or windowed: window 3 and 12 are shorter than the 12-token span; 12 runs the fused-op tiles, 3 the
    band mask) plus each span's strictly-future keys == the explicit mask, out and every gradient (float64)."""
    q, k, v, dout = _inputs()
    spans = BidirectionalSpans.of_block_ids(_block_ids())
    kernel = SpanKernel(windowed(base, window), base, spans)
    out, lse, aux = kernel.forward(q, k, v)
    grads = kernel.backward(dout, q, k, v, out, lse, aux)
    leaves = [t.transpose(1, 2).clone().requires_grad_(True) for t in (q, k, v)]
    ref = masked_reference(*leaves, window, spans=SPANS)
    ref.backward(dout.transpose(1, 2))
    for got, want in zip((out, *grads), (ref, *(t.grad for t in leaves))):
        torch.testing.assert_close(got, want.detach().transpose(1, 2), rtol=1e-12, atol=1e-12)
    causal = masked_reference(*(t.transpose(1, 2) for t in (q, k, v)), window)
    assert (out - causal.transpose(1, 2)).abs().max() > 1e-2, "the spans must change the output"
    # DistributedAttention's contract through the kernel's own autograd
    qb, kb, vb = (t.transpose(1, 2) for t in (q, k, v))
    torch.testing.assert_close(kernel_autograd(kernel, qb, kb, vb), ref.detach(), rtol=1e-12, atol=1e-12)


def test_span_kernel_pieces_are_equal_length_causal_calls():
    """Each span piece is one causal call of equal q/k lengths (span - 1 rows), what every kernel takes."""
    calls = []

    class Recording(MathKernel):
        def forward(self, q, k, v):
            calls.append((q.shape[2], k.shape[2], self.causal))
            return super().forward(q, k, v)

    q, k, v, _ = _inputs()
    SpanKernel(
        SlidingWindowKernel(MathKernel(), 4), Recording(), BidirectionalSpans.of_block_ids(_block_ids())
    ).forward(q, k, v)
    assert calls == [(e - s - 1, e - s - 1, True) for row in SPANS for s, e in row]


def test_spans_run_alone():
    """Spans with packed documents or attention sinks are refused by name (a ring: the same rule)."""
    runtime = UPipeRuntime.build(UPipeOptions(), group=None, num_heads=4, num_kv_heads=2)
    spans = BidirectionalSpans.of_block_ids(_block_ids())
    documents = DocumentBoundaries.of([0, 20, 40])
    with pytest.raises(ValueError, match="bidirectional spans .* with packed documents: not supported"):
        runtime.attention(documents, None, None, spans=spans)
    with pytest.raises(ValueError, match="bidirectional spans .* with attention sinks: not supported"):
        runtime.attention(None, None, torch.zeros(4), spans=spans)
    assert isinstance(runtime.attention(DocumentBoundaries.of([0, 40]), 4, None, spans=spans), SpanKernel)
