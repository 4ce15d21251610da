"""The tracker: torch's MemTracker with the peak's operation and largest tensors (``PeakTracker``), the runs
that stop at a peak, and the one analytic term fake execution cannot see (``kernel_workspace_bytes``)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils.weak import WeakIdKeyDictionary

KERNELS = ("none", "fa2", "fa3")
_FLASH_BACKWARD = {
    "aten._scaled_dot_product_flash_attention_for_cpu_backward.default",
    "aten._scaled_dot_product_flash_attention_backward.default",
}


# -- the one analytic term: the CUDA kernel's backward workspace ----------------------------------


def kernel_workspace_bytes(kernel: str, q: torch.Size, k: torch.Size, element_size: int) -> int:
    """Bytes a GPU flash-attention backward allocates inside the kernel for one call on q [b, h, S, d]
    and k [b, hkv, S, d] (besides dq, dk, dv, which the fake run counts).

    - "fa2" (torch SDPA's CUDA flash backward = flash-attn 2, what ALST's transformers "sdpa" and
      ds_upipe's TorchSDPAKernel run in 16-bit): ``dq_accum``, float32 [b, S, h, d]
      (flash-attn csrc/flash_attn/flash_api.cpp, mha_bwd), and under GQA dk/dv of the query
      heads' size (``dk_expanded``/``dv_expanded``, input dtype) summed to the KV heads afterwards.
    - "fa3" (flash-attn 3, hopper/flash_api.cpp): float32 ``dq_accum``, ``dk_accum``, ``dv_accum``.
    - "none": CPU, where MemTracker sees everything the op allocates.
    """
    if kernel == "none":
        return 0
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r}: choose one of {list(KERNELS)}")
    nq, nkv = q.numel(), k.numel()
    if kernel == "fa3":
        return 4 * nq + 2 * 4 * nkv
    return 4 * nq + (2 * element_size * nq if q[1] != k[1] else 0)


# -- the tracker ------------------------------------------------------------------------------------


@dataclass
class Peak:
    """The peak of one measured step on rank 0 (bytes), and what it is made of."""

    total: int  # everything tracked at the peak, the kernel workspace included
    weights: int  # of which the module's parameters (tracked for the whole step)
    workspace: int  # of which the analytic kernel workspace (0 unless the peak is inside a kernel backward)
    at: str  # the operation whose allocation set the peak
    live: list[tuple[str, int]] = field(default_factory=list)  # largest allocations alive then, by origin
    after_forward: int = 0  # live bytes right after the forward (saved for backward + output + inputs)
    #: the peak total of each phase of the step, where the step names its phases (``model_step``)
    phases: dict[str, int] = field(default_factory=dict)

    @property
    def activations(self) -> int:
        """The peak without the parameters (ZeRO-partitioned or gathered: counted by the planner)."""
        return self.total - self.weights

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class NoModuleTracking:
    """Stands in for MemTracker's ModTracker (also for ds_upipe.tools.memory's real measurements).  Its
    hooks on a module's inputs hold their gradients until every one has arrived, so autograd copies
    each input gradient instead of taking it over (the copy exists only under the tracker); and its
    backward hooks fail on modules called inside an autograd Function's no-grad forward (DeepSpeed's
    TiledMLP calls gate/up/down_proj there).  The per-storage accounting, and so the peak total, does
    not depend on it."""

    is_bw = False
    parents: set[str] = set()

    def register_user_hooks(self, *hooks: Any) -> None: ...

    def clear_user_hooks(self) -> None: ...

    def __enter__(self) -> NoModuleTracking:
        return self

    def __exit__(self, *args: Any) -> None: ...


class PeakTracker(MemTracker):
    """MemTracker that also names each storage's origin and, at the peak, the operation that set it.

    Origin: "forward <module path>: <op>" (module paths from global forward hooks) or "backward
    <autograd node>: <op>".  With ``kernel`` a GPU kernel, a flash backward op's workspace is counted
    on top of the live bytes while it runs (``kernel_workspace_bytes``)."""

    def __init__(
        self, kernel: str = "none", names: dict[int, str] | None = None, phase: Callable[[], str] | None = None
    ) -> None:
        super().__init__()
        self.phase = phase
        self.phase_peaks: dict[str, int] = {}
        self._mod_tracker = NoModuleTracking()
        self.kernel = kernel
        self.names = names or {}
        self.origins: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.modules: list[str] = []
        self.op = "before the step"
        self.extra = 0
        self.peak = Peak(0, 0, 0, "nothing allocated")
        self.weights = 0

    def label_external(self, label: str, *tensors: torch.Tensor) -> None:
        for t in tensors:
            self.origins[t.untyped_storage()] = label

    def _context(self) -> str:
        if torch._C._current_graph_task_id() != -1:
            node = torch._C._current_autograd_node()
            return f"backward {node.name() if node is not None else '?'}"
        return f"forward {self.modules[-1]}" if self.modules else "forward"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.op = f"{self._context()}: {func}"
        self.extra = 0
        if self.kernel != "none" and str(func) in _FLASH_BACKWARD:
            q, k = args[1], args[2]
            self.extra = kernel_workspace_bytes(self.kernel, q.shape, k.shape, q.element_size())
        res = super().__torch_dispatch__(func, types, args, kwargs)
        for t in (r for r in (res if isinstance(res, tuple | list) else (res,)) if isinstance(r, torch.Tensor)):
            self.origins.setdefault(t.untyped_storage(), self.op)
        self.extra = 0
        return res

    def _update_peak_stats(self, peak_state: Any) -> None:
        total = sum(snap["Total"] for snap in self._curr_mem_snap.values()) + self.extra
        if self.phase is not None:
            name = self.phase()
            self.phase_peaks[name] = max(self.phase_peaks.get(name, 0), total)
        if total > self.peak.total:
            self.peak = Peak(total, self.weights, self.extra, self.op + (" (+ kernel workspace)" if self.extra else ""))

    def live_now(self, top: int = 10) -> list[tuple[str, int]]:
        """The largest live allocations, summed by origin."""
        by: dict[str, int] = {}
        for st, (winfo, _) in list(self._WINFO.items()):
            by[self.origins.get(st, "other")] = by.get(self.origins.get(st, "other"), 0) + winfo.mem_consumed
        return sorted(by.items(), key=lambda kv: -kv[1])[:top]

    def current(self) -> int:
        return sum(snap["Total"] for snap in self._curr_mem_snap.values())


def _forward_hooks(tracker: PeakTracker) -> contextlib.ExitStack:
    """Global module hooks keeping the stack of module paths the forward is in (for the labels)."""
    from torch.nn.modules import module as nn_module

    def pre(module: torch.nn.Module, *_: Any) -> None:
        tracker.modules.append(tracker.names.get(id(module), type(module).__name__))

    def post(module: torch.nn.Module, *_: Any) -> None:
        if tracker.modules:
            tracker.modules.pop()

    stack = contextlib.ExitStack()
    stack.callback(nn_module.register_module_forward_pre_hook(pre).remove)
    stack.callback(nn_module.register_module_forward_hook(post, always_call=True).remove)
    return stack


def track(
    step: Callable[[], Any],
    external: dict[str, list[torch.Tensor]],
    weights: list[torch.Tensor],
    *,
    kernel: str = "none",
    names: dict[int, str] | None = None,
    forward: Callable[[], Any] | None = None,
    live: bool = False,
    phase: Callable[[], str] | None = None,
) -> Peak:
    """The peak of ``step()`` (``forward()`` then ``step(forward's result)`` when ``forward`` is given),
    counting the ``external`` tensors (by label) and the ``weights``, with the live set at the peak.

    ``live``: run twice, the second run stopping when the first one's peak is reached again to
    record what is alive then (cheaper than a snapshot at every new high).  ``phase``: the name of the
    phase the step is in now (``Peak.phases`` then holds each phase's peak)."""
    first = _run(step, external, weights, kernel, names, forward, stop_at=None, phase=phase)
    if not live:
        return first
    for t in [*weights, *(t for ts in external.values() for t in ts)]:
        t.grad = None  # the second run allocates the gradients again
    second = _run(step, external, weights, kernel, names, forward, stop_at=first.total, phase=phase)
    first.live = second.live
    return first


class _StopAtPeak(Exception):
    pass


def _run(step, external, weights, kernel, names, forward, stop_at: int | None, phase=None) -> Peak:  # type: ignore[no-untyped-def]
    tracker = PeakTracker(kernel, names, phase)
    if stop_at is not None:
        original = tracker._update_peak_stats

        def update(peak_state: Any) -> None:
            original(peak_state)
            if tracker.peak.total >= stop_at:
                tracker.peak.live = tracker.live_now()
                if tracker.extra:
                    tracker.peak.live.insert(0, (f"kernel workspace ({kernel})", tracker.extra))
                raise _StopAtPeak

        tracker._update_peak_stats = update  # type: ignore[method-assign]
    tensors = [t for ts in external.values() for t in ts]
    tracker.track_external(*tensors, *weights)
    for label, ts in external.items():
        tracker.label_external(label, *ts)
    tracker.label_external("parameters", *weights)
    tracker.weights = sum(w.untyped_storage().nbytes() for w in {id(w): w for w in weights}.values())
    after_forward = 0
    try:
        with tracker, _forward_hooks(tracker):
            tracker.peak = Peak(tracker.current(), tracker.weights, 0, "before the step")
            if forward is not None:
                out = forward()
                after_forward = tracker.current()
                step(out)
                del out
            else:
                step()
    except _StopAtPeak:
        pass
    peak = tracker.peak
    peak.after_forward = after_forward
    peak.phases = dict(tracker.phase_peaks)
    return peak
