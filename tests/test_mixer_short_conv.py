"""The short-conv mixer kind (hf_patches/mixers/short_conv.py): LFM2 and LFM2-MoE on 2 and 4 gloo ranks
(one spawn each) equal the unpatched model at float64, plain and packed, with gradient checkpointing;
its refusals; causal-conv1d's argument contract on CPU."""

from __future__ import annotations

import pytest
import torch

from ds_upipe.tools.ranks import run_ranks
from hf_patches.mixers.common import check_causal_conv1d_arguments
from tests import mixer_short_conv_cases as cases

TOLERANCE = 1e-10

REFUSALS = {  # case -> words its message must contain (the layer, the offending value, the rule)
    "short_shard": ["decoder layer 0 (Lfm2ShortConv)", "shards of 1 tokens", "halo of conv_L_cache - 1 = 2"],
    "head_chunk": ["decoder layer 0 (Lfm2MoeShortConv)", "does not apply", "pass mixer_head_chunk_size=None"],
    "width": ["decoder layer 0 (Lfm2ShortConv)", "conv_L_cache=5", "widths 2, 3, 4"],
}


@pytest.mark.parametrize("world", [2, 4])
def test_short_conv_parity_and_refusals(world):
    results = run_ranks(cases.short_conv_ranks, world)
    for rank, result in enumerate(results):
        assert set(result["errors"]) == set(cases.CASES)
        for case, errors in result["errors"].items():
            assert max(errors.values()) <= TOLERANCE, f"C={world} rank {rank} {case}: {errors}"
        assert result["refusals"] == results[0]["refusals"], "every rank must raise the same errors"
    for case, words in REFUSALS.items():
        for word in words:
            assert word in results[0]["refusals"][case], f"{case}: {results[0]['refusals'][case]!r} lacks {word!r}"
    if world == 4:
        assert "use sequences of at least 8 tokens" in results[0]["refusals"]["short_shard"]


def _channel_last(batch: int, dim: int, seq: int) -> torch.Tensor:
    return torch.zeros(batch, seq, dim).transpose(1, 2)


VALID = {
    "channel_first": (torch.zeros(2, 8, 5), torch.zeros(8, 4), torch.zeros(8), None),
    "channel_last_seq_idx": (_channel_last(2, 16, 5), torch.zeros(16, 2), None, torch.zeros(2, 5, dtype=torch.int32)),
}
INVALID = {  # case -> (x, weight, bias, seq_idx, words of the assertion)
    "x_2d": (torch.zeros(8, 5), torch.zeros(8, 3), None, None, "x must be [batch, dim, seqlen]"),
    "weight_dim": (torch.zeros(2, 8, 5), torch.zeros(4, 3), None, None, "weight must be [8, width]"),
    "width_5": (torch.zeros(2, 8, 5), torch.zeros(8, 5), None, None, "width 5"),
    "width_1": (torch.zeros(2, 8, 5), torch.zeros(8, 1), None, None, "width 1"),
    "strided": (torch.zeros(2, 8, 10)[:, :, ::2], torch.zeros(8, 3), None, None, "stride 1 over time or channels"),
    "channel_last_dim": (_channel_last(2, 12, 5), torch.zeros(12, 3), None, None, "dim divisible by 8"),
    "bias_shape": (torch.zeros(2, 8, 5), torch.zeros(8, 3), torch.zeros(4), None, "bias must be [8]"),
    "bias_dtype": (torch.zeros(2, 8, 5), torch.zeros(8, 3), torch.zeros(8, dtype=torch.float64), None, "bias dtype"),
    "bias_stride": (torch.zeros(2, 8, 5), torch.zeros(8, 3), torch.zeros(16)[::2], None, "stride 1"),
    "seq_idx_channel_first": (
        torch.zeros(2, 8, 5),
        torch.zeros(8, 3),
        None,
        torch.zeros(2, 5, dtype=torch.int32),
        "only supported for channel-last",
    ),
    "seq_idx_dtype": (_channel_last(2, 8, 5), torch.zeros(8, 3), None, torch.zeros(2, 5, dtype=torch.long), "int32"),
    "seq_idx_shape": (_channel_last(2, 8, 5), torch.zeros(8, 3), None, torch.zeros(2, 4, dtype=torch.int32), "[2, 5]"),
    "seq_idx_contiguous": (
        _channel_last(2, 8, 5),
        torch.zeros(8, 3),
        None,
        torch.zeros(5, 2, dtype=torch.int32).t(),
        "contiguous",
    ),
}


def test_causal_conv1d_argument_contract():
    for x, weight, bias, seq_idx in VALID.values():
        check_causal_conv1d_arguments(x, weight, bias, seq_idx)
    for case, (x, weight, bias, seq_idx, words) in INVALID.items():
        with pytest.raises(ValueError) as err:
            check_causal_conv1d_arguments(x, weight, bias, seq_idx)
        assert words in str(err.value), f"{case}: {err.value}"
