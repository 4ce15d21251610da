"""hf_patches.mixers.mamba2: Nemotron-H, Granite 4 hybrid and Bamba patched by apply_upipe on sequence shards == the
unpatched model on the whole sequence (logits, loss, every parameter gradient summed over the ranks, float64), on
packed rows == every document alone, over 2 and 4 gloo ranks in one spawn each; the bf16 layer under SP (C=2) bit
for bit in its output, within its own variation in its gradients; the refusals of a bad U; the argument contracts
of mamba_ssm's and causal-conv1d's kernels."""

from __future__ import annotations

import pytest
import torch

from ds_upipe.tools.ranks import run_ranks
from hf_patches.mixers import mamba2
from hf_patches.mixers.common import check_causal_conv1d_arguments
from tests import mixer_mamba2_cases as cases
from tests.test_mixer_gated_delta import check_bf16

F64, F32 = 1e-10, 1e-5


@pytest.mark.parametrize("world", [2, 4])
def test_mamba2_hybrids_match_the_unpatched_model(world):
    for rank, result in enumerate(run_ranks(cases.matrix, world)):
        assert len(result["float64"]) == 3 * len(cases.FAMILIES) + 1 + (world == 2)
        for case, errors in result["float64"].items():
            assert max(errors.values()) <= F64, f"C={world} rank {rank} {case}: {errors}"
        for case in ("float32_internals", "kernel_path"):  # float32: transformers' own internals, the kernel route
            errors = result[case]
            assert max(errors.values()) <= F32, f"C={world} rank {rank} {case}: {errors}"
        for words in ("decoder layer 0 (BambaMixer)", f"mixer_head_chunk_size={world + 1}", "Valid values: "):
            assert words in result["refusal"], result["refusal"]
        if world == 2:  # Nemotron-H's Mamba-2 layer in bf16 (tests/mixer_bf16.py)
            check_bf16(result["bf16"], f"rank {rank}")


@pytest.mark.parametrize(
    "size, u, words",
    [
        (2, 3, ["mixer_head_chunk_size=3", "multiple of the group size 2", "Valid values: 2, 4, 8"]),
        (2, 6, ["mixer_head_chunk_size=6", "dividing num_heads=8", "Valid values: 2, 4, 8"]),
        (4, 2, ["mixer_head_chunk_size=2", "Valid values: 4, 8"]),
        (3, None, ["mixer_head_chunk_size=None (U=3)", "the group size 3 does not divide num_heads=8"]),
    ],
)
def test_bad_head_chunk_size_is_refused(size, u, words):
    mixer = cases.mixers(cases.build("bamba"))[0]
    with pytest.raises(ValueError) as info:
        mamba2.check(0, mixer, size, u)
    for w in ("apply_upipe: decoder layer 0 (BambaMixer)", *words):
        assert w in str(info.value)


def _conv_args(dim=16, seq=6, width=4, channel_last=True, seq_idx=True, dtype=torch.float32):
    x = torch.randn(2, seq, dim, dtype=dtype).transpose(1, 2) if channel_last else torch.randn(2, dim, seq, dtype=dtype)
    idx = torch.zeros(2, seq, dtype=torch.int32) if seq_idx else None
    return x, torch.randn(dim, width, dtype=dtype), torch.randn(dim, dtype=dtype), idx


def _scan_args(heads=4, groups=2, seq=6):
    x, dt = torch.randn(2, seq, heads, 8), torch.randn(2, seq, heads)
    bc = torch.randn(2, seq, groups, 4)
    return x, dt, torch.randn(heads), bc, bc.clone(), torch.randn(heads), torch.randn(heads)


def test_kernel_argument_contracts():
    check_causal_conv1d_arguments(*_conv_args())
    check_causal_conv1d_arguments(*_conv_args(dim=12, channel_last=False, seq_idx=False))
    bad_conv = {
        "seq_idx without channel-last": _conv_args(channel_last=False),
        "channel-last D % 8": _conv_args(dim=12, seq_idx=False),
        "float64 where the kernel runs": (*_conv_args(dtype=torch.float64), True),
        "width 5": _conv_args(width=5),
        "seq_idx int64": (*_conv_args()[:3], torch.zeros(2, 6, dtype=torch.int64)),
        "seq_idx shape": (*_conv_args()[:3], torch.zeros(2, 5, dtype=torch.int32)),
    }
    for name, args in bad_conv.items():
        with pytest.raises(ValueError):
            check_causal_conv1d_arguments(*args)
            pytest.fail(name)
    x, dt, A, B, C, D, dt_bias = _scan_args()
    mamba2.check_mamba_ssm_arguments(x, dt, A, B, C, D, dt_bias, torch.zeros(2, 6, dtype=torch.int32))
    bad_scan = {
        "groups not dividing heads": (x, dt, A, *_scan_args(groups=3)[3:5], D, dt_bias, None),
        "dt [B, H, T]": (x, dt.transpose(1, 2), A, B, C, D, dt_bias, None),
        "A per group": (x, dt, A[:2], B, C, D, dt_bias, None),
        "x with no unit stride": (x[..., ::2], dt, A, B, C, D, dt_bias, None),
        "C of another shape": (x, dt, A, B, C[:, :, :1], D, dt_bias, None),
        "seq_idx int64": (x, dt, A, B, C, D, dt_bias, torch.zeros(2, 6, dtype=torch.int64)),
    }
    for name, args in bad_scan.items():
        with pytest.raises(ValueError):
            mamba2.check_mamba_ssm_arguments(*args)
            pytest.fail(name)
