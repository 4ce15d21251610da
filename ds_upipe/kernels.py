"""Local attention kernels with an explicit (out, lse) contract.

UPipe's backward replays each stage from saved, sequence-sharded inputs.  A kernel that returns the
log-sum-exp (lse) in forward and takes it in backward lets that replay skip the attention recompute.
Every kernel here works on the kernel layout [b, h, S, d]; key/value may have fewer heads than query
(GQA: query head i uses KV head i // (hq // hkv)).

A kernel instance is also a plain callable with DeepSpeed ``DistributedAttention``'s local-attention
contract (``kernel(q, k, v)`` with [b, S, h, d] tensors, autograd through torch), so the same kernel
can serve DeepSpeed's baseline and UPipe in a side-by-side comparison.
"""

from __future__ import annotations

import abc
import math

import torch
from torch import Tensor


def _expand_kv(kv: Tensor, num_q_heads: int) -> Tensor:
    """Stride-0 GQA broadcast of [b, hkv, S, d] to [b, hq, S, d] (no copy)."""
    b, hkv, seq, d = kv.shape
    group = num_q_heads // hkv
    return kv[:, :, None].expand(b, hkv, group, seq, d).reshape(b, num_q_heads, seq, d) if group > 1 else kv


def _reduce_kv_grad(grad: Tensor, num_kv_heads: int) -> Tensor:
    """Sum the gradient of an expanded KV back to its [b, hkv, S, d] heads."""
    b, hq, seq, d = grad.shape
    if hq == num_kv_heads:
        return grad
    return grad.view(b, num_kv_heads, hq // num_kv_heads, seq, d).sum(dim=2)


class AttentionKernel(abc.ABC):
    """``forward(q, k, v) -> (out, lse)``; ``backward(dout, q, k, v, out, lse) -> (dq, dk, dv)``."""

    #: name used in configs and error messages
    name: str = ""

    def __init__(self, causal: bool = True, softmax_scale: float | None = None) -> None:
        self.causal = causal
        self.softmax_scale = softmax_scale

    def scale_for(self, head_dim: int) -> float:
        return self.softmax_scale if self.softmax_scale is not None else 1.0 / math.sqrt(head_dim)

    @abc.abstractmethod
    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]: ...

    @abc.abstractmethod
    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]: ...

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, *args, **kwargs) -> Tensor:
        """DistributedAttention's local-attention contract: [b, S, h, d] in and out, autograd by torch."""
        qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
        out = torch.nn.functional.scaled_dot_product_attention(
            qh,
            _expand_kv(kh, qh.shape[1]),
            _expand_kv(vh, qh.shape[1]),
            is_causal=self.causal,
            scale=self.scale_for(q.shape[-1]),
        )
        return out.transpose(1, 2).contiguous()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(causal={self.causal}, softmax_scale={self.softmax_scale})"


class TorchSDPAKernel(AttentionKernel):
    """torch's flash attention with an explicit lse (CPU: any float dtype; CUDA: fp16/bf16).

    Uses the aten ops behind ``scaled_dot_product_attention`` directly because the public function
    does not return the lse, which is what lets backward skip the recompute.  On CUDA in float32
    (no flash kernel) it falls back to the math reference in the input dtype."""

    name = "sdpa"

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        scale = self.scale_for(q.shape[-1])
        if q.device.type == "cpu":
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, self.causal, scale=scale)
        if q.dtype in (torch.float16, torch.bfloat16):
            k, v = _expand_kv(k, q.shape[1]), _expand_kv(v, q.shape[1])
            out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(
                q, k, v, 0.0, self.causal, False, scale=scale
            )
            return out, lse
        return MathKernel(self.causal, self.softmax_scale, compute_dtype=q.dtype).forward(q, k, v)

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        scale = self.scale_for(q.shape[-1])
        hkv = k.shape[1]
        if q.device.type == "cpu":
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                dout, q, k, v, out, lse, 0.0, self.causal, scale=scale
            )
            return dq, _reduce_kv_grad(dk, hkv), _reduce_kv_grad(dv, hkv)
        if q.dtype in (torch.float16, torch.bfloat16):
            ke, ve = _expand_kv(k, q.shape[1]), _expand_kv(v, q.shape[1])
            seq = q.shape[2]
            zero = torch.zeros((), dtype=torch.int64, device=q.device)
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
                dout, q, ke, ve, out, lse, zero, zero, seq, seq, 0.0, self.causal, zero, zero, scale=scale
            )
            return dq, _reduce_kv_grad(dk, hkv), _reduce_kv_grad(dv, hkv)
        return MathKernel(self.causal, self.softmax_scale, compute_dtype=q.dtype).backward(dout, q, k, v, out, lse)


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

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        ct = self.compute_dtype
        qc, kc, vc = q.to(ct), _expand_kv(k, q.shape[1]).to(ct), _expand_kv(v, q.shape[1]).to(ct)
        probs, lse = self._probabilities(qc, kc, None)
        return torch.matmul(probs, vc).to(q.dtype), lse

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor
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


def flash_attn_available() -> bool:
    """flash-attn needs CUDA and the package; on CPU machines this is False and its tests skip."""
    if not torch.cuda.is_available():
        return False
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


class FlashAttnKernel(AttentionKernel):
    """flash-attn 2 (``flash_attn.flash_attn_interface``) on CUDA, fp16/bf16, native GQA.

    flash-attn works on [b, S, h, d]; this adapter transposes to and from the kernel layout."""

    name = "flash_attn"

    def __init__(self, causal: bool = True, softmax_scale: float | None = None) -> None:
        if not flash_attn_available():
            raise ValueError(
                "kernel 'flash_attn' needs a CUDA device and the flash-attn package "
                "(pip install 'ds-upipe[flash]'); use kernel 'sdpa' instead"
            )
        super().__init__(causal, softmax_scale)
        from flash_attn import flash_attn_interface

        self._fa = flash_attn_interface

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        qb, kb, vb = (t.transpose(1, 2).contiguous() for t in (q, k, v))
        res = self._fa._flash_attn_forward(
            qb,
            kb,
            vb,
            0.0,
            self.scale_for(q.shape[-1]),
            causal=self.causal,
            window_size_left=-1,
            window_size_right=-1,
            softcap=0.0,
            alibi_slopes=None,
            return_softmax=False,
        )
        out, lse = res[0], res[1]
        return out.transpose(1, 2), lse

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        qb, kb, vb, ob, db = (t.transpose(1, 2).contiguous() for t in (q, k, v, out, dout))
        dq, dk, dv = torch.empty_like(qb), torch.empty_like(kb), torch.empty_like(vb)
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
            -1,
            -1,
            0.0,
            None,
            False,
        )
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


KERNELS: dict[str, type[AttentionKernel]] = {k.name: k for k in (TorchSDPAKernel, MathKernel, FlashAttnKernel)}


def make_kernel(name: str, causal: bool = True, softmax_scale: float | None = None) -> AttentionKernel:
    """Build a kernel by config name ('sdpa', 'math', 'flash_attn')."""
    if name not in KERNELS:
        raise ValueError(f"unknown attention kernel {name!r}; choose one of {sorted(KERNELS)}")
    return KERNELS[name](causal=causal, softmax_scale=softmax_scale)
