"""Attention sinks (GPT-OSS ``s_aux``) from any kernel's log-sum-exp, exact forward and backward.

transformers' GPT-OSS ``eager_attention_forward`` appends one logit ``sink_h`` per head to every query
row's scores, softmaxes over keys and sink together and drops the sink's column: the sink takes
probability mass but adds no value.  With the kernel's ``(out, lse)`` over the keys alone this is

    out' = out * sigmoid(lse - sink_h),        lse' = logaddexp(lse, sink_h)

(``exp(lse - lse')`` rescales every key's probability).  Backward: the kernel's own backward run on
``(dout', out', lse')`` is exact for q, k, v, because its softmax gradient ``P (dP - rowsum(dout' *
out'))`` over the keys is the sink softmax's (the sink column has no value, so dP = 0 there); and

    d sink_h = -sum_{b, t} rowsum(dout' * out') * exp(sink_h - lse').

``SinkKernel`` wraps a kernel with this; the pipeline runs each stage with ``for_heads`` (the stage's
global query heads on this rank, from the stage plan), so each stage uses its own heads' sinks.  The
sinks' gradient is summed over the stages into ``SinkKernel.grad`` ([H], this rank's share: the heads
and tokens it attended, so the group's shares sum to the whole gradient, as for every other parameter
under sequence parallelism), which ``UPipeAttentionFunction`` returns as the gradient of its ``sinks``
input: autograd hands it to the attention module's parameter (ZeRO-3 safe; never written by hand).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .kernels import AttentionKernel, CallableKernel, KernelAux


def check_sinks(sinks: object, num_heads: int | None = None) -> None:
    """ValueError unless ``sinks`` is a floating 1-D tensor of ``num_heads`` values (one per query head)."""
    if not isinstance(sinks, Tensor):
        raise ValueError(f"sinks must be a tensor of one logit per query head, got {type(sinks).__name__}")
    if not sinks.is_floating_point():
        raise ValueError(f"sinks must be a floating-point tensor, got {sinks.dtype}")
    if sinks.dim() != 1 or (num_heads is not None and sinks.shape[0] != num_heads):
        want = f"[{num_heads}]" if num_heads is not None else "[num_heads]"
        raise ValueError(
            f"sinks must have shape {want} (one logit per query head, e.g. GPT-OSS's module.sinks), "
            f"got {list(sinks.shape)}"
        )


#: ``sinks_shape_code`` of a call without sinks, and of sinks that are not a floating 1-D tensor
NO_SINKS, BAD_SINKS = -1, -2


def sinks_shape_code(sinks: object) -> int:
    """One int for the input exchange (``ds_upipe.validation``): the number of sinks of a floating 1-D
    tensor, ``NO_SINKS`` for None, ``BAD_SINKS`` for anything else."""
    if sinks is None:
        return NO_SINKS
    if isinstance(sinks, Tensor) and sinks.is_floating_point() and sinks.dim() == 1:
        return sinks.shape[0]
    return BAD_SINKS


def _lse_dtype(lse: Tensor) -> torch.dtype:
    return torch.float64 if lse.dtype == torch.float64 else torch.float32


class SinkKernel(AttentionKernel):
    """``inner`` with one sink logit per query head.  ``sinks`` ([H], the global heads) is read
    detached; its gradient accumulates in ``grad`` (float32, float64 for float64 sinks).

    Called directly (not through the pipeline) it treats the tensors' heads as heads 0 ... h-1."""

    name = "sinks"
    per_head = True

    def __init__(self, inner: AttentionKernel, sinks: Tensor) -> None:
        if isinstance(inner, (CallableKernel, SinkKernel)) or not isinstance(inner, AttentionKernel):
            raise ValueError(
                "attention sinks need an AttentionKernel with an lse inside (not a plain callable, whose "
                f"backward recomputes, nor another SinkKernel), got {inner!r}"
            )
        check_sinks(sinks)
        super().__init__(inner.causal, inner.softmax_scale)
        self.inner = inner
        self.values = sinks.detach()
        acc = torch.float64 if sinks.dtype == torch.float64 else torch.float32
        self.grad = torch.zeros(sinks.shape, dtype=acc, device=sinks.device)

    @property
    def needs_output_in_backward(self) -> bool:  # type: ignore[override]
        return True  # the sink's gradient and the rescaled softmax gradient read out'

    @property
    def reads_strided_inputs(self) -> bool:  # type: ignore[override]
        return self.inner.reads_strided_inputs  # q, k, v go to the inner kernel as they come

    def for_heads(self, heads: Tensor) -> AttentionKernel:
        return _StageSinks(self, heads)

    def _all_heads(self, q: Tensor) -> _StageSinks:
        return _StageSinks(self, torch.arange(q.shape[1], device=self.values.device))

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, KernelAux]:
        return self._all_heads(q).forward(q, k, v)

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, aux: KernelAux
    ) -> tuple[Tensor, Tensor, Tensor]:
        return self._all_heads(q).backward(dout, q, k, v, out, lse, aux)

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, *args, **kwargs) -> Tensor:
        raise TypeError(
            "SinkKernel runs inside UPipeDistributedAttention(..., sinks=...) (its gradient goes to the sinks "
            "tensor through the pipeline's autograd node)"
        )

    def __repr__(self) -> str:
        return f"SinkKernel({self.inner!r}, heads={self.values.shape[0]})"


class _StageSinks(AttentionKernel):
    """A ``SinkKernel`` bound to one stage's query heads (global indices, in tensor order)."""

    name = "sinks"
    needs_output_in_backward = True

    def __init__(self, parent: SinkKernel, heads: Tensor) -> None:
        super().__init__(parent.causal, parent.softmax_scale)
        self.parent, self.heads = parent, heads.to(parent.values.device)

    @property
    def reads_strided_inputs(self) -> bool:  # type: ignore[override]
        return self.parent.reads_strided_inputs

    def _sinks(self, lse: Tensor) -> Tensor:
        """This stage's sinks as [1, n, 1] in the lse's compute dtype, on its device."""
        return self.parent.values.index_select(0, self.heads).to(lse.device, _lse_dtype(lse))[None, :, None]

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, KernelAux]:
        out, lse, aux = self.parent.inner.forward(q, k, v)
        rows = out.shape[2]
        sinks = self._sinks(lse)
        # a kernel may pad its lse past the rows (torch's memory-efficient op): the padding is transformed
        # too (the backward never reads it) so the lse keeps its kernel's layout
        weight = torch.sigmoid(lse[..., :rows].to(sinks.dtype) - sinks)
        out = (out * weight.unsqueeze(-1)).to(out.dtype)
        return out, torch.logaddexp(lse.to(sinks.dtype), sinks).to(lse.dtype), aux

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, aux: KernelAux
    ) -> tuple[Tensor, Tensor, Tensor]:
        grads = self.parent.inner.backward(dout, q, k, v, out, lse, aux)
        rows = out.shape[2]
        sinks = self._sinks(lse)
        acc = self.parent.grad.dtype
        row_dot = (dout.to(acc) * out.to(acc)).sum(dim=-1)  # [b, n, S]
        share = torch.exp(sinks.to(acc) - lse[..., :rows].to(acc))  # the sink's probability
        self.parent.grad.index_add_(0, self.heads, -(row_dot * share).sum(dim=(0, 2)))
        return grads

    def __repr__(self) -> str:
        return f"{self.parent!r} for heads {self.heads.tolist()}"


def find_sink_kernel(kernel: AttentionKernel) -> SinkKernel | None:
    """The ``SinkKernel`` in a kernel stack (itself, or inside a ``DocumentKernel``), None without one."""
    while kernel is not None:
        if isinstance(kernel, SinkKernel):
            return kernel
        kernel = getattr(kernel, "inner", None)
    return None
