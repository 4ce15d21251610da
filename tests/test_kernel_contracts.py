"""Contract tests of the CUDA kernel adapters, on CPU.

No GPU here, so the CUDA aten ops the adapters call get CPU implementations for the length of this
module (``torch.library``): each records the arguments it is handed, checks its inputs as the real
CUDA kernel does, and computes exact attention in float64 from the lse it is given, so a wrong
lse, a folded GQA layout or a dropped gradient shows in the numbers.  The same registered op is then
driven by torch's *own* SDPA autograd formula (``out.backward`` through the aten op), so the tests
compare what the adapters pass to each backward op with what torch itself passes there: the forward's
outputs handed back unchanged (undefined cum_seq, the forward's RNG state, max_q/max_k), dropout 0,
the causal flag and the scale.  A fake ``flash_attn`` package with the exact private signatures of
flash-attn 2.6.3, 2.7.4.post1 and 2.8.3 (and, for the varlen functions ``DocumentKernel`` calls
around ``FlashAttnKernel``, of every release whose varlen signature differs: 2.6.0, 2.6.1, 2.7.0)
does the same for ``FlashAttnKernel``, computing varlen attention per document in float64.
"""

from __future__ import annotations

import inspect
import math
import re
import sys
import types

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ds_upipe import kernel_choice
from ds_upipe.kernels import FA3Kernel, FlashAttnKernel, MathKernel, TorchSDPAKernel, sdpa_path, torch_sdpa
from ds_upipe.pipeline import PipelineContext, PlanIndices, UPipeAttentionFunction
from ds_upipe.schedule import build_plan

aten = torch.ops.aten
SCALE = 0.3


# -- CPU stand-ins for the CUDA ops ----------------------------------------------------------------


class Recorder:
    """Every call of a registered op: (op name, args, kwargs, result)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple, dict, object]] = []

    def of(self, name: str) -> list[tuple[tuple, dict, object]]:
        return [(a, kw, r) for n, a, kw, r in self.calls if n == name]

    def clear(self) -> None:
        self.calls.clear()


def _reference(causal: bool, scale: float | None) -> MathKernel:
    return MathKernel(causal=causal, softmax_scale=scale, compute_dtype=torch.float64)


def _assert_matches_reference(
    inputs: tuple[torch.Tensor, ...], got: tuple[torch.Tensor, ...], scale: float | None, tol: float
) -> None:
    """(out, dq, dk, dv) of a causal kernel on (q, k, v, dout), [b, h, S, d], against the float64 reference."""
    q, k, v, dout = (t.double() for t in inputs)
    ref = _reference(True, scale)
    out_ref, lse_ref, _ = ref.forward(q, k, v)
    for g, want in zip(got, (out_ref, *ref.backward(dout, q, k, v, out_ref, lse_ref, ()))):
        assert g.shape == want.shape
        torch.testing.assert_close(g.double(), want, rtol=tol, atol=tol)


def _check_last_dim_contiguous(*tensors: torch.Tensor) -> None:
    for t in tensors:
        assert t.stride(-1) == 1, "CUDA attention kernels need a contiguous last dimension"


def _check_one_head_dim(*tensors: torch.Tensor) -> None:
    """flash-attn 2's mha_fwd / mha_bwd (and varlen) check v, out, dout and the gradients against q's head size
    (CHECK_SHAPE(v, ..., head_size)): one head dim for all; latent attention's narrower value must come padded."""
    dims = {t.shape[-1] for t in tensors}
    assert len(dims) == 1, f"flash-attn 2 takes one head size for q, k, v, out, dout, dq, dk, dv; got {dims}"


def _token_major(t: torch.Tensor) -> torch.Tensor:
    """[b, h, S, d] with [b, S, h, d] memory, as torch's CUDA forward ops allocate their output."""
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def _check_flash_inputs(*tensors: torch.Tensor) -> None:
    """What mha_fwd / mha_bwd (aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp) check."""
    dtype, head_dim = tensors[0].dtype, tensors[0].shape[-1]
    assert dtype in (torch.float16, torch.bfloat16), "FlashAttention only supports fp16 and bf16"
    assert all(t.dtype == dtype for t in tensors), "query, key, value (and out, dout) must have the same dtype"
    assert head_dim % 8 == 0, "head_size must be a multiple of 8, this is ensured by padding!"
    assert head_dim <= 256, "FlashAttention forward only supports head dimension at most 256"
    assert all(t.shape[-1] == head_dim for t in tensors), "query, key, value (and out, dout): one head size"
    _check_last_dim_contiguous(*tensors)


def _check_raw_lse(lse: torch.Tensor, shape: tuple[int, ...]) -> None:
    """mha_bwd checks only the lse's device and reads it by raw pointer as (b * h + head) * seqlen: it
    must be float32, of exactly [b, h, S] and contiguous, or heads >= 1 read another head's rows."""
    assert lse.dtype == torch.float32, f"softmax_lse must be float32, got {lse.dtype}"
    assert tuple(lse.shape) == shape, f"softmax_lse must be {shape} (read by raw pointer), got {tuple(lse.shape)}"
    assert lse.is_contiguous(), f"softmax_lse is read by raw pointer: it must be contiguous, got strides {lse.stride()}"


def _flash_forward(rec: Recorder):
    def impl(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
        _check_flash_inputs(query, key, value)
        assert query.shape[1] % key.shape[1] == 0, "key/value heads must divide query heads"
        out, lse, _ = _reference(is_causal, scale).forward(query, key, value)
        out = _token_major(out)  # mha_fwd's out is [b, S, h, d], handed back transposed
        seq_q, seq_k = query.shape[2], key.shape[2]
        rng_state = torch.tensor([1234, 0], dtype=torch.int64)  # distinct tensors, so their identity is traceable
        unused = torch.tensor(0, dtype=torch.int64)
        res = (out, lse.float(), None, None, seq_q, seq_k, rng_state, unused, torch.empty(0, dtype=query.dtype))
        rec.calls.append(("flash", (query, key, value, dropout_p, is_causal, return_debug_mask), {"scale": scale}, res))
        return res

    return impl


def _flash_backward(rec: Recorder):
    def impl(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
             philox_seed, philox_offset, *, scale=None):  # fmt: skip
        args = (grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                is_causal, philox_seed, philox_offset)  # fmt: skip
        rec.calls.append(("flash_backward", args, {"scale": scale}, None))
        if cum_seq_q is not None:
            raise RuntimeError("a defined cum_seq_q selects flash's varlen backward (mha_varlen_bwd)")
        _check_flash_inputs(query, key, value, out, grad_out)
        _check_raw_lse(logsumexp, tuple(query.shape[:3]))
        return _reference(is_causal, scale).backward(grad_out, query, key, value, out, logsumexp, ())

    return impl


def _padded_lse_len(seq: int) -> int:
    return math.ceil(seq / 32) * 32  # the efficient kernel pads lse to its block size


def _efficient_forward(rec: Recorder):
    def impl(query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, *, scale=None):
        assert query.dtype in (torch.float16, torch.bfloat16, torch.float32)
        assert key.dtype == value.dtype == query.dtype, "query, key and value must have the same dtype"
        assert query.shape[1] == key.shape[1] == value.shape[1], "efficient attention needs equal head counts"
        _check_last_dim_contiguous(query, key, value)
        out, lse, _ = _reference(is_causal, scale).forward(query, key, value)
        out = _token_major(out)  # allocated [B, M, num_heads, K] and handed back transposed
        b, h, seq = lse.shape
        lse_padded = torch.full((b, h, _padded_lse_len(seq) if compute_log_sumexp else 0), float("nan"))
        lse_padded[..., :seq] = lse
        res = (out, lse_padded, torch.tensor(99, dtype=torch.int64), torch.tensor(7, dtype=torch.int64))
        args = (query, key, value, attn_bias, compute_log_sumexp, dropout_p, is_causal)
        rec.calls.append(("efficient", args, {"scale": scale}, res))
        return res

    return impl


def _efficient_backward(rec: Recorder):
    def impl(grad_out_, query, key, value, attn_bias, out, logsumexp, philox_seed, philox_offset, dropout_p,
             grad_input_mask, is_causal=False, *, scale=None):  # fmt: skip
        args = (grad_out_, query, key, value, attn_bias, out, logsumexp, philox_seed, philox_offset, dropout_p,
                list(grad_input_mask), is_causal)  # fmt: skip
        rec.calls.append(("efficient_backward", args, {"scale": scale}, None))
        assert query.shape[1] == key.shape[1] == value.shape[1], "efficient attention needs equal head counts"
        assert all(t.dtype == query.dtype for t in (key, value, out, grad_out_)), "one dtype for all inputs"
        _check_last_dim_contiguous(query, key, value, out, grad_out_, logsumexp)
        # kernel_backward.h reads out through its head stride but takes its token stride to be
        # num_heads * head_dim (o_strideM): only token-major out, as the forward returns it, is read right
        b, h, seq, d = out.shape
        # one head: its stride is moot; one token (a 2-token image span's piece): the token stride is moot
        token_major = (seq == 1 or out.stride(2) == h * d) and (h == 1 or out.stride(1) == d)
        assert token_major and out.stride(3) == 1, f"out must be token-major [b, S, h, d] memory, got {out.stride()}"
        want = (b, h, _padded_lse_len(seq))
        assert tuple(logsumexp.shape) == want, f"logsumexp must be {want} (padded to 32), got {tuple(logsumexp.shape)}"
        lse = logsumexp[..., : query.shape[2]]
        dq, dk, dv = _reference(is_causal, scale).backward(grad_out_, query, key, value, out, lse, ())
        # dense gradients of the inputs' shapes, as at::empty(key.sizes()) allocates them
        return dq.contiguous(), dk.contiguous(), dv.contiguous(), None

    return impl


@pytest.fixture(scope="module")
def cuda_ops() -> Recorder:
    """CPU implementations of torch's CUDA flash and memory-efficient attention ops, for this module."""
    rec = Recorder()
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("_scaled_dot_product_flash_attention", _flash_forward(rec), "CPU")
    lib.impl("_scaled_dot_product_flash_attention_backward", _flash_backward(rec), "CPU")
    lib.impl("_scaled_dot_product_efficient_attention", _efficient_forward(rec), "CPU")
    lib.impl("_scaled_dot_product_efficient_attention_backward", _efficient_backward(rec), "CPU")
    yield rec
    lib._destroy()


@pytest.fixture
def as_cuda(cuda_ops: Recorder, monkeypatch) -> Recorder:
    """TorchSDPAKernel takes its CUDA decisions for these CPU tensors."""
    monkeypatch.setattr(
        torch_sdpa,
        "sdpa_path",
        lambda device_type, dtype, head_dim=None, value_head_dim=None: sdpa_path(
            "cuda", dtype, head_dim, value_head_dim
        ),
    )
    cuda_ops.clear()
    return cuda_ops


def _inputs(hq: int, hkv: int, dtype: torch.dtype, seq: int = 40, d: int = 8, b: int = 2, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, seq, d, generator=gen, dtype=torch.float64).to(dtype)
    k, v = (torch.randn(b, hkv, seq, d, generator=gen, dtype=torch.float64).to(dtype) for _ in range(2))
    dout = torch.randn(b, hq, seq, d, generator=gen, dtype=torch.float64).to(dtype)
    return q, k, v, dout


# -- describing arguments by where they came from ---------------------------------------------------


def _key(t: torch.Tensor) -> tuple:
    return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)


def _describe(value, roles: dict[tuple, str]):
    """A recorded argument as its role: 'q', 'fwd[6]' (the forward op's 7th output), or a plain value."""
    if isinstance(value, torch.Tensor):
        return roles.get(_key(value), f"<other tensor {tuple(value.shape)}>")
    if isinstance(value, (list, tuple)):
        return type(value)(_describe(x, roles) for x in value)
    return value


def _roles(inputs: dict[str, torch.Tensor], fwd_result: tuple) -> dict[tuple, str]:
    roles = {_key(t): name for name, t in inputs.items()}
    roles.update({_key(t): f"fwd[{i}]" for i, t in enumerate(fwd_result) if isinstance(t, torch.Tensor)})
    return roles


def _torch_autograd_backward_call(rec: Recorder, fwd_name: str, call, hq: int, hkv: int, dtype, causal: bool):
    """Run the aten op under torch's own autograd and describe what its derivative passes to the backward op."""
    q, k, v, dout = (t.requires_grad_(i < 3) for i, t in enumerate(_inputs(hq, hkv, dtype)))
    rec.clear()
    res = call(q, k, v, causal)
    res[0].backward(dout)
    (_, _, fwd_res), (bwd_args, bwd_kwargs, _) = rec.of(fwd_name)[0], rec.of(f"{fwd_name}_backward")[0]
    roles = _roles({"q": q, "k": k, "v": v, "dout": dout}, fwd_res)
    return _describe(bwd_args, roles), bwd_kwargs, (q.grad, k.grad, v.grad)


def _adapter_backward_call(rec: Recorder, fwd_name: str, hq: int, hkv: int, dtype, causal: bool):
    """The same through TorchSDPAKernel's forward and backward."""
    q, k, v, dout = _inputs(hq, hkv, dtype)
    kernel = TorchSDPAKernel(causal=causal, softmax_scale=SCALE)
    rec.clear()
    out, lse, aux = kernel.forward(q, k, v)
    grads = kernel.backward(dout, q, k, v, out, lse, aux)
    (fwd_args, fwd_kwargs, fwd_res), (bwd_args, bwd_kwargs, _) = rec.of(fwd_name)[0], rec.of(f"{fwd_name}_backward")[0]
    roles = _roles({"q": q, "k": k, "v": v, "dout": dout}, fwd_res)
    assert _key(out) == _key(fwd_res[0]) and _key(lse) == _key(fwd_res[1])  # the op's own out and lse
    return _describe(fwd_args, roles), fwd_kwargs, _describe(bwd_args, roles), bwd_kwargs, grads


# -- path selection ----------------------------------------------------------------------------------


def test_sdpa_path_selection():
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        assert sdpa_path("cpu", dtype).name == "cpu_flash"
    assert sdpa_path("cuda", torch.bfloat16).name == sdpa_path("cuda", torch.float16).name == "cuda_flash"
    # float32 on CUDA has no flash kernel: memory-efficient attention, never the S x S math path
    assert sdpa_path("cuda", torch.float32).name == "cuda_efficient"
    assert not sdpa_path("cuda", torch.float32).quadratic_memory
    assert sdpa_path("cuda", torch.float64).quadratic_memory  # the reference: no fused float64 CUDA kernel
    with pytest.raises(ValueError, match="kernel 'sdpa' runs on cpu or cuda tensors, got device type 'xpu'"):
        sdpa_path("xpu", torch.float32)


def test_sdpa_path_by_head_dim():
    """fp16/bf16 on CUDA: the flash op takes head_dim % 8 == 0 up to 256; others are padded to a multiple
    of 8 (as F.scaled_dot_product_attention pads), and above 256 the memory-efficient op runs."""
    for dtype in (torch.float16, torch.bfloat16):
        assert sdpa_path("cuda", dtype, 64).name == sdpa_path("cuda", dtype, 256).name == "cuda_flash"
        assert sdpa_path("cuda", dtype, 12).name == sdpa_path("cuda", dtype, 250).name == "cuda_flash_padded"
        assert sdpa_path("cuda", dtype, 264).name == "cuda_efficient"
        assert sdpa_path("cuda", dtype, 260).name == "cuda_efficient_padded"
    assert sdpa_path("cuda", torch.float32, 12).name == "cuda_efficient"
    assert sdpa_path("cuda", torch.float32, 12).lse_block == 32 and sdpa_path("cuda", torch.bfloat16, 12).lse_block == 1


@pytest.mark.parametrize("dtype, d, op", [(torch.bfloat16, 12, "flash"), (torch.float16, 20, "flash"),
                                          (torch.bfloat16, 260, "efficient")])  # fmt: skip
def test_head_dim_the_flash_op_refuses_is_padded(as_cuda, dtype, d, op):
    """head_dim 12 or 20 reach the flash op padded to 16 / 24 with the scale of the true head_dim (the
    default 1/sqrt(d)), 260 the efficient op padded to 264; out and gradients of the true head_dim
    equal the float64 reference, through a GQA stage with packed documents too."""
    q, k, v, dout = _inputs(4, 2, dtype, d=d)
    kernel = TorchSDPAKernel(causal=True)
    out, lse, aux = kernel.forward(q, k, v)
    grads = kernel.backward(dout, q, k, v, out, lse, aux)
    (fwd_args, fwd_kw, _), (bwd_args, _, _) = as_cuda.of(op)[0], as_cuda.of(f"{op}_backward")[0]
    padded = d + (-d % 8)
    assert fwd_args[0].shape[-1] == padded and bwd_args[1].shape[-1] == padded
    assert fwd_kw["scale"] == 1 / math.sqrt(d)
    tol = 2e-2 if dtype == torch.bfloat16 else 5e-3
    _assert_matches_reference((q, k, v, dout), (out, *grads), None, tol=tol)
    if op == "flash":
        ref_kernel = TorchSDPAKernel(causal=True, softmax_scale=SCALE)
        _check_documents(ref_kernel, q, k, v, dout, tol)
        # the stage loop takes the padded path's sliced (strided) out and gradients as they come
        plan = build_plan(4, 2, 1, 2)
        pctx = PipelineContext(plan=plan, indices=PlanIndices.build(plan, torch.device("cpu")), group=None,
                               attention=TorchSDPAKernel(causal=True))  # fmt: skip
        qs, ks, vs = (t.transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
        UPipeAttentionFunction.apply(qs, ks, vs, pctx).backward(dout.transpose(1, 2))
        got = tuple(
            t.transpose(1, 2) for t in (UPipeAttentionFunction.apply(qs, ks, vs, pctx), qs.grad, ks.grad, vs.grad)
        )
        _assert_matches_reference((q, k, v, dout), got, None, tol=tol)


# -- torch flash (fp16/bf16) ------------------------------------------------------------------------


def _call_flash(q, k, v, causal):
    return aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=SCALE)


@pytest.mark.parametrize("hq, hkv, causal", [(4, 2, True), (4, 4, True), (4, 1, False)])
def test_cuda_flash_passes_what_torch_autograd_passes(as_cuda, hq, hkv, causal):
    want_bwd, want_kw, want_grads = _torch_autograd_backward_call(
        as_cuda, "flash", _call_flash, hq, hkv, torch.bfloat16, causal
    )
    fwd, fwd_kw, got_bwd, got_kw, grads = _adapter_backward_call(as_cuda, "flash", hq, hkv, torch.bfloat16, causal)
    # forward: q, k, v as given (native GQA: k, v keep hkv heads), dropout 0, no debug mask
    assert fwd == ("q", "k", "v", 0.0, causal, False) and fwd_kw == {"scale": SCALE}
    # backward: torch's derivative formula's arguments, the forward's outputs unchanged
    assert got_bwd == want_bwd and got_kw == want_kw
    assert got_bwd == (
        "dout", "q", "k", "v", "fwd[0]", "fwd[1]", None, None, 40, 40, 0.0, causal, "fwd[6]", "fwd[7]",
    )  # fmt: skip
    for got, want in zip(grads, want_grads):
        assert got.shape == want.shape and torch.equal(got, want)


# -- torch memory-efficient attention (fp32) ----------------------------------------------------------


def _call_efficient(q, k, v, causal):
    return aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=SCALE)


@pytest.mark.parametrize("causal", [True, False])
def test_cuda_efficient_passes_what_torch_autograd_passes(as_cuda, causal):
    want_bwd, want_kw, want_grads = _torch_autograd_backward_call(
        as_cuda, "efficient", _call_efficient, 4, 4, torch.float32, causal
    )
    fwd, fwd_kw, got_bwd, got_kw, grads = _adapter_backward_call(as_cuda, "efficient", 4, 4, torch.float32, causal)
    assert fwd == ("q", "k", "v", None, True, 0.0, causal) and fwd_kw == {"scale": SCALE}
    assert got_bwd == want_bwd and got_kw == want_kw
    assert got_bwd == (
        "dout", "q", "k", "v", None, "fwd[0]", "fwd[1]", "fwd[2]", "fwd[3]", 0.0, [True, True, True, False], causal,
    )  # fmt: skip
    for got, want in zip(grads, want_grads):
        assert torch.equal(got, want)


def test_cuda_efficient_gqa_broadcasts_kv_without_copies(as_cuda):
    """Efficient attention needs equal head counts: each KV head is broadcast over its query heads with
    head stride 0 (no copy), the forward's seed/offset and lse reach the backward, dK/dV sum the group."""
    q, k, v, dout = _inputs(8, 2, torch.float32)
    kernel = TorchSDPAKernel(causal=True, softmax_scale=SCALE)
    out, lse, aux = kernel.forward(q, k, v)
    grads = kernel.backward(dout, q, k, v, out, lse, aux)
    (fwd_args, _, fwd_res), (bwd_args, _, _) = as_cuda.of("efficient")[0], as_cuda.of("efficient_backward")[0]
    for kv, folded in zip((k, v), fwd_args[1:3]):
        assert folded.shape == (2 * 2, 4, 40, 8) and folded.stride(1) == 0 and folded.data_ptr() == kv.data_ptr()
    assert bwd_args[7] is fwd_res[2] and bwd_args[8] is fwd_res[3]  # philox seed, offset: the forward's
    assert bwd_args[6].data_ptr() == fwd_res[1].data_ptr()  # the forward's padded lse, per folded head
    _assert_matches_reference((q, k, v, dout), (out, *grads), SCALE, tol=1e-5)


class _LargestOutput(TorchDispatchMode):
    """Records every aten op the adapter issues and the largest tensor any of them returns."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: set[str] = set()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        res = func(*args, **(kwargs or {}))
        self.ops.add(func.__name__)
        for t in res if isinstance(res, (tuple, list)) else (res,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return res


@pytest.mark.parametrize("hkv", [4, 1])
def test_float32_on_cuda_never_materializes_scores(as_cuda, hkv):
    seq = 64
    q, k, v, dout = _inputs(4, hkv, torch.float32, seq=seq, b=1)
    kernel = TorchSDPAKernel(causal=True)
    with _LargestOutput() as mode:
        out, lse, aux = kernel.forward(q, k, v)
        kernel.backward(dout, q, k, v, out, lse, aux)
    assert {"_scaled_dot_product_efficient_attention.default"} <= mode.ops
    assert "_scaled_dot_product_efficient_attention_backward.default" in mode.ops
    # scores of one head alone would be seq * seq = 4096 elements; q is 1 * 4 * 64 * 8 = 2048
    assert mode.largest <= q.numel() < seq * seq, (mode.largest, sorted(mode.ops))


# -- through the pipeline: each stage's aux reaches that stage's backward ------------------------------


@pytest.mark.parametrize(
    "dtype, fwd_name, aux_at", [(torch.bfloat16, "flash", (6, 7)), (torch.float32, "efficient", (2, 3))]
)
def test_pipeline_threads_each_stages_aux(as_cuda, dtype, fwd_name, aux_at):
    plan = build_plan(8, 2, 1, 2)  # one rank, 2 query heads per stage: 4 stages in 2 rounds
    pctx = PipelineContext(plan=plan, indices=PlanIndices.build(plan, torch.device("cpu")), group=None,
                           attention=TorchSDPAKernel(causal=True))  # fmt: skip
    q, k, v, dout = (t.transpose(1, 2).contiguous() for t in _inputs(8, 2, dtype, seq=32))  # [b, s, h, d]
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = UPipeAttentionFunction.apply(q, k, v, pctx)
    out.backward(dout)
    fwd, bwd = as_cuda.of(fwd_name), as_cuda.of(f"{fwd_name}_backward")
    assert len(fwd) == len(bwd) == plan.num_stages == 4
    for (_, _, res), (args, _, _) in zip(fwd, bwd):  # stages run in the same order both ways
        for fwd_i, bwd_i in zip(aux_at, (-2, -1) if fwd_name == "flash" else (7, 8)):
            assert args[bwd_i] is res[fwd_i]
    if fwd_name == "flash":
        assert all(args[6] is None and args[7] is None for args, _, _ in bwd)  # cum_seq: undefined, as returned
    inputs = tuple(t.detach().transpose(1, 2) for t in (q, k, v, dout))
    got = tuple(t.transpose(1, 2) for t in (out, q.grad, k.grad, v.grad))
    _assert_matches_reference(inputs, got, None, tol=2e-2 if dtype == torch.bfloat16 else 1e-5)


# -- flash-attn 2: a fake package with each supported release's exact private signatures ------------


# the parameter lists of flash_attn/flash_attn_interface.py's _flash_attn_forward/_flash_attn_backward,
# copied from the v2.6.3 and v2.7.0 / v2.7.4.post1 / v2.8.3 sources (2.7 and 2.8 agree)
def _fa_forward_26(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, return_softmax): ...
def _fa_backward_26(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, window_size,
                    softcap, alibi_slopes, deterministic, rng_state=None): ...  # fmt: skip
def _fa_forward_27(q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap,
                   alibi_slopes, return_softmax): ...  # fmt: skip
def _fa_backward_27(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, window_size_left,
                    window_size_right, softcap, alibi_slopes, deterministic, rng_state=None): ...  # fmt: skip


# the parameter lists of _flash_attn_varlen_forward/_flash_attn_varlen_backward, copied from the sources:
# v2.6.0 (block_table without a default), v2.6.1 (+ leftpad_k), v2.6.2 = v2.6.3 (+ seqused_k, defaults),
# v2.7.0 = v2.7.2 (window_size_left/right), v2.7.3 = v2.7.4.post1 = v2.8.3 (+ zero_tensors)
def _fa_varlen_forward_260(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                           causal, window_size, softcap, alibi_slopes, return_softmax, block_table): ...  # fmt: skip
def _fa_varlen_forward_261(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                           causal, window_size, softcap, alibi_slopes, return_softmax, block_table=None,
                           leftpad_k=None): ...  # fmt: skip
def _fa_varlen_forward_263(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                           causal, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, return_softmax=False,
                           block_table=None, leftpad_k=None, seqused_k=None): ...  # fmt: skip
def _fa_varlen_backward_26(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                           max_seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, rng_state=None): ...  # fmt: skip
def _fa_varlen_forward_270(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                           causal, window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None,
                           return_softmax=False, block_table=None, leftpad_k=None, seqused_k=None): ...  # fmt: skip
def _fa_varlen_backward_270(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                            max_seqlen_k, dropout_p, softmax_scale, causal, window_size_left, window_size_right,
                            softcap, alibi_slopes, deterministic, rng_state=None): ...  # fmt: skip
def _fa_varlen_forward_273(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                           causal, window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None,
                           return_softmax=False, block_table=None, leftpad_k=None, seqused_k=None,
                           zero_tensors=False): ...  # fmt: skip
def _fa_varlen_backward_273(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                            max_seqlen_k, dropout_p, softmax_scale, causal, window_size_left, window_size_right,
                            softcap, alibi_slopes, deterministic, rng_state=None, zero_tensors=False): ...  # fmt: skip


def _release_tuple(version: str) -> tuple[int, ...]:
    """(major, minor, patch); () for a version string without one (the refused 'unknown')."""
    match = re.match(r"(\d+)\.(\d+)\.(\d+)", version)
    return tuple(int(x) for x in match.groups()) if match else ()


def _varlen_signatures(version: str) -> tuple[inspect.Signature, inspect.Signature]:
    release = _release_tuple(version)
    if release >= (2, 7, 3):
        fwd, bwd = _fa_varlen_forward_273, _fa_varlen_backward_273
    elif release >= (2, 7):
        fwd, bwd = _fa_varlen_forward_270, _fa_varlen_backward_270
    elif release >= (2, 6, 2):
        fwd, bwd = _fa_varlen_forward_263, _fa_varlen_backward_26
    elif release >= (2, 6, 1):
        fwd, bwd = _fa_varlen_forward_261, _fa_varlen_backward_26
    else:
        fwd, bwd = _fa_varlen_forward_260, _fa_varlen_backward_26
    return inspect.signature(fwd), inspect.signature(bwd)


def _documents_of(cu_seqlens: torch.Tensor) -> list[tuple[int, int]]:
    """The (start, end) token ranges flash-attn's varlen kernels read from cu_seqlens, as mha_varlen_fwd
    checks it: int32, contiguous, 1-D."""
    assert cu_seqlens.dtype == torch.int32 and cu_seqlens.is_contiguous() and cu_seqlens.dim() == 1
    cu = cu_seqlens.tolist()
    return list(zip(cu, cu[1:]))


def _per_head(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(0, 1).unsqueeze(0)  # [L, h, d] -> [1, h, L, d]


def _fa_reference(a: dict) -> MathKernel:
    """The float64 reference of one fake flash-attn call, honouring its window as flash-attn documents it:
    with ``causal``, query i sees keys i - window_size[0] ... i (a window of left + 1 tokens; -1: none)."""
    ref = _reference(a["causal"], a["softmax_scale"])
    left, right = a.get("window_size", (a.get("window_size_left", -1), a.get("window_size_right", -1)))
    if left < 0:
        assert right < 0, "a right window without a left one"
        return ref
    from ds_upipe.windows import SlidingWindowKernel

    assert a["causal"] and right == 0, f"causal sliding windows only, got ({left}, {right})"
    return SlidingWindowKernel(ref, left + 1, tile=8)


def _fake_flash_attn(version: str, rec: Recorder) -> types.ModuleType:
    """flash_attn with ``__version__`` and an interface whose private functions bind their arguments
    with the release's signature, record them, and compute exact attention on [b, S, h, d] (varlen:
    per document of [total, h, d], with flash-attn's [h, total] float32 lse)."""
    old = version.startswith("2.6")
    fwd_sig = inspect.signature(_fa_forward_26 if old else _fa_forward_27)
    bwd_sig = inspect.signature(_fa_backward_26 if old else _fa_backward_27)
    varlen_fwd_sig, varlen_bwd_sig = _varlen_signatures(version)

    def forward(*args, **kwargs):
        a = fwd_sig.bind(*args, **kwargs).arguments
        q, k, v = a["q"], a["k"], a["v"]
        assert q.dtype in (torch.float16, torch.bfloat16) and q.shape[2] % k.shape[2] == 0
        _check_one_head_dim(q, k, v)
        _check_last_dim_contiguous(q, k, v)
        out, lse, _ = _fa_reference(a).forward(*(t.transpose(1, 2) for t in (q, k, v)))
        out = out.transpose(1, 2)
        rng_state = torch.tensor([5, 6], dtype=torch.int64)
        res = (
            (out, q, k, v, out, lse.float(), torch.empty(0), rng_state)
            if old
            else (out, lse.float(), torch.empty(0), rng_state)
        )
        rec.calls.append(("fa_forward", (), a, res))
        return res

    def backward(*args, **kwargs):
        a = bwd_sig.bind(*args, **kwargs)
        a.apply_defaults()
        a = a.arguments
        rec.calls.append(("fa_backward", (), a, None))
        _check_one_head_dim(*(a[n] for n in ("q", "k", "v", "out", "dout", "dq", "dk", "dv")))
        q, k, v, out, dout = (a[n].transpose(1, 2) for n in ("q", "k", "v", "out", "dout"))
        grads = _fa_reference(a).backward(dout, q, k, v, out, a["softmax_lse"], ())
        for buf, g in zip((a["dq"], a["dk"], a["dv"]), grads):
            assert buf.shape == g.transpose(1, 2).shape  # dk, dv: the hkv heads of k, v
            buf.copy_(g.transpose(1, 2))  # the real kernels fill the buffers they are given
        softmax_d = torch.empty(0)
        return (a["dq"], a["dk"], a["dv"], softmax_d) if old else softmax_d

    def varlen_forward(*args, **kwargs):
        a = varlen_fwd_sig.bind(*args, **kwargs).arguments  # what the caller passed (defaults left out)
        q, k, v = a["q"], a["k"], a["v"]
        assert q.dtype in (torch.float16, torch.bfloat16) and q.dim() == k.dim() == v.dim() == 3
        assert q.shape[1] % k.shape[1] == 0
        _check_one_head_dim(q, k, v)
        _check_last_dim_contiguous(q, k, v)
        docs = _documents_of(a["cu_seqlens_q"])
        assert docs[-1][1] == q.shape[0] and _documents_of(a["cu_seqlens_k"])[-1][1] == k.shape[0]
        ref = _fa_reference(a)
        out = torch.empty_like(q)  # mha_varlen_fwd: empty_like(q), so q's strides
        lse = torch.full((q.shape[1], q.shape[0]), float("nan"), dtype=torch.float32)  # {num_heads, total_q}
        for s, e in docs:
            o, doc_lse, _ = ref.forward(*(_per_head(t[s:e]) for t in (q, k, v)))
            out[s:e] = o[0].transpose(0, 1)
            lse[:, s:e] = doc_lse[0]
        rng_state = torch.tensor([7, 8], dtype=torch.int64)
        res = (out, q, k, v, out, lse, torch.empty(0), rng_state) if old else (out, lse, torch.empty(0), rng_state)
        rec.calls.append(("fa_varlen_forward", (), a, res))
        return res

    def varlen_backward(*args, **kwargs):
        a = varlen_bwd_sig.bind(*args, **kwargs)
        a.apply_defaults()
        a = a.arguments
        rec.calls.append(("fa_varlen_backward", (), a, None))
        q, k, v, out, dout, lse = (a[n] for n in ("q", "k", "v", "out", "dout", "softmax_lse"))
        _check_one_head_dim(q, k, v, out, dout, a["dq"], a["dk"], a["dv"])
        _check_last_dim_contiguous(q, k, v, out, dout, a["dq"], a["dk"], a["dv"])
        assert lse.shape == (q.shape[1], q.shape[0]) and lse.dtype == torch.float32 and lse.is_contiguous()
        ref = _fa_reference(a)
        for s, e in _documents_of(a["cu_seqlens_q"]):
            grads = ref.backward(*(_per_head(t[s:e]) for t in (dout, q, k, v, out)), lse[None, :, s:e], ())
            for buf, g in zip((a["dq"], a["dk"], a["dv"]), grads):
                assert buf.shape[1:] == g.shape[1:2] + g.shape[3:]  # dk, dv: the hkv heads of k, v
                buf[s:e] = g[0].transpose(0, 1)  # the real kernels fill the buffers they are given
        softmax_d = torch.empty(0)
        return (a["dq"], a["dk"], a["dv"], softmax_d) if old else softmax_d

    iface = types.ModuleType("flash_attn.flash_attn_interface")
    iface._flash_attn_forward, iface._flash_attn_backward = forward, backward
    iface._flash_attn_varlen_forward, iface._flash_attn_varlen_backward = varlen_forward, varlen_backward
    pkg = types.ModuleType("flash_attn")
    pkg.__version__, pkg.flash_attn_interface = version, iface
    return pkg


@pytest.fixture
def install_flash_attn(monkeypatch):
    def install(version: str) -> Recorder:
        rec = Recorder()
        pkg = _fake_flash_attn(version, rec)
        monkeypatch.setitem(sys.modules, "flash_attn", pkg)
        monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", pkg.flash_attn_interface)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        return rec

    return install


@pytest.mark.parametrize("version", ["2.6.3", "2.7.4.post1", "2.8.3"])
def test_flash_attn_adapter_matches_release_signature(install_flash_attn, version):
    rec = install_flash_attn(version)
    kernel = FlashAttnKernel(causal=True, softmax_scale=SCALE)
    q, k, v, dout = _inputs(4, 2, torch.bfloat16, d=16)
    out, lse, aux = kernel.forward(q, k, v)
    grads = kernel.backward(dout, q, k, v, out, lse, aux)
    (_, fwd, fwd_res), (_, bwd, _) = rec.of("fa_forward")[0], rec.of("fa_backward")[0]
    old = version.startswith("2.6")
    window = {"window_size": (-1, -1)} if old else {"window_size_left": -1, "window_size_right": -1}
    rng_state = fwd_res[-1]
    # forward: [b, S, h, d] views of the kernel's tensors, no dropout, window, softcap, alibi or softmax
    assert all(fwd[n].data_ptr() == t.data_ptr() and fwd[n].shape == t.transpose(1, 2).shape
               for n, t in (("q", q), ("k", k), ("v", v)))  # fmt: skip
    assert {n: fwd[n] for n in fwd if n not in ("q", "k", "v")} == {
        "dropout_p": 0.0, "softmax_scale": SCALE, "causal": True, **window, "softcap": 0.0, "alibi_slopes": None,
        "return_softmax": False,
    }  # fmt: skip
    assert aux == (rng_state,) and lse is fwd_res[5 if old else 1]
    # backward: what flash-attn's own FlashAttnFunc passes, the forward's rng_state among it
    assert bwd["rng_state"] is rng_state and bwd["softmax_lse"] is lse
    tensors = ("dout", "q", "k", "v", "out", "softmax_lse", "dq", "dk", "dv", "rng_state")
    assert {n: bwd[n] for n in bwd if n not in tensors} == {
        "dropout_p": 0.0, "softmax_scale": SCALE, "causal": True, **window, "softcap": 0.0, "alibi_slopes": None,
        "deterministic": False,
    }  # fmt: skip
    _assert_matches_reference((q, k, v, dout), (out, *grads), SCALE, tol=2e-2)


def _windowed_reference(q, k, v, dout, window, documents=None):
    """float64 out, dq, dk, dv of [b, h, S, d] tensors under an explicit S x S mask: causal, key j visible to
    query i iff i - window < j <= i (transformers' sliding_window), within each document of ``documents``."""
    from tests.core_cases import masked_reference

    leaves = [t.detach().double().transpose(1, 2).requires_grad_(True) for t in (q, k, v)]
    out = masked_reference(*leaves, window, None, documents)
    out.backward(dout.double().transpose(1, 2))
    return [t.transpose(1, 2) for t in (out.detach(), *(x.grad for x in leaves))]


@pytest.mark.parametrize("version", ["2.6.3", "2.7.4.post1", "2.8.3"])
def test_flash_attn_window_is_flash_attns_own(install_flash_attn, version):
    """``FlashAttnKernel(window=W)`` passes flash-attn's ``window_size=(W - 1, 0)`` (query i sees keys
    i - W + 1 ... i) to forward and backward, dense and varlen (``DocumentKernel``), and the result is
    transformers' sliding window under an explicit mask."""
    from ds_upipe.packing import DocumentBoundaries, DocumentKernel

    rec = install_flash_attn(version)
    old = version.startswith("2.6")
    window = 5
    expected = {"window_size": (window - 1, 0)} if old else {"window_size_left": window - 1, "window_size_right": 0}
    kernel = kernel_choice.make_kernel("flash_attn", softmax_scale=None, window=window)
    assert isinstance(kernel, FlashAttnKernel) and kernel.window == window
    q, k, v, dout = _inputs(4, 2, torch.bfloat16, d=16)
    out, lse, aux = kernel.forward(q, k, v)
    grads = kernel.backward(dout, q, k, v, out, lse, aux)
    for name in ("fa_forward", "fa_backward"):
        args = rec.of(name)[0][1]
        assert {n: args[n] for n in expected} == expected, (name, args)
    dense = _windowed_reference(q, k, v, dout, window)
    for got, want in zip((out, *grads), dense):
        torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-2)
    # DistributedAttention's contract ([b, S, h, d], autograd) keeps the window too
    qb, kb, vb = (t.transpose(1, 2) for t in (q, k, v))
    torch.testing.assert_close(kernel(qb, kb, vb).transpose(1, 2).double(), dense[0], rtol=2e-2, atol=2e-2)
    # the window per document, in one varlen call
    docs = DocumentKernel(kernel, DocumentBoundaries(_DOCUMENTS))
    out, lse, aux = docs.forward(q, k, v)
    grads = docs.backward(dout, q, k, v, out, lse, aux)
    for name in ("fa_varlen_forward", "fa_varlen_backward"):
        args = rec.of(name)[0][1]
        assert {n: args[n] for n in expected} == expected, (name, args)
    want = _windowed_reference(q, k, v, dout, window, _DOCUMENTS)
    for got, w in zip((out, *grads), want):
        torch.testing.assert_close(got.double(), w, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("version", ["2.5.9", "2.9.0", "3.0.0b1", "unknown"])
def test_flash_attn_outside_supported_range_is_refused(install_flash_attn, version):
    install_flash_attn(version)
    with pytest.raises(ValueError, match=rf"supports flash-attn>=2\.6,<2\.9, found flash-attn {version}"):
        FlashAttnKernel()


def test_flash_attn_refuses_inputs_it_cannot_run(install_flash_attn):
    install_flash_attn("2.8.3")
    kernel = FlashAttnKernel()
    q, k, v, _ = _inputs(4, 2, torch.float32, d=16)
    with pytest.raises(ValueError, match="runs float16 or bfloat16, got torch.float32"):
        kernel.forward(q, k, v)
    q, k, v, _ = _inputs(4, 2, torch.bfloat16, d=12)
    with pytest.raises(ValueError, match="head_dim a multiple of 8 and at most 256, got 12"):
        kernel.forward(q, k, v)


# -- flash-attn 3: a fake flash_attn_interface with v2.8.3 hopper/'s exact private signatures ---------


# the parameter lists (and defaults) of hopper/flash_attn_interface.py's _flash_attn_forward /
# _flash_attn_backward, copied from flash-attention v2.8.3 (v2.8.0-v2.8.2: the same)
def _fa3_forward_283(q, k, v, k_new, v_new, qv, out, cu_seqlens_q, cu_seqlens_k, cu_seqlens_k_new, seqused_q,
                     seqused_k, max_seqlen_q, max_seqlen_k, page_table, kv_batch_idx, leftpad_k, rotary_cos,
                     rotary_sin, seqlens_rotary, q_descale, k_descale, v_descale, softmax_scale, causal,
                     window_size=(-1, -1), attention_chunk=0, softcap=0.0, rotary_interleaved=True,
                     scheduler_metadata=None, num_splits=1, pack_gqa=None, sm_margin=0): ...  # fmt: skip
def _fa3_backward_283(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, sequed_q, sequed_k, max_seqlen_q,
                      max_seqlen_k, dq, dk, dv, softmax_scale, causal, window_size=(-1, -1), softcap=0.0,
                      deterministic=False, sm_margin=0): ...  # fmt: skip
# v2.7.3-v2.7.4's (also "3.0.0b1"): no qv / seqlens_rotary / attention_chunk / scheduler_metadata, a sink_token_length
def _fa3_forward_273(q, k, v, k_new, v_new, out, cu_seqlens_q, cu_seqlens_k, cu_seqlens_k_new, seqused_q, seqused_k,
                     max_seqlen_q, max_seqlen_k, page_table, kv_batch_idx, leftpad_k, rotary_cos, rotary_sin,
                     q_descale, k_descale, v_descale, softmax_scale, causal, window_size=(-1, -1),
                     sink_token_length=0, softcap=0.0, rotary_interleaved=True, num_splits=1, pack_gqa=None,
                     sm_margin=0): ...  # fmt: skip


def _fa3_check_common(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """What hopper/flash_api.cpp's mha_fwd and mha_bwd check of q, k, v (16-bit inputs; fp8 is forward-only)."""
    assert q.dtype in (torch.float16, torch.bfloat16), "FlashAttention only supports fp16 and bf16 data type"
    assert k.dtype == q.dtype and v.dtype == q.dtype, "query and key / value must have the same dtype"
    _check_last_dim_contiguous(q, k, v)
    d, dv = q.shape[-1], v.shape[-1]
    assert d % 8 == 0 and dv % 8 == 0, "head_size / head_size_v should be a multiple of 8"
    assert q.shape[2] % k.shape[2] == 0, "Number of heads in key/value must divide number of heads in query"
    assert k.shape[:3] == v.shape[:3] and k.shape[-1] == d, "CHECK_SHAPE(k / v, batch_size, seqlen_k, num_heads_k, ...)"


def _fake_fa3(rec: Recorder, fwd_sig=None) -> types.ModuleType:
    """flash_attn_interface whose private functions bind their arguments with v2.8.3's signature (or
    ``fwd_sig``'s), record them, check what FA3 checks, and compute exact attention on [b, S, h, d]."""

    def forward(*args, **kwargs):
        a = inspect.signature(_fa3_forward_283).bind(*args, **kwargs)
        a.apply_defaults()
        a = a.arguments
        q, k, v = a["q"], a["k"], a["v"]
        _fa3_check_common(q, k, v)
        d, dv = q.shape[-1], v.shape[-1]
        assert d <= 256, "FlashAttention forward only supports head dimension at most 256"
        if d != dv:  # mha_fwd; Hopper only
            assert (128 < d <= 192 and 96 < dv <= 128) or (d <= 64 and dv <= 512), "If V headdim is different ..."
        out, lse, _ = _fa_reference(a).forward(*(t.transpose(1, 2) for t in (q, k, v)))
        # out: torch::empty({b, S, h, dv}); softmax_lse: {b, h, S} float32; no accumulators with num_splits=1
        res = (out.transpose(1, 2).contiguous().to(q.dtype), lse.float().contiguous(), None, None)
        rec.calls.append(("fa3_forward", (), a, res))
        return res

    def backward(*args, **kwargs):
        a = inspect.signature(_fa3_backward_283).bind(*args, **kwargs)
        a.apply_defaults()
        a = a.arguments
        rec.calls.append(("fa3_backward", (), a, None))
        q, k, v, out, dout = (a[n] for n in ("q", "k", "v", "out", "dout"))
        _fa3_check_common(q, k, v)
        assert max(q.shape[-1], v.shape[-1]) <= 256
        for name, t, like in (("out", out, q), ("dout", dout, q), ("dq", a["dq"], q), ("dk", a["dk"], k),
                              ("dv", a["dv"], v)):  # fmt: skip
            assert t.dtype == q.dtype and t.stride(-1) == 1, f"{name}: q's dtype, contiguous last dimension"
            want = (*like.shape[:-1], v.shape[-1] if name in ("out", "dout", "dv") else like.shape[-1])
            assert tuple(t.shape) == want, f"CHECK_SHAPE({name}, {want}), got {tuple(t.shape)}"
        _check_raw_lse(a["softmax_lse"], (q.shape[0], q.shape[2], q.shape[1]))
        grads = _fa_reference(a).backward(*(t.transpose(1, 2) for t in (dout, q, k, v, out)), a["softmax_lse"], ())
        for buf, g in zip((a["dq"], a["dk"], a["dv"]), grads):
            buf.copy_(g.transpose(1, 2))  # mha_bwd fills the buffers it is given
        return a["dq"], a["dk"], a["dv"], torch.empty(0)

    iface = types.ModuleType("flash_attn_interface")
    iface._flash_attn_forward, iface._flash_attn_backward = forward, backward
    # the adapter reads the signatures the way inspect does: give the stand-ins the release's own
    forward.__signature__ = fwd_sig or inspect.signature(_fa3_forward_283)
    backward.__signature__ = inspect.signature(_fa3_backward_283)
    return iface


@pytest.fixture
def install_fa3(monkeypatch):
    def install(fwd_sig=None) -> Recorder:
        rec = Recorder()
        monkeypatch.setitem(sys.modules, "flash_attn_interface", _fake_fa3(rec, fwd_sig))
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        return rec

    return install


_FA3_NONE = (
    "k_new", "v_new", "qv", "out", "cu_seqlens_q", "cu_seqlens_k", "cu_seqlens_k_new", "seqused_q", "seqused_k",
    "max_seqlen_q", "max_seqlen_k", "page_table", "kv_batch_idx", "leftpad_k", "rotary_cos", "rotary_sin",
    "seqlens_rotary", "q_descale", "k_descale", "v_descale", "scheduler_metadata", "pack_gqa",
)  # fmt: skip


@pytest.mark.parametrize("d, dv, window", [(16, 16, None), (24, 16, None), (192, 128, None), (24, 16, 5)])
def test_fa3_adapter_matches_v2_8_signature(install_fa3, d, dv, window):
    """``make_kernel("fa3")`` calls FA3's ``_flash_attn_forward`` / ``_flash_attn_backward`` with v2.8.3's
    parameters, every one by name, as its own ``FlashAttnFunc`` does: q, k, v as [b, S, h, d] views of the kernel's
    tensors, the value at its own head dim (MLA: 24/16, DeepSeek's 192/128; no padding), the forward's
    [b, h, S] float32 lse handed back unchanged, no aux; a window as FA3's ``window_size=(W - 1, 0)``.  out, dq,
    dk, dv equal the float64 reference (explicit mask with a window), also through ``DocumentKernel``.  The windowed
    case takes the default scale: 1/sqrt of the q/k head dim, not the value's."""
    rec = install_fa3()
    scale = None if window else SCALE
    kernel = kernel_choice.make_kernel("fa3", softmax_scale=scale, window=window)
    scale = 1 / math.sqrt(d) if scale is None else scale
    assert isinstance(kernel, FA3Kernel) and kernel.window == window  # FA3's own window, not banded tiles
    q, k, v, dout = _latent_inputs(torch.bfloat16, d=d, dv=dv)
    out, lse, aux = kernel.forward(q, k, v)
    grads = kernel.backward(dout, q, k, v, out, lse, aux)
    (_, fwd, fwd_res), (_, bwd, _) = rec.of("fa3_forward")[0], rec.of("fa3_backward")[0]
    assert all(fwd[n].data_ptr() == t.data_ptr() and fwd[n].shape == t.transpose(1, 2).shape
               for n, t in (("q", q), ("k", k), ("v", v)))  # fmt: skip
    window_size = (-1, -1) if window is None else (window - 1, 0)
    assert {n: fwd[n] for n in fwd if n not in ("q", "k", "v")} == {
        **dict.fromkeys(_FA3_NONE), "softmax_scale": scale, "causal": True, "window_size": window_size,
        "attention_chunk": 0, "softcap": 0.0, "rotary_interleaved": True, "num_splits": 1, "sm_margin": 0,
    }  # fmt: skip
    assert aux == () and lse is fwd_res[1] and lse.shape == (2, 4, 40) and lse.dtype == torch.float32
    assert bwd["softmax_lse"] is lse and bwd["v"].shape[-1] == bwd["dout"].shape[-1] == bwd["dv"].shape[-1] == dv
    tensors = ("dout", "q", "k", "v", "out", "softmax_lse", "dq", "dk", "dv")
    assert {n: bwd[n] for n in bwd if n not in tensors} == {
        **dict.fromkeys(("cu_seqlens_q", "cu_seqlens_k", "sequed_q", "sequed_k", "max_seqlen_q", "max_seqlen_k")),
        "softmax_scale": scale, "causal": True, "window_size": window_size, "softcap": 0.0, "deterministic": False,
        "sm_margin": 0,
    }  # fmt: skip
    assert out.shape == (2, 4, 40, dv) and [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    if window is None:
        tol = 2e-2 if d <= 64 else 6e-2  # bf16 rounding of out and dout grows with the head dim
        _assert_matches_reference((q, k, v, dout), (out, *grads), SCALE, tol=tol)
        _check_documents(kernel, q, k, v, dout, tol)  # packed rows: one FA3 call per document
        return
    wanted = _windowed_reference(q, k, v, dout, window)  # scale 1/sqrt(d)
    for got, want in zip((out, *grads), wanted):
        torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-2)
    qb, kb, vb = (t.transpose(1, 2) for t in (q, k, v))  # DistributedAttention's contract keeps the window
    torch.testing.assert_close(kernel(qb, kb, vb).transpose(1, 2).double(), wanted[0], rtol=2e-2, atol=2e-2)


def test_fa3_in_the_stage_loop_keeps_the_value_head_dim(install_fa3):
    """Latent attention (q/k 24, v 16, 8 heads each) through the UPipe stage loop with FA3: 4 stages, each FA3
    call gets the stage's value at 16 (no padding anywhere in the loop) and its own forward's lse back; out and
    the gradients equal the float64 reference."""
    rec = install_fa3()
    plan = build_plan(8, 8, 1, 2)  # one rank, 2 query heads per stage: 4 stages
    pctx = PipelineContext(plan=plan, indices=PlanIndices.build(plan, torch.device("cpu")), group=None,
                           attention=FA3Kernel(causal=True, softmax_scale=SCALE))  # fmt: skip
    q, k, v, dout = _inputs(8, 8, torch.bfloat16, seq=32, d=24)
    v, dout = v[..., :16], dout[..., :16]
    q, k, v, dout = (t.transpose(1, 2).contiguous() for t in (q, k, v, dout))  # [b, s, h, d]
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = UPipeAttentionFunction.apply(q, k, v, pctx)
    out.backward(dout)
    fwd, bwd = rec.of("fa3_forward"), rec.of("fa3_backward")
    assert len(fwd) == len(bwd) == plan.num_stages == 4
    assert all(a["v"].shape[-1] == 16 for _, a, _ in fwd) and all(a["dv"].shape[-1] == 16 for _, a, _ in bwd)
    assert all(b["softmax_lse"] is res[1] for (_, _, res), (_, b, _) in zip(fwd, bwd))  # stage order both ways
    inputs = tuple(t.detach().transpose(1, 2) for t in (q, k, v, dout))
    got = tuple(t.transpose(1, 2) for t in (out, q.grad, k.grad, v.grad))
    _assert_matches_reference(inputs, got, SCALE, tol=2e-2)


def test_fa3_refusals(install_fa3, monkeypatch):
    """Inputs FA3 cannot run are refused by name (float32; head dims; a value head dim outside mha_fwd's rule),
    and so is a build whose private signature is not v2.8.x's (v2.7.3's hopper/, the same "3.0.0b1")."""
    install_fa3()
    kernel = FA3Kernel(causal=True)
    q, k, v, _ = _inputs(4, 2, torch.float32, d=16)
    with pytest.raises(ValueError, match="kernel 'fa3' runs float16 or bfloat16, got torch.float32"):
        kernel.forward(q, k, v)
    for d, dv, why in ((12, 12, "multiples of 8"), (264, 264, "at most 256"), (128, 64, r"q/k in \(128, 192\]")):
        q, k, v, _ = _latent_inputs(torch.bfloat16, d=d, dv=min(dv, d))
        v = torch.zeros(*v.shape[:-1], dv, dtype=v.dtype)
        with pytest.raises(ValueError, match=rf"q/k head dim {d} with value head dim {dv}: .*{why}"):
            kernel.forward(q, k, v)
    install_fa3(inspect.signature(_fa3_forward_273))
    refused = r"_flash_attn_forward with the parameters of flash-attention v2\.8\.0-v2\.8\.3.*"
    with pytest.raises(ValueError, match=refused + r"missing \['attention_chunk', 'qv', .*\['sink_token_length'\]"):
        kernel_choice.make_kernel("fa3")
    monkeypatch.setitem(sys.modules, "flash_attn_interface", None)  # not installed: import fails
    with pytest.raises(ValueError, match="kernel 'fa3' needs a CUDA device and flash-attn 3"):
        FA3Kernel()


# -- CallableKernel: a DistributedAttention-contract function as a kernel ----------------------------


@pytest.mark.parametrize("batch_dim_idx", [0, 1])
def test_callable_kernel_recomputes_a_plain_function(batch_dim_idx):
    """Its forward runs the function in its own layout with the call's extra arguments and returns an
    empty lse and no aux; its backward recomputes it and needs no output; a ring refuses it."""
    from ds_upipe.kernels import CallableKernel, gqa_native_sdpa
    from ds_upipe.ring import RingAttentionKernel

    def attention(q, k, v, *args, scale=None):  # [b, S, h, d] (batch_dim_idx 0) or [S, b, h, d] (1)
        assert args == ("extra",) and q.is_contiguous()
        if batch_dim_idx:
            q, k, v = (t.transpose(0, 1) for t in (q, k, v))
        out = gqa_native_sdpa(q, k, v, softmax_scale=scale)
        return out.transpose(0, 1) if batch_dim_idx else out

    kernel = CallableKernel(attention, batch_dim_idx, ("extra",), {"scale": SCALE})
    q, k, v, dout = _inputs(8, 2, torch.float64)
    out, lse, aux = kernel.forward(q.requires_grad_(), k, v)  # no autograd graph even so
    assert lse.numel() == 0 and aux == () and not kernel.needs_output_in_backward and not out.requires_grad
    grads = kernel.backward(dout, q, k, v, None, lse, aux)
    _assert_matches_reference((q.detach(), k, v, dout), (out, *grads), SCALE, tol=1e-10)
    with pytest.raises(ValueError, match="not a plain callable"):
        RingAttentionKernel(kernel, None)


# -- packed rows: DocumentKernel around each CUDA path ------------------------------------------------

#: per batch row: a one-token document, short ones, and one longer than the efficient op's 32-row lse block
_DOCUMENTS = ((0, 1, 7, 40), (0, 33, 34, 40))


def _per_document_reference(q, k, v, dout, documents=_DOCUMENTS):
    """float64 attention of every document alone: out and dq, dk, dv."""
    ref = _reference(True, SCALE)
    outs, grads = (
        torch.zeros((*q.shape[:-1], v.shape[-1]), dtype=torch.float64),
        [torch.zeros_like(t, dtype=torch.float64) for t in (q, k, v)],
    )
    for r, cu in enumerate(documents):
        for s, e in zip(cu, cu[1:]):
            qs, ks, vs, ds = (t[r : r + 1, :, s:e].double() for t in (q, k, v, dout))
            o, lse, _ = ref.forward(qs, ks, vs)
            outs[r : r + 1, :, s:e] = o
            for g, piece in zip(grads, ref.backward(ds, qs, ks, vs, o, lse, ())):
                g[r : r + 1, :, s:e] = piece
    return outs, grads


def _check_documents(kernel, q, k, v, dout, tol: float, documents=_DOCUMENTS) -> tuple:
    from ds_upipe.packing import DocumentBoundaries, DocumentKernel

    docs = DocumentKernel(kernel, DocumentBoundaries(documents))
    out, lse, aux = docs.forward(q, k, v)
    grads = docs.backward(dout, q, k, v, out, lse, aux)
    out_ref, grads_ref = _per_document_reference(q, k, v, dout, documents)
    for got, want in zip((out, *grads), (out_ref, *grads_ref)):
        assert got.shape == want.shape and got.dtype == q.dtype
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
    return out, lse, aux, grads


@pytest.mark.parametrize("dtype, op", [(torch.bfloat16, "flash"), (torch.float32, "efficient")])
def test_document_kernel_on_torch_cuda_paths(as_cuda, dtype, op):
    """Packed rows through TorchSDPAKernel's CUDA ops (CPU stand-ins): one dense call per document, the
    efficient op's lse padded to 32 with NaN per document and handed back per document (lengths in aux)."""
    q, k, v, dout = _inputs(4, 2, dtype)
    out, lse, aux, _ = _check_documents(
        TorchSDPAKernel(causal=True, softmax_scale=SCALE), q, k, v, dout, 2e-2 if dtype == torch.bfloat16 else 1e-5
    )
    segments = sum(len(cu) - 1 for cu in _DOCUMENTS)
    assert len(as_cuda.of(op)) == len(as_cuda.of(f"{op}_backward")) == segments
    lengths = [e - s for cu in _DOCUMENTS for s, e in zip(cu, cu[1:])]
    want = lengths if op == "flash" else [_padded_lse_len(n) for n in lengths]
    assert aux[0].tolist() == want and lse.shape[-1] == sum(want)
    assert len(aux) == 1 + segments * (4 if op == "flash" else 2)  # each segment's own aux, in order
    # only FlashAttnKernel takes the one-call varlen path: torch's ops (and the math kernel) run per segment
    from ds_upipe.packing import DocumentBoundaries, DocumentKernel

    assert not any(
        DocumentKernel(kernel, DocumentBoundaries(_DOCUMENTS)).varlen for kernel in (TorchSDPAKernel(), MathKernel())
    )


@pytest.mark.parametrize("dtype, op", [(torch.bfloat16, "flash"), (torch.float32, "efficient")])
def test_sliding_window_tiles_on_torch_cuda_paths(as_cuda, dtype, op):
    """``SlidingWindowKernel`` on TorchSDPAKernel's CUDA ops (CPU stand-ins; without flash-attn this is the
    CUDA window): every tile's pieces are causal or unmasked calls on the ops, the efficient op's NaN-padded
    lse is sliced in forward and padded again for its backward, and the result is transformers' sliding
    window under an explicit mask."""
    from ds_upipe.windows import SlidingWindowKernel

    window = 7
    kernel = SlidingWindowKernel(TorchSDPAKernel(causal=True), window, tile=4)
    assert kernel.fused is False  # W - 1 < MIN_FUSED_TILE: the band mask unless asked
    kernel = SlidingWindowKernel(TorchSDPAKernel(causal=True), window, tile=4, fused=True)
    q, k, v, dout = _inputs(4, 2, dtype)
    out, lse, aux = kernel.forward(q, k, v)
    grads = kernel.backward(dout, q, k, v, out, lse, aux)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    for got, want in zip((out, *grads), _windowed_reference(q, k, v, dout, window)):
        assert got.dtype == q.dtype
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
    forwards, backwards = as_cuda.of(op), as_cuda.of(f"{op}_backward")
    assert len(forwards) == len(backwards) > 3 * (40 // 4 - 2)  # three pieces per tile past the first ones
    is_causal = 4 if op == "flash" else 6  # where each forward op takes its causal flag
    assert {args[is_causal] for args, _, _ in forwards} == {True, False}  # causal and unmasked pieces


#: bidirectional spans (Gemma 3's images) of the two rows of ``_inputs``: one longer than the windows below
_SPANS = (((3, 15), (20, 22)), ((30, 40),))


def _spans_reference(q, k, v, dout, window):
    """float64 out, dq, dk, dv under the image overlay's explicit mask (``core_cases.masked_reference``)."""
    from tests.core_cases import masked_reference

    leaves = [t.detach().double().transpose(1, 2).requires_grad_(True) for t in (q, k, v)]
    out = masked_reference(*leaves, window, spans=_SPANS)
    out.backward(dout.double().transpose(1, 2))
    return [t.transpose(1, 2) for t in (out.detach(), *(x.grad for x in leaves))]


@pytest.mark.parametrize("dtype, op", [(torch.bfloat16, "flash"), (torch.float32, "efficient")])
def test_span_kernel_on_torch_cuda_paths(as_cuda, dtype, op):
    """Gemma 3's image spans (``SpanKernel``) on TorchSDPAKernel's CUDA ops (CPU stand-ins), causal and around the
    window's fused tiles: each span piece is one causal call of equal q/k lengths on contiguous reversed rows (no
    non-causal call of unequal lengths), the efficient op's lse sliced and padded to 32 again for each piece's
    backward; the result is the overlay's explicit mask."""
    from ds_upipe.spans import BidirectionalSpans, SpanKernel
    from ds_upipe.windows import SlidingWindowKernel

    q, k, v, dout = _inputs(4, 2, dtype)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    base = TorchSDPAKernel(causal=True)
    for window in (None, 9):
        inner = base if window is None else SlidingWindowKernel(base, window, tile=4, fused=True)
        kernel = SpanKernel(inner, base, BidirectionalSpans(_SPANS))
        as_cuda.clear()
        out, lse, aux = kernel.forward(q, k, v)
        grads = kernel.backward(dout, q, k, v, out, lse, aux)
        for got, want in zip((out, *grads), _spans_reference(q, k, v, dout, window)):
            assert got.dtype == q.dtype
            torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
    # the last kernel's calls: the window's tiles, then one causal call per span of its length - 1 rows and keys
    pieces = [(args[0].shape[2], args[1].shape[2]) for args, _, _ in as_cuda.of(op)[-3:]]
    assert pieces == [(e - s - 1, e - s - 1) for row in _SPANS for s, e in row]
    is_causal = 4 if op == "flash" else 6  # where each forward op takes its causal flag
    assert all(args[is_causal] for args, _, _ in as_cuda.of(op)[-3:])
    assert len(as_cuda.of(op)) == len(as_cuda.of(f"{op}_backward"))


@pytest.mark.parametrize("version", ["2.6.3", "2.8.3"])
def test_span_kernel_around_flash_attn(install_flash_attn, version):
    """``SpanKernel`` around flash-attn's own window: one windowed call (W - 1, 0) over the sequence, then per span
    one causal call without a window, q and k of equal lengths; each piece's backward gets its reversed rows' merged
    lse as flash-attn reads it (float32, [1, h, rows], contiguous); the result is the overlay's explicit mask."""
    from ds_upipe.spans import BidirectionalSpans, SpanKernel
    from ds_upipe.windows import windowed

    rec = install_flash_attn(version)
    old = version.startswith("2.6")
    base = FlashAttnKernel(causal=True)
    kernel = SpanKernel(windowed(base, 5), base, BidirectionalSpans(_SPANS))
    q, k, v, dout = _inputs(4, 2, torch.bfloat16, d=16)
    out, lse, aux = kernel.forward(q, k, v)
    grads = kernel.backward(dout, q, k, v, out, lse, aux)
    for got, want in zip((out, *grads), _spans_reference(q, k, v, dout, 5)):
        torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-2)
    lengths = [e - s - 1 for row in _SPANS for s, e in row]
    for name in ("fa_forward", "fa_backward"):
        calls = [a for _, a, _ in rec.of(name)]
        windows = [a["window_size"] if old else (a["window_size_left"], a["window_size_right"]) for a in calls]
        assert windows == [(4, 0)] + [(-1, -1)] * len(lengths) and all(a["causal"] for a in calls)
        assert [(a["q"].shape[1], a["k"].shape[1]) for a in calls[1:]] == [(n, n) for n in lengths]
    for a, n in zip([a for _, a, _ in rec.of("fa_backward")][1:], lengths):
        lse_piece = a["softmax_lse"]
        assert lse_piece.dtype == torch.float32 and lse_piece.shape == (1, 4, n) and lse_piece.is_contiguous()


#: flash-attn releases whose varlen signatures differ (see _varlen_signatures), and the pinned ones
_VARLEN_VERSIONS = ["2.6.0", "2.6.1", "2.6.3", "2.7.0", "2.7.4.post1", "2.8.3"]


@pytest.mark.parametrize("version", _VARLEN_VERSIONS)
def test_document_kernel_around_flash_attn_is_one_varlen_call(install_flash_attn, version):
    """Packed rows through FlashAttnKernel (the fake package with the release's signatures): one varlen
    forward and one varlen backward for all documents of both rows, with cu_seqlens over the rows
    concatenated, the longest document as max_seqlen, the forward's lse ([h, b*S]) and rng_state handed
    back; values equal every document attended alone."""
    rec = install_flash_attn(version)
    q, k, v, dout = _inputs(4, 2, torch.bfloat16, d=16)
    out, lse, aux, _ = _check_documents(FlashAttnKernel(causal=True, softmax_scale=SCALE), q, k, v, dout, 2e-2)
    assert not rec.of("fa_forward") and not rec.of("fa_backward")  # no per-document dense calls
    ((_, fwd, fwd_res),), ((_, bwd, _),) = rec.of("fa_varlen_forward"), rec.of("fa_varlen_backward")
    old = version.startswith("2.6")
    window = {"window_size": (-1, -1)} if old else {"window_size_left": -1, "window_size_right": -1}
    cu = fwd["cu_seqlens_q"]
    # row 1's boundaries follow row 0's 40 tokens: the rows concatenated, [b*S, h, d]
    assert cu.tolist() == [0, 1, 7, 40, 73, 74, 80] and fwd["cu_seqlens_k"] is cu
    for n, t in (("q", q), ("k", k), ("v", v)):
        assert torch.equal(fwd[n], t.transpose(1, 2).reshape(-1, t.shape[1], t.shape[3]))  # token-major
    # exactly these arguments: leftpad_k, seqused_k and zero_tensors stay at their defaults
    assert {n: fwd[n] for n in fwd if n not in ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k")} == {
        "max_seqlen_q": 33, "max_seqlen_k": 33, "dropout_p": 0.0, "softmax_scale": SCALE, "causal": True,
        **window, "softcap": 0.0, "alibi_slopes": None, "return_softmax": False, "block_table": None,
    }  # fmt: skip
    rng_state = fwd_res[-1]
    assert lse is fwd_res[5 if old else 1] and lse.shape == (4, 80) and aux == (cu, rng_state)
    assert bwd["softmax_lse"] is lse and bwd["rng_state"] is rng_state
    assert bwd["cu_seqlens_q"] is cu and bwd["cu_seqlens_k"] is cu
    tensors = ("dout", "q", "k", "v", "out", "softmax_lse", "dq", "dk", "dv", "cu_seqlens_q", "cu_seqlens_k",
               "rng_state")  # fmt: skip
    want_bwd = {
        "max_seqlen_q": 33, "max_seqlen_k": 33, "dropout_p": 0.0, "softmax_scale": SCALE, "causal": True, **window,
        "softcap": 0.0, "alibi_slopes": None, "deterministic": False,
    }  # fmt: skip
    if _release_tuple(version) >= (2, 7, 3):
        want_bwd["zero_tensors"] = False  # its default
    assert {n: bwd[n] for n in bwd if n not in tensors} == want_bwd


def _latent_inputs(dtype: torch.dtype, d: int = 24, dv: int = 16):
    """Multi-head latent attention's shapes after its up-projection: q/k of ``d``, v and dout of ``dv`` < d."""
    q, k, v, dout = _inputs(4, 2, dtype, d=d)
    return q, k, v[..., :dv].contiguous(), dout[..., :dv].contiguous()


@pytest.mark.parametrize("version", ["2.6.3", "2.8.3"])
def test_flash_attn_pads_a_narrower_value(install_flash_attn, version):
    """MLA's value (v_head_dim 16 < q/k head dim 24) reaches flash-attn 2, which takes one head size, zero-padded
    to 24 (bf16, contiguous last dim), q and k as they are (views, no copy); out and dV come back sliced to 16 and
    equal the float64 reference; dout and out reach the backward padded the same way.  Packed rows too: one varlen
    call with the padded value, per-document values exact."""
    rec = install_flash_attn(version)
    kernel = FlashAttnKernel(causal=True, softmax_scale=SCALE)
    q, k, v, dout = _latent_inputs(torch.bfloat16)
    out, lse, aux = kernel.forward(q, k, v)
    grads = kernel.backward(dout, q, k, v, out, lse, aux)
    (_, fwd, _), (_, bwd, _) = rec.of("fa_forward")[0], rec.of("fa_backward")[0]
    assert fwd["q"].data_ptr() == q.data_ptr() and fwd["k"].data_ptr() == k.data_ptr()
    assert fwd["v"].shape == (2, 40, 2, 24) and fwd["v"].dtype == torch.bfloat16 and fwd["v"].stride(-1) == 1
    assert torch.equal(fwd["v"][..., :16], v.transpose(1, 2)) and not fwd["v"][..., 16:].any()
    for name, t in (("v", v), ("dout", dout)):
        assert bwd[name].shape[-1] == 24 and torch.equal(bwd[name][..., :16], t.transpose(1, 2))
        assert not bwd[name][..., 16:].any()
    assert not bwd["out"][..., 16:].any()  # the forward's zero columns, as flash-attn wrote them
    assert out.shape == (2, 4, 40, 16) and [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    _assert_matches_reference((q, k, v, dout), (out, *grads), SCALE, tol=2e-2)
    rec.clear()
    _check_documents(kernel, q, k, v, dout, 2e-2)
    ((_, varlen, _),) = rec.of("fa_varlen_forward")
    assert varlen["v"].shape[-1] == 24 and rec.of("fa_varlen_backward")[0][1]["dv"].shape[-1] == 24


@pytest.mark.parametrize("dtype, op", [(torch.bfloat16, "flash"), (torch.float32, "efficient")])
def test_sdpa_pads_a_narrower_value(as_cuda, dtype, op):
    """TorchSDPAKernel on CUDA with MLA's shapes: torch's flash op (one head size) and the padded efficient op get
    the value padded to the q/k head dim, out and dV sliced back; the path is chosen by both head dims."""
    assert sdpa_path("cuda", dtype, 24, 16).name == f"cuda_{op}_padded"
    assert (
        sdpa_path("cpu", dtype, 24, 16).name == "cpu_flash_padded"
        and sdpa_path("cpu", dtype, 24, 24).name == "cpu_flash"
    )
    q, k, v, dout = _latent_inputs(dtype)
    kernel = TorchSDPAKernel(causal=True, softmax_scale=SCALE)
    out, lse, aux = kernel.forward(q, k, v)
    grads = kernel.backward(dout, q, k, v, out, lse, aux)
    (fwd_args, _, _), (bwd_args, _, _) = as_cuda.of(op)[0], as_cuda.of(f"{op}_backward")[0]
    assert fwd_args[2].shape[-1] == 24 and not fwd_args[2][..., 16:].any()
    assert bwd_args[0].shape[-1] == 24  # dout, padded
    _assert_matches_reference((q, k, v, dout), (out, *grads), SCALE, tol=2e-2 if dtype == torch.bfloat16 else 1e-5)


def test_varlen_with_one_row_makes_no_copies(install_flash_attn):
    """b = 1 (a packed row): the [1, h, S, d] tensors are handed to flash-attn as [S, h, d] views (token
    stride d, head stride S*d), and out, dq, dk, dv come back as views of flash-attn's buffers."""
    rec = install_flash_attn("2.8.3")
    documents = ((0, 5, 6, 24, 40),)
    q, k, v, dout = _inputs(4, 2, torch.bfloat16, d=16, b=1)
    out, _, _, grads = _check_documents(
        FlashAttnKernel(causal=True, softmax_scale=SCALE), q, k, v, dout, 2e-2, documents
    )
    ((_, fwd, fwd_res),), ((_, bwd, _),) = rec.of("fa_varlen_forward"), rec.of("fa_varlen_backward")
    for n, t in (("q", q), ("k", k), ("v", v)):
        assert fwd[n].data_ptr() == t.data_ptr() and fwd[n].stride() == (16, 40 * 16, 1)
    for n, t in (("q", q), ("k", k), ("v", v), ("dout", dout), ("out", out)):
        assert bwd[n].data_ptr() == t.data_ptr()
    assert out.data_ptr() == fwd_res[0].data_ptr()
    assert [g.data_ptr() for g in grads] == [bwd[n].data_ptr() for n in ("dq", "dk", "dv")]
    assert fwd["cu_seqlens_q"].tolist() == [0, 5, 6, 24, 40] and fwd["max_seqlen_q"] == 18


def test_pipeline_threads_varlen_aux_per_stage(install_flash_attn):
    """Through the stage loop: each stage's one varlen backward gets that stage's lse and rng_state and
    the shared cu_seqlens; outputs and gradients equal every document attended alone."""
    from ds_upipe.packing import DocumentBoundaries, DocumentKernel

    rec = install_flash_attn("2.8.3")
    plan = build_plan(8, 2, 1, 2)  # one rank, 2 query heads per stage: 4 stages in 2 rounds
    attention = DocumentKernel(FlashAttnKernel(causal=True, softmax_scale=SCALE), DocumentBoundaries(_DOCUMENTS))
    pctx = PipelineContext(plan=plan, indices=PlanIndices.build(plan, torch.device("cpu")), group=None,
                           attention=attention)  # fmt: skip
    q, k, v, dout = (t.transpose(1, 2).contiguous() for t in _inputs(8, 2, torch.bfloat16, d=16))  # [b, s, h, d]
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = UPipeAttentionFunction.apply(q, k, v, pctx)
    out.backward(dout)
    fwd, bwd = rec.of("fa_varlen_forward"), rec.of("fa_varlen_backward")
    assert len(fwd) == len(bwd) == plan.num_stages == 4 and not rec.of("fa_forward")
    cu = fwd[0][1]["cu_seqlens_q"]
    for (_, _, res), (_, b, _) in zip(fwd, bwd):  # stages run in the same order both ways
        assert b["rng_state"] is res[3] and b["softmax_lse"] is res[1] and b["cu_seqlens_q"] is cu
    out_ref, grads_ref = _per_document_reference(*(t.detach().transpose(1, 2) for t in (q, k, v, dout)))
    got = tuple(t.transpose(1, 2) for t in (out, q.grad, k.grad, v.grad))
    for g, want in zip(got, (out_ref, *grads_ref)):
        torch.testing.assert_close(g.double(), want, rtol=2e-2, atol=2e-2)


# -- the GPU kit's memory mode: torch's CUDA flash op as memory (ds_upipe.tools.memory_mode) ------------


def _layout(t: torch.Tensor) -> tuple:
    return tuple(t.shape), t.stride(), t.dtype


@pytest.mark.parametrize("hq, hkv", [(4, 2), (4, 4)])
def test_flash_memory_stand_in_allocates_what_the_flash_op_does(as_cuda, hq, hkv):
    """The memory rows' stand-in: out, lse and the aux handed to the backward, then dq, dk, dv, of the layouts and
    dtypes the CUDA flash op gives TorchSDPAKernel (this module's CPU implementation of the op, which checks its
    inputs as mha_fwd / mha_bwd do, out token-major) and the real CPU flash op; its backward allocates exactly
    dq + dk + dv and the planner's flash-attn 2 workspace (fake_run.kernel_workspace_bytes), nothing else."""
    from ds_upipe.integration.fake_run import kernel_workspace_bytes
    from ds_upipe.tools.memory import measure_peak
    from ds_upipe.tools.memory_mode import FlashMemoryStandIn

    q, k, v, dout = _inputs(hq, hkv, torch.bfloat16, d=16)
    dout = dout.transpose(1, 2).contiguous().transpose(1, 2)  # as the pipeline hands it: token-major
    stand_in, cuda = FlashMemoryStandIn(causal=True), TorchSDPAKernel(causal=True)
    got, want = stand_in.forward(q, k, v), cuda.forward(q, k, v)
    assert [_layout(t) for t in got[:2]] == [_layout(t) for t in want[:2]]
    assert [None if t is None else _layout(t)[0::2] for t in got[2]] == [
        None if t is None else (tuple(t.shape), torch.uint64) for t in want[2]
    ]  # cum_q, cum_k undefined; the RNG state and the unused tensor (uint64 on CUDA; the CPU stand-in's int64)
    grads = stand_in.backward(dout, q, k, v, *got)
    assert [_layout(g) for g in grads] == [_layout(g) for g in cuda.backward(dout, q, k, v, *want)]
    # the real CPU flash op (native GQA: dk, dv with the KV heads): the same shapes and dtypes
    cpu = torch_sdpa.CPU_FLASH.forward(q, k, v, True, 0.25)
    assert [t.shape for t in got[:2]] == [t.shape for t in cpu[:2]] and got[1].dtype == cpu[1].dtype
    peak = measure_peak(lambda: stand_in.backward(dout, q, k, v, *got), [], torch.device("cpu"))
    workspace = kernel_workspace_bytes("fa2", q.shape, k.shape, q.element_size())
    assert workspace > 0 and peak == sum(g.numel() * g.element_size() for g in grads) + workspace
    with pytest.raises(ValueError, match="stands in for torch's CUDA flash op: fp16/bf16, head_dim a multiple of 8"):
        stand_in.forward(*(t.float() for t in (q, k, v)))
