"""Local attention kernels with an explicit (out, lse) contract (``contract``'s docstring states it).

One module a job: ``contract`` (the contract, ``CallableKernel``, ``kernel_autograd``,
``gqa_native_sdpa``, ``with_softmax_scale``), ``torch_sdpa`` (torch's SDPA ops: ``TorchSDPAKernel``,
``MathKernel``, ``sdpa_path``, ``lse_block``), ``flash`` (flash-attn 2: ``FlashAttnKernel``; and
``FlashWindowKernel``, the flash kernels' own sliding window), ``fa3`` (flash-attn 3: ``FA3Kernel``, a
value head dim of its own natively).  Choosing a kernel by its config name, with a sliding window, is
``ds_upipe.kernel_choice.make_kernel`` (above ``windows``, which wraps these kernels).
"""

from __future__ import annotations

from .contract import (
    AttentionKernel,
    CallableKernel,
    KernelAux,
    gqa_native_sdpa,
    kernel_autograd,
    with_softmax_scale,
)
from .fa3 import FA3Kernel, fa3_available, fa3_head_dims_refusal
from .flash import (
    FLASH_ATTN_REQUIREMENT,
    FlashAttnKernel,
    FlashWindowKernel,
    flash_attn_available,
    flash_attn_release,
)
from .torch_sdpa import MathKernel, SDPAPath, TorchSDPAKernel, lse_block, sdpa_path

__all__ = [
    "FLASH_ATTN_REQUIREMENT",
    "AttentionKernel",
    "CallableKernel",
    "FA3Kernel",
    "FlashAttnKernel",
    "FlashWindowKernel",
    "KernelAux",
    "MathKernel",
    "SDPAPath",
    "TorchSDPAKernel",
    "fa3_available",
    "fa3_head_dims_refusal",
    "flash_attn_available",
    "flash_attn_release",
    "gqa_native_sdpa",
    "kernel_autograd",
    "lse_block",
    "sdpa_path",
    "with_softmax_scale",
]
