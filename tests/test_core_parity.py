"""UPipeDistributedAttention equals single-process attention (forward and dq/dk/dv)."""

import pytest

from ds_upipe.tools.ranks import run_ranks
from tests import core_cases


@pytest.mark.parametrize("world", [2, 4])
def test_sdpa_kernel_matrix(world):
    results = run_ranks(core_cases.kernel_matrix, world)
    for rank, (failures, count) in enumerate(results):
        assert count == 4 * 2 * 3 * 2 * 2 * 4  # float64 twice: with and without overlapped communication
        assert not failures, f"rank {rank}: {failures[:5]}"


@pytest.mark.parametrize("world", [2, 4])
def test_math_kernel_generic_callable_and_packed_rows(world):
    """Also packed rows (cu_seqlens, random document lengths crossing the shards, a one-token
    document) against every document attended alone, in the same spawn."""
    for rank, result in enumerate(run_ranks(core_cases.other_attention_and_packing, world)):
        failures, count = result["other"]
        assert count == 4 * 2 * 3 * 2 * 2
        assert not failures, f"rank {rank}: {failures[:5]}"
        failures, count = result["packed"]
        assert count == 2 * 2 * 2 * 2 * 2
        assert not failures, f"rank {rank} packed: {failures[:5]}"
