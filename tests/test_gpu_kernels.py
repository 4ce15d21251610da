"""CUDA kernel paths (torch flash SDPA in bf16, flash-attn) against the float64 math reference.

Skipped on machines without CUDA (CI is CPU-only); run on a GPU machine with `pytest tests/test_gpu_kernels.py`."""

import pytest
import torch

from ds_upipe.kernels import FlashAttnKernel, MathKernel, TorchSDPAKernel, flash_attn_available

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _check(kernel, dtype, tol):
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 8, 256, 64, device="cuda", generator=gen, dtype=dtype)
    k, v = (torch.randn(2, 2, 256, 64, device="cuda", generator=gen, dtype=dtype) for _ in range(2))
    dout = torch.randn_like(q)
    ref = MathKernel(causal=True)
    out_ref, lse_ref = ref.forward(q.double(), k.double(), v.double())
    grads_ref = ref.backward(dout.double(), q.double(), k.double(), v.double(), out_ref, lse_ref)
    out, lse = kernel.forward(q, k, v)
    grads = kernel.backward(dout, q, k, v, out, lse)
    for got, want in zip((out, *grads), (out_ref, *grads_ref)):
        assert ((got.double() - want).abs().max() / want.abs().max()).item() < tol


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_torch_sdpa_cuda(dtype):
    _check(TorchSDPAKernel(causal=True), dtype, 2e-2)


@cuda
@pytest.mark.skipif(not flash_attn_available(), reason="flash-attn not installed")
def test_flash_attn():
    _check(FlashAttnKernel(causal=True), torch.bfloat16, 2e-2)


def test_flash_attn_refused_without_cuda_or_package():
    if flash_attn_available():
        pytest.skip("flash-attn is available here")
    with pytest.raises(ValueError, match="kernel 'flash_attn' needs a CUDA device and the flash-attn package"):
        FlashAttnKernel()
