"""GPU check: one Llama3-8B decoder layer as rank 0 of C = 8, Ulysses (ALST) vs UPipe, on one GPU.

One GPU cannot host eight NCCL ranks, so this process plays rank 0 of eight over torch's *fake*
process group:

    dist.init_process_group("fake", rank=0, world_size=8, store=FakeStore())

Its collectives are no-ops that keep shapes, so every tensor this rank allocates and every kernel it
runs are those of a real eight-GPU run, but the all-to-alls move nothing: the times below are one
rank's compute (and memory traffic), not communication.  Attention runs on torch's SDPA flash
kernels in bf16 (transformers' "sdpa" under ALST; ``ds_upipe.TorchSDPAKernel`` under UPipe), the
MLP is DeepSpeed's TiledMLP (the paper's setting).  Memory is the CUDA allocator's peak over one
forward+backward (weights, input, dy and everything the step allocates), next to the planner's
prediction for the same layer.

    python scripts/gpu_check.py                 # 128K..1M tokens, stops starting lengths after --budget-s
    python scripts/gpu_check.py --cpu-smoke     # tiny shapes on CPU (the same code path, MemTracker)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

WORLD = 8
LLAMA3_8B = {"heads": 32, "kv_heads": 8, "head_dim": 128, "hidden": 4096, "intermediate": 14336}
TINY = {"heads": 32, "kv_heads": 8, "head_dim": 16, "hidden": 256, "intermediate": 512}


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    from ds_upipe.cli import _token_list

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=_token_list, default=None, help="global lengths (default 128K,256K,512K,1M)")
    p.add_argument("--methods", default="alst,upipe-fused-8,upipe-fused-16,upipe-unfused-8")
    p.add_argument("--repeats", type=int, default=1, help="timed steps after one warm-up step (0: memory only)")
    p.add_argument("--budget-s", type=float, default=360.0, help="start no new length after this many seconds")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on CPU, to check the script end to end")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    return p.parse_args(argv)


def _method(name: str):
    from ds_upipe.bench import Method

    if name == "alst":
        return Method("alst", "alst")
    kind, mode, u = name.split("-")
    if kind != "upipe" or mode not in ("fused", "unfused"):
        raise ValueError(f"method {name!r}: use alst or upipe-fused-U / upipe-unfused-U")
    return Method(name, "upipe", int(u), mode == "fused")


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


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    import torch

    from ds_upipe import planner
    from ds_upipe.bench import BenchSpec, build_layer, layer_case

    smoke = args.cpu_smoke
    if not smoke and not torch.cuda.is_available():
        print("no CUDA device: run with --cpu-smoke for the CPU path", file=sys.stderr)
        return 2
    device_name = "cpu" if smoke else "cuda"
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
    _init_fake_group(device_name)
    device = torch.device(device_name, 0) if device_name == "cuda" else torch.device("cpu")
    gpu = torch.cuda.get_device_name(0) if device_name == "cuda" else "cpu"
    print(
        f"ds-upipe GPU check on {gpu}: one rank of C={WORLD} over a FAKE process group "
        "(collectives are no-ops: memory and compute are one rank's, no communication is timed)",
        flush=True,
    )
    dims = planner.ModelDims(
        "check", spec.heads, spec.kv_heads, spec.head_dim, spec.hidden_size, spec.intermediate_size, 1, 128
    )
    start = time.monotonic()
    rows = []
    layers = {}
    for seq in seqs:
        if time.monotonic() - start > args.budget_s:
            print(f"  time budget reached: skipping {planner.fmt_tokens(seq)} and longer", flush=True)
            break
        for m in methods:
            row = {"method": m.name, "seq_len": seq}
            try:
                if m.name not in layers:
                    layers[m.name] = build_layer(m, spec, device)
                res = layer_case(*layers[m.name], spec, seq, 0, device)
                pm = (
                    planner.Method("ulysses")
                    if m.kind == "alst"
                    else planner.Method("upipe", m.head_chunk_size, m.fused)
                )
                pred, _ = planner.layer_peak_bytes(
                    dims,
                    pm,
                    seq,
                    WORLD,
                    "fp32" if smoke else "bf16",
                    tiled_mlp=True,
                    kernel="none" if smoke else "fa2",
                )
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
            print(f"  done {m.name} at {planner.fmt_tokens(seq)} ({time.monotonic() - start:.0f}s)", flush=True)
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
    print(_table(rows, gpu))
    return 0 if all("error" not in r for r in rows) else 1


def _table(rows: list[dict], gpu: str) -> str:
    from ds_upipe.planner import fmt_tokens

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
