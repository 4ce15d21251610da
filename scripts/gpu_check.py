"""GPU acceptance on one GPU: kernel parity, multi-rank parity over gloo, and one Llama3-8B layer.

1. Kernel parity against float64.  ``sdpa`` (torch's CUDA flash op in bf16/fp16, its
   memory-efficient op in fp32; ``flash_attn`` and ``fa3`` too when installed) forward + backward over
   MHA / GQA / MQA x S not a multiple of 32 or 128 x head_dim 64 / 128 (and 20, padded to 24 for the
   flash op) x causal / full, packed documents (two rows, several documents each, 8 query heads),
   Gemma 3's bidirectional image spans (``SpanKernel``, causal and a window shorter than a span, against
   torch SDPA with the overlay's explicit mask),
   and through the UPipe stage loop (4 stages on one rank), there also with multi-head latent
   attention's shapes (q/k head dim 192, values of 128: torch's flash ops and flash-attn 2 get v
   zero-padded to 192 and out, dv sliced back; ``fa3``, flash-attn 3 when installed, takes the 128
   natively): out, dq, dk, dv against float64 may be off
   by at most twice what torch's own ``F.scaled_dot_product_attention`` in the same dtype is off,
   plus a small floor.  With ``kernels`` too: FLA's ``chunk_gated_delta_rule`` forward + backward (when
   flash-linear-attention is installed), ``max_memory_allocated`` within 10% of the planner's stand-in
   (``ds_upipe.integration.fake_run.fla``) on the same shapes.
2. Multi-rank parity.  NCCL refuses two ranks on one GPU, so C = 2 and C = 4 processes share the
   one GPU over gloo (one spawn of 4; C = 2 is a subgroup): the stage loop
   (``UPipeDistributedAttention``) against single-process float64 attention, and the fused HF
   path (``apply_upipe(fused_projections=True)``, a tiny Llama) against the single-process model.
3. The layer table.  One Llama3-8B decoder layer at 128K, 256K, 512K, 1M tokens as rank 0 of 8 over
   torch's *fake* process group (collectives are no-ops that keep shapes: every tensor this rank
   allocates and every kernel it runs are those of an eight-GPU run, nothing moves):
   ``max_memory_allocated`` and ``max_memory_reserved`` beside the planner's prediction, with the
   default allocator and with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (each in a fresh
   process); forward + backward time of UPipe fused, fused + recompute and ALST at 256K.

4. The memory rows (issue 41: calibrating the planner's reserve).  One rank's step at 1M and 2M tokens per
   rank (8M and 16M over C = 8; the fake group as above): the Llama3-8B layer's checkpointed replay and
   backward (UPipe fused + recompute, U = 8; x and dy alive, the replayed output released: the top-layer
   phase where a long-context step peaks), the attention kernel replaced by ``tools.memory_mode``'s
   stand-in (torch's CUDA flash op's outputs and workspace, no compute: a real stage at 1M tokens a rank is
   ~10^17 FLOP), so ``max_memory_allocated`` and ``max_memory_reserved`` are real for everything else;
   printed beside the planner's figure of the same phase, with the CUDA context and other non-allocator
   memory (``mem_get_info``'s used less reserved), for both allocator settings (fresh processes).  A length
   whose plan exceeds the GPU SKIPs.  On CPU (``--cpu-smoke``) the same rows run at 128 tokens per rank
   with MemTracker against the planner (fa2 workspace).

Every check prints one line, ``PASS name``, ``FAIL name: detail`` or ``SKIP name: why``; a summary
and the table come last; everything is written as JSON to ``--out`` (default ``$OUT``, else
runs/gpu_check); the exit status is 1 if any check failed.

    python scripts/gpu_check.py                 # the whole acceptance (about 4 minutes on an H200)
    python scripts/gpu_check.py --only kernels  # one part: kernels, ranks, layer or memory
    python scripts/gpu_check.py --cpu-smoke     # the CPU dry run: tiny shapes, CUDA rows SKIP
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

WORLD = 8
LLAMA3_8B = {"heads": 32, "kv_heads": 8, "head_dim": 128, "hidden": 4096, "intermediate": 14336}
TINY = {"heads": 32, "kv_heads": 8, "head_dim": 16, "hidden": 256, "intermediate": 512}

#: (name, query heads, KV heads) of the parity shapes
HEADS = (("mha", 8, 8), ("gqa", 8, 2), ("mqa", 8, 1))
#: error allowed on top of twice torch SDPA's own, relative to the largest reference value
FLOOR = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1e-2}
#: per batch row, the cumulative document lengths of the packed-documents parity case (two rows)
DOCUMENTS = {200: ((0, 1, 70, 71, 200), (0, 128, 199, 200)), 40: ((0, 1, 7, 40), (0, 33, 34, 40))}
#: per batch row, the image spans of the bidirectional-spans case (Gemma 3's overlay), and a window shorter than them
SPANS = {200: (((3, 70), (71, 120)), ((150, 200),)), 40: (((3, 15), (20, 22)), ((30, 40),))}
SPAN_WINDOW = {200: 16, 40: 5}
#: the layer table's planner check: allocated within this fraction of the prediction
PLANNER_TOLERANCE = 0.15
TIMED_SEQ = 2**18  # 256K: the timed row of the layer table
#: multi-head latent attention's (q/k, value) head dims: DeepSeek-V3's 128 + 64 and 128 (smoke: 24 and 16)
LATENT_DIMS = {False: (192, 128), True: (24, 16)}
PARTS = ("kernels", "ranks", "layer", "memory")
#: the memory rows' tokens per rank (smoke: 128) and their method: the long-context configs' attention
MEMORY_TOKENS_PER_RANK = (2**20, 2**21)
#: the memory rows run the attention and long-context stack of the config the long-context plans are made for
MEMORY_CONFIG = REPO / "ds_configs" / "upipe_llama3_8b_8m.json"


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    from ds_upipe.tools.cli import parse_token_list

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=parse_token_list, default=None, help="global lengths (default 128K,256K,512K,1M)")
    p.add_argument("--methods", default="alst,upipe-fused-8,upipe-recompute-8")
    p.add_argument("--repeats", type=int, default=2, help="timed steps at 256K after one warm-up step (0: none)")
    p.add_argument("--budget-s", type=float, default=420.0, help="start no new layer length after this many seconds")
    p.add_argument("--only", choices=PARTS, default=None, help="run one part")
    p.add_argument("--cpu-smoke", action="store_true", help="the CPU dry run: tiny shapes, CUDA rows SKIP")
    p.add_argument("--out", type=Path, default=None, help="folder for gpu_check.json (default $OUT or runs/gpu_check)")
    p.add_argument("--alloc-conf", default="", help=argparse.SUPPRESS)  # the layer child's allocator setting
    p.add_argument("--layer-child", type=Path, default=None, help=argparse.SUPPRESS)  # where a child writes its rows
    return p.parse_args(argv)


def report(name: str, failure: str | None) -> bool:
    """Print the check's one line; True when it passed."""
    print(f"PASS {name}" if failure is None else f"FAIL {name}: {failure}", flush=True)
    return failure is None


def skip(name: str, why: str) -> None:
    print(f"SKIP {name}: {why}", flush=True)


#: the FLA memory check: FLA's chunk gated delta rule within this fraction of the fake run's stand-in
FLA_TOLERANCE = 0.10


def fla_memory_check(device: str, smoke: bool) -> dict:
    """FLA's ``chunk_gated_delta_rule`` forward + backward as transformers calls it (bf16, l2 norm in the kernel,
    grouped value heads): ``max_memory_allocated`` (inputs, their gradients and the kernel's own buffers)
    against the peak of the planner's stand-in (``fake_run.fla``) on fake tensors of the same shapes."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ds_upipe.integration.fake_run import fla, track

    b, t, h, hv, dk, dv = (1, 200, 2, 4, 16, 8) if smoke else (1, 2**16, 4, 8, 128, 128)
    name = f"fla memory chunk_gated_delta_rule T={t} H={h} HV={hv} K={dk} V={dv} bf16"

    def inputs(dev: str) -> list:
        def make(*shape, dtype=torch.bfloat16, grad=True):
            x = torch.empty(*shape, dtype=dtype, device=dev)
            return x.requires_grad_() if grad else x

        g = make(b, t, hv, dtype=torch.float32)
        return [
            make(b, t, h, dk),
            make(b, t, h, dk),
            make(b, t, hv, dv),
            g,
            make(b, t, hv),
            make(b, t, hv, dv, grad=False),
        ]

    with FakeTensorMode():
        q, k, v, g, beta, do = inputs("cpu")
        planned = track(
            lambda o: o.backward(do),
            {"q, k, v, g, beta, do": [q, k, v, g, beta, do]},
            [],
            forward=lambda: fla.chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0],
        ).total
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        chunk_gated_delta_rule = None
    if device != "cuda" or chunk_gated_delta_rule is None:
        why = "needs a CUDA device" if device != "cuda" else "flash-linear-attention is not installed"
        skip(name, f"{why} (the stand-in plans {planned / 2**20:.1f} MiB)")
        return {"check": name, "status": "SKIP", "detail": why, "planned_bytes": planned}
    q, k, v, g, beta, do = inputs("cuda")
    with torch.no_grad():
        for x in (q, k, v, beta, do):
            x.normal_()
        g.uniform_(-0.1, 0.0)
        beta.sigmoid_()

    def step() -> None:
        o, _ = chunk_gated_delta_rule(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)
        o.backward(do)

    step()  # Triton's autotuning and compilation outside the measured step
    for x in (q, k, v, g, beta):
        x.grad = None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated()
    off = planned / measured - 1
    failure = None if abs(off) <= FLA_TOLERANCE else f"planned {planned} B is {off:+.1%} off FLA's {measured} B"
    report(f"{name}: planned {off:+.1%} of measured", failure)
    return {
        "check": name,
        "status": "PASS" if failure is None else "FAIL",
        "planned_bytes": planned,
        "measured_bytes": measured,
        "detail": failure,
    }


# -- 1. kernel parity ----------------------------------------------------------------------------


def kernel_cases(device: str) -> list[tuple[str, Callable[[], object] | str, str]]:
    """(kernel name, factory or the reason it cannot run here, dtype name) for every parity case."""
    from ds_upipe.kernels import FA3Kernel, FlashAttnKernel, TorchSDPAKernel, fa3_available, flash_attn_available

    if device == "cpu":
        no_cuda = "needs a CUDA device"
        return [
            ("sdpa", TorchSDPAKernel, "float32"),
            ("sdpa", TorchSDPAKernel, "bfloat16"),
            ("sdpa cuda", no_cuda, "bfloat16/float16/float32"),
            ("flash_attn", no_cuda, "bfloat16/float16"),
            ("fa3", no_cuda, "bfloat16/float16"),
        ]
    flash = FlashAttnKernel if flash_attn_available() else "flash-attn is not installed"
    # FA3 (Hopper): its latent row runs the value head dim natively, the others' pad it
    fa3 = FA3Kernel if fa3_available() else "flash-attn 3 (flash_attn_interface, built from hopper/) is not installed"
    return [("sdpa", TorchSDPAKernel, dt) for dt in ("bfloat16", "float16", "float32")] + [
        (name, factory, dt) for name, factory in (("flash_attn", flash), ("fa3", fa3)) for dt in ("bfloat16", "float16")
    ]


def _sdpa_autograd(q, k, v, dout, causal: bool):
    """torch's own attention and its q/k/v gradients: F.scaled_dot_product_attention under autograd."""
    import torch
    import torch.nn.functional as F

    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])
    return (out, *torch.autograd.grad(out, (q, k, v), dout))


def _per_document(run: Callable, documents) -> Callable:
    """``run`` on every document of every row alone, stitched back: the packed rows' reference."""
    import torch

    def stitched(q, k, v, dout, causal: bool):
        outs = [torch.empty_like(t) for t in (q, q, k, v)]
        for r, cu in enumerate(documents):
            for s, e in zip(cu, cu[1:]):
                pieces = run(*(t[r : r + 1, :, s:e] for t in (q, k, v, dout)), causal)
                for o, piece in zip(outs, pieces):
                    o[r : r + 1, :, s:e] = piece
        return tuple(outs)

    return stitched


def _overlay_mask(spans, seq: int, window: int | None, device: str):
    """[b, 1, S, S] boolean mask of Gemma 3's image overlay: causal, or a whole span inside it, then the window
    (transformers' ``AND(sliding_window_overlay, OR(causal, blockwise))``)."""
    import torch

    i, j = torch.arange(seq, device=device)[:, None], torch.arange(seq, device=device)[None, :]
    mask = (j <= i).expand(len(spans), seq, seq).clone()
    for r, row in enumerate(spans):
        for s, e in row:
            mask[r, s:e, s:e] = True
    if window is not None:
        mask &= j > i - window
    return mask[:, None]


def _sdpa_masked(mask) -> Callable:
    """torch's own attention under an explicit mask, and its q/k/v gradients: the spans' reference."""
    import torch
    import torch.nn.functional as F

    def run(q, k, v, dout, causal: bool):
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
        return (out, *torch.autograd.grad(out, (q, k, v), dout))

    return run


def _upipe_attention(kernel, q, k, v, dout, head_chunk_size: int):
    """The kernel inside the UPipe pipeline on one rank ([b, h, S, d] in and out): several stages,
    each saving its lse and aux for its own backward."""
    import torch

    from ds_upipe.pipeline import PipelineContext, PlanIndices, UPipeAttentionFunction
    from ds_upipe.schedule import build_plan

    plan = build_plan(q.shape[1], k.shape[1], 1, head_chunk_size)
    pctx = PipelineContext(plan=plan, indices=PlanIndices.build(plan, q.device), group=None, attention=kernel)
    q, k, v = (t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v))
    out = UPipeAttentionFunction.apply(q, k, v, pctx)
    grads = torch.autograd.grad(out, (q, k, v), dout.transpose(1, 2))
    return tuple(t.transpose(1, 2) for t in (out, *grads))


def _kernel_attention(kernel, q, k, v, dout):
    out, lse, aux = kernel.forward(q, k, v)
    return (out, *kernel.backward(dout, q, k, v, out, lse, aux))


def parity(
    run: Callable,
    dtype_name: str,
    hq: int,
    hkv: int,
    device: str,
    seq: int,
    head_dim: int,
    causal: bool = True,
    reference: Callable = _sdpa_autograd,
    value_head_dim: int | None = None,
) -> str | None:
    """None when ``run(q, k, v, dout) -> (out, dq, dk, dv)`` agrees with ``reference`` (torch SDPA) in
    float64 within twice the reference's own error in this dtype plus a floor; else what differs.
    ``value_head_dim``: v and dout of their own head dim (latent attention; None: ``head_dim``)."""
    import torch

    dtype = getattr(torch, dtype_name)
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(h: int, d: int = head_dim):
        return torch.randn(2, h, seq, d, generator=gen, device=device, dtype=torch.float64)

    dv = value_head_dim or head_dim
    q64, k64, v64, dout64 = rand(hq), rand(hkv), rand(hkv, dv), rand(hq, dv)
    q, k, v, dout = (t.to(dtype) for t in (q64, k64, v64, dout64))
    exact = reference(*(t.double() for t in (q, k, v, dout)), causal)  # the same inputs, in float64
    torch_same = reference(q, k, v, dout, causal)
    got = run(q, k, v, dout)
    for name, g, t, e in zip(("out", "dq", "dk", "dv"), got, torch_same, exact):
        if g.shape != e.shape or g.dtype != dtype:
            return f"{name}: {tuple(g.shape)} {g.dtype}, expected {tuple(e.shape)} {dtype}"
        scale = e.abs().max().item()
        err = (g.double() - e).abs().max().item() / scale
        allowed = 2 * (t.double() - e).abs().max().item() / scale + FLOOR[dtype_name]
        if not err <= allowed:  # also catches NaN
            return f"{name}: max error {err:.2e} of the largest value > {allowed:.2e} (2x torch SDPA's own + floor)"
    return None


def run_kernel_checks(device: str, smoke: bool) -> list[dict]:
    """Parity of every kernel with torch SDPA, alone, on packed documents and inside the pipeline."""
    from ds_upipe.packing import DocumentBoundaries, DocumentKernel
    from ds_upipe.spans import BidirectionalSpans, SpanKernel
    from ds_upipe.windows import windowed

    seqs, dims = ((40,), (16,)) if smoke else ((200, 333), (64, 128))
    rows = []
    for kernel_name, factory, dtype_name in kernel_cases(device):
        if isinstance(factory, str):
            skip(f"kernel {kernel_name} {dtype_name}", factory)
            rows.append({"check": f"kernel {kernel_name} {dtype_name}", "status": "SKIP", "detail": factory})
            continue
        half = dtype_name != "float32"
        # head_dim 20: not a multiple of 8, padded to 24 for the fp16/bf16 flash op (sdpa only)
        odd = (20,) if half and kernel_name == "sdpa" and not smoke else ()
        for (heads, hq, hkv), seq, d, causal in (
            (h, s, d, c) for h in HEADS for s in seqs for d in dims + odd for c in (True, False)
        ):
            name = f"kernel {kernel_name} {dtype_name} {heads} (H={hq}, KV={hkv}) S={seq} d={d} {_mask(causal)}"
            run = _run_kernel(factory, causal)
            rows.append(_check(name, run, dtype_name, hq, hkv, device, seq, d, causal))
        seq = 40 if smoke else 200
        documents = DOCUMENTS[seq]
        for heads, hq, hkv in HEADS:
            name = f"documents {kernel_name} {dtype_name} {heads} (H={hq}, KV={hkv}) rows {documents} causal"

            def run(q, k, v, dout, factory=factory, documents=documents):
                kernel = DocumentKernel(factory(causal=True), DocumentBoundaries(documents))
                return _kernel_attention(kernel, q, k, v, dout)

            reference = _per_document(_sdpa_autograd, documents)
            rows.append(_check(name, run, dtype_name, hq, hkv, device, seq, dims[0], True, reference))
        spans = SPANS[seq]
        for window in (None, SPAN_WINDOW[seq]):
            name = f"spans {kernel_name} {dtype_name} gqa (H=8, KV=2) rows {spans} window {window}"

            def run(q, k, v, dout, factory=factory, spans=spans, window=window):
                base = factory(causal=True)
                kernel = SpanKernel(windowed(base, window), base, BidirectionalSpans(spans))
                return _kernel_attention(kernel, q, k, v, dout)

            reference = _sdpa_masked(_overlay_mask(spans, seq, window, device))
            rows.append(_check(name, run, dtype_name, 8, 2, device, seq, dims[0], True, reference))
        name = f"pipeline {kernel_name} {dtype_name} gqa (H=8, KV=2, U=2: 4 stages) S={seqs[0]} causal"
        rows.append(_check(name, _run_upipe(factory), dtype_name, 8, 2, device, seqs[0], dims[0]))
        # latent attention after its up-projection: every query head its own K/V head, values narrower
        d, dv = LATENT_DIMS[smoke]
        name = f"latent {kernel_name} {dtype_name} (H=8, KV=8, d={d}, d_v={dv}, U=2: 4 stages) S={seqs[0]} causal"
        rows.append(_check(name, _run_upipe(factory), dtype_name, 8, 8, device, seqs[0], d, True, _sdpa_autograd, dv))
    return rows


def _mask(causal: bool) -> str:
    return "causal" if causal else "full"


def _run_kernel(factory: Callable, causal: bool = True) -> Callable:
    return lambda q, k, v, dout: _kernel_attention(factory(causal=causal), q, k, v, dout)


def _run_upipe(factory: Callable) -> Callable:
    return lambda q, k, v, dout: _upipe_attention(factory(causal=True), q, k, v, dout, head_chunk_size=2)


def _check(name: str, run: Callable, *parity_args) -> dict:
    """``parity(run, *parity_args)`` reported as one line; a crash is this check's failure."""
    try:
        failure = parity(run, *parity_args)
    except Exception as err:  # noqa: BLE001 - the other checks still run
        failure = f"{type(err).__name__}: {err}"
    report(name, failure)
    return {"check": name, "status": "PASS" if failure is None else "FAIL", "detail": failure}


# -- 2. multi-rank parity over gloo, every rank on the one device ----------------------------------


def rank_checks(rank: int, world: int, device_name: str, smoke: bool) -> dict[str, str | None]:
    """On each of 4 ranks (C = 4, and C = 2 on ranks 0 and 1): the stage loop and the fused HF path
    against single-process float64; returns {check: failure or None} (rank 0's is reported)."""
    import torch
    import torch.distributed as dist

    device = torch.device(device_name, 0) if device_name == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    groups = {2: dist.new_group([0, 1]), 4: dist.group.WORLD}
    results: dict[str, str | None] = {}
    for c, group in groups.items():
        if rank >= c:
            continue
        for dtype_name, tol in (("float32", 1e-4), ("bfloat16", 3e-2)):
            name = f"ranks stage loop C={c} sdpa {dtype_name} gqa (H=8, KV=2, U=C: {8 // c} stages)"
            results[name] = _guard(_stage_loop_case, rank, c, group, device, dtype_name, tol)
        name = f"ranks fused HF Llama C={c} float32 (U=C) vs the single-process model"
        results[name] = _guard(_fused_hf_case, group, device, c)
        for family, kernels in HYBRID_FAMILIES.items():
            name = f"ranks hybrid {family} C={c} float32 (mixer U=C) vs the single-process model ({kernels})"
            results[name] = _guard(_hybrid_case, group, device, c, family)
    return results


def _guard(case: Callable[..., str | None], *args) -> str | None:
    try:
        return case(*args)
    except Exception as err:  # noqa: BLE001 - the other checks still run
        return f"{type(err).__name__}: {err}"


def _stage_loop_case(rank, world, group, device, dtype_name: str, tol: float) -> str | None:
    import torch

    from ds_upipe import UPipeDistributedAttention
    from ds_upipe.kernels import TorchSDPAKernel
    from tests.core_cases import local_shard, make_inputs, reference_attention, relative_error

    dtype = getattr(torch, dtype_name)
    q, k, v, dout = make_inputs(0, 2, 50 * world, 8, 2, 64, dtype)  # 50 tokens a rank: not a multiple of 32
    full = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref = reference_attention(*full, True)
    ref.backward(dout)
    mine = [local_shard(t, rank, world, 0).to(device, dtype).requires_grad_(True) for t in (q, k, v)]
    attn = UPipeDistributedAttention(TorchSDPAKernel(causal=True), group, head_chunk_size=world)
    out = attn(*mine, 0)
    out.backward(local_shard(dout, rank, world, 0).to(device, dtype))
    errors = {"out": relative_error(out.cpu(), local_shard(ref.detach(), rank, world, 0))}
    for n, t, r in zip("qkv", mine, full):
        errors[f"d{n}"] = relative_error(t.grad.cpu(), local_shard(r.grad, rank, world, 0))
    bad = {n: e for n, e in errors.items() if not e <= tol}
    return None if not bad else f"relative errors above {tol:g}: {bad}"


def _fused_hf_case(group, device, world: int) -> str | None:
    import torch

    from tests import hf_cases

    seq = 12 * world
    data = {n: t.to(device) for n, t in hf_cases.make_batch(0, 2, seq).items()}
    model = hf_cases.build_model("llama", torch.float64).to(device)
    ref = hf_cases.reference_step(model, data)  # float64, one process, the whole sequence
    model = model.float()
    hf_cases.patch_model(model, group, None, True, False, False)
    got = hf_cases.sharded_step(model, data, group)
    errors = hf_cases.compare(ref, got, seq)
    bad = {n: e for n, e in errors.items() if not e <= 1e-4}
    return None if not bad else f"relative errors above 1e-4 (float32 vs float64): {bad}"


#: hybrid model -> the CUDA kernels its sequence mixers call where installed (FLA, causal-conv1d, mamba_ssm;
#: transformers' torch fallbacks otherwise): each row runs the mixer head-sharded in stages on the device
HYBRID_FAMILIES = {
    "qwen3_5": "gated delta net: FLA chunk_gated_delta_rule, causal_conv1d_fn",
    "nemotron_h": "Mamba-2: mamba_ssm mamba_chunk_scan_combined, causal_conv1d_fn",
}


def _hybrid_case(group, device, world: int, family: str) -> str | None:
    import torch

    import hf_patches
    from tests import hf_cases, mixer_gated_delta_cases, mixer_mamba2_cases

    build = mixer_gated_delta_cases.build_model if family == "qwen3_5" else mixer_mamba2_cases.build
    seq = 16 * world
    data = {n: t.to(device) for n, t in hf_cases.make_batch(0, 2, seq).items()}
    model = build(family).to(device=device, dtype=torch.float64)
    ref = hf_cases.reference_step(model, data)  # float64 torch fallbacks, one process, the whole sequence
    model = model.float()  # the CUDA kernels take float32 / half
    hf_patches.apply_upipe(model, group)
    got = hf_cases.sharded_step(model, data, group)
    errors = hf_cases.compare(ref, got, seq)
    # transformers computes some of these models' internals in float32 anyway (norms, A_log's exp)
    bad = {n: e for n, e in errors.items() if not e <= 1e-4}
    return None if not bad else f"relative errors above 1e-4 (float32 vs float64): {bad}"


def run_rank_checks(device_name: str, smoke: bool) -> list[dict]:
    from ds_upipe.tools.ranks import run_ranks

    try:
        per_rank = run_ranks(rank_checks, 4, device_name, smoke, backend="gloo", threads=1 if smoke else 2, timeout=240)
    except Exception as err:  # noqa: BLE001 - reported as the part's failure
        report("ranks (4 processes over gloo)", f"{type(err).__name__}: {str(err)[-2000:]}")
        return [{"check": "ranks", "status": "FAIL", "detail": str(err)[-4000:]}]
    rows = []
    for name, failure in per_rank[0].items():
        others = [r.get(name) for r in per_rank[1:] if name in r]
        failure = failure or next((f for f in others if f), None)  # any rank's failure fails the check
        report(name, failure)
        rows.append({"check": name, "status": "PASS" if failure is None else "FAIL", "detail": failure})
    return rows


# -- 3. the layer table ----------------------------------------------------------------------------


def _method(name: str):
    from ds_upipe.tools.bench import Method

    if name == "alst":
        return Method("alst", "alst")
    kind, mode, u = name.split("-")
    if kind != "upipe" or mode not in ("fused", "recompute", "unfused"):
        raise ValueError(f"method {name!r}: use alst or upipe-fused-U / upipe-recompute-U / upipe-unfused-U")
    # recompute: fused with recompute_attention_output
    return Method.upipe(
        name, int(u), False, fused_projections=mode != "unfused", recompute_attention_output=mode == "recompute"
    )


def _init_fake_group(device: str) -> None:
    """Rank 0 of eight over the fake backend; deepspeed.comm wraps the same group (ALST talks through it)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if device == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29599", RANK="0", LOCAL_RANK="0", WORLD_SIZE=str(WORLD))
    dist.init_process_group("fake", rank=0, world_size=WORLD, store=FakeStore())
    import deepspeed

    deepspeed.init_distributed(dist_backend="fake", verbose=False)


def layer_rows(args: argparse.Namespace, device_name: str, alloc: str) -> list[dict]:
    """This process's layer rows (one allocator setting): memory at every length, time at 256K."""
    import torch

    from ds_upipe.tools import planner
    from ds_upipe.tools.bench import BenchSpec, build_layer, layer_case

    smoke = args.cpu_smoke
    seqs = args.seq or ([1024] if smoke else [2**17, 2**18, 2**19, 2**20])
    timed_seq = seqs[0] if smoke else TIMED_SEQ
    shapes = TINY if smoke else LLAMA3_8B
    spec = BenchSpec(
        world=WORLD,
        seq_lens=seqs,
        levels=("layer",),
        tiled_mlp=True,
        dtype="float32" if smoke else "bfloat16",
        repeats=0,
        warmup=0,
        device=device_name,
        **shapes,
    )
    timed = dataclasses.replace(spec, repeats=args.repeats, warmup=1)
    methods = [_method(m.strip()) for m in args.methods.split(",") if m.strip()]
    dims = planner.ModelDims(
        "check", spec.heads, spec.kv_heads, spec.head_dim, spec.hidden_size, spec.intermediate_size, 1, 128
    )
    setup = planner.TrainSetup(
        gpus=WORLD,
        dtype="fp32" if smoke else "bf16",
        tiled_mlp=True,
        tiled_norm=False,
        tiled_loss=False,
        kernel="none" if smoke else "fa2",
    )
    # the planner's fake-tensor runs need a process without a process group: before the fake group below
    predicted = {
        (m.name, seq): planner.layer_peak(
            dims,
            setup,
            planner.measured_scheme(m.kind, m.options),
            seq,
        ).total
        for m in methods
        for seq in seqs
    }
    _init_fake_group(device_name)
    device = torch.device(device_name, 0) if device_name == "cuda" else torch.device("cpu")
    start = time.monotonic()
    rows: list[dict] = []
    layers: dict = {}
    for seq in seqs:
        if time.monotonic() - start > args.budget_s:
            skip(f"layer {planner.fmt_tokens(seq)} and longer [{alloc}]", f"--budget-s {args.budget_s:.0f} reached")
            break
        for m in methods:
            row = {"method": m.name, "seq_len": seq, "alloc": alloc}
            try:
                if m.name not in layers:
                    layers[m.name] = build_layer(m, spec, device)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats(device)
                res = layer_case(*layers[m.name], spec, seq, 0, device)
                pred = predicted[(m.name, seq)]
                row.update(allocated_gib=res["peak"] / 2**30, activation_gib=res["intermediate"] / 2**30)
                row["planner_gib"] = pred / 2**30
                if device.type == "cuda":
                    row["max_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
                    row["max_reserved_gib"] = torch.cuda.max_memory_reserved(device) / 2**30
                del res
                if seq == timed_seq and args.repeats and not alloc:
                    row["time_s"] = layer_case(*layers[m.name], timed, seq, 0, device)["time"]
                off = row["allocated_gib"] / row["planner_gib"] - 1
                if abs(off) > PLANNER_TOLERANCE:
                    row["error"] = f"allocated {row['allocated_gib']:.3f} GiB is {off:+.0%} off the planner's"
            except Exception as err:  # noqa: BLE001 - reported in the table, the other cases still run
                row["error"] = f"{type(err).__name__}: {err}"
                traceback.print_exc()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            rows.append(row)
            label = f"layer {m.name} {planner.fmt_tokens(seq)} [{alloc or 'default allocator'}]"
            report(f"{label} ({time.monotonic() - start:.0f}s)", row.get("error"))
    _close_fake_group()
    return rows


def memory_rows(args: argparse.Namespace, device_name: str, alloc: str) -> list[dict]:
    """This process's memory rows (one allocator setting): one rank's checkpointed layer replay + backward at each
    length, the attention kernel as ``memory_mode.FlashMemoryStandIn``, beside the planner's figure."""
    import torch

    from ds_upipe.tools import planner
    from ds_upipe.tools.bench import BenchSpec, Method, build_layer, layer_inputs
    from ds_upipe.tools.memory_mode import use_memory_stand_in

    smoke = args.cpu_smoke
    per_rank = (128,) if smoke else MEMORY_TOKENS_PER_RANK
    seqs = [WORLD * t for t in per_rank]
    shapes = TINY if smoke else LLAMA3_8B
    # bf16 on CPU too: the stand-in is the flash op, which has no float32 kernel
    spec = BenchSpec(world=WORLD, seq_lens=seqs, levels=("layer",), tiled_mlp=True, dtype="bfloat16",
                     repeats=0, warmup=0, device=device_name, **shapes)  # fmt: skip
    # the config's attention (fused, recompute, input-dtype accumulation) at U = C and its stack (tiled norms and
    # MLP), checkpointed; the stand-in allocates flash-attn 2's workspace; no ZeRO terms: the rows measure the layer
    # phase to which the planner's whole step adds them
    raw = {**json.loads(MEMORY_CONFIG.read_text()), "sequence_parallel_size": WORLD}
    setup, scheme, _ = planner.from_ds_config(raw)
    setup = dataclasses.replace(setup, kernel="fa2", offload_checkpoints=False)
    scheme = dataclasses.replace(scheme, options=dataclasses.replace(scheme.options, head_chunk_size=WORLD))
    method = Method(scheme.label, "upipe", scheme.options)
    dims = planner.ModelDims(
        "check", spec.heads, spec.kv_heads, spec.head_dim, spec.hidden_size, spec.intermediate_size, 1, 128
    )
    # before the fake group; the second allocator's process reads the first's (the fake runs take ~30 s a length)
    cache = _out_dir(args) / f"memory-planned{'-smoke' if smoke else ''}.json"
    known = {int(k): v for k, v in json.loads(cache.read_text()).items()} if cache.exists() else {}
    predicted = {seq: known.get(seq) or planner.layer_peak(dims, setup, scheme, seq).total for seq in seqs}
    cache.write_text(json.dumps(predicted))
    _init_fake_group(device_name)
    device = torch.device(device_name, 0) if device_name == "cuda" else torch.device("cpu")
    capacity = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else math.inf
    layer, rotary = build_layer(method, spec, device, long_context=True)
    use_memory_stand_in(layer)
    rows: list[dict] = []
    for seq in seqs:
        label = f"memory {method.name} {planner.fmt_tokens(seq // WORLD)}/rank [{alloc or 'default allocator'}]"
        row = {"method": method.name, "seq_len": seq, "tokens_per_rank": seq // WORLD, "alloc": alloc,
               "planner_gib": predicted[seq] / 2**30}  # fmt: skip
        if predicted[seq] > capacity:
            why = f"planned {predicted[seq] / 2**30:.1f} GiB > this GPU's {capacity / 2**30:.1f} GiB"
            skip(label, why)
            rows.append({**row, "skipped": why})
            continue
        try:
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
            peak = _replay_peak(layer, layer_inputs(rotary, spec, seq, 0, device), device)
            row["allocated_gib"] = peak / 2**30
            if device.type == "cuda":
                free, total = torch.cuda.mem_get_info(device)
                row["max_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
                row["max_reserved_gib"] = torch.cuda.max_memory_reserved(device) / 2**30
                # the CUDA context, cuBLAS/NCCL-free library memory: what the device uses outside the allocator
                row["outside_allocator_gib"] = (total - free - torch.cuda.memory_reserved(device)) / 2**30
            layer.zero_grad(set_to_none=True)
            off = row["allocated_gib"] / row["planner_gib"] - 1
            if abs(off) > PLANNER_TOLERANCE:
                row["error"] = f"allocated {row['allocated_gib']:.3f} GiB is {off:+.0%} off the planner's"
        except Exception as err:  # noqa: BLE001 - reported in the table, the other rows still run
            row["error"] = f"{type(err).__name__}: {err}"
            traceback.print_exc()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        rows.append(row)
        report(label, row.get("error"))
    _close_fake_group()
    return rows


def _close_fake_group() -> None:
    """Undo ``_init_fake_group``, so that the next part's planner runs its fake runs (they need a process without a
    process group) and opens the group again (on CPU the parts share one process)."""
    import torch.distributed as dist

    from ds_upipe.integration.fake_run import _release_deepspeed_sp_groups

    _release_deepspeed_sp_groups()
    dist.destroy_process_group()
    comm = sys.modules.get("deepspeed.comm.comm")
    if comm is not None:
        comm.cdb = None


def _replay_peak(layer, inputs: tuple, device) -> int:
    """Peak bytes of what a checkpoint's backward runs for ``layer`` (tests/bench_cases.py's replay point): the
    replay through ``without_recomputed_outputs`` (its output released) and the backward from dy, x and dy alive."""
    from ds_upipe.integration.checkpointing import without_recomputed_outputs
    from ds_upipe.tools.memory import measure_peak

    x0, dy, pos, cos, sin = inputs
    x = x0.requires_grad_(True)

    def step() -> None:
        without_recomputed_outputs(layer, x, position_embeddings=(cos, sin), position_ids=pos).backward(dy)

    return measure_peak(step, [layer, x, dy, cos, sin, pos], device)


def run_child_rows(args: argparse.Namespace, device_name: str, deadline: float, part: str) -> list[dict]:
    """``part``'s rows ("layer" or "memory") with the default allocator and with expandable segments, each in a
    fresh process on CUDA (the allocator setting is read at CUDA's start); on CPU the default in this process."""
    rows_of = layer_rows if part == "layer" else memory_rows
    for cache in _out_dir(args).glob("memory-planned*.json"):  # the memory rows' plans are made afresh each run
        cache.unlink()
    if device_name == "cpu":
        rows = rows_of(args, device_name, "")
        skip(f"{part} [expandable_segments:True]", "needs a CUDA device")
        return rows
    rows: list[dict] = []
    for alloc in ("", "expandable_segments:True"):
        left = deadline - time.monotonic()
        if left < 30:
            skip(f"{part} [{alloc or 'default allocator'}]", "the acceptance's time is spent")
            continue
        out = _out_dir(args) / f"{part}{'-expandable' if alloc else ''}.json"
        env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": alloc} if alloc else dict(os.environ)
        cmd = [sys.executable, __file__, "--only", part, "--layer-child", str(out), "--methods", args.methods]
        cmd += ["--repeats", str(args.repeats), "--budget-s", str(min(args.budget_s, left * 0.45))]
        cmd += ["--alloc-conf", alloc] + (["--seq", ",".join(map(str, args.seq))] if args.seq else [])
        try:
            subprocess.run(cmd, env=env, timeout=max(left - 10, 1), check=False)
            rows += json.loads(out.read_text())
        except Exception as err:  # noqa: BLE001 - a crashed or timed-out child fails its rows
            report(f"{part} [{alloc or 'default allocator'}]", f"{type(err).__name__}: {err}")
            rows.append({"method": "-", "seq_len": 0, "alloc": alloc, "error": f"{type(err).__name__}: {err}"})
    return rows


def _out_dir(args: argparse.Namespace) -> Path:
    out = args.out or Path(os.environ.get("OUT") or REPO / "runs" / "gpu_check")
    out.mkdir(parents=True, exist_ok=True)
    return out


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    import torch

    if not args.cpu_smoke and not torch.cuda.is_available():
        print("no CUDA device: run with --cpu-smoke for the CPU dry run", file=sys.stderr)
        return 2
    device_name = "cpu" if args.cpu_smoke else "cuda"
    if args.layer_child is not None:  # one allocator setting's layer or memory rows, for the parent
        rows_of = memory_rows if args.only == "memory" else layer_rows
        args.layer_child.write_text(json.dumps(rows_of(args, device_name, args.alloc_conf)))
        return 0
    deadline = time.monotonic() + 450  # 7.5 minutes: inside one 8-minute device call
    gpu = torch.cuda.get_device_name(0) if device_name == "cuda" else "cpu"
    print(f"ds-upipe GPU acceptance on {gpu}: torch {torch.__version__}, CUDA {torch.version.cuda}", flush=True)
    checks: list[dict] = []
    if args.only in (None, "kernels"):
        checks += run_kernel_checks(device_name, args.cpu_smoke)
        checks.append(fla_memory_check(device_name, args.cpu_smoke))
    if args.only in (None, "ranks"):
        checks += run_rank_checks(device_name, args.cpu_smoke)
    memory: list[dict] = []
    if args.only in (None, "memory"):
        memory = run_child_rows(args, device_name, deadline, "memory")
        checks += [
            {
                "check": f"memory {r['method']} {r['seq_len']} [{r['alloc']}]",
                "status": "SKIP" if "skipped" in r else "FAIL" if "error" in r else "PASS",
            }
            for r in memory
        ]
    layer: list[dict] = []
    if args.only in (None, "layer"):
        layer = run_child_rows(args, device_name, deadline, "layer")
        checks += [
            {
                "check": f"layer {r['method']} {r['seq_len']} [{r['alloc']}]",
                "status": "FAIL" if "error" in r else "PASS",
            }
            for r in layer
        ]
    failed = sum(c["status"] == "FAIL" for c in checks)
    passed = sum(c["status"] == "PASS" for c in checks)
    skipped = sum(c["status"] == "SKIP" for c in checks)
    out = _out_dir(args) / "gpu_check.json"
    versions = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": gpu}
    out.write_text(json.dumps({**versions, "checks": checks, "layer": layer, "memory": memory}, indent=2))
    print(f"wrote {out}", flush=True)
    print(f"{passed} passed, {failed} failed, {skipped} skipped", flush=True)
    if memory:
        print(_memory_table(memory, gpu))
    if layer:
        print(_table(layer, gpu))  # last, so it is what a reader sees
    return 1 if failed else 0


def _memory_table(rows: list[dict], gpu: str) -> str:
    """The memory rows: the step's peak (weights, inputs and what it allocates), the allocator's max allocated /
    reserved, memory outside the allocator (CUDA context, libraries), the planner's figure."""
    from ds_upipe.tools.planner import fmt_tokens

    done = [r for r in rows if "allocated_gib" in r]
    unit, div = ("GiB", 1.0) if done and max(r["allocated_gib"] for r in done) >= 1 else ("MiB", 1 / 1024)
    lines = [
        f"one rank's checkpointed Llama3-8B layer replay + backward, rank 0 of C={WORLD} (FAKE group), attention "
        f"as memory (tools.memory_mode), {gpu}; {unit}",
        f"{'method':<31}{'tokens/rank':>12} {'allocator':<11}{'step peak':>10}{'max alloc':>10}{'max resvd':>10}"
        f"{'outside':>9}{'planner':>9}{'x plan':>8}",
    ]
    for r in rows:
        alloc = "expandable" if r["alloc"] else "default"
        head = f"{r['method']:<31}{fmt_tokens(r.get('tokens_per_rank', 0)):>12} {alloc:<11}"
        if "allocated_gib" not in r:
            lines.append(head + f" {r.get('skipped') or r.get('error', '')[:80]}")
            continue
        cuda = [r.get(k, math.nan) / div for k in ("max_allocated_gib", "max_reserved_gib", "outside_allocator_gib")]
        lines.append(
            head + f"{r['allocated_gib'] / div:>10.2f}{cuda[0]:>10.2f}{cuda[1]:>10.2f}{cuda[2]:>9.2f}"
            f"{r['planner_gib'] / div:>9.2f}{r['allocated_gib'] / r['planner_gib']:>8.3f}"
            + ("  FAIL" if "error" in r else "")
        )
    return "\n".join(lines)


def _table(rows: list[dict], gpu: str) -> str:
    from ds_upipe.tools.planner import fmt_tokens

    ok = [r for r in rows if "error" not in r or "allocated_gib" in r]
    unit, div = ("GiB", 1.0) if ok and max(r["allocated_gib"] for r in ok) >= 1 else ("MiB", 1 / 1024)
    base = {r["seq_len"]: r for r in ok if r["method"] == "alst" and not r["alloc"] and "time_s" in r}
    lines = [
        f"one Llama3-8B-shaped decoder layer, rank 0 of C={WORLD} (FAKE process group), {gpu}; memory in {unit}",
        f"{'method':<19}{'seq':>6} {'allocator':<11}{'allocated':>10}{'reserved':>10}{'planner':>9}{'x plan':>8}"
        f"{'fwd+bwd s':>11}{'x ALST':>8}",
    ]
    for r in rows:
        alloc = "expandable" if r["alloc"] else "default"
        if "allocated_gib" not in r:
            lines.append(f"{r['method']:<19}{fmt_tokens(r['seq_len']):>6} {alloc:<11} error: {r['error'][:70]}")
            continue
        reserved = r.get("max_reserved_gib", math.nan) / div
        b = base.get(r["seq_len"])
        t = r.get("time_s", math.nan)
        t_x = t / b["time_s"] if b and "time_s" in r else math.nan
        lines.append(
            f"{r['method']:<19}{fmt_tokens(r['seq_len']):>6} {alloc:<11}{r['allocated_gib'] / div:>10.2f}"
            f"{reserved:>10.2f}{r['planner_gib'] / div:>9.2f}{r['allocated_gib'] / r['planner_gib']:>8.2f}"
            f"{t:>11.3f}{t_x:>8.2f}" + ("  FAIL" if "error" in r else "")
        )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
