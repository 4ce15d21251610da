"""Per-rank memory of one attention forward+backward, measured with torch's MemTracker (CPU) or the
CUDA allocator.  Shared by the memory tests and ``ds-upipe bench``.

"Intermediate peak" is what the attention layer holds beyond its inputs, its output and their
gradients: peak total minus the bytes of q, k, v, out, dout, dq, dk and dv.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

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


def _nbytes(*tensors: Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def measure_attention(
    attention: Callable[..., Tensor], q: Tensor, k: Tensor, v: Tensor, dout: Tensor, batch_dim_idx: int
) -> AttentionMemory:
    """Run ``attention(q, k, v, batch_dim_idx)`` forward+backward once and measure this rank's peak.

    q, k, v must be leaf tensors with requires_grad; their .grad is reset first."""
    for t in (q, k, v):
        t.grad = None
    if q.device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        start = time.perf_counter()
        out = attention(q, k, v, batch_dim_idx)
        out.backward(dout)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        # everything allocated before the call except q, k, v, dout is not the layer's
        peak = torch.cuda.max_memory_allocated() - base + _nbytes(q, k, v, dout)
    else:
        from torch.distributed._tools.mem_tracker import MemTracker

        tracker = MemTracker()
        tracker.track_external(q, k, v, dout)
        start = time.perf_counter()
        with tracker:
            out = attention(q, k, v, batch_dim_idx)
            out.backward(dout)
        seconds = time.perf_counter() - start
        peak = max(snap["Total"] for snap in tracker.get_tracker_snapshot("peak").values())
    io = _nbytes(q, k, v, out, dout, q.grad, k.grad, v.grad)
    return AttentionMemory(peak_bytes=peak, io_bytes=io, seconds=seconds)
