"""DPO and GRPO under UPipe (hf_patches.rl_loss) equal TRL's non-SP definitions: float64, tiny Llama,
in-process ranks over gloo (one spawn per group size); rank bodies in tests/rl_cases.py."""

from __future__ import annotations

import pytest

pytest.importorskip("trl")

from ds_upipe.tools.ranks import run_ranks  # noqa: E402
from tests import rl_cases  # noqa: E402

NUM_CASES = {2: 7, 4: 4}


@pytest.mark.parametrize("world", [2, 4])
def test_rl_losses_equal_no_sp(world):
    results = run_ranks(rl_cases.cases, world)
    for rank, cases in enumerate(results):
        assert len(cases) == NUM_CASES[world]
        for case, errors in cases.items():
            for name, error in errors.items():  # f32_: against TRL's own (float32) fused LM head
                tolerance = rl_cases.F32 if name.startswith("f32_") else rl_cases.F64
                assert error <= tolerance, f"C={world} rank {rank} {case} {name}: {errors}"
