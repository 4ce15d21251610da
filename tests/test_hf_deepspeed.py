"""hf_patches under DeepSpeed: one ZeRO-3 step (deepspeed.initialize with the sequence-parallel mpu)
gives the unpatched single-process loss and gradients, fused and unfused, with HF gradient
checkpointing (reentrant and not), each gradient reduced exactly once; and the sequence-parallel
dataloader (padding + UlyssesSPDataLoaderAdapter) feeds the patched model correctly."""

from ds_upipe.tools.ranks import run_ranks
from tests import hf_cases

F32 = hf_cases.TOLERANCE[hf_cases.torch.float32]
F64 = hf_cases.TOLERANCE[hf_cases.torch.float64]


def test_zero3_and_dataloader():
    results = run_ranks(hf_cases.deepspeed_cases, 2, use_deepspeed=True)
    for rank, r in enumerate(results):
        assert len(r["zero3"]) == 6
        for case, errors in r["zero3"].items():
            assert errors["reduced_once"] == 0 and errors["grad_names"] == 0, f"rank {rank} {case}: {errors}"
            assert max(errors.values()) <= F32, f"rank {rank} {case}: {errors}"
        loader = r["dataloader"]
        assert len([k for k in loader if k.startswith("logits_")]) == 2
        assert max(loader.values()) <= F64, f"rank {rank}: {loader}"
