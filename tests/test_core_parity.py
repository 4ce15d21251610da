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


@pytest.fixture(scope="module")
def other_and_packed():
    """One spawn per world size (2 and 4) of ``core_cases.other_attention_and_packing``, run on first use."""

    class Spawns(dict):
        def __missing__(self, world):
            self[world] = run_ranks(core_cases.other_attention_and_packing, world)
            return self[world]

    return Spawns()


@pytest.mark.parametrize("world", [2, 4])
def test_math_kernel_generic_callable_and_packed_rows(world, other_and_packed):
    """Also packed rows (cu_seqlens, random document lengths crossing the shards, a one-token
    document) against every document attended alone, in the same spawn."""
    for rank, result in enumerate(other_and_packed[world]):
        failures, count = result["other"]
        assert count == 4 * 2 * 3 * 2 * 2
        assert not failures, f"rank {rank}: {failures[:5]}"
        failures, count = result["packed"]
        assert count == 2 * 2 * 2 * 2 * 2
        assert not failures, f"rank {rank} packed: {failures[:5]}"


@pytest.mark.parametrize("world", [2, 4])
def test_value_head_dim_other_than_query_key(world, other_and_packed):
    """Multi-head latent attention's shapes (v_head_dim 8 < qk head dim 12): the exchanges of v, the
    output, dout and dV carry v's head dim, the sdpa kernel pads v for torch's flash op and slices back
    (``core_cases.latent_matrix``)."""
    for rank, result in enumerate(other_and_packed[world]):
        failures, count = result["latent"]
        assert count == 2 * 2 * 2 * 2 + 3
        assert not failures, f"rank {rank} latent: {failures[:5]}"


@pytest.mark.parametrize("world", [2, 4])
def test_received_heads_are_views_of_the_exchange(world, other_and_packed):
    """The heads-to-sequence exchange hands the kernel views of its receive buffer (token-major rows:
    no rearranging copy), or with ``own_storage`` one contiguous token-major tensor each."""
    for rank, result in enumerate(other_and_packed[world]):
        err, storages, token_major = result["exchange_layout"][False]
        assert err == 0.0 and storages == 1, (rank, err, storages)
        err, storages, token_major = result["exchange_layout"][True]
        assert err == 0.0 and storages == 2 and token_major, (rank, err, storages, token_major)


@pytest.mark.parametrize("world", [2, 4])
def test_two_runtimes_and_a_recreated_group(world, other_and_packed):
    """Two differently configured layers interleaved in one process, and layers on a destroyed and
    re-created group, each equal to its float64 reference (``core_cases.runtimes_case``)."""
    for rank, result in enumerate(other_and_packed[world]):
        errors = result["runtimes"]
        assert len(errors) == 2 * 4 + 2 * 4 + 1, errors
        assert max(errors.values()) <= 1e-10, f"rank {rank}: {errors}"


@pytest.mark.parametrize("world", [2, 4])
def test_sliding_windows_and_sinks(world, other_and_packed):
    """Windows below, equal to and beyond a shard and the sequence, crossing shards, with and without
    GPT-OSS sinks (their gradient summed over the ranks), packed rows, vs an explicit-mask eager
    reference; the mutations the cases must catch (window off by one, sinks on other heads) change the
    reference by far more than the tolerance."""
    for rank, result in enumerate(other_and_packed[world]):
        failures, count, sensitivity = result["windows"]
        assert count == 2 * 2 * 6 + 2 * 2 * 2 + 1
        assert not failures, f"rank {rank} windows: {failures[:5]}"
        assert min(sensitivity.values()) > 0.1, sensitivity


WINDOW_ERRORS = {
    "window_zero": "window must be a positive int (the W tokens a query sees, itself included",
    "window_negative_in_constructor": "or None for full causal attention, got -3",
    "window_bool": "got True",
    "window_differs": "the sliding window differs across the ranks of the sequence-parallel group (rank 0: 4",
    "window_non_causal": "a sliding window (window=4) is causal",
    "window_generic": "a sliding window (window=4) needs an AttentionKernel as local_attention",
    "sinks_wrong_length": "sinks must be a floating-point tensor of shape [16] (one logit per query head, the global "
    "num_heads), got 8 values",
    "sinks_2d": "got not a floating-point 1-D tensor",
    "sinks_int": "got not a floating-point 1-D tensor",
    "sinks_on_one_rank": "the attention sinks' shape (-1: none) differs across the ranks",
    "sinks_generic": "attention sinks need an AttentionKernel as local_attention",
    "ok_after_errors": "no error",
}


@pytest.mark.parametrize("world", [2, 4])
def test_bad_windows_and_sinks_fail_on_every_rank(world, other_and_packed):
    results = other_and_packed[world]
    for case, fragment in WINDOW_ERRORS.items():
        messages = {res["window_errors"][case] for res in results}
        assert len(messages) == 1, f"{case}: ranks disagree: {messages}"
        assert fragment in messages.pop(), case
