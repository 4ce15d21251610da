"""The activation checkpoint's recompute without the recomputed layer output.

A reentrant checkpoint (DeepSpeed's ``CheckpointFunction``, what ``ds_upipe.initialize`` and the HF
integration install) replays a layer in backward and then runs ``torch.autograd.backward(outputs,
grads)`` while holding the replayed ``outputs``: one hidden state per layer output that nothing
reads (the layer's last op, the residual add, does not save its result), alive through the layer's
whole backward -- at the attention's backward, where a long-context step peaks.  ``releasing``
wraps the checkpoint's ``run_function`` so that in the replay each output is handed back as
``OutputStandIn``: a zero-stride stand-in of the same shape (one element of storage) whose
gradient goes unchanged to the real output's graph.  The real output is then freed as soon as
the layer returns, unless its own graph saved it (then it stays, and the result is the same).
The first forward (without grad: the outputs are the next layer's input) is untouched.

``ExactPinnedOffloadEngine`` (``install_exact_pinned_pool``): DeepSpeed's checkpoint offload with
host buffers pinned at exactly their size instead of torch's power-of-two pinned blocks, and without
DeepSpeed's forward stash (``max_fwd_stash_count=0``): DeepSpeed keeps the device copy of the newest
offloaded input (besides the newest input, which is not offloaded) until the next offload, so at the end
of the forward the top two layers' inputs are on the device through the top layer's backward, where a
long-context step peaks: one hidden state (8 GiB at 1M tokens per rank for Llama3-8B) that the next
layer's backward can bring back from the host instead (docs/benchmarks.md, issue 41).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor


class OutputStandIn(torch.autograd.Function):
    """Identity for gradients; the forward value is a stand-in that holds no memory."""

    @staticmethod
    def forward(ctx, output: Tensor) -> Tensor:
        return output.new_empty(()).expand(output.shape)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return grad


def _stand_in(value: Any) -> Any:
    if isinstance(value, Tensor) and value.requires_grad and value.is_floating_point():
        return OutputStandIn.apply(value)
    if isinstance(value, tuple | list):
        return type(value)(_stand_in(v) for v in value)
    return value


def without_recomputed_outputs(run_function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``run_function(*args, **kwargs)``; when it runs with grad (the checkpoint's replay in backward,
    whose outputs only root the layer's backward) its differentiable outputs become stand-ins."""
    outputs = run_function(*args, **kwargs)
    return _stand_in(outputs) if torch.is_grad_enabled() else outputs


def releasing(checkpoint: Callable[..., Any]) -> Callable[..., Any]:
    """A ``gradient_checkpointing_func`` (``checkpoint(run_function, *args)``) whose replay releases
    the replayed outputs (module docstring)."""

    @functools.wraps(checkpoint)
    def run(run_function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return checkpoint(functools.partial(without_recomputed_outputs, run_function), *args, **kwargs)

    return run


# -- exact-size pinned host buffers for offloaded checkpoints --------------------------------------


def register_pinned(host: Tensor) -> bool:
    """Page-lock a host tensor in place (``cudaHostRegister``: exactly its bytes, where torch's
    ``pin_memory()`` would round the block up to a power of two).  False where there is nothing to
    do (no CUDA, an empty tensor); RuntimeError if CUDA refuses."""
    nbytes = host.numel() * host.element_size()
    if not (torch.cuda.is_available() and nbytes):
        return False
    err = torch.cuda.cudart().cudaHostRegister(host.data_ptr(), nbytes, 0)
    if int(getattr(err, "value", err)) != 0:
        raise RuntimeError(f"cudaHostRegister of a {nbytes}-byte checkpoint buffer failed: {err}")
    return True


def unregister_pinned(hosts: list[Tensor]) -> None:
    """Undo ``register_pinned`` for each tensor (before its memory is freed) and empty the list."""
    if torch.cuda.is_available():
        for host in hosts:
            if host.numel():
                torch.cuda.cudart().cudaHostUnregister(host.data_ptr())
    hosts.clear()


def _exact_engine_class() -> type:
    """``ExactPinnedOffloadEngine``, built on first use (DeepSpeed imports lazily here)."""
    from deepspeed.runtime.activation_checkpointing.offload_activations import _ActivationOffloadEngine

    class ExactPinnedOffloadEngine(_ActivationOffloadEngine):
        """DeepSpeed's checkpoint offload engine with host buffers pinned at exactly their size.

        DeepSpeed 0.19.8 pins each host buffer with ``tensor.pin_memory()`` (through the
        accelerator), i.e. torch's CachingHostAllocator, which rounds every block up to a power of
        two: a 4.5 GiB layer input takes 8 GiB of pinned memory, and at 7M tokens of Llama3-8B on 8
        ranks that is 1,984 GiB per node.  Here each buffer is a pageable ``torch.empty`` of exactly
        the checkpoint's bytes, registered with ``cudaHostRegister`` (page-locked in place, no
        rounding), and kept in ``registered`` for the engine's lifetime: DeepSpeed's buffer pool
        reuses them step after step (keyed by shape), so a run at one sequence length pins
        ``layers - 1`` buffers once.  ``release()`` unregisters them.  Everything else (streams,
        keep-last, stash, pool) is DeepSpeed's."""

        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.registered: list[Tensor] = []
            self.pinned_bytes = 0

        def _empty_cpu_like(self, tensor: Tensor) -> tuple[Tensor, Any]:
            self._reap_cpu_buffer_pool()
            key = self._buffer_key(tensor)
            pool = self._cpu_buffer_pool.get(key)
            if pool:
                self._cpu_buffer_pool_count -= 1
                return pool.pop(), key
            host = torch.empty(tuple(tensor.size()), dtype=tensor.dtype, layout=tensor.layout, device="cpu")
            if self.use_pin_memory:
                register_pinned(host)
                self.registered.append(host)
                self.pinned_bytes += host.numel() * host.element_size()
            return host, key

        def release(self) -> None:
            """Unregister (unpin) every buffer; the engine must not be used afterwards."""
            self.reset()
            unregister_pinned(self.registered)
            self._cpu_buffer_pool.clear()
            self._cpu_buffer_pool_count = 0
            self.pinned_bytes = 0

    return ExactPinnedOffloadEngine


#: the offloaded inputs whose device copies ds_upipe's engine keeps (DeepSpeed's default: 2; the planner reads it)
FORWARD_STASH = 0


def exact_pinned_offload_engine(**kwargs: Any) -> Any:
    """An ``ExactPinnedOffloadEngine`` (DeepSpeed's engine arguments; DeepSpeed's own defaults for
    checkpoints: ``keep_last_count=1, min_offload_bytes=0``; no forward stash: the module docstring)."""
    kwargs.setdefault("keep_last_count", 1)
    kwargs.setdefault("min_offload_bytes", 0)
    # no device copy of an offloaded input kept (DeepSpeed's default 2 keeps the newest offloaded one): its
    # backward copies it back from the host, the same bytes (planner.offloaded_below_top)
    kwargs.setdefault("max_fwd_stash_count", FORWARD_STASH)
    return _exact_engine_class()(**kwargs)


def install_exact_pinned_pool() -> Any | None:
    """Make DeepSpeed's cpu_checkpointing use the exact-size pinned pool (after
    ``deepspeed.checkpointing.configure``).  Returns the engine, or None where DeepSpeed would not
    offload asynchronously (CPU accelerators, partitioned activations, cpu_checkpointing off)."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.activation_checkpointing import checkpointing as ds_checkpointing

    if not ds_checkpointing.CPU_CHECKPOINT or ds_checkpointing.PARTITION_ACTIVATIONS:
        return None
    if get_accelerator().is_synchronized_device():
        return None
    if not isinstance(ds_checkpointing._cpu_offload_engine, _exact_engine_class()):
        previous = ds_checkpointing._cpu_offload_engine
        if previous is not None:
            previous.reset()
        ds_checkpointing._cpu_offload_engine = exact_pinned_offload_engine()
    return ds_checkpointing._cpu_offload_engine
