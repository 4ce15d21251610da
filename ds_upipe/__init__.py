"""ds_upipe: UPipe (headwise-chunked Ulysses) sequence parallelism for DeepSpeed."""

from .engine import initialize  # deepspeed.initialize with sequence parallelism from the ds_config
from .kernels import AttentionKernel, FlashAttnKernel, MathKernel, TorchSDPAKernel, make_kernel
from .layer import UPipeDistributedAttention
from .schedule import StagePlan, build_plan, valid_head_chunk_sizes

__all__ = [
    "AttentionKernel",
    "FlashAttnKernel",
    "MathKernel",
    "StagePlan",
    "TorchSDPAKernel",
    "UPipeDistributedAttention",
    "build_plan",
    "initialize",
    "make_kernel",
    "valid_head_chunk_sizes",
]
__version__ = "0.1.0"
