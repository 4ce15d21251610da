"""flash-attn 3 (Hopper, ``flash_attn_interface`` built from flash-attention's hopper/) as a kernel (``FA3Kernel``).

FA3 takes a value head dim of its own (multi-head latent attention: DeepSeek's q/k 192, v 128), so latent
attention runs it natively, unpadded, unlike flash-attn 2 (``FlashAttnKernel`` pads v to q/k's head dim).
"""

from __future__ import annotations

import inspect
from types import ModuleType

import torch
from torch import Tensor

from .contract import KernelAux
from .flash import FlashWindowKernel, cuda_module_available

#: the parameters of hopper/flash_attn_interface.py's ``_flash_attn_forward`` / ``_flash_attn_backward`` as
#: flash-attention v2.8.0-v2.8.3 ship them (FA3 "3.0.0b1"), which this adapter passes, all by name.  The
#: package's version string does not tell the interfaces apart (v2.7.x's hopper/ is also "3.0.0b1" and has
#: no ``qv``/``attention_chunk`` but ``sink_token_length``; later ones take ``window_size_left``/``_right``
#: and ``out_``), so the adapter compares the signature itself and refuses any other.
FA3_FORWARD_PARAMETERS = (
    "q", "k", "v", "k_new", "v_new", "qv", "out", "cu_seqlens_q", "cu_seqlens_k", "cu_seqlens_k_new",
    "seqused_q", "seqused_k", "max_seqlen_q", "max_seqlen_k", "page_table", "kv_batch_idx", "leftpad_k",
    "rotary_cos", "rotary_sin", "seqlens_rotary", "q_descale", "k_descale", "v_descale", "softmax_scale",
    "causal", "window_size", "attention_chunk", "softcap", "rotary_interleaved", "scheduler_metadata",
    "num_splits", "pack_gqa", "sm_margin",
)  # fmt: skip
FA3_BACKWARD_PARAMETERS = (
    "dout", "q", "k", "v", "out", "softmax_lse", "cu_seqlens_q", "cu_seqlens_k", "sequed_q", "sequed_k",
    "max_seqlen_q", "max_seqlen_k", "dq", "dk", "dv", "softmax_scale", "causal", "window_size", "softcap",
    "deterministic", "sm_margin",
)  # fmt: skip
#: the release whose hopper/ interface has those parameters (docs/gpu.md says how to build it)
FA3_RELEASE = "flash-attention v2.8.0-v2.8.3 hopper/ (flash_attn_3 3.0.0b1)"

# the forward's optional inputs a dense, unpaged, unrotated, unquantized call leaves out (FlashAttnFunc's Nones)
_FORWARD_NONE = (
    "k_new", "v_new", "qv", "out", "cu_seqlens_q", "cu_seqlens_k", "cu_seqlens_k_new", "seqused_q", "seqused_k",
    "max_seqlen_q", "max_seqlen_k", "page_table", "kv_batch_idx", "leftpad_k", "rotary_cos", "rotary_sin",
    "seqlens_rotary", "q_descale", "k_descale", "v_descale", "scheduler_metadata", "pack_gqa",
)  # fmt: skip
_BACKWARD_NONE = ("cu_seqlens_q", "cu_seqlens_k", "sequed_q", "sequed_k", "max_seqlen_q", "max_seqlen_k")


def fa3_available() -> bool:
    """FA3 needs CUDA and its ``flash_attn_interface`` module."""
    return cuda_module_available("flash_attn_interface")


def _check_signature(module: ModuleType, name: str, expected: tuple[str, ...]) -> None:
    # by the name asked for: later builds wrap these functions in torch.library custom ops (no __name__)
    found = tuple(inspect.signature(getattr(module, name)).parameters)
    if found != expected:
        missing, extra = sorted(set(expected) - set(found)), sorted(set(found) - set(expected))
        differ = f"missing {missing}, unexpected {extra}" if missing or extra else "the same names in another order"
        raise ValueError(
            f"kernel 'fa3' calls flash_attn_interface.{name} with the parameters of {FA3_RELEASE}; "
            f"this build's differ ({differ}): build FA3 from flash-attention v2.8.3's hopper/ or use kernel "
            "'flash_attn' or 'sdpa'"
        )


def _load_fa3() -> ModuleType:
    """FA3's interface module, refused unless CUDA and the v2.8.x signatures are present."""
    if not fa3_available():
        raise ValueError(
            "kernel 'fa3' needs a CUDA device and flash-attn 3 (the flash_attn_interface module built from "
            "flash-attention's hopper/, docs/gpu.md); use kernel 'flash_attn' or 'sdpa' instead"
        )
    import flash_attn_interface

    _check_signature(flash_attn_interface, "_flash_attn_forward", FA3_FORWARD_PARAMETERS)
    _check_signature(flash_attn_interface, "_flash_attn_backward", FA3_BACKWARD_PARAMETERS)
    return flash_attn_interface


def fa3_head_dims_refusal(head_dim: int, value_head_dim: int) -> str | None:
    """Why FA3's forward and backward (hopper/flash_api.cpp mha_fwd, mha_bwd, 16-bit inputs) refuse q/k head dim
    ``head_dim`` with value head dim ``value_head_dim``, or None when they run it."""
    d, dv = head_dim, value_head_dim
    if d % 8 or dv % 8:
        return "head dims must be multiples of 8"
    if max(d, dv) > 256:  # mha_fwd: head_size <= 256; mha_bwd: max(head_size, head_size_v) <= 256
        return "head dims must be at most 256"
    # mha_fwd's rule for a value head dim of its own (Hopper only), within mha_bwd's 256
    if d != dv and not (128 < d <= 192 and 96 < dv <= 128) and not d <= 64:
        return "a value head dim of its own needs q/k in (128, 192] and v in (96, 128], or q/k <= 64"
    return None


class FA3Kernel(FlashWindowKernel):
    """flash-attn 3 (``flash_attn_interface._flash_attn_forward`` / ``_flash_attn_backward``, flash-attention
    v2.8.x's hopper/) on CUDA, fp16/bf16, native GQA, head dims multiples of 8 up to 256, and a value head dim
    of its own (``fa3_head_dims_refusal``; FA3 allows that on Hopper only) passed as it is: no padding.

    FA3 works on [b, S, h, d] and reads its inputs through their strides (only the last dim must be contiguous),
    so the adapter hands it transposed views of the kernel layout, no copies.  Its forward returns out and the lse
    ([b, h, S] float32, which its backward reads by raw pointer) and no RNG state (no dropout): aux is empty.
    ``DocumentKernel`` runs it once per document (FA3's varlen functions are not adapted)."""

    name = "fa3"

    def __init__(self, causal: bool = True, softmax_scale: float | None = None, window: int | None = None) -> None:
        super().__init__(causal, softmax_scale, window)
        self._fa = _load_fa3()

    @staticmethod
    def _check_inputs(q: Tensor, v: Tensor) -> None:
        # FA3's forward also takes float8_e4m3fn, its backward does not
        if q.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"kernel 'fa3' runs float16 or bfloat16, got {q.dtype}; use kernel 'sdpa'")
        refusal = fa3_head_dims_refusal(q.shape[-1], v.shape[-1])
        if refusal is not None:
            raise ValueError(
                f"kernel 'fa3' cannot run q/k head dim {q.shape[-1]} with value head dim {v.shape[-1]}: {refusal} "
                "(flash-attn 3's mha_fwd/mha_bwd); use kernel 'flash_attn' (pads the value) or 'sdpa'"
            )

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, KernelAux]:
        self._check_inputs(q, v)
        qb, kb, vb = (t.transpose(1, 2) for t in (q, k, v))
        out, lse, *_ = self._fa._flash_attn_forward(
            q=qb,
            k=kb,
            v=vb,
            **dict.fromkeys(_FORWARD_NONE),
            softmax_scale=self.scale_for(q.shape[-1]),
            causal=self.causal,
            window_size=self.window_size(),
            attention_chunk=0,
            softcap=0.0,
            rotary_interleaved=True,
            num_splits=1,
            sm_margin=0,
        )
        return out.transpose(1, 2), lse, ()

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, aux: KernelAux
    ) -> tuple[Tensor, Tensor, Tensor]:
        qb, kb, vb, ob, db = (t.transpose(1, 2) for t in (q, k, v, out, dout))
        dq, dk, dv = torch.empty_like(qb), torch.empty_like(kb), torch.empty_like(vb)
        # fills dq, dk, dv in place (dk, dv keep the hkv heads, dv v's own head dim: FA3 sums the GQA groups)
        self._fa._flash_attn_backward(
            dout=db,
            q=qb,
            k=kb,
            v=vb,
            out=ob,
            softmax_lse=lse,
            **dict.fromkeys(_BACKWARD_NONE),
            dq=dq,
            dk=dk,
            dv=dv,
            softmax_scale=self.scale_for(q.shape[-1]),
            causal=self.causal,
            window_size=self.window_size(),
            softcap=0.0,
            deterministic=False,
            sm_margin=0,
        )
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
