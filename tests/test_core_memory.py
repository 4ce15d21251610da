"""UPipe's intermediate attention memory at U = C is <= 30% of DeepSpeed's and grows with U."""

from ds_upipe.tools.ranks import run_ranks
from tests import core_cases


def test_intermediate_peak_vs_deepspeed():
    for rank, res in enumerate(run_ranks(core_cases.memory_by_head_chunk, 4, use_deepspeed=True)):
        baseline = res.pop("deepspeed")[0]
        by_u = sorted(res.items())
        assert by_u[0][0] == 4
        assert by_u[0][1][0] <= 0.30 * baseline, f"rank {rank}: U=C {by_u[0][1][0]} vs DeepSpeed {baseline}"
        intermediates = [m[0] for _, m in by_u]
        assert intermediates == sorted(intermediates) and intermediates[0] < intermediates[-1], intermediates
