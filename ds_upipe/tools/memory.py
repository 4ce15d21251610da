"""Per-rank peak memory of one step, measured with torch's MemTracker (CPU) or the CUDA allocator:
the one measurement of the bench, the HF layer measurement (hf_memory) and the memory tests.

"Intermediate peak" is what the attention layer holds beyond its inputs, its output and their
gradients: peak total minus the bytes of q, k, v, out, dout, dq, dk and dv.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


@dataclass
class AttentionMemory:
    peak_bytes: int
    io_bytes: int  # q, k, v, out, dout, dq, dk, dv
    seconds: float

    @property
    def intermediate_bytes(self) -> int:
        return self.peak_bytes - self.io_bytes


def tensor_bytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def measure_attention(
    attention: Callable[..., Tensor], q: Tensor, k: Tensor, v: Tensor, dout: Tensor, batch_dim_idx: int
) -> AttentionMemory:
    """Run ``attention(q, k, v, batch_dim_idx)`` forward+backward once and measure this rank's peak.

    q, k, v must be leaf tensors with requires_grad; their .grad is reset first."""
    for t in (q, k, v):
        t.grad = None
    result: dict[str, Tensor] = {}

    def step() -> None:
        result["out"] = attention(q, k, v, batch_dim_idx)
        result["out"].backward(dout)

    start = time.perf_counter()
    peak = measure_peak(step, [q, k, v, dout], q.device)
    seconds = time.perf_counter() - start
    io = tensor_bytes(q, k, v, result["out"], dout, q.grad, k.grad, v.grad)
    return AttentionMemory(peak_bytes=peak, io_bytes=io, seconds=seconds)


def measure_peak(step: Callable[[], Any], tracked: list[Any], device: torch.device) -> int:
    """Peak bytes held during ``step()`` on this rank, counting ``tracked`` (the modules and tensors
    made before the step) and everything the step allocates.

    CPU: torch's MemTracker (deterministic).  CUDA: the allocator's peak above what was allocated
    before the step, plus the tracked bytes (the same quantity)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        held = sum(
            tensor_bytes(*obj.parameters(), *obj.buffers()) if isinstance(obj, torch.nn.Module) else tensor_bytes(obj)
            for obj in tracked
        )
        return int(torch.cuda.max_memory_allocated(device) - base + held)
    return int(max(snap["Total"] for snap in peak_snapshot(step, tracked, module_tracking=False).values()))


def peak_snapshot(step: Callable[[], Any], tracked: list[Any], module_tracking: bool = True) -> dict[Any, dict]:
    """MemTracker's per-device peak snapshot of ``step()`` (CPU): bytes per category ("Parameter",
    "Gradient", ..., "Total"), counting ``tracked`` and everything the step allocates."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    if not module_tracking:
        tracker._mod_tracker = _NoModuleTracking()
    tracker.track_external(*tracked)
    with tracker:
        step()
    return tracker.get_tracker_snapshot("peak")


class _NoModuleTracking:
    """Stands in for MemTracker's ModTracker, whose backward hooks fail on modules called inside an
    autograd Function's no-grad forward (DeepSpeed's TiledMLP calls gate/up/down_proj there).  The
    per-storage accounting, and so the peak total, does not depend on it."""

    is_bw = False
    parents: set[str] = set()

    def register_user_hooks(self, *hooks: Any) -> None: ...

    def clear_user_hooks(self) -> None: ...

    def __enter__(self) -> _NoModuleTracking:
        return self

    def __exit__(self, *args: Any) -> None: ...
