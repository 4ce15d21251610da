"""CUDA kernel paths (torch flash / memory-efficient SDPA, flash-attn 2 and 3) against the float64 math reference,
and the GPU acceptance script's parity checks.

The CUDA tests skip on machines without CUDA (CI is CPU-only); on a GPU machine run
`pytest tests/test_gpu_kernels.py` or, for the whole acceptance, `python scripts/gpu_check.py`."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ds_upipe.kernels import (
    FA3Kernel,
    FlashAttnKernel,
    MathKernel,
    TorchSDPAKernel,
    fa3_available,
    flash_attn_available,
)

REPO = Path(__file__).resolve().parents[1]
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _check(kernel, dtype, tol, hkv, ref=None, d=64, dv=64):
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 8, 256, d, device="cuda", generator=gen, dtype=dtype)
    k = torch.randn(2, hkv, 256, d, device="cuda", generator=gen, dtype=dtype)
    v = torch.randn(2, hkv, 256, dv, device="cuda", generator=gen, dtype=dtype)
    dout = torch.randn(2, 8, 256, dv, device="cuda", generator=gen, dtype=dtype)
    ref = ref or MathKernel(causal=True)
    out_ref, lse_ref, aux_ref = ref.forward(q.double(), k.double(), v.double())
    grads_ref = ref.backward(dout.double(), q.double(), k.double(), v.double(), out_ref, lse_ref, aux_ref)
    out, lse, aux = kernel.forward(q, k, v)
    grads = kernel.backward(dout, q, k, v, out, lse, aux)
    for got, want in zip((out, *grads), (out_ref, *grads_ref)):
        assert got.shape == want.shape
        assert ((got.double() - want).abs().max() / want.abs().max()).item() < tol


@cuda
@pytest.mark.parametrize("hkv", [2, 8])
@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 2e-2), (torch.float16, 5e-3), (torch.float32, 1e-4)])
def test_torch_sdpa_cuda(dtype, tol, hkv):
    _check(TorchSDPAKernel(causal=True), dtype, tol, hkv)


@cuda
@pytest.mark.skipif(not flash_attn_available(), reason="flash-attn not installed")
@pytest.mark.parametrize("hkv", [2, 8])
def test_flash_attn(hkv):
    _check(FlashAttnKernel(causal=True), torch.bfloat16, 2e-2, hkv)


@cuda
@pytest.mark.skipif(not fa3_available(), reason="flash-attn 3 (flash_attn_interface) not installed")
@pytest.mark.parametrize("hkv", [2, 8])
@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 2e-2), (torch.float16, 5e-3)])
def test_fa3(dtype, tol, hkv):
    _check(FA3Kernel(causal=True), dtype, tol, hkv)


@cuda
@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 2e-2), (torch.float32, 1e-4)])
def test_latent_attention_value_cuda(dtype, tol):
    """Multi-head latent attention's shapes (q/k 192, v 128: DeepSeek-V3): torch's flash / efficient ops and
    flash-attn 2 (where installed) with the value padded to 192, out and dV sliced back; flash-attn 3 (where
    installed, Hopper) with the value as it is."""
    _check(TorchSDPAKernel(causal=True), dtype, tol, 8, d=192, dv=128)
    if flash_attn_available() and dtype == torch.bfloat16:
        _check(FlashAttnKernel(causal=True), dtype, tol, 8, d=192, dv=128)
    if fa3_available() and dtype == torch.bfloat16:
        _check(FA3Kernel(causal=True), dtype, tol, 8, d=192, dv=128)


@cuda
@pytest.mark.parametrize("window", [1, 40, 300])
@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 2e-2), (torch.float32, 1e-4)])
def test_sliding_window_cuda(window, dtype, tol):
    """The windowed kernel ``windowed`` builds on CUDA (flash-attn's window where installed, else tiles on
    torch's flash / memory-efficient ops, or the band mask below W = 9) against the float64 band mask."""
    from ds_upipe.windows import SlidingWindowKernel, windowed

    base = FlashAttnKernel(causal=True) if flash_attn_available() and dtype == torch.bfloat16 else TorchSDPAKernel()
    ref = SlidingWindowKernel(MathKernel(causal=True), window, fused=False)
    _check(windowed(base, window), dtype, tol, 2, ref)
    if fa3_available() and dtype == torch.bfloat16:  # FA3's own window_size=(W - 1, 0)
        _check(windowed(FA3Kernel(causal=True), window), dtype, tol, 2, ref)


@cuda
@pytest.mark.skipif(not flash_attn_available(), reason="flash-attn not installed")
@pytest.mark.parametrize("hkv", [2, 8])
@pytest.mark.parametrize("batch", [1, 2])
def test_flash_attn_varlen_documents(hkv, batch):
    """Packed rows around flash-attn: one varlen call per direction (rows with different boundaries
    concatenated when batch = 2) against every document attended alone in float64."""
    from ds_upipe.packing import DocumentBoundaries, DocumentKernel

    rows = ((0, 1, 70, 71, 256), (0, 128, 200, 256))[:batch]
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(batch, 8, 256, 64, device="cuda", generator=gen, dtype=torch.bfloat16)
    k, v = (torch.randn(batch, hkv, 256, 64, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(2))
    dout = torch.randn_like(q)
    kernel = DocumentKernel(FlashAttnKernel(causal=True), DocumentBoundaries(rows))
    assert kernel.varlen
    out, lse, aux = kernel.forward(q, k, v)
    got = (out, *kernel.backward(dout, q, k, v, out, lse, aux))
    ref, wants = MathKernel(causal=True), [torch.zeros_like(t, dtype=torch.float64) for t in (q, q, k, v)]
    for r, cu in enumerate(rows):
        for s, e in zip(cu, cu[1:]):
            qs, ks, vs, ds = (t[r : r + 1, :, s:e].double() for t in (q, k, v, dout))
            o, doc_lse, _ = ref.forward(qs, ks, vs)
            for want, piece in zip(wants, (o, *ref.backward(ds, qs, ks, vs, o, doc_lse, ()))):
                want[r : r + 1, :, s:e] = piece
    for g, want in zip(got, wants):
        assert g.shape == want.shape
        assert ((g.double() - want).abs().max() / want.abs().max()).item() < 2e-2


def test_flash_attn_refused_without_cuda_or_package():
    if flash_attn_available():
        pytest.skip("flash-attn is available here")
    with pytest.raises(ValueError, match="kernel 'flash_attn' needs a CUDA device and the flash-attn package"):
        FlashAttnKernel()


def test_fa3_refused_without_cuda_or_package():
    if fa3_available():
        pytest.skip("flash-attn 3 is available here")
    with pytest.raises(ValueError, match="kernel 'fa3' needs a CUDA device and flash-attn 3"):
        FA3Kernel()


# -- scripts/gpu_check.py's parity part, on CPU ------------------------------------------------------


def _gpu_check_module():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_check_dry_run_on_cpu(tmp_path):
    """The whole acceptance script on CPU (``--cpu-smoke``: tiny shapes), so it cannot fail on the device
    for a Python error: kernel parity, documents and pipeline rows run on CPU, the 4 gloo ranks (C = 2
    and 4) run the stage loop and the fused HF path, the layer table and the memory rows run over the fake
    group; the CUDA-only rows print SKIP; the JSON lands in --out."""
    import json

    proc = subprocess.run(
        [sys.executable, "scripts/gpu_check.py", "--cpu-smoke", "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert not [line for line in lines if line.startswith("FAIL")], lines
    for want in (
        "PASS kernel sdpa bfloat16 mqa (H=8, KV=1) S=40 d=16 full",
        "PASS documents sdpa bfloat16 gqa (H=8, KV=2) rows ((0, 1, 7, 40), (0, 33, 34, 40)) causal",
        "PASS pipeline sdpa float32 gqa (H=8, KV=2, U=2: 4 stages) S=40 causal",
        "PASS spans sdpa bfloat16 gqa (H=8, KV=2) rows (((3, 15), (20, 22)), ((30, 40),)) window 5",
        "PASS latent sdpa bfloat16 (H=8, KV=8, d=24, d_v=16, U=2: 4 stages) S=40 causal",
        "PASS ranks stage loop C=4 sdpa bfloat16 gqa (H=8, KV=2, U=C: 2 stages)",
        "PASS ranks fused HF Llama C=2 float32 (U=C) vs the single-process model",
        "PASS ranks hybrid qwen3_5 C=4 float32 (mixer U=C) vs the single-process model (gated delta net: FLA "
        "chunk_gated_delta_rule, causal_conv1d_fn)",
        "PASS ranks hybrid nemotron_h C=2 float32 (mixer U=C) vs the single-process model (Mamba-2: mamba_ssm "
        "mamba_chunk_scan_combined, causal_conv1d_fn)",
        "SKIP kernel sdpa cuda bfloat16/float16/float32: needs a CUDA device",
        "SKIP kernel fa3 bfloat16/float16: needs a CUDA device",
        "SKIP layer [expandable_segments:True]: needs a CUDA device",
        "SKIP fla memory chunk_gated_delta_rule T=200 H=2 HV=4 K=16 V=8 bf16: needs a CUDA device (the stand-in "
        "plans 0.4 MiB)",
    ):
        assert want in lines, (want, lines)
    assert any(line.startswith("PASS layer upipe-recompute-8 1K [default allocator]") for line in lines), lines
    # the memory rows: the attention as memory (tools.memory_mode), MemTracker against the planner on CPU
    assert "PASS memory upipe+input-acc+recompute U=8 128/rank [default allocator]" in lines, lines
    assert "SKIP memory [expandable_segments:True]: needs a CUDA device" in lines
    summary = next(line for line in lines if line.endswith("skipped"))
    assert summary == "40 passed, 0 failed, 4 skipped", summary
    assert lines[-1].startswith("upipe-recompute-8")  # the table comes last
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    (memory,) = result["memory"]
    assert memory["tokens_per_rank"] == 128 and abs(memory["allocated_gib"] / memory["planner_gib"] - 1) < 0.05
    assert len(result["checks"]) == 44 and [r["method"] for r in result["layer"]] == [
        "alst", "upipe-fused-8", "upipe-recompute-8",
    ]  # fmt: skip


def test_gpu_check_reports_a_wrong_kernel_and_exits_nonzero(monkeypatch, capsys, tmp_path):
    gpu_check = _gpu_check_module()
    # a kernel that ignores the causal mask: its output and gradients differ from torch SDPA's
    wrong = ("math-noncausal", lambda causal: MathKernel(causal=False, compute_dtype=torch.float32), "float32")
    monkeypatch.setattr(gpu_check, "kernel_cases", lambda device: [wrong, ("sdpa", TorchSDPAKernel, "float32")])
    assert gpu_check.main(["--cpu-smoke", "--only", "kernels", "--out", str(tmp_path)]) == 1
    lines = capsys.readouterr().out.splitlines()
    text = "\n".join(lines)
    assert "FAIL kernel math-noncausal float32 gqa (H=8, KV=2) S=40 d=16 causal: out: max error" in text
    assert "PASS kernel math-noncausal float32 gqa (H=8, KV=2) S=40 d=16 full" in lines  # it is right there
    assert "FAIL documents math-noncausal float32 mqa" in text
    assert "PASS kernel sdpa float32 gqa (H=8, KV=2) S=40 d=16 causal" in lines
    assert "FAIL latent math-noncausal float32 (H=8, KV=8, d=24, d_v=16, U=2: 4 stages) S=40 causal" in text
    assert "FAIL spans math-noncausal float32 gqa (H=8, KV=2) rows (((3, 15), (20, 22)), ((30, 40),)) window" in text
    assert lines[-1] == "16 passed, 10 failed, 1 skipped"
