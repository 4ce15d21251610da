"""A kernel by its config name ('sdpa', 'math', 'flash_attn'), with a sliding window when asked.

Above both the kernels and ``windows`` (which wraps them), so neither imports the other's user."""

from __future__ import annotations

from .kernels import AttentionKernel, FlashAttnKernel, MathKernel, TorchSDPAKernel
from .windows import windowed

KERNELS: dict[str, type[AttentionKernel]] = {k.name: k for k in (TorchSDPAKernel, MathKernel, FlashAttnKernel)}


def make_kernel(
    name: str, causal: bool = True, softmax_scale: float | None = None, window: int | None = None
) -> AttentionKernel:
    """Build a kernel by config name ('sdpa', 'math', 'flash_attn'); ``window`` restricts it to a sliding
    window (``ds_upipe.windows.windowed``: flash-attn's own, banded tiles for the others)."""
    if name not in KERNELS:
        raise ValueError(f"unknown attention kernel {name!r}; choose one of {sorted(KERNELS)}")
    kernel = KERNELS[name](causal=causal, softmax_scale=softmax_scale)
    if window is None:
        return kernel
    return windowed(kernel, window)
