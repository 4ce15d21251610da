"""Planner vs measurement: the decoder-layer fake-tensor run of ``ds_upipe.tools.planner`` against the per-rank peak
that ``ds-upipe bench`` measures with MemTracker on CPU, for every method and U at a few lengths.

    python benchmarks/validate_planner.py                       # C=4, H=32, KV=8, d=16, hidden 512
    python benchmarks/validate_planner.py --seq 4096,8192 --out benchmarks/results/planner_validation.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    from ds_upipe.options import UPipeOptions
    from ds_upipe.tools import planner
    from ds_upipe.tools.bench import BenchSpec, run_bench
    from ds_upipe.tools.cli import parse_token_list

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--seq", type=parse_token_list, default=[4096, 8192])
    p.add_argument("--shape", default="32,8,16,512,512", help="heads,kv_heads,head_dim,hidden,intermediate")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--no-tiled-mlp", action="store_true")
    p.add_argument("--overlap-comm", action="store_true", help="UPipe prefetches the next stage's all-to-alls")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    heads, kv, d, hidden, inter = (int(x) for x in args.shape.split(","))
    tiled = not args.no_tiled_mlp
    spec = BenchSpec(
        world=args.world,
        seq_lens=args.seq,
        levels=("layer",),
        heads=heads,
        kv_heads=kv,
        head_dim=d,
        hidden=hidden,
        intermediate=inter,
        tiled_mlp=tiled,
        overlap_comm=args.overlap_comm,
        dtype=args.dtype,
        repeats=0,
    )
    rows = run_bench(spec)
    dims = planner.ModelDims("validation", heads, kv, d, hidden, inter, 1, 128)
    points = []
    print(f"{'method':<22}{'seq':>7}{'measured MiB':>14}{'planner MiB':>13}{'error':>9}  peak set by")
    for r in rows:
        options = UPipeOptions(
            head_chunk_size=r.head_chunk_size, fused_projections=bool(r.fused), overlap_comm=args.overlap_comm
        )
        m = planner.measured_scheme(r.kind, options)
        # the measured layer runs plain forward + backward (no replay)
        setup = planner.measured_layer_setup(args.world, args.dtype, tiled, hidden_size=hidden)
        peak = planner.layer_peak(dims, setup, m, r.seq_len)
        pred, where = peak.total, peak.at
        err = pred / r.peak_bytes - 1
        points.append(
            {
                "method": r.method,
                "seq_len": r.seq_len,
                "measured_bytes": r.peak_bytes,
                "planner_bytes": pred,
                "relative_error": err,
                "peak_at": where,
            }
        )
        print(f"{r.method:<22}{r.seq_len:>7}{r.peak_bytes / 2**20:>14.2f}{pred / 2**20:>13.2f}{err:>+9.2%}  {where}")
    worst = max(abs(pt["relative_error"]) for pt in points)
    print(f"{len(points)} points, worst relative error {worst:.2%}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        payload = {"spec": vars(spec), "measured_with": "MemTracker, worst rank", "points": points}
        args.out.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    return 0 if worst <= 0.10 else 1


if __name__ == "__main__":
    raise SystemExit(main())
