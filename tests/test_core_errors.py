"""Bad inputs are refused with the documented ValueError, identically on every rank, without hangs."""

import pytest

from ds_upipe import build_plan, valid_head_chunk_sizes
from ds_upipe.tools.ranks import run_ranks
from tests import core_cases

DIFFERS = "differs across the ranks of the sequence-parallel group ("
EXPECTED = {
    "u_not_multiple_of_c": "multiple of the sequence-parallel size",
    "u_not_dividing_h": "must divide num_heads=12",
    "u_splits_kv_group": "whole fraction of a KV group",
    "heads_not_divisible": "not divisible by the sequence-parallel size",
    "kv_incompatible": "one must divide the other",
    "uneven_shards": "sequence shard lengths differ across ranks",
    "batch_dim_idx": "batch_dim_idx=2",
    "key_query_mismatch": "must agree on batch, sequence and head_dim",
    "constructor_bad_u": "head_chunk_size must be a positive int or None, got 0",
    # settings every rank must share: the per-rank values are listed
    "u_differs_across_ranks": f"head_chunk_size {DIFFERS}rank 0: 4, rank 1: 8, rank 2: 4, rank 3: 8)",
    "u_none_vs_int": f"head_chunk_size {DIFFERS}rank 0: None, rank 1: 8, rank 2: 8, rank 3: 8)",
    "overlap_differs": f"overlap_comm {DIFFERS}rank 0: True, rank 1: False,",
    "accumulate_differs": f"accumulate_in_input_dtype {DIFFERS}rank 0: True, rank 1: False,",
    "kernel_vs_callable": f"local_attention is an AttentionKernel {DIFFERS}rank 0: False, rank 1: True,",
    "causal_differs": f"the kernel's causal {DIFFERS}rank 0: False, rank 1: True,",
    "scale_differs": f"the kernel's softmax_scale {DIFFERS}rank 0: 0.5, rank 1: None,",
    "scatter_idx_on_one_rank": f"scatter_idx {DIFFERS}rank 0: 3, rank 1: 2,",
    "dtype_differs": f"query dtype {DIFFERS}rank 0: 'float64', rank 1: 'float32',",
    "cu_seqlens_differ": "packed-sequence boundaries (cu_seqlens) differ across the ranks",
    "cu_seqlens_on_one_rank": "given per rank: [True, False, False, False]",
    "cu_seqlens_bad_end": "must ascend strictly from 0 to the global sequence length 24",
    "cu_seqlens_rows": "cu_seqlens has 3 rows for a batch of 2",
    "cu_seqlens_generic": "need an AttentionKernel as local_attention",
    "ok_after_errors": "no error",
}


def test_errors_on_every_rank():
    results = run_ranks(core_cases.bad_input_errors, 4, timeout=300)
    for case, fragment in EXPECTED.items():
        messages = {r[case] for r in results}
        assert len(messages) == 1, f"{case}: ranks disagree: {messages}"
        message = messages.pop()
        assert fragment in message, f"{case}: {message!r}"
    # invalid head_chunk_size errors list the valid values
    assert "Valid values: [4, 8, 12, 24, 48]" in results[0]["u_splits_kv_group"]


def test_plain_errors_without_processes():
    with pytest.raises(ValueError, match=r"invalid head_chunk_size=6 .* Valid values: \[2, 4, 8, 16\]"):
        build_plan(16, 4, 2, 6)
    assert valid_head_chunk_sizes(24, 4, 2) == [2, 4, 6, 12, 24]
    with pytest.raises(ValueError, match="whole fraction of a KV group or whole KV groups"):
        build_plan(24, 4, 2, 8)


def test_document_boundaries_without_processes():
    """transformers' rule (a position that is not its predecessor's + 1 starts a document), right
    padding joining the last document, and the boundary checks."""
    import torch

    from ds_upipe.packing import DocumentBoundaries, documents_from_positions

    pos = torch.tensor([[0, 1, 0, 0, 1, 2, 3, 0], [5, 6, 7, 8, 9, 10, 11, 12]])
    assert documents_from_positions(pos).rows == ((0, 2, 3, 7, 8), (0, 8))
    keep = torch.ones_like(pos)
    keep[0, 6:] = 0  # right padding: no document starts under it
    assert documents_from_positions(pos, keep).rows == ((0, 2, 3, 8), (0, 8))
    assert documents_from_positions(pos[1:]) is None  # no restart: plain causal attention
    docs = DocumentBoundaries.of([0, 3, 8])
    assert docs.for_batch(2) == ((0, 3, 8), (0, 3, 8)) and not docs.is_trivial
    assert docs.fingerprint() == DocumentBoundaries.of(torch.tensor([0, 3, 8])).fingerprint()
    assert docs.fingerprint() != DocumentBoundaries.of([0, 4, 8]).fingerprint()
    docs.check(2, 8)
    with pytest.raises(ValueError, match="must ascend strictly from 0 to the global sequence length 9"):
        docs.check(1, 9)
    with pytest.raises(ValueError, match="must ascend strictly"):
        DocumentBoundaries.of([0, 3, 3, 8]).check(1, 8)
    with pytest.raises(ValueError, match="cu_seqlens has 2 rows for a batch of 3"):
        DocumentBoundaries.of([[0, 8], [0, 2, 8]]).check(3, 8)


def test_input_check_reads_the_host_once_per_layout():
    """The input exchange reads the gathered rows on the host (a device sync on CUDA) once per input
    layout per layer: a checked layout is compared on the device, a new shape or a changed setting is
    read again; every call still exchanges (so a rank changing alone cannot skip a collective its
    peers run).  Mutation: no cache (host read every call) fails the counts; skipping the exchange
    for a checked layout fails the refusing ``_gather`` below."""
    import torch

    from ds_upipe import UPipeDistributedAttention, validation
    from ds_upipe.kernels import TorchSDPAKernel

    layer = UPipeDistributedAttention(TorchSDPAKernel(causal=True), None, head_chunk_size=2)
    q, k, v = (torch.randn(1, 8, 4, 8, dtype=torch.float64) for _ in range(3))
    for _ in range(3):
        layer(q, k, v, 0)
    assert layer.checked_inputs.host_checks == 1
    layer(q[:, :4], k[:, :4], v[:, :4], 0)
    assert layer.checked_inputs.host_checks == 2
    layer.overlap_comm = True  # a setting is part of the layout: read again
    layer(q, k, v, 0)
    assert layer.checked_inputs.host_checks == 3
    layer.overlap_comm = False

    def no_collective(*args):
        raise AssertionError("the exchange ran")

    gather = validation._gather
    try:
        validation._gather = no_collective
        with pytest.raises(AssertionError, match="the exchange ran"):  # a checked layout is exchanged too
            layer(q, k, v, 0)
    finally:
        validation._gather = gather
    # a second layer (its own runtime) reads its first call itself
    other = UPipeDistributedAttention(TorchSDPAKernel(causal=True), None, head_chunk_size=2)
    other(q, k, v, 0)
    assert other.checked_inputs.host_checks == 1
