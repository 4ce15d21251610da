"""``ds-upipe``: the command-line entry point (``bench`` and ``plan``).

Heavy imports (torch.distributed, deepspeed, transformers, matplotlib) happen inside the
subcommands, so ``ds-upipe --help`` and ``ds-upipe plan`` stay quick.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

_SUFFIX = {"k": 2**10, "m": 2**20, "g": 2**30}


def parse_tokens(text: str) -> int:
    """'131072', '128K', '1M', '2.5M' -> tokens (K = 1024, as in the paper's lengths)."""
    t = text.strip().lower()
    try:
        if t and t[-1] in _SUFFIX:
            return int(round(float(t[:-1]) * _SUFFIX[t[-1]]))
        return int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a token count: {text!r} (use e.g. 4096, 128K, 1M, 2.5M)") from None


def parse_token_list(text: str) -> list[int]:
    """ "4096,128K,1M" -> [4096, 131072, 1048576] (argparse type of the --seq options)."""
    return [parse_tokens(x) for x in text.split(",") if x.strip()]


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ds-upipe", description="UPipe for DeepSpeed: measure and plan.")
    sub = parser.add_subparsers(dest="command", required=True)

    plan = sub.add_parser(
        "plan",
        help="predict per-GPU peak memory and the largest context that fits",
        description="Analytic per-GPU memory model for Ulysses (DeepSpeed ALST) and UPipe at each valid head "
        "chunk size U.  Defaults are the paper's memory-efficient setting (ZeRO-3, full checkpointing with CPU "
        "offload, tiled MLP and loss, bf16).",
    )
    plan.add_argument("--model", default="llama3-8b", help="preset (llama3-8b, qwen3-32b) or a config.json path")
    plan.add_argument("--gpus", type=int, default=8, help="sequence-parallel GPUs (default 8)")
    plan.add_argument("--gpu-memory", type=float, default=79.6, help="GiB per GPU (default 79.6: an 80 GB card)")
    plan.add_argument("--zero", type=int, default=3, choices=(0, 1, 2, 3), help="ZeRO stage (default 3)")
    plan.add_argument("--no-checkpointing", action="store_true", help="no activation checkpointing")
    plan.add_argument("--no-offload", action="store_true", help="keep activation checkpoints on the GPU")
    plan.add_argument("--no-tiled-mlp", action="store_true", help="plain MLP instead of DeepSpeed's TiledMLP")
    plan.add_argument("--no-tiled-loss", action="store_true", help="full logits instead of a tiled loss")
    plan.add_argument(
        "--fused-rmsnorm", action="store_true", help="a fused RMSNorm kernel (Liger) instead of transformers' eager one"
    )
    plan.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    plan.add_argument("--batch", type=int, default=1, help="micro-batch size (default 1)")
    plan.add_argument(
        "--kernel",
        default="fa2",
        choices=("fa2", "fa3", "none"),
        help="attention kernel's backward workspace: fa2 = torch SDPA flash / flash-attn 2 (default), fa3",
    )
    plan.add_argument("--reserve", type=float, default=2.0, help="GiB for CUDA context and fragmentation (default 2)")
    plan.add_argument("--unfused", action="store_true", help="UPipe without fused projections")
    plan.add_argument("--overlap-comm", action="store_true", help="UPipe prefetches the next stage's all-to-alls")
    plan.add_argument(
        "--seq",
        type=parse_token_list,
        default=None,
        help="sequence lengths of the table (default: the paper's 128K,...,5M)",
    )
    plan.add_argument("--tokens", type=parse_tokens, help="which head chunk size U do I need for this many tokens?")
    plan.add_argument("--json", type=Path, help="also write the predictions to this JSON file")

    bench = sub.add_parser(
        "bench",
        help="measure DeepSpeed Ulysses, ALST and UPipe side by side",
        description="Spawns --world ranks (gloo on CPU, nccl on GPU) and runs every method over the same inputs at "
        "the attention-core level and the decoder-layer level: per-rank peak memory, intermediate memory and "
        "forward+backward time, with ratios to the baseline (DeepSpeed's DistributedAttention at the core, ALST at "
        "the layer).  Writes OUT.json and OUT.png.",
    )
    bench.add_argument("--world", type=int, default=4, help="ranks = sequence-parallel degree C (default 4)")
    bench.add_argument("--seq", type=parse_token_list, default=[2048, 4096], help="global sequence lengths")
    bench.add_argument("--levels", default="core,layer", help="comma-separated: core, layer (default both)")
    bench.add_argument("--heads", type=int, default=32)
    bench.add_argument("--kv-heads", type=int, default=8)
    bench.add_argument("--head-dim", type=int, default=64)
    bench.add_argument("--hidden", type=int, default=None, help="layer level (default heads * head-dim)")
    bench.add_argument("--intermediate", type=int, default=None, help="layer level (default 2 * hidden)")
    bench.add_argument("--tiled-mlp", action="store_true", help="layer level: DeepSpeed's TiledMLP")
    bench.add_argument("--overlap-comm", action="store_true", help="UPipe prefetches the next stage's all-to-alls")
    bench.add_argument("--head-chunk-sizes", type=_int_list, default=None, help="U values (default: all valid)")
    bench.add_argument("--dtype", default=None, help="float32 (CPU default), bfloat16 (GPU default), float64")
    bench.add_argument("--batch", type=int, default=1)
    bench.add_argument("--repeats", type=int, default=2, help="timed repetitions (median reported)")
    bench.add_argument("--warmup", type=int, default=1)
    bench.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda if available")
    bench.add_argument("--out", type=Path, default=Path("bench"), help="output stem: writes OUT.json and OUT.png")
    bench.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def _plan(args: argparse.Namespace) -> int:
    from . import planner

    dims = planner.model_dims(args.model)
    setup = planner.TrainSetup(
        gpus=args.gpus,
        gpu_memory_gib=args.gpu_memory,
        zero_stage=args.zero,
        checkpointing=not args.no_checkpointing,
        offload_checkpoints=not (args.no_offload or args.no_checkpointing),
        tiled_mlp=not args.no_tiled_mlp,
        tiled_loss=not args.no_tiled_loss,
        fused_rmsnorm=args.fused_rmsnorm,
        dtype=args.dtype,
        batch=args.batch,
        kernel=args.kernel,
        reserve_gib=args.reserve,
    )
    fused, overlap = not args.unfused, args.overlap_comm
    seq_lens = args.seq or planner.PAPER_STEPS
    bad = [s for s in seq_lens if s < setup.gpus or s % setup.gpus]
    if bad:
        raise ValueError(f"--seq {bad}: every length must be a positive multiple of --gpus {setup.gpus}")
    print(planner.plan_table(dims, setup, seq_lens, fused, overlap))
    if args.tokens is not None:
        print()
        print(planner.which_head_chunk_report(dims, setup, args.tokens, fused, overlap))
    if args.json:
        payload = planner.to_json(dims, setup, seq_lens, fused, overlap)
        if args.tokens is not None:
            preds = planner.which_head_chunk(dims, setup, args.tokens, fused, overlap)
            payload["which_u"] = [vars(p) for p in preds]
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"\nwrote {args.json}")
    return 0


def _bench(args: argparse.Namespace) -> int:
    import torch

    from . import bench

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = args.dtype or ("bfloat16" if device == "cuda" else "float32")
    spec = bench.BenchSpec(
        world=args.world,
        seq_lens=args.seq,
        levels=tuple(x.strip() for x in args.levels.split(",") if x.strip()),
        heads=args.heads,
        kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        hidden=args.hidden,
        intermediate=args.intermediate,
        tiled_mlp=args.tiled_mlp,
        overlap_comm=args.overlap_comm,
        batch=args.batch,
        dtype=dtype,
        head_chunk_sizes=args.head_chunk_sizes,
        repeats=args.repeats,
        warmup=args.warmup,
        device=device,
    )
    rows = bench.run_bench(spec, show_progress=not args.no_progress)
    json_path, png_path = args.out.with_suffix(".json"), args.out.with_suffix(".png")
    bench.write_json(json_path, spec, rows, {"command": "ds-upipe " + " ".join(args.argv)})
    bench.plot(png_path, rows, title=f"ds-upipe bench: C={spec.world}, H={spec.heads}, KV={spec.kv_heads}, {dtype}")
    print(bench.format_table(rows))
    print(f"wrote {json_path} and {png_path}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    try:
        return _plan(args) if args.command == "plan" else _bench(args)
    except ValueError as err:
        print(f"ds-upipe {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
