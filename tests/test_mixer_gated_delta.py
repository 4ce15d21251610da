"""Gated delta net layers under apply_upipe (hf_patches/mixers/gated_delta.py): whole-model parity of
Qwen3.5 (dense, MoE), Qwen3-Next and OLMo hybrid with the unpatched model, float64, over 2 and 4 gloo
ranks (one spawn each; the cases are in tests/mixer_gated_delta_cases.py), the refusals of bad U, the bf16
layer under SP (C=2) bit for bit in its output and within its own variation in its gradients
(tests/mixer_bf16.py), and FLA's argument contract checked on CPU."""

from __future__ import annotations

import pytest
import torch

from ds_upipe.tools.ranks import run_ranks
from hf_patches.mixers.gated_delta import check_fla_arguments
from tests import mixer_bf16
from tests import mixer_gated_delta_cases as cases


@pytest.mark.parametrize("world", [2, 4])
def test_parity_and_refusals(world):
    results = run_ranks(cases.spawn_body, world)
    names = set(cases.cases(world)) | {"packed_qwen3_5_u=C", "packed_qwen3_next_u=H"}
    names |= {"packed_qwen3_5_mrope_3_rows", "packed_qwen3_5_mrope_4_rows"}
    for rank, result in enumerate(results):
        assert set(result["parity"]) == names
        for name, errors in result["parity"].items():
            bad = {k: v for k, v in errors.items() if not v <= cases.tolerance_of(k)}
            assert not bad, f"C={world} rank {rank} {name}: {errors}"
        refusals = result["refusals"]
        assert "decoder layer 0 (Qwen3_5GatedDeltaNet)" in refusals["not_multiple"], refusals
        assert f"mixer_head_chunk_size={world + 1}" in refusals["not_multiple"], refusals
        valid = [u for u in range(world, 9, world) if 8 % u == 0]
        assert f"Valid values: {', '.join(map(str, valid))}" in refusals["not_multiple"], refusals
        assert f"mixer_head_chunk_size={3 * world}" in refusals["not_dividing"], refusals
        assert "linear_num_value_heads=8" in refusals["not_dividing"], refusals
        for words in (f"position_ids per rank {[-3] * world}", "[4, batch, local_seq] with the text positions first"):
            assert words in refusals["vision_positions"], refusals
        if world == 2:
            check_bf16(result["bf16"], f"rank {rank}")


def check_bf16(result: dict, where: str) -> None:
    """The bf16 layer under SP at U=C and U=all: output bit for bit, gradients within the unpatched layer's own
    variation (tests/mixer_bf16.py), and the SP runs really differ somewhere (the bounds are not vacuous)."""
    assert {k for k in result if k.startswith("sp_")} == {"sp_u=C", "sp_u=H"}, result
    assert not any(mixer_bf16.beyond_bounds(result).values()), f"{where}: {mixer_bf16.beyond_bounds(result)}"
    assert any(d > 0 for d in result["sp_u=C"].values()), result


def _fla_inputs(b=2, t=5, h=2, hv=4, k=3, v=4):
    q, kk = torch.randn(b, t, h, k), torch.randn(b, t, h, k)
    return q, kk, torch.randn(b, t, hv, v), torch.randn(b, t, hv), torch.rand(b, t, hv)


def test_fla_arguments_accepted():
    check_fla_arguments(*_fla_inputs(), None)
    check_fla_arguments(*_fla_inputs(b=1), torch.tensor([0, 2, 5], dtype=torch.int32))


@pytest.mark.parametrize(
    "mutate, cu_seqlens, match",
    [
        (lambda x: (x[0].transpose(1, 2), x[1].transpose(1, 2), *x[2:]), None, "v .* must be \\[B, T, HV, V\\]"),
        (lambda x: (x[0], x[1][:, :, :1], *x[2:]), None, "q .* and k .* must be equal"),
        (lambda x: (*x[:2], x[2][:, :, :3], x[3][..., :3], x[4][..., :3]), None, "HV a multiple of H=2"),
        (lambda x: (*x[:3], x[3][..., :2], x[4]), None, "g .* must be \\[B, T, HV\\]"),
        (lambda x: (x[0].transpose(0, 1).contiguous().transpose(0, 1), *x[1:]), None, "q must be contiguous"),
        (lambda x: (x[0].double(), *x[1:]), None, "dtypes"),
        (lambda x: x, torch.tensor([0, 5], dtype=torch.int32), "flatten the rows to B == 1"),
        (lambda x: tuple(t[:1] for t in x), torch.tensor([0, 5]), "1-D int32"),
        (lambda x: tuple(t[:1] for t in x), torch.tensor([0, 4], dtype=torch.int32), "from 0 to T=5"),
    ],
)
def test_fla_arguments_refused(mutate, cu_seqlens, match):
    with pytest.raises(ValueError, match=match):
        check_fla_arguments(*mutate(_fla_inputs()), cu_seqlens)
