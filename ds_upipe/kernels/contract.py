"""The kernel contract: local attention with an explicit (out, lse) contract, and its adapters.

UPipe's backward replays each stage from saved, sequence-sharded inputs.  A kernel that returns the
log-sum-exp (lse) in forward and takes it in backward lets that replay skip the attention recompute.
Every kernel here works on the kernel layout [b, h, S, d]; key/value may have fewer heads than query
(GQA: query head i uses KV head i // (hq // hkv)).

``forward(q, k, v) -> (out, lse, aux)`` and ``backward(dout, q, k, v, out, lse, aux) -> (dq, dk, dv)``:
``aux`` is whatever else the backward op needs from its forward op, handed back unchanged (the RNG
state and undefined cumulative sequence lengths of torch's CUDA ops, flash-attn's rng_state), as
torch's own autograd and its context-parallel ring attention do.  It holds only tensors or None and
has a fixed length per kernel and input dtype/device, so a caller can ``save_for_backward`` it
next to the lse.

``needs_output_in_backward`` (class attribute, default True) says whether ``backward`` uses ``out``:
the pipeline gathers each stage's output for backward only then and passes ``out=None`` otherwise.
``CallableKernel`` adapts any local attention with DistributedAttention's contract (a plain
function of [b, S, h, d] or [S, b, h, d] tensors) to this contract: its forward runs the function
without autograd and returns an empty lse and no aux; its backward recomputes the function under
autograd (so it needs neither the lse nor the output).  The lse a kernel returns is therefore only
meaningful to its own backward (and to ring attention, which refuses ``CallableKernel``).

A kernel instance is also a plain callable with DeepSpeed ``DistributedAttention``'s local-attention
contract (``kernel(q, k, v)`` with [b, S, h, d] tensors, autograd through torch), GQA-native like
``gqa_native_sdpa``: K/V keep their heads, nothing is expanded.  ``gqa_native_sdpa`` is the local
attention a DeepSpeed user writes, and the baseline of the core-level measurements.
"""

from __future__ import annotations

import abc
import copy
import math
from collections.abc import Callable

import torch
from torch import Tensor

#: the forward-to-backward state of one kernel call besides the lse (see the module docstring)
KernelAux = tuple[Tensor | None, ...]


def _expand_kv(kv: Tensor, num_q_heads: int) -> Tensor:
    """GQA broadcast of [b, hkv, S, d] to [b, hq, S, d]; a copy when hq > hkv (the repeated heads
    are not expressible as one 4-D stride), so only the float64 math reference uses it."""
    b, hkv, seq, d = kv.shape
    group = num_q_heads // hkv
    return kv[:, :, None].expand(b, hkv, group, seq, d).reshape(b, num_q_heads, seq, d) if group > 1 else kv


def common_head_dim(q: Tensor, v: Tensor, multiple: int = 1) -> int:
    """The one head dim of a kernel op that takes q, k and v of one head dim (flash attention: torch's and
    flash-attn 2's) when v's differs (latent attention: v_head_dim < qk_head_dim), rounded up to ``multiple``."""
    dim = max(q.shape[-1], v.shape[-1])
    return dim + (-dim % multiple)


def pad_head_dim(t: Tensor, dim: int) -> Tensor:
    """``t`` zero-padded on its last dim to ``dim`` (itself when it is that wide: no copy).  Exact for
    attention: zero q/k columns add nothing to the scores (the scale is the caller's, of the true head dim),
    zero v columns give zero output columns, sliced off; zero dout columns add nothing to any gradient."""
    pad = dim - t.shape[-1]
    return torch.nn.functional.pad(t, (0, pad)) if pad else t


def gqa_native_sdpa(
    q: Tensor, k: Tensor, v: Tensor, *args: object, causal: bool = True, softmax_scale: float | None = None, **kwargs
) -> Tensor:
    """Local attention with DeepSpeed ``DistributedAttention``'s contract, as a user writes it: [b, S, h, d]
    in and out, ``F.scaled_dot_product_attention(..., enable_gqa=True)`` on the [b, h, S, d] transposes,
    autograd by torch.  K/V keep their (fewer) heads: no GQA-expanded copy is made or differentiated
    through.  Extra positional/keyword arguments from DistributedAttention's forward are ignored.

    ``enable_gqa`` is passed only when the head counts differ: on CUDA torch serves GQA with its flash
    (fp16/bf16) and math kernels only, so equal head counts keep the memory-efficient kernel in float32."""
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(
        qh, kh, vh, is_causal=causal, scale=softmax_scale, enable_gqa=kh.shape[1] != qh.shape[1]
    )
    return out.transpose(1, 2)


def _reduce_kv_grad(grad: Tensor, num_kv_heads: int) -> Tensor:
    """Sum the gradient of an expanded KV back to its [b, hkv, S, d] heads."""
    b, hq, seq, d = grad.shape
    if hq == num_kv_heads:
        return grad
    return grad.view(b, num_kv_heads, hq // num_kv_heads, seq, d).sum(dim=2)


class AttentionKernel(abc.ABC):
    """``forward(q, k, v) -> (out, lse, aux)``; ``backward(dout, q, k, v, out, lse, aux) -> (dq, dk, dv)``."""

    #: name used in configs and error messages
    name: str = ""
    #: whether ``backward`` uses the forward output ``out`` (an lse-based backward does; a recompute
    #: does not, and gets ``out=None``): the pipeline gathers the stage output in backward only then
    needs_output_in_backward: bool = True
    #: whether the kernel has per-head state (attention sinks): the pipeline then runs each stage with
    #: ``for_heads(this rank's global query heads of the stage)``
    per_head: bool = False
    #: whether ``forward``/``backward`` read q, k, v through any strides with a contiguous last dim (as
    #: torch's attention ops and flash-attn do): the pipeline then hands them strided views of the
    #: exchange's receive buffer; otherwise each is first copied to its own token-major storage
    #: ([b, S, h, d] contiguous, seen as [b, h, S, d])
    reads_strided_inputs: bool = True

    def __init__(self, causal: bool = True, softmax_scale: float | None = None) -> None:
        self.causal = causal
        self.softmax_scale = softmax_scale

    def for_heads(self, heads: Tensor) -> AttentionKernel:
        """This kernel for a stage whose query heads are ``heads`` (global indices, in the order of the
        stage's [b, n, S, d] tensors); a kernel without per-head state is the same for every stage."""
        return self

    def scale_for(self, head_dim: int) -> float:
        return self.softmax_scale if self.softmax_scale is not None else 1.0 / math.sqrt(head_dim)

    @abc.abstractmethod
    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, KernelAux]: ...

    @abc.abstractmethod
    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, aux: KernelAux
    ) -> tuple[Tensor, Tensor, Tensor]: ...

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, *args, **kwargs) -> Tensor:
        """DistributedAttention's local-attention contract: [b, S, h, d] in and out, autograd by torch,
        GQA-native (``gqa_native_sdpa`` with this kernel's causal flag and scale)."""
        return gqa_native_sdpa(q, k, v, causal=self.causal, softmax_scale=self.scale_for(q.shape[-1]))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(causal={self.causal}, softmax_scale={self.softmax_scale})"


class _KernelFunction(torch.autograd.Function):
    """Autograd through a kernel's own forward and backward, on [b, h, S, d] tensors."""

    @staticmethod
    def forward(fctx, q: Tensor, k: Tensor, v: Tensor, kernel: AttentionKernel) -> Tensor:
        out, lse, aux = kernel.forward(q, k, v)
        fctx.kernel, fctx.num_aux = kernel, len(aux)
        fctx.save_for_backward(q, k, v, out, lse, *aux)
        return out

    @staticmethod
    def backward(fctx, dout: Tensor):
        q, k, v, out, lse, *aux = fctx.saved_tensors
        # dout as it comes (a transposed view): the kernels here take any strides, a copy would be a q-sized buffer
        dq, dk, dv = fctx.kernel.backward(dout, q, k, v, out, lse, tuple(aux))
        return dq, dk, dv, None


def kernel_autograd(kernel: AttentionKernel, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """DistributedAttention's local-attention contract ([b, S, h, d] in and out) through ``kernel``'s own
    forward/backward: for kernels whose mask torch's SDPA cannot express (a sliding window)."""
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    return _KernelFunction.apply(qh, kh, vh, kernel).transpose(1, 2)


class CallableKernel(AttentionKernel):
    """A local attention with DeepSpeed ``DistributedAttention``'s contract as a kernel:
    ``attention(q, k, v, *args, **kwargs)`` on [b, S, h, d] (``batch_dim_idx=0``) or [S, b, h, d]
    (``batch_dim_idx=1``) tensors, autograd by torch, built per call with that call's layout and
    extra arguments.

    ``forward`` runs it without autograd and returns an empty lse and no aux; ``backward``
    recomputes it under autograd and differentiates it (the recompute needs no lse and no output,
    hence ``needs_output_in_backward = False``).  Causality and scale are the function's own."""

    name = "callable"
    needs_output_in_backward = False
    # DistributedAttention's local attention gets contiguous [b, S, h, d] tensors (DeepSpeed's
    # all-to-all output); a user's function may ``.view`` them
    reads_strided_inputs = False

    def __init__(
        self,
        attention: Callable[..., Tensor],
        batch_dim_idx: int = 0,
        args: tuple[object, ...] = (),
        kwargs: dict[str, object] | None = None,
    ) -> None:
        # no causal / softmax_scale: the wrapped function decides them
        self.attention = attention
        self.batch_dim_idx = batch_dim_idx
        self.args = args
        self.kwargs = kwargs or {}

    def _to_layout(self, t: Tensor) -> Tensor:
        t = t.transpose(1, 2)  # [b, S, n, d]
        return (t.transpose(0, 1) if self.batch_dim_idx == 1 else t).contiguous()

    def _run(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """The function on [b, n, S, d] q, k, v, its output as a [b, n, S, d] view."""
        out = self.attention(self._to_layout(q), self._to_layout(k), self._to_layout(v), *self.args, **self.kwargs)
        out = out.transpose(0, 1) if self.batch_dim_idx == 1 else out
        return out.transpose(1, 2)

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, KernelAux]:
        with torch.no_grad():
            out = self._run(q, k, v)
        # an empty placeholder lse keeps the (out, lse, aux) contract and save_for_backward
        return out, q.new_empty(0), ()

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor | None, lse: Tensor, aux: KernelAux
    ) -> tuple[Tensor, Tensor, Tensor]:
        with torch.enable_grad():
            q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
            dq, dk, dv = torch.autograd.grad(self._run(q, k, v), (q, k, v), dout)
        return dq, dk, dv

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, *args, **kwargs) -> Tensor:
        """The wrapped function itself (DistributedAttention's contract)."""
        return self.attention(q, k, v, *args, **kwargs)

    def __repr__(self) -> str:
        return f"CallableKernel({self.attention!r}, batch_dim_idx={self.batch_dim_idx})"


def with_softmax_scale(kernel: AttentionKernel, scale: float | None, head_dim: int | None = None) -> AttentionKernel:
    """``kernel`` with softmax scale ``scale`` (None: ``kernel`` itself): the same kernel when its scale is
    already exactly that, else a shallow copy with ``softmax_scale = scale``.  The scale reaches the kernel's
    ops as it is (no pre-scaled q), so a model's own scale (Gemma's ``query_pre_attn_scalar``, Granite's
    ``attention_multiplier``) is exact in every dtype.  A ``CallableKernel`` decides its own scale
    (1/sqrt(head_dim)): another one is refused."""
    if scale is None or kernel.softmax_scale == scale:
        return kernel
    if isinstance(kernel, CallableKernel):
        if head_dim is not None and abs(scale * math.sqrt(head_dim) - 1.0) <= 1e-12:
            return kernel
        raise ValueError(
            f"softmax scale {scale} (the attention module's) differs from 1/sqrt(head_dim) and {kernel!r} takes no "
            "scale: use an AttentionKernel ('sdpa', 'math', 'flash_attn', 'fa3')"
        )
    scaled = copy.copy(kernel)
    scaled.softmax_scale = float(scale)
    return scaled
