"""GPU acceptance: kernel parity with torch SDPA, then one Llama3-8B decoder layer as rank 0 of C = 8.

1. Kernel parity.  Each attention kernel (``sdpa`` in bf16, fp16 and fp32 -- torch's CUDA flash
   and memory-efficient ops --, ``flash_attn`` in bf16 and fp16 when flash-attn is installed) runs
   forward and backward at small shapes, GQA and MHA, causal, and its output and q/k/v gradients
   are compared with ``F.scaled_dot_product_attention(..., enable_gqa=True)`` under autograd: both
   against the float64 result, the kernel may be off by at most twice what torch's own SDPA in the
   same dtype is off, plus a small floor.  The same again through the UPipe pipeline (several
   stages, one rank), which threads each stage's lse and RNG state from forward to backward.
2. The layer table.  One GPU cannot host eight NCCL ranks, so this process plays rank 0 of eight
   over torch's *fake* process group:

       dist.init_process_group("fake", rank=0, world_size=8, store=FakeStore())

   Its collectives are no-ops that keep shapes, so every tensor this rank allocates and every
   kernel it runs are those of a real eight-GPU run, but the all-to-alls move nothing: the times
   below are one rank's compute (and memory traffic), not communication.  Attention runs on torch's
   SDPA flash kernels in bf16 (transformers' "sdpa" under ALST; ``ds_upipe.TorchSDPAKernel`` under
   UPipe), the MLP is DeepSpeed's TiledMLP (the paper's setting).  Memory is the CUDA allocator's
   peak over one forward+backward (weights, input, dy and everything the step allocates), next to
   the planner's prediction for the same layer.

Every check prints one line, ``PASS name`` or ``FAIL name: detail`` (``SKIP name: why`` for what
cannot run here); the table comes last; the exit status is 1 if any check failed.

    python scripts/gpu_check.py                 # parity, then 128K..1M tokens (no new length after --budget-s)
    python scripts/gpu_check.py --only kernels  # parity checks only (seconds)
    python scripts/gpu_check.py --cpu-smoke     # tiny shapes on CPU (the same code paths, MemTracker)
"""

from __future__ import annotations

import argparse
import json
import math
import os
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
HEADS = (("gqa", 8, 2), ("mha", 4, 4))
#: error allowed on top of twice torch SDPA's own, relative to the largest reference value
FLOOR = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1e-2}


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    from ds_upipe.tools.cli import parse_token_list

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=parse_token_list, default=None, help="global lengths (default 128K,256K,512K,1M)")
    p.add_argument("--methods", default="alst,upipe-fused-8,upipe-recompute-8,upipe-fused-16,upipe-unfused-8")
    p.add_argument("--repeats", type=int, default=1, help="timed steps after one warm-up step (0: memory only)")
    p.add_argument("--budget-s", type=float, default=240.0, help="start no new length after this many seconds")
    p.add_argument("--only", choices=("kernels", "layer"), default=None, help="run one of the two parts")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on CPU, to check the script end to end")
    p.add_argument("--json", type=Path, default=None, help="also write the layer results here")
    return p.parse_args(argv)


def report(name: str, failure: str | None) -> bool:
    """Print the check's one line; True when it passed."""
    print(f"PASS {name}" if failure is None else f"FAIL {name}: {failure}", flush=True)
    return failure is None


# -- 1. kernel parity ----------------------------------------------------------------------------


def kernel_cases(device: str) -> list[tuple[str, Callable[[], object] | str, str]]:
    """(kernel name, factory or the reason it cannot run here, dtype name) for every parity case."""
    from ds_upipe.kernels import FlashAttnKernel, TorchSDPAKernel, flash_attn_available

    if device == "cpu":
        no_cuda = "needs a CUDA device"
        return [
            ("sdpa", TorchSDPAKernel, "float32"),
            ("sdpa", TorchSDPAKernel, "bfloat16"),
            ("flash_attn", no_cuda, ""),
        ]
    flash = FlashAttnKernel if flash_attn_available() else "flash-attn is not installed"
    return [("sdpa", TorchSDPAKernel, dt) for dt in ("bfloat16", "float16", "float32")] + [
        ("flash_attn", flash, dt) for dt in ("bfloat16", "float16")
    ]


def _sdpa_autograd(q, k, v, dout, causal: bool):
    """torch's own attention and its q/k/v gradients: F.scaled_dot_product_attention under autograd."""
    import torch
    import torch.nn.functional as F

    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    return (out, *torch.autograd.grad(out, (q, k, v), dout))


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
    run: Callable, dtype_name: str, hq: int, hkv: int, device: str, seq: int, head_dim: int, causal: bool = True
) -> str | None:
    """None when ``run(q, k, v, dout) -> (out, dq, dk, dv)`` agrees with torch SDPA; else what differs."""
    import torch

    dtype = getattr(torch, dtype_name)
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(h: int):
        return torch.randn(2, h, seq, head_dim, generator=gen, device=device, dtype=torch.float64)

    q64, k64, v64, dout64 = rand(hq), rand(hkv), rand(hkv), rand(hq)
    q, k, v, dout = (t.to(dtype) for t in (q64, k64, v64, dout64))
    exact = _sdpa_autograd(*(t.double() for t in (q, k, v, dout)), causal)  # the same inputs, in float64
    torch_same = _sdpa_autograd(q, k, v, dout, causal)
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


def run_kernel_checks(device: str, smoke: bool) -> list[bool]:
    """Parity of every kernel with torch SDPA, alone and inside the pipeline; one line per check."""
    seq, head_dim = (64, 16) if smoke else (256, 64)
    results = []
    for kernel_name, factory, dtype_name in kernel_cases(device):
        if isinstance(factory, str):
            print(f"SKIP {kernel_name} {dtype_name}".rstrip() + f": {factory}", flush=True)
            continue
        for heads, hq, hkv in HEADS:
            name = f"kernel {kernel_name} {dtype_name} {heads} (H={hq}, KV={hkv}) causal"
            results.append(_check(name, _run_kernel(factory), dtype_name, hq, hkv, device, seq, head_dim))
        name = f"pipeline {kernel_name} {dtype_name} gqa (H=8, KV=2, U=2: 4 stages) causal"
        results.append(_check(name, _run_upipe(factory), dtype_name, 8, 2, device, seq, head_dim))
    return results


def _run_kernel(factory: Callable) -> Callable:
    return lambda q, k, v, dout: _kernel_attention(factory(causal=True), q, k, v, dout)


def _run_upipe(factory: Callable) -> Callable:
    return lambda q, k, v, dout: _upipe_attention(factory(causal=True), q, k, v, dout, head_chunk_size=2)


def _check(name: str, run: Callable, *parity_args) -> bool:
    """``parity(run, *parity_args)`` reported as one line; a crash is this check's failure."""
    try:
        failure = parity(run, *parity_args)
    except Exception as err:  # noqa: BLE001 - the other checks still run
        failure = f"{type(err).__name__}: {err}"
    return report(name, failure)


# -- 2. the layer table ----------------------------------------------------------------------------


def _method(name: str):
    from ds_upipe.tools.bench import Method

    if name == "alst":
        return Method("alst", "alst")
    kind, mode, u = name.split("-")
    if kind != "upipe" or mode not in ("fused", "recompute", "unfused"):
        raise ValueError(f"method {name!r}: use alst or upipe-fused-U / upipe-recompute-U / upipe-unfused-U")
    # recompute: fused with recompute_attention_output
    return Method(name, "upipe", int(u), mode != "unfused", recompute_attention_output=mode == "recompute")


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


def run_layer_checks(args: argparse.Namespace, device_name: str) -> tuple[list[bool], str]:
    """The layer table's rows, one line per (method, length); returns the results and the table."""
    import torch

    from ds_upipe.tools import planner
    from ds_upipe.tools.bench import BenchSpec, build_layer, layer_case

    smoke = args.cpu_smoke
    seqs = args.seq or ([1024, 2048] if smoke else [2**17, 2**18, 2**19, 2**20])
    shapes = TINY if smoke else LLAMA3_8B
    spec = BenchSpec(
        world=WORLD,
        seq_lens=seqs,
        levels=("layer",),
        tiled_mlp=True,
        dtype="float32" if smoke else "bfloat16",
        repeats=args.repeats,
        warmup=1 if args.repeats else 0,
        device=device_name,
        **shapes,
    )
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
            planner.measured_scheme(m.kind, m.head_chunk_size, m.fused, False, m.recompute_attention_output),
            seq,
        ).total
        for m in methods
        for seq in seqs
    }
    _init_fake_group(device_name)
    device = torch.device(device_name, 0) if device_name == "cuda" else torch.device("cpu")
    gpu = torch.cuda.get_device_name(0) if device_name == "cuda" else "cpu"
    print(
        f"layer table on {gpu}: one rank of C={WORLD} over a FAKE process group "
        "(collectives are no-ops: memory and compute are one rank's, no communication is timed)",
        flush=True,
    )
    start = time.monotonic()
    rows: list[dict] = []
    results: list[bool] = []
    layers: dict = {}
    for seq in seqs:
        if time.monotonic() - start > args.budget_s:
            print(
                f"SKIP layer {planner.fmt_tokens(seq)} and longer: --budget-s {args.budget_s:.0f} reached", flush=True
            )
            break
        for m in methods:
            row = {"method": m.name, "seq_len": seq}
            try:
                if m.name not in layers:
                    layers[m.name] = build_layer(m, spec, device)
                res = layer_case(*layers[m.name], spec, seq, 0, device)
                pred = predicted[(m.name, seq)]
                row.update(
                    peak_gib=res["peak"] / 2**30,
                    activation_gib=res["intermediate"] / 2**30,
                    time_s=res["time"],
                    planner_gib=pred / 2**30,
                )
                del res
            except Exception as err:  # noqa: BLE001 - reported in the table, the other cases still run
                row["error"] = f"{type(err).__name__}: {err}"
                traceback.print_exc()
            if device_name == "cuda":
                torch.cuda.empty_cache()
            rows.append(row)
            name = f"layer {m.name} {planner.fmt_tokens(seq)} ({time.monotonic() - start:.0f}s)"
            results.append(report(name, row.get("error")))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {
                    "device": gpu,
                    "world": WORLD,
                    "fake_process_group": True,
                    "spec": {k: v for k, v in vars(spec).items()},
                    "rows": rows,
                },
                indent=2,
            )
        )
    return results, _table(rows, gpu)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    import torch

    if not args.cpu_smoke and not torch.cuda.is_available():
        print("no CUDA device: run with --cpu-smoke for the CPU path", file=sys.stderr)
        return 2
    device_name = "cpu" if args.cpu_smoke else "cuda"
    print(f"ds-upipe GPU acceptance on {torch.cuda.get_device_name(0) if device_name == 'cuda' else 'cpu'}", flush=True)
    results: list[bool] = []
    table = None
    if args.only in (None, "kernels"):
        results += run_kernel_checks(device_name, args.cpu_smoke)
    if args.only in (None, "layer"):
        layer_results, table = run_layer_checks(args, device_name)
        results += layer_results
    failed = results.count(False)
    print(f"{len(results) - failed} passed, {failed} failed", flush=True)
    if table is not None:
        print(table)  # last, so it is what a reader sees
    return 1 if failed else 0


def _table(rows: list[dict], gpu: str) -> str:
    from ds_upipe.tools.planner import fmt_tokens

    base = {r["seq_len"]: r for r in rows if r["method"] == "alst" and "error" not in r}
    ok = [r for r in rows if "error" not in r]
    unit, div = ("GiB", 1.0) if ok and max(r["peak_gib"] for r in ok) >= 1 else ("MiB", 1 / 1024)
    lines = [
        f"one Llama3-8B-shaped decoder layer, rank 0 of C={WORLD} (FAKE process group), {gpu}; memory in {unit}",
        f"{'method':<20}{'seq':>7}{'peak':>10}{'activ.':>10}{'x ALST':>8}{'fwd+bwd s':>11}{'x ALST':>8}{'planner':>10}",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['method']:<20}{fmt_tokens(r['seq_len']):>7}  error: {r['error'][:70]}")
            continue
        b = base.get(r["seq_len"])
        mem_x = r["activation_gib"] / b["activation_gib"] if b else math.nan
        t_x = r["time_s"] / b["time_s"] if b and b["time_s"] == b["time_s"] else math.nan
        lines.append(
            f"{r['method']:<20}{fmt_tokens(r['seq_len']):>7}{r['peak_gib'] / div:>10.2f}"
            f"{r['activation_gib'] / div:>10.2f}{mem_x:>8.2f}{r['time_s']:>11.3f}{t_x:>8.2f}"
            f"{r['planner_gib'] / div:>10.2f}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
