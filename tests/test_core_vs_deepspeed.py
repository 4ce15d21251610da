"""UPipeDistributedAttention and DeepSpeed's DistributedAttention agree (float64, 1e-10)."""


def test_same_outputs_and_gradients_as_deepspeed(four_deepspeed_ranks):
    # core_cases.deepspeed_parity on 4 ranks (the spawn shared with the memory tests: tests/four_ranks.py)
    for rank, diffs in enumerate(four_deepspeed_ranks["test_core_vs_deepspeed.py"]):
        assert len(diffs) == 2 * 2 * 3 * 2 * 2
        assert max(diffs) <= 1e-10, f"rank {rank}: {max(diffs)}"
