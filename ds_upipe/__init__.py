"""ds_upipe: UPipe (headwise-chunked Ulysses) sequence parallelism for DeepSpeed.

The public names below are imported on first use (PEP 562): ``import ds_upipe.schedule`` or
``ds-upipe --help`` must not pay for torch.distributed, deepspeed, transformers or pydantic.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

#: public name -> submodule that defines it
_LAZY = {
    "initialize": "integration.engine",  # deepspeed.initialize with sequence parallelism from the ds_config
    "AttentionKernel": "kernels",
    "CallableKernel": "kernels",
    "FA3Kernel": "kernels",
    "FlashAttnKernel": "kernels",
    "MathKernel": "kernels",
    "TorchSDPAKernel": "kernels",
    "make_kernel": "kernel_choice",
    "UPipeDistributedAttention": "layer",
    "UPipeRuntime": "runtime",
    "DocumentKernel": "packing",
    "SinkKernel": "sinks",
    "SlidingWindowKernel": "windows",
    "windowed": "windows",
    "documents_from_positions": "packing",
    "StagePlan": "schedule",
    "build_plan": "schedule",
    "valid_head_chunk_sizes": "schedule",
    "exit_process": "integration.process_exit",
}

__all__ = [
    "AttentionKernel",
    "CallableKernel",
    "DocumentKernel",
    "FA3Kernel",
    "FlashAttnKernel",
    "MathKernel",
    "SinkKernel",
    "SlidingWindowKernel",
    "StagePlan",
    "TorchSDPAKernel",
    "UPipeDistributedAttention",
    "UPipeRuntime",
    "build_plan",
    "documents_from_positions",
    "exit_process",
    "initialize",
    "make_kernel",
    "valid_head_chunk_sizes",
    "windowed",
]
__version__ = "0.1.0"

if TYPE_CHECKING:
    from .integration.engine import initialize
    from .integration.process_exit import exit_process
    from .kernel_choice import make_kernel
    from .kernels import AttentionKernel, CallableKernel, FA3Kernel, FlashAttnKernel, MathKernel, TorchSDPAKernel
    from .layer import UPipeDistributedAttention
    from .packing import DocumentKernel, documents_from_positions
    from .runtime import UPipeRuntime
    from .schedule import StagePlan, build_plan, valid_head_chunk_sizes
    from .sinks import SinkKernel
    from .windows import SlidingWindowKernel, windowed


#: public submodules under a short name: ``from ds_upipe import hf_integration`` (the Trainer hook)
_SUBMODULES = {"hf_integration": "integration.hf_integration"}


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        value = importlib.import_module(f".{_SUBMODULES[name]}", __name__)
    elif name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    else:
        raise AttributeError(f"module 'ds_upipe' has no attribute {name!r}")
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY, *_SUBMODULES])
