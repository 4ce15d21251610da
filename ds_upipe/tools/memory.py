"""Per-rank peak memory of one step, measured with torch's MemTracker (CPU) or the CUDA allocator:
the one measurement of the bench, the HF layer measurement (hf_memory), the planner's validation
and the memory tests.

The core "intermediate" metric (docs/benchmarks.md, "Metric definitions"), ``measure_attention``:
one forward and one backward of ``attention(q, k, v, batch_dim_idx)`` on this rank, where

- q, k, v are fresh leaf tensors with ``requires_grad=True`` (inside a model the attention's inputs
  always need gradients);
- the output gradient ``dout`` is a materialized tensor of the output's shape (e.g. ``torch.randn``),
  not the broadcast scalar gradient of ``out.sum().backward()``, which needs no memory;
- **peak** is the largest total of live tensor bytes during the call, counting q, k, v and dout:
  torch's MemTracker on CPU with its module tracking off (its hooks on a module's inputs hold their
  gradients, which makes autograd copy them instead of taking them over, so the tracker would
  perturb what it measures), the CUDA allocator's peak on GPU;
- **intermediate** = peak minus the bytes of q, k, v, out, dout, dq, dk and dv: what the attention
  holds beyond its inputs, its output and their gradients.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..integration.fake_run import NoModuleTracking


@dataclass
class AttentionMemory:
    peak_bytes: int
    io_bytes: int  # q, k, v, out, dout, dq, dk, dv
    seconds: float
    out: Tensor  # detached
    grads: tuple[Tensor, Tensor, Tensor]  # dq, dk, dv

    @property
    def intermediate_bytes(self) -> int:
        return self.peak_bytes - self.io_bytes


def tensor_bytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _check_materialized(dout: Tensor, out: Tensor) -> None:
    if dout.shape != out.shape or 0 in dout.stride():
        raise ValueError(
            f"dout must be a materialized tensor of the output's shape {tuple(out.shape)}, got shape "
            f"{tuple(dout.shape)} and strides {dout.stride()} (an expanded tensor, such as the gradient of "
            "out.sum(), would hide the memory an output gradient takes)"
        )


def measure_attention(
    attention: Callable[..., Tensor], q: Tensor, k: Tensor, v: Tensor, dout: Tensor, batch_dim_idx: int
) -> AttentionMemory:
    """Run ``attention(q, k, v, batch_dim_idx)`` forward and ``backward(dout)`` once on fresh leaf
    copies of q, k, v that require grad, and measure this rank's peak and intermediate memory as
    defined in the module docstring."""
    ql, kl, vl = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    result: dict[str, Tensor] = {}

    def step() -> None:
        out = attention(ql, kl, vl, batch_dim_idx)
        _check_materialized(dout, out)
        out.backward(dout)
        result["out"] = out

    start = time.perf_counter()
    peak = measure_peak(step, [ql, kl, vl, dout], q.device)
    seconds = time.perf_counter() - start
    grads = (ql.grad, kl.grad, vl.grad)
    io = tensor_bytes(ql, kl, vl, result["out"], dout, *grads)
    return AttentionMemory(peak, io, seconds, result["out"].detach(), grads)


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
        tracker._mod_tracker = NoModuleTracking()
    tracker.track_external(*tracked)
    with tracker:
        step()
    return tracker.get_tracker_snapshot("peak")
