"""torch's SDPA ops as kernels: one small forward/backward pair per aten backend (``TorchSDPAKernel``),
and the float64 math reference (``MathKernel``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from .contract import AttentionKernel, KernelAux, _expand_kv, _reduce_kv_grad, common_head_dim, pad_head_dim

aten = torch.ops.aten

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


def _padded(path: SDPAPath, multiple: int = FLASH_HEAD_DIM_MULTIPLE) -> SDPAPath:
    """``path`` on q, k and v zero-padded to one head dim, a multiple of ``multiple``, as
    ``F.scaled_dot_product_attention`` pads for the flash op (attention.cpp, ``pad_last_dim<8>``) and as
    latent attention's value (v_head_dim < qk_head_dim) is padded for the flash ops, which take one head
    dim (``common_head_dim``): the caller's scale is of the true head_dim, zero columns change neither the
    scores nor the lse, out and the gradients are sliced back."""

    def forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor, KernelAux]:
        dim = common_head_dim(q, v, multiple)
        out, lse, aux = path.forward(*(pad_head_dim(t, dim) for t in (q, k, v)), causal, scale)
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
        dim = common_head_dim(q, v, multiple)
        padded = (pad_head_dim(t, dim) for t in (dout, q, k, v, out))
        grads = path.backward(*padded, lse, aux, causal, scale)
        return tuple(g[..., : t.shape[-1]] for g, t in zip(grads, (q, k, v)))

    return SDPAPath(f"{path.name}_padded", forward, backward, path.quadratic_memory, path.lse_block)


CPU_FLASH = SDPAPath("cpu_flash", _cpu_flash_forward, _cpu_flash_backward)
CPU_FLASH_PADDED = _padded(CPU_FLASH, multiple=1)
CUDA_FLASH = SDPAPath("cuda_flash", _cuda_flash_forward, _cuda_flash_backward)
CUDA_FLASH_PADDED = _padded(CUDA_FLASH)
CUDA_EFFICIENT = SDPAPath("cuda_efficient", _cuda_efficient_forward, _cuda_efficient_backward, lse_block=32)
CUDA_EFFICIENT_PADDED = _padded(CUDA_EFFICIENT)
MATH = SDPAPath("math", _math_forward, _math_backward, quadratic_memory=True)


def sdpa_path(
    device_type: str, dtype: torch.dtype, head_dim: int | None = None, value_head_dim: int | None = None
) -> SDPAPath:
    """The aten backend ``TorchSDPAKernel`` runs for tensors of this device type, dtype and head_dim
    (None: any the flash op takes) and value head dim (None: head_dim).

    The flash ops take q, k and v of one head dim: a value head dim of its own (latent attention) runs
    them on the padded path (``_padded``), CPU included.  CUDA fp16/bf16: the flash op, on head_dim padded
    to a multiple of 8 when it is not one (the op raises "head_size must be a multiple of 8, this is
    ensured by padding"); above 256, which flash has no kernel for, the memory-efficient op (padded the
    same way, for its aligned kernels)."""
    equal = value_head_dim is None or value_head_dim == head_dim
    if device_type == "cpu":
        return CPU_FLASH if equal else CPU_FLASH_PADDED
    if device_type != "cuda":
        raise ValueError(f"kernel 'sdpa' runs on cpu or cuda tensors, got device type {device_type!r}")
    if head_dim is not None and not equal:
        head_dim = max(head_dim, value_head_dim)
    if dtype in (torch.float16, torch.bfloat16):
        if head_dim is None:
            return CUDA_FLASH
        aligned = head_dim % FLASH_HEAD_DIM_MULTIPLE == 0 and equal
        if head_dim + (-head_dim % FLASH_HEAD_DIM_MULTIPLE) <= FLASH_MAX_HEAD_DIM:
            return CUDA_FLASH if aligned else CUDA_FLASH_PADDED
        return CUDA_EFFICIENT if aligned else CUDA_EFFICIENT_PADDED
    if dtype == torch.float32:
        if not equal:
            return CUDA_EFFICIENT_PADDED
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
        path = sdpa_path(q.device.type, q.dtype, q.shape[-1], v.shape[-1])
        return path.forward(q, k, v, self.causal, self.scale_for(q.shape[-1]))

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, aux: KernelAux
    ) -> tuple[Tensor, Tensor, Tensor]:
        path = sdpa_path(q.device.type, q.dtype, q.shape[-1], v.shape[-1])
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


def lse_block(kernel: AttentionKernel, q: Tensor) -> int:
    """Rows the kernel's backward reads its lse padded to: torch's memory-efficient op returns and reads
    it padded to 32 rows; every other kernel 1.  (``sdpa_path`` is looked up at call time, as
    ``TorchSDPAKernel`` does: the CUDA contract tests patch it on this module.)"""
    if not isinstance(kernel, TorchSDPAKernel):
        return 1
    return sdpa_path(q.device.type, q.dtype, q.shape[-1]).lse_block
