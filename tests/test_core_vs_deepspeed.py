"""UPipeDistributedAttention and DeepSpeed's DistributedAttention agree (float64, 1e-10)."""

from ds_upipe.tools.ranks import run_ranks
from tests import core_cases


def test_same_outputs_and_gradients_as_deepspeed():
    for rank, diffs in enumerate(run_ranks(core_cases.deepspeed_parity, 4, use_deepspeed=True)):
        assert len(diffs) == 2 * 2 * 3 * 2 * 2
        assert max(diffs) <= 1e-10, f"rank {rank}: {max(diffs)}"
