"""A kernel by its config name ('sdpa', 'math', 'flash_attn', 'fa3'), with a sliding window when asked.

Above both the kernels and ``windows`` (which wraps them), so neither imports the other's user."""

from __future__ import annotations

from .kernels import AttentionKernel, FA3Kernel, FlashAttnKernel, MathKernel, TorchSDPAKernel
from .windows import windowed

# no automatic choice: a kernel is named explicitly ('fa3' never replaces 'sdpa' or 'flash_attn' on its own)
KERNELS: dict[str, type[AttentionKernel]] = {
    k.name: k for k in (TorchSDPAKernel, MathKernel, FlashAttnKernel, FA3Kernel)
}


def make_kernel(
    name: str, causal: bool = True, softmax_scale: float | None = None, window: int | None = None
) -> AttentionKernel:
    """Build a kernel by config name ('sdpa', 'math', 'flash_attn', 'fa3'); ``window`` restricts it to a sliding
    window (``ds_upipe.windows.windowed``: flash-attn 2's or 3's own, banded tiles for the others)."""
    if name not in KERNELS:
        raise ValueError(f"unknown attention kernel {name!r}; choose one of {sorted(KERNELS)}")
    kernel = KERNELS[name](causal=causal, softmax_scale=softmax_scale)
    if window is None:
        return kernel
    return windowed(kernel, window)
