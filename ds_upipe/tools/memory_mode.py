"""A memory mode for measuring one rank's step at lengths whose attention is too much compute for a check.

At a million tokens per rank one Llama3-8B layer's attention is ~10^17 FLOP (a stage's S x S over the whole
sequence), minutes of GPU time a layer; everything else in the layer (projections, exchanges, norms, the MLP) is
~10^15 FLOP.  ``FlashMemoryStandIn`` is torch's CUDA flash attention (``TorchSDPAKernel``'s path for bf16/fp16,
head_dim a multiple of 8 up to 256) as memory only: its forward returns uninitialized tensors of exactly the
outputs the real op returns (out, lse, and the RNG state / unused tensors handed to the backward as ``aux``), its
backward dq, dk, dv and, for the length of the op, the workspace flash-attn 2's ``mha_bwd`` allocates
(``fake_run.kernel_workspace_bytes("fa2")``, the planner's own term).  The shapes, strides and dtypes come from
torch's meta functions of the same aten ops (``aten._scaled_dot_product_flash_attention`` and its backward: the
outputs torch declares for the CUDA kernels; out token-major, as ``mha_fwd`` allocates it), so the pipeline
saves, exchanges and frees what it would around the real kernel; ``torch.cuda.max_memory_allocated`` /
``max_memory_reserved`` of the step are real for everything else.  The values are garbage: a memory measurement
only.  tests/test_kernel_contracts.py pins the outputs against what the CUDA op gives ``TorchSDPAKernel`` (that
module's CPU implementation of it) and the real CPU flash op's, and the workspace against the planner's.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils._python_dispatch import _disable_current_modes

from ..integration.fake_run import kernel_workspace_bytes
from ..kernels import TorchSDPAKernel
from ..kernels.contract import KernelAux
from ..kernels.torch_sdpa import FLASH_HEAD_DIM_MULTIPLE, FLASH_MAX_HEAD_DIM

aten = torch.ops.aten


def _meta(t: Tensor) -> Tensor:
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


def _like(meta: Tensor | None, device: torch.device) -> Tensor | None:
    """An uninitialized tensor of ``meta``'s shape, strides and dtype on ``device``."""
    if meta is None:
        return None
    return torch.empty_strided(meta.shape, meta.stride(), dtype=meta.dtype, device=device)


class FlashMemoryStandIn(TorchSDPAKernel):
    """torch's CUDA flash attention as memory (module docstring): no compute, the real op's allocations."""

    name = "sdpa-memory"

    @staticmethod
    def check_inputs(q: Tensor, v: Tensor) -> None:
        d = q.shape[-1]
        if q.dtype not in (torch.float16, torch.bfloat16) or d % FLASH_HEAD_DIM_MULTIPLE or d > FLASH_MAX_HEAD_DIM:
            raise ValueError(
                f"the flash memory stand-in stands in for torch's CUDA flash op: fp16/bf16, head_dim a multiple of "
                f"{FLASH_HEAD_DIM_MULTIPLE} up to {FLASH_MAX_HEAD_DIM}; got {q.dtype}, head_dim {d}"
            )
        if v.shape[-1] != d:
            raise ValueError(f"the flash memory stand-in takes one head dim; got q {d}, v {v.shape[-1]}")

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, KernelAux]:
        self.check_inputs(q, v)
        scale = self.scale_for(q.shape[-1])
        with _disable_current_modes():  # bookkeeping on meta tensors: outside a memory tracker's view
            out, lse, cum_q, cum_k, _, _, rng_state, unused, _ = aten._scaled_dot_product_flash_attention(
                _meta(q), _meta(k), _meta(v), 0.0, self.causal, False, scale=scale
            )
        aux = (cum_q, cum_k, _like(rng_state, q.device), _like(unused, q.device))
        # mha_fwd allocates out as [b, S, h, d] and the op hands it back transposed (token-major; the meta function
        # declares the shape and dtype, not this layout): later copies of it are then the real op's
        token_major = _like(out.transpose(1, 2).contiguous(), q.device).transpose(1, 2)
        return token_major, _like(lse, q.device), aux

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, aux: KernelAux
    ) -> tuple[Tensor, Tensor, Tensor]:
        self.check_inputs(q, v)
        cum_q, cum_k, rng_state, unused = aux
        scale = self.scale_for(q.shape[-1])
        with _disable_current_modes():
            metas = [_meta(t) for t in (dout, q, k, v, out, lse, rng_state, unused)]
            dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
                *metas[:6], cum_q, cum_k, q.shape[2], k.shape[2], 0.0, self.causal, *metas[6:], scale=scale
            )
        grads = tuple(_like(g, q.device) for g in (dq, dk, dv))
        # the kernel's own buffers, alive while the op runs (dq accumulator; under GQA dk/dv of the query heads)
        workspace = torch.empty(
            kernel_workspace_bytes("fa2", q.shape, k.shape, q.element_size()), dtype=torch.uint8, device=q.device
        )
        del workspace
        return grads


def use_memory_stand_in(module: torch.nn.Module) -> FlashMemoryStandIn:
    """Make the UPipe attention in ``module`` (a model patched by ``hf_patches.apply_upipe``, or one of its decoder
    layers: they share the model's runtime) run ``FlashMemoryStandIn``; returns it."""
    state = next((m._upipe_state for m in module.modules() if getattr(m, "_upipe_state", None) is not None), None)
    if state is None:
        raise ValueError(f"{type(module).__name__} holds no attention patched by hf_patches.apply_upipe")
    kernel = state.kernel
    stand_in = FlashMemoryStandIn(causal=kernel.causal, softmax_scale=kernel.softmax_scale)
    state.kernel = stand_in
    return stand_in
