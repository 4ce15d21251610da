"""Local attention kernels with an explicit (out, lse) contract.

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
import re
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch
from torch import Tensor

#: the forward-to-backward state of one kernel call besides the lse (see the module docstring)
KernelAux = tuple[Tensor | None, ...]

aten = torch.ops.aten


def _expand_kv(kv: Tensor, num_q_heads: int) -> Tensor:
    """GQA broadcast of [b, hkv, S, d] to [b, hq, S, d]; a copy when hq > hkv (the repeated heads
    are not expressible as one 4-D stride), so only the float64 math reference uses it."""
    b, hkv, seq, d = kv.shape
    group = num_q_heads // hkv
    return kv[:, :, None].expand(b, hkv, group, seq, d).reshape(b, num_q_heads, seq, d) if group > 1 else kv


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


# -- torch SDPA: one small forward/backward pair per aten backend ----------------------------------
#
# Each pair calls the op with exactly the arguments torch's own SDPA autograd uses
# (derivatives.yaml; torch.distributed.tensor.experimental._context_parallel does the same): dropout
# 0, the kernel's causal flag and scale, and the forward op's extra outputs handed to the backward op
# unchanged as ``aux``.

SDPAForward = Callable[[Tensor, Tensor, Tensor, bool, float], tuple[Tensor, Tensor, KernelAux]]
SDPABackward = Callable[
    [Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, KernelAux, bool, float], tuple[Tensor, Tensor, Tensor]
]


@dataclass(frozen=True)
class SDPAPath:
    """One backend of ``TorchSDPAKernel``: the aten forward/backward pair it runs."""

    name: str
    forward: SDPAForward
    backward: SDPABackward
    #: whether it materializes S x S scores (only the float64 reference does)
    quadratic_memory: bool = False
    #: the forward returns the lse padded to a multiple of this many rows (torch's memory-efficient op: 32),
    #: and the backward reads it so
    lse_block: int = 1


def _cpu_flash_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor, KernelAux]:
    # native GQA: k, v keep their hkv heads and dk, dv come back with them
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return out, lse, ()


def _cpu_flash_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, aux: KernelAux, causal: bool, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, causal, scale=scale
    )
    return dq, dk, dv


def _cuda_flash_forward(
    q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float
) -> tuple[Tensor, Tensor, KernelAux]:
    # native GQA, as torch's SDPA hands it to this op: the flash kernel takes hkv dividing hq
    out, lse, cum_q, cum_k, max_q, max_k, rng_state, unused, _ = aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, causal, False, scale=scale
    )
    if cum_q is not None or cum_k is not None or max_q != q.shape[2] or max_k != k.shape[2]:
        # dense inputs give undefined cum_seq and max_q/max_k equal to the lengths; the backward
        # takes max_q/max_k from the shapes and would take the varlen path on a defined cum_seq
        raise RuntimeError(
            f"_scaled_dot_product_flash_attention returned cum_seq_q={cum_q}, max_q={max_q}, max_k={max_k} "
            f"for dense inputs of lengths {q.shape[2]}, {k.shape[2]}"
        )
    return out, lse, (cum_q, cum_k, rng_state, unused)


def _cuda_flash_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, aux: KernelAux, causal: bool, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    cum_q, cum_k, rng_state, unused = aux
    # the forward's outputs, unchanged: undefined cum_seq selects the dense (not varlen) backward
    dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse, cum_q, cum_k, q.shape[2], k.shape[2], 0.0, causal, rng_state, unused, scale=scale
    )
    return dq, dk, dv


def _fold_kv_groups(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """GQA as equal head counts without copying KV: [b, hq, S, d] q -> [b*hkv, g, S, d] and each KV head
    broadcast over its g query heads with head stride 0.  torch's efficient attention needs equal head
    counts but reads every tensor through its strides (only the last dim must be contiguous) and
    allocates its own dense dk, dv of the broadcast shape, which ``_unfold_kv_grad`` sums."""
    b, hq, seq, d = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    if group == 1:
        return q, k, v

    def broadcast(t: Tensor) -> Tensor:
        return t.reshape(b * hkv, 1, t.shape[2], t.shape[3]).expand(-1, group, -1, -1)

    return q.reshape(b * hkv, group, seq, d), broadcast(k), broadcast(v)


def _unfold_kv_grad(grad: Tensor, kv_shape: torch.Size) -> Tensor:
    """[b*hkv, g, S, d] gradient of a broadcast KV -> [b, hkv, S, d]."""
    return grad if grad.shape == kv_shape else grad.sum(dim=1).reshape(kv_shape)


def _cuda_efficient_forward(
    q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float
) -> tuple[Tensor, Tensor, KernelAux]:
    qf, kf, vf = _fold_kv_groups(q, k, v)
    out, lse, philox_seed, philox_offset = aten._scaled_dot_product_efficient_attention(
        qf, kf, vf, None, True, 0.0, causal, scale=scale
    )
    # lse is [b*hkv, g, S rounded up to 32] (contiguous): viewed per query head, as the pipeline saves it
    return out.reshape(q.shape), lse.reshape(q.shape[0], q.shape[1], -1), (philox_seed, philox_offset)


def _cuda_efficient_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, aux: KernelAux, causal: bool, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    philox_seed, philox_offset = aux
    qf, kf, vf = _fold_kv_groups(q, k, v)
    lse_f = lse.reshape(qf.shape[0], qf.shape[1], -1)
    # grad_input_mask: q, k, v need gradients, there is no attn_bias (what autograd passes here)
    # the op reads out through its head stride but takes its token stride to be num_heads * head_dim
    # (kernel_backward.h, o_strideM): out must be token-major ([b, S, h, d] memory), as its own forward
    # returns it; the pipeline's gathered stage output is a view of its exchange's buffer, whose token
    # stride counts every packed tensor's heads, so it is copied (once, here)
    out_f = out.reshape(qf.shape).transpose(1, 2).contiguous().transpose(1, 2)
    dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
        dout.reshape(qf.shape),
        qf,
        kf,
        vf,
        None,
        out_f,
        lse_f.contiguous(),
        philox_seed,
        philox_offset,
        0.0,
        [True, True, True, False],
        causal,
        scale=scale,
    )
    return dq.reshape(q.shape), _unfold_kv_grad(dk, k.shape), _unfold_kv_grad(dv, v.shape)


def _math_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor, KernelAux]:
    return MathKernel(causal, scale, compute_dtype=q.dtype).forward(q, k, v)


def _math_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, aux: KernelAux, causal: bool, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    return MathKernel(causal, scale, compute_dtype=q.dtype).backward(dout, q, k, v, out, lse, aux)


#: torch's CUDA flash op (``mha_fwd``/``mha_bwd``) takes head sizes that are multiples of 8 up to 256
FLASH_HEAD_DIM_MULTIPLE, FLASH_MAX_HEAD_DIM = 8, 256


def _pad_head_dim(t: Tensor, multiple: int = FLASH_HEAD_DIM_MULTIPLE) -> Tensor:
    pad = -t.shape[-1] % multiple
    return torch.nn.functional.pad(t, (0, pad)) if pad else t


def _padded(path: SDPAPath) -> SDPAPath:
    """``path`` on head_dim zero-padded to a multiple of 8, as ``F.scaled_dot_product_attention`` pads
    for the flash op (attention.cpp, ``pad_last_dim<8>``): the caller's scale is of the true head_dim,
    zero columns change neither the scores nor the lse, out and the gradients are sliced back."""

    def forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor, KernelAux]:
        out, lse, aux = path.forward(*(_pad_head_dim(t) for t in (q, k, v)), causal, scale)
        return out[..., : v.shape[-1]], lse, aux

    def backward(
        dout: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        lse: Tensor,
        aux: KernelAux,
        causal: bool,
        scale: float,
    ) -> tuple[Tensor, Tensor, Tensor]:
        padded = (_pad_head_dim(t) for t in (dout, q, k, v, out))
        grads = path.backward(*padded, lse, aux, causal, scale)
        return tuple(g[..., : t.shape[-1]] for g, t in zip(grads, (q, k, v)))

    return SDPAPath(f"{path.name}_padded", forward, backward, path.quadratic_memory, path.lse_block)


CPU_FLASH = SDPAPath("cpu_flash", _cpu_flash_forward, _cpu_flash_backward)
CUDA_FLASH = SDPAPath("cuda_flash", _cuda_flash_forward, _cuda_flash_backward)
CUDA_FLASH_PADDED = _padded(CUDA_FLASH)
CUDA_EFFICIENT = SDPAPath("cuda_efficient", _cuda_efficient_forward, _cuda_efficient_backward, lse_block=32)
CUDA_EFFICIENT_PADDED = _padded(CUDA_EFFICIENT)
MATH = SDPAPath("math", _math_forward, _math_backward, quadratic_memory=True)


def sdpa_path(device_type: str, dtype: torch.dtype, head_dim: int | None = None) -> SDPAPath:
    """The aten backend ``TorchSDPAKernel`` runs for tensors of this device type, dtype and head_dim
    (None: any the flash op takes).

    CUDA fp16/bf16: the flash op, on head_dim padded to a multiple of 8 when it is not one (the op
    raises "head_size must be a multiple of 8, this is ensured by padding"); above 256, which flash
    has no kernel for, the memory-efficient op (padded the same way, for its aligned kernels)."""
    if device_type == "cpu":
        return CPU_FLASH
    if device_type != "cuda":
        raise ValueError(f"kernel 'sdpa' runs on cpu or cuda tensors, got device type {device_type!r}")
    if dtype in (torch.float16, torch.bfloat16):
        if head_dim is None:
            return CUDA_FLASH
        aligned = head_dim % FLASH_HEAD_DIM_MULTIPLE == 0
        if head_dim + (-head_dim % FLASH_HEAD_DIM_MULTIPLE) <= FLASH_MAX_HEAD_DIM:
            return CUDA_FLASH if aligned else CUDA_FLASH_PADDED
        return CUDA_EFFICIENT if aligned else CUDA_EFFICIENT_PADDED
    if dtype == torch.float32:
        return CUDA_EFFICIENT  # flash has no float32 kernel; memory-efficient attention is O(S) with an lse
    return MATH  # float64 has no fused CUDA kernel: the S x S reference, for tests


class TorchSDPAKernel(AttentionKernel):
    """torch's fused attention ops with an explicit lse: CPU flash (any float dtype), CUDA flash
    (fp16/bf16; head_dim padded to a multiple of 8 as torch's SDPA pads it, the memory-efficient op
    above 256), CUDA memory-efficient attention (fp32); CUDA float64 falls back to the math reference.

    Uses the aten ops behind ``scaled_dot_product_attention`` directly because the public function
    does not return the lse, which is what lets backward skip the recompute."""

    name = "sdpa"

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, KernelAux]:
        path = sdpa_path(q.device.type, q.dtype, q.shape[-1])
        return path.forward(q, k, v, self.causal, self.scale_for(q.shape[-1]))

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, aux: KernelAux
    ) -> tuple[Tensor, Tensor, Tensor]:
        path = sdpa_path(q.device.type, q.dtype, q.shape[-1])
        return path.backward(dout, q, k, v, out, lse, aux, self.causal, self.scale_for(q.shape[-1]))


class MathKernel(AttentionKernel):
    """Reference attention computed explicitly (float64 by default); materializes S x S scores.

    For tests and as the ground truth: exact softmax with lse, any device, any float dtype."""

    name = "math"

    def __init__(
        self, causal: bool = True, softmax_scale: float | None = None, compute_dtype: torch.dtype = torch.float64
    ) -> None:
        super().__init__(causal, softmax_scale)
        self.compute_dtype = compute_dtype

    def _probabilities(self, q: Tensor, k: Tensor, lse: Tensor | None) -> tuple[Tensor, Tensor]:
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.scale_for(q.shape[-1])
        if self.causal:
            seq_q, seq_k = scores.shape[-2:]
            mask = torch.ones(seq_q, seq_k, dtype=torch.bool, device=q.device).tril(seq_k - seq_q)
            scores = scores.masked_fill(~mask, float("-inf"))
        if lse is None:
            lse = torch.logsumexp(scores, dim=-1)
        return torch.exp(scores - lse.unsqueeze(-1)), lse

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, KernelAux]:
        ct = self.compute_dtype
        qc, kc, vc = q.to(ct), _expand_kv(k, q.shape[1]).to(ct), _expand_kv(v, q.shape[1]).to(ct)
        probs, lse = self._probabilities(qc, kc, None)
        return torch.matmul(probs, vc).to(q.dtype), lse, ()

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, aux: KernelAux
    ) -> tuple[Tensor, Tensor, Tensor]:
        ct = self.compute_dtype
        qc, kc, vc = q.to(ct), _expand_kv(k, q.shape[1]).to(ct), _expand_kv(v, q.shape[1]).to(ct)
        doc, oc = dout.to(ct), out.to(ct)
        probs, _ = self._probabilities(qc, kc, lse.to(ct))
        scale = self.scale_for(q.shape[-1])
        dv = torch.matmul(probs.transpose(-1, -2), doc)
        dprobs = torch.matmul(doc, vc.transpose(-1, -2))
        delta = (doc * oc).sum(dim=-1, keepdim=True)
        dscores = probs * (dprobs - delta)
        dq = torch.matmul(dscores, kc) * scale
        dk = torch.matmul(dscores.transpose(-1, -2), qc) * scale
        hkv = k.shape[1]
        return dq.to(q.dtype), _reduce_kv_grad(dk, hkv).to(k.dtype), _reduce_kv_grad(dv, hkv).to(v.dtype)


# -- flash-attn 2 ------------------------------------------------------------------------------------

#: flash-attn releases whose private ``_flash_attn_forward``/``_flash_attn_backward`` and
#: ``_flash_attn_varlen_forward``/``_flash_attn_varlen_backward`` this adapter calls with their exact
#: signatures, read from the v2.6.0-v2.6.3, v2.7.0, v2.7.4.post1 and v2.8.3 sources: 2.6 takes
#: ``window_size=(left, right)`` and returns (out, q, k, v, out_padded, softmax_lse, S_dmask,
#: rng_state); 2.7 and 2.8 take ``window_size_left``/``window_size_right`` and return (out,
#: softmax_lse, S_dmask, rng_state); the varlen backward returns (dq, dk, dv, softmax_d) in 2.6 and
#: softmax_d in 2.7+, filling the dq, dk, dv it is given in both.  The varlen forward's trailing
#: optional arguments differ (2.6.0: ``block_table`` without a default; 2.6.1 adds ``leftpad_k``,
#: 2.6.2 ``seqused_k``, 2.7.3 ``zero_tensors``), so the adapter passes ``block_table=None`` and leaves
#: the others at their defaults.  Keep in step with setup.py's "flash" extra.
FLASH_ATTN_REQUIREMENT = "flash-attn>=2.6,<2.9"
_FLASH_ATTN_RANGE = ((2, 6), (2, 9))


def flash_attn_release(version: str) -> tuple[int, int]:
    """(major, minor) of a flash-attn version this adapter supports; ValueError for any other."""
    match = re.match(r"(\d+)\.(\d+)", version)
    release = (int(match.group(1)), int(match.group(2))) if match else None
    if release is None or not _FLASH_ATTN_RANGE[0] <= release < _FLASH_ATTN_RANGE[1]:
        raise ValueError(
            f"kernel 'flash_attn' supports {FLASH_ATTN_REQUIREMENT}, found flash-attn {version}: the private "
            "_flash_attn_forward/_flash_attn_backward it calls change between releases; install "
            f"'{FLASH_ATTN_REQUIREMENT}' or use kernel 'sdpa'"
        )
    return release


def flash_attn_available() -> bool:
    """flash-attn needs CUDA and the package; on CPU machines this is False and its tests skip."""
    if not torch.cuda.is_available():
        return False
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def _load_flash_attn() -> tuple[ModuleType, tuple[int, int]]:
    """flash-attn's interface module and its (major, minor) release, refused unless CUDA and a
    supported release are present."""
    if not flash_attn_available():
        raise ValueError(
            "kernel 'flash_attn' needs a CUDA device and the flash-attn package "
            "(pip install 'ds-upipe[flash]'); use kernel 'sdpa' instead"
        )
    import flash_attn
    from flash_attn import flash_attn_interface

    return flash_attn_interface, flash_attn_release(getattr(flash_attn, "__version__", "unknown"))


def _token_major(t: Tensor) -> Tensor:
    """[b, h, S, d] -> [b*S, h, d], flash-attn's varlen layout (the rows' tokens concatenated).

    flash-attn reads a varlen tensor through one token stride and one head stride (only the last dim
    must be contiguous), so this is a view when the tokens of all rows are evenly strided (one row, a
    single head, or token-major memory) and one copy otherwise (b > 1 rows of head-major memory)."""
    return t.transpose(1, 2).flatten(0, 1)


class FlashAttnKernel(AttentionKernel):
    """flash-attn 2 (``flash_attn.flash_attn_interface``, releases 2.6-2.8) on CUDA, fp16/bf16,
    native GQA, head_dim a multiple of 8 up to 256.

    flash-attn works on [b, S, h, d] and reads its inputs through their strides (only the last dim
    must be contiguous), so the adapter hands it transposed views of the kernel layout, no copies.

    ``forward_varlen``/``backward_varlen`` run flash-attn's varlen functions once over many documents
    (``ds_upipe.packing.DocumentKernel`` calls them for packed rows)."""

    name = "flash_attn"

    def __init__(self, causal: bool = True, softmax_scale: float | None = None, window: int | None = None) -> None:
        super().__init__(causal, softmax_scale)
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ValueError(f"window must be a positive int or None, got {window!r}")
        if window is not None and not causal:
            raise ValueError("a sliding window is causal: FlashAttnKernel(window=...) needs causal=True")
        #: sliding window (``ds_upipe.windows``: key j visible to query i iff i - W < j <= i), None = none
        self.window = window
        self._fa, self.release = _load_flash_attn()

    def _window(self) -> dict[str, object]:
        """The sliding window in the release's own argument names: flash-attn's (W - 1, 0) is query i
        seeing keys i - W + 1 ... i (transformers' sliding_window W); (-1, -1) is none."""
        left, right = (-1, -1) if self.window is None else (self.window - 1, 0)
        return (
            {"window_size": (left, right)}
            if self.release < (2, 7)
            else {"window_size_left": left, "window_size_right": right}
        )

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, *args, **kwargs) -> Tensor:
        """DistributedAttention's contract; with a window through this kernel (SDPA has no window)."""
        if self.window is None:
            return super().__call__(q, k, v, *args, **kwargs)
        return kernel_autograd(self, q, k, v)

    def __repr__(self) -> str:
        extra = "" if self.window is None else f", window={self.window}"
        return f"FlashAttnKernel(causal={self.causal}, softmax_scale={self.softmax_scale}{extra})"

    @staticmethod
    def _check_inputs(q: Tensor) -> None:
        if q.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"kernel 'flash_attn' runs float16 or bfloat16, got {q.dtype}; use kernel 'sdpa'")
        if q.shape[-1] % 8 or q.shape[-1] > 256:
            # flash-attn pads other head sizes inside its autograd Function, not in these calls
            raise ValueError(
                f"kernel 'flash_attn' needs head_dim a multiple of 8 and at most 256, got {q.shape[-1]}; "
                "use kernel 'sdpa'"
            )

    def _forward_outputs(self, res: tuple) -> tuple[Tensor, Tensor, Tensor]:
        """(out, softmax_lse, rng_state) of a dense or varlen forward's return tuple: 2.6 returns
        (out, q, k, v, out_padded, softmax_lse, S_dmask, rng_state), 2.7+ (out, softmax_lse, S_dmask, rng_state)."""
        return (res[0], res[5], res[7]) if self.release < (2, 7) else (res[0], res[1], res[3])

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, KernelAux]:
        self._check_inputs(q)
        qb, kb, vb = (t.transpose(1, 2) for t in (q, k, v))
        res = self._fa._flash_attn_forward(
            qb,
            kb,
            vb,
            0.0,
            self.scale_for(q.shape[-1]),
            causal=self.causal,
            **self._window(),
            softcap=0.0,
            alibi_slopes=None,
            return_softmax=False,
        )
        out, lse, rng_state = self._forward_outputs(res)
        return out.transpose(1, 2), lse, (rng_state,)

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, aux: KernelAux
    ) -> tuple[Tensor, Tensor, Tensor]:
        (rng_state,) = aux
        qb, kb, vb, ob, db = (t.transpose(1, 2) for t in (q, k, v, out, dout))
        dq, dk, dv = torch.empty_like(qb), torch.empty_like(kb), torch.empty_like(vb)
        # fills dq, dk, dv in place (dk, dv keep the hkv heads: flash-attn sums the GQA groups)
        self._fa._flash_attn_backward(
            db,
            qb,
            kb,
            vb,
            ob,
            lse,
            dq,
            dk,
            dv,
            0.0,
            self.scale_for(q.shape[-1]),
            self.causal,
            **self._window(),
            softcap=0.0,
            alibi_slopes=None,
            deterministic=False,
            rng_state=rng_state,
        )
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)

    def forward_varlen(
        self, q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int
    ) -> tuple[Tensor, Tensor, KernelAux]:
        """One ``_flash_attn_varlen_forward`` call for every document of the [b, h, S, d] tensors.

        ``cu_seqlens`` (int32, on q's device) are the document boundaries over the b*S tokens of the
        rows concatenated (``_token_major``), the same for queries and keys; ``max_seqlen`` is the
        longest document.  Returns out ([b, h, S, d], a view of flash-attn's token-major output),
        the lse in flash-attn's varlen layout, [h, b*S] float32 (``softmax_lse`` of ``mha_varlen_fwd``:
        ``{num_heads, total_q}``), only for ``backward_varlen``, and ``(rng_state,)``."""
        self._check_inputs(q)
        b, _, seq, _ = q.shape
        res = self._fa._flash_attn_varlen_forward(
            _token_major(q),
            _token_major(k),
            _token_major(v),
            cu_seqlens,
            cu_seqlens,
            max_seqlen,
            max_seqlen,
            0.0,
            self.scale_for(q.shape[-1]),
            causal=self.causal,
            **self._window(),
            softcap=0.0,
            alibi_slopes=None,
            return_softmax=False,
            block_table=None,  # 2.6.0 has no default for it; leftpad_k, seqused_k, zero_tensors keep theirs
        )
        out, lse, rng_state = self._forward_outputs(res)
        return out.unflatten(0, (b, seq)).transpose(1, 2), lse, (rng_state,)

    def backward_varlen(
        self,
        dout: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        lse: Tensor,
        aux: KernelAux,
        cu_seqlens: Tensor,
        max_seqlen: int,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """One ``_flash_attn_varlen_backward`` call: ``forward_varlen``'s lse and aux handed back."""
        (rng_state,) = aux
        b, _, seq, _ = q.shape
        qt, kt, vt, ot, dt = (_token_major(t) for t in (q, k, v, out, dout))
        dq, dk, dv = torch.empty_like(qt), torch.empty_like(kt), torch.empty_like(vt)
        # fills dq, dk, dv in place (dk, dv keep the hkv heads: flash-attn sums the GQA groups)
        self._fa._flash_attn_varlen_backward(
            dt,
            qt,
            kt,
            vt,
            ot,
            lse,
            dq,
            dk,
            dv,
            cu_seqlens,
            cu_seqlens,
            max_seqlen,
            max_seqlen,
            0.0,
            self.scale_for(q.shape[-1]),
            self.causal,
            **self._window(),
            softcap=0.0,
            alibi_slopes=None,
            deterministic=False,
            rng_state=rng_state,
        )
        return tuple(g.unflatten(0, (b, seq)).transpose(1, 2) for g in (dq, dk, dv))


KERNELS: dict[str, type[AttentionKernel]] = {k.name: k for k in (TorchSDPAKernel, MathKernel, FlashAttnKernel)}


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
            "scale: use an AttentionKernel ('sdpa', 'math', 'flash_attn')"
        )
    scaled = copy.copy(kernel)
    scaled.softmax_scale = float(scale)
    return scaled


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
    from .windows import windowed  # windows imports this module

    return windowed(kernel, window)
