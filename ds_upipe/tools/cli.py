"""``ds-upipe``: the command-line entry point (``bench``, ``plan`` and ``sweep``).

Heavy imports (torch.distributed, deepspeed, transformers, matplotlib) happen inside the
subcommands, so ``ds-upipe --help`` and ``ds-upipe plan`` stay quick.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

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
    parser = argparse.ArgumentParser(prog="ds-upipe", description="UPipe for DeepSpeed: measure, plan, sweep.")
    sub = parser.add_subparsers(dest="command", required=True)

    plan = sub.add_parser(
        "plan",
        help="predict per-GPU peak memory and the largest context that fits",
        description="Per-GPU peak memory of a sequence-parallel training step for DeepSpeed ALST (Ulysses) and UPipe: "
        "the real decoder layer and loss run on fake tensors (rank 0 of C, MemTracker), plus model states, ZeRO "
        "buffers, checkpoints and the CUDA kernel workspace.  --config: what that ds_config runs.  Without it: "
        "ALST and UPipe at every U, with ZeRO-3, offloaded checkpoints and the long-context stack.",
    )
    plan.add_argument("--config", type=Path, help="a ds_config JSON: predict only what it runs")
    plan.add_argument(
        "--model",
        default="llama3-8b",
        help=(
            "a preset (planner.PRESETS: llama3-8b, qwen3-32b, ..., the hybrids qwen3.5-9b, qwen3.5-27b, ...) or the "
            "path of a config.json (or its folder): a Llama-family, MoE or hybrid (Qwen3.5, Qwen3.5-MoE, Qwen3-Next, "
            "Nemotron-H) model, or a vision-language model (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5, LLaVA, "
            "Mistral 3): its text model is planned, its vision tower's parameters counted"
        ),
    )
    plan.add_argument(
        "--images", type=int, default=0, help="a vision-language model's images per sample (shared out over the ranks)"
    )
    plan.add_argument(
        "--vision-tokens",
        type=parse_tokens,
        default=0,
        help="a vision-language model's vision tokens per sample (its images' placeholder tokens after the merger): "
        "sequence tokens, counted in each planned length",
    )
    plan.add_argument(
        "--tower-mib-per-image",
        type=float,
        default=0.0,
        help="a vision-language model's tower + projector activations saved for backward per image, MiB, as "
        "measured (docs/vlm.md); default 0: not planned",
    )
    plan.add_argument("--gpus", type=int, default=None, help="sequence-parallel GPUs (default: the preset's, or 8)")
    plan.add_argument(
        "--ring-size",
        type=int,
        default=None,
        help="UPipe x Ring (upipe.ring_size): Ulysses degree gpus / R x ring R (default 1, or the config's)",
    )
    plan.add_argument("--gpu-memory", type=float, default=79.6, help="GiB per GPU (default 79.6: an 80 GB card)")
    plan.add_argument("--zero", type=int, default=None, choices=(0, 1, 2, 3), help="ZeRO stage (default 3)")
    plan.add_argument("--no-checkpointing", action="store_true", help="no activation checkpointing")
    plan.add_argument("--no-offload", action="store_true", help="keep activation checkpoints on the GPU")
    for part in ("loss", "norm", "mlp"):
        plan.add_argument(
            f"--tiled-{part}",
            action=argparse.BooleanOptionalAction,
            default=None,
            help=f"hf_patches' long-context stack: tiled {part} (default on without --config)",
        )
    plan.add_argument("--dtype", default=None, choices=("bf16", "fp16", "fp32"))
    plan.add_argument("--batch", type=int, default=None, help="micro-batch size (default 1)")
    plan.add_argument(
        "--kernel",
        default="fa2",
        choices=("fa2", "fa3", "none"),
        help="attention kernel's backward workspace: fa2 = torch SDPA flash / flash-attn 2 (default), fa3, none "
        "(CPU); fa2 / fa3 (a GPU target) also plan gated delta nets as FLA's chunk kernel, none as the torch fallback",
    )
    plan.add_argument(
        "--gpu-reserve",
        "--reserve",
        dest="reserve",
        type=float,
        default=None,
        help="GiB per GPU kept free: CUDA context and cuBLAS workspaces, NCCL communicators / NVLS buffers, caching-"
        "allocator fragmentation (default: TrainSetup.reserve_gib, basis in planner.RESERVE_BASIS)",
    )
    plan.add_argument(
        "--host-reserve",
        type=float,
        default=None,
        help="GiB per node kept free of host memory for the OS, page cache and daemons (default: "
        "TrainSetup.host_os_gib, basis in planner.HOST_BASIS; each rank's processes are counted apart)",
    )
    plan.add_argument(
        "--host-memory", type=float, default=2048.0, help="GiB of host memory per node (default 2048: a DGX-class node)"
    )
    plan.add_argument("--gpus-per-node", type=int, default=8, help="GPUs (ranks) per node sharing its host memory")
    plan.add_argument(
        "--checkpoint-pinning",
        choices=("pow2", "exact"),
        default=None,
        help="offloaded checkpoints: pow2 = DeepSpeed's engine (torch's pinned allocator rounds each up to a power "
        "of two), exact = ds_upipe's exact-size pool (default: the config's upipe.offload_checkpoints setting)",
    )
    plan.add_argument(
        "--offload-optimizer",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="optimizer states in host memory (zero_optimization.offload_optimizer.device=cpu; default: the config's)",
    )
    plan.add_argument(
        "--checkpoint-pairs",
        type=int,
        default=None,
        help="upipe.checkpoint_pairs: checkpoint the lowest 2N layers in pairs on one saved input (N layer inputs "
        "fewer kept, N more layer forwards per step; default 0, or the config's)",
    )
    plan.add_argument(
        "--checkpoint-group-size",
        default=None,
        help="upipe.checkpoint_group_size k: checkpoint the layers in groups of k on one saved input (as many groups "
        "as fit, or --checkpoint-groups); 'auto': the k that reaches the longest context on both memories, the "
        "least extra compute among those, with the table of every k (default: the config's)",
    )
    plan.add_argument(
        "--checkpoint-groups",
        type=int,
        default=None,
        help="upipe.checkpoint_groups N: the lowest N x k layers in groups (default with --checkpoint-group-size: "
        "layers // k)",
    )
    plan.add_argument("--unfused", action="store_true", help="UPipe without fused projections")
    plan.add_argument("--overlap-comm", action="store_true", help="UPipe prefetches the next stage's all-to-alls")
    plan.add_argument(
        "--accumulate-dtype",
        choices=("fp32", "input"),
        default=None,
        help="upipe.accumulate_dtype: sum bf16/fp16 gradients over the stages in float32 or the input dtype "
        "(overrides the config; default fp32 without --config)",
    )
    plan.add_argument(
        "--recompute-attention-output",
        action="store_true",
        help="upipe.recompute_attention_output: fused UPipe's backward recomputes each stage's attention output "
        "instead of keeping the layer's (one hidden state less, one more attention forward per stage)",
    )
    plan.add_argument(
        "--seq",
        type=parse_token_list,
        default=None,
        help="sequence lengths of the table (default: the paper's 128K,...,5M)",
    )
    plan.add_argument("--tokens", type=parse_tokens, help="which head chunk size U do I need for this many tokens?")
    plan.add_argument(
        "--breakdown", action="store_true", help="components of the peak at --tokens (else at the max context)"
    )
    plan.add_argument("--json", type=Path, help="also write the predictions to this JSON file")

    bench = sub.add_parser(
        "bench",
        help="measure DeepSpeed Ulysses, ALST and UPipe side by side",
        description="Spawns --world ranks (gloo on CPU, nccl on GPU) and runs every method over the same inputs at "
        "the attention-core level and the decoder-layer level: per-rank peak memory, intermediate memory and "
        "forward+backward time, with ratios to the baseline (DeepSpeed's DistributedAttention at the core, ALST at "
        "the layer; at the mixer level, --levels mixer, each hybrid mixer at U = H: all heads at once).  Writes "
        "OUT.json and OUT.png.",
    )
    bench.add_argument("--world", type=int, default=4, help="ranks = sequence-parallel degree C (default 4)")
    bench.add_argument(
        "--ring-size",
        type=int,
        default=1,
        help="UPipe x Ring: --world = Ulysses degree x R; compares UPipe x Ring at each U against U = H (Ulysses x "
        "Ring) on zigzag shards (DeepSpeed's and ALST's attention have no ring)",
    )
    bench.add_argument("--seq", type=parse_token_list, default=[2048, 4096], help="global sequence lengths")
    bench.add_argument(
        "--levels",
        default="core,layer",
        help="comma-separated: core, layer (default both), mixer (one hybrid decoder layer per --mixers kind, UPipe's "
        "mixer stages at each U against U = H); or 'ops' alone: the op-count benchmark "
        "(collectives, copy bytes, aten ops and host syncs per step on rank 0, main-thread CPU time averaged "
        "over the ranks; CPU)",
    )
    bench.add_argument("--heads", type=int, default=32, help="query heads (mixer level: value heads / SSM heads)")
    bench.add_argument("--kv-heads", type=int, default=8, help="KV heads (mixer level: key heads / Mamba-2 B,C groups)")
    bench.add_argument("--head-dim", type=int, default=64, help="(mixer level: key and value / SSM head dim)")
    bench.add_argument(
        "--mixers",
        default="gated_delta,mamba2",
        help="mixer level: comma-separated kinds, gated_delta (a Qwen3.5 layer), mamba2 (a Nemotron-H layer)",
    )
    bench.add_argument("--ssm-state", type=int, default=64, help="mixer level, mamba2: SSM state size (default 64)")
    bench.add_argument("--ssm-chunk", type=int, default=64, help="mixer level, mamba2: scan chunk length (default 64)")
    bench.add_argument("--hidden", type=int, default=None, help="layer level (default heads * head-dim)")
    bench.add_argument("--intermediate", type=int, default=None, help="layer level (default 2 * hidden)")
    bench.add_argument("--tiled-mlp", action="store_true", help="layer level: DeepSpeed's TiledMLP")
    bench.add_argument("--overlap-comm", action="store_true", help="UPipe prefetches the next stage's all-to-alls")
    bench.add_argument(
        "--arch", choices=("llama", "qwen3"), default="llama", help="layer level: the decoder (qwen3: q/k norms)"
    )
    bench.add_argument(
        "--recompute-attention-output",
        action="store_true",
        help="layer level: also fused UPipe with upipe.recompute_attention_output (upipe-fused-recompute rows)",
    )
    bench.add_argument("--head-chunk-sizes", type=_int_list, default=None, help="U values (default: all valid)")
    bench.add_argument("--dtype", default=None, help="float32 (CPU default), bfloat16 (GPU default), float64")
    bench.add_argument("--batch", type=int, default=1)
    bench.add_argument(
        "--documents",
        type=int,
        default=1,
        help="core level: also run rows of N equal packed documents (DeepSpeed per document, UPipe with cu_seqlens)",
    )
    bench.add_argument(
        "--window",
        type=int,
        default=None,
        help="core level: also run DeepSpeed (with ds_upipe's windowed kernel) and UPipe with a sliding window of W "
        "tokens, with their time and memory against full causal",
    )
    bench.add_argument("--repeats", type=int, default=2, help="timed repetitions (median reported)")
    bench.add_argument("--warmup", type=int, default=1)
    bench.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda if available")
    bench.add_argument("--out", type=Path, default=Path("bench"), help="output stem: writes OUT.json and OUT.png")
    bench.add_argument("--no-progress", action="store_true", help="no progress bar")
    sweep = sub.add_parser(
        "sweep",
        help="every causal decoder family of transformers, patched, against itself unpatched",
        description="For each model type of transformers' causal-LM auto mapping (or those given), a tiny float64 "
        "model patched by apply_upipe on 2 gloo ranks against the same model unpatched on the whole sequence "
        "(logits, loss, every gradient), fused and unfused: one row each, exact-fused / exact-unfused / refused "
        "(ds_upipe's message) / failed / not-built; beside it DeepSpeed ALST on the same model and shards: "
        "exact / wrong / crashed.  Exits 1 if any UPipe row failed.",
    )
    sweep.add_argument(
        "--model-type", action="append", dest="model_types", help="a model type (repeatable; default: all)"
    )
    sweep.add_argument("--json", type=Path, help="also write the rows to this JSON file")
    sweep.add_argument("--markdown", type=Path, help="also write the table as a markdown page (docs/families.md)")
    return parser


def _sweep(args: argparse.Namespace) -> int:
    import time

    from . import sweep

    start = time.perf_counter()
    rows = sweep.run_sweep(args.model_types, verbose=True)
    seconds = time.perf_counter() - start
    table = sweep.format_table(rows)
    print(table)
    print("UPipe: " + ", ".join(f"{n} {status}" for status, n in sweep.counts(rows).items()) + f"; {seconds:.0f} s")
    print("DeepSpeed ALST: " + ", ".join(f"{n} {status}" for status, n in sweep.alst_counts(rows).items()))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = {"command": "ds-upipe " + " ".join(args.argv), "seconds": seconds, "rows": [vars(r) for r in rows]}
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(sweep.markdown_page(rows, "ds-upipe " + " ".join(args.argv), seconds))
    return 1 if any(r.status == "failed" for r in rows) else 0


def _plan_setup(args: argparse.Namespace) -> tuple:
    """(dims, setup, methods) from --config and the flags (a flag given overrides the config)."""
    from dataclasses import replace

    from . import planner

    dims = planner.model_dims(args.model)
    base = planner.TrainSetup(
        gpus=args.gpus or planner.PRESET_GPUS.get(args.model, 8),
        gpu_memory_gib=args.gpu_memory,
        host_memory_gib=args.host_memory,
        gpus_per_node=args.gpus_per_node,
        images=args.images,
        vision_tokens=args.vision_tokens,
        tower_bytes_per_image=round(args.tower_mib_per_image * 2**20),
    )
    settings = None
    if args.config is not None:
        from ..integration.config import load_config, parse_config

        settings = parse_config(load_config(args.config))  # the runtime's one reader, read once
        setup, scheme, _ = planner.from_ds_config(settings, base)
        methods = [scheme]
    else:
        setup = replace(base, ring_size=args.ring_size or 1)
        methods = planner.methods_for(dims, setup.gpus, not args.unfused, args.overlap_comm, setup.ring_size)
    changes = {
        "gpus": args.gpus,
        "ring_size": args.ring_size,
        "zero_stage": args.zero,
        "dtype": args.dtype,
        "batch": args.batch,
        "tiled_loss": args.tiled_loss,
        "tiled_norm": args.tiled_norm,
        "tiled_mlp": args.tiled_mlp,
        "checkpoint_pinning": args.checkpoint_pinning,
        "offload_optimizer": args.offload_optimizer,
    }
    if args.checkpoint_pairs is not None:
        changes.update(checkpoint_groups=args.checkpoint_pairs, checkpoint_group_size=2)
    auto_groups = args.checkpoint_group_size == "auto"
    if args.checkpoint_group_size is not None and not auto_groups:
        k = int(args.checkpoint_group_size)
        groups = args.checkpoint_groups if args.checkpoint_groups is not None else dims.num_layers // k
        changes.update(checkpoint_groups=groups, checkpoint_group_size=k)
    elif args.checkpoint_groups is not None:
        changes.update(checkpoint_groups=args.checkpoint_groups)
    changes = {k: v for k, v in changes.items() if v is not None}
    if args.accumulate_dtype is not None:
        on = args.accumulate_dtype == "input"
        methods = [m.with_options(accumulate_in_input_dtype=on) if m.kind == "upipe" else m for m in methods]
    if args.recompute_attention_output:
        if any(m.kind == "upipe" and not m.options.fused_projections for m in methods):
            raise ValueError(
                "--recompute-attention-output needs fused projections (drop --unfused, or set "
                "upipe.fused_projections=true in the config)"
            )
        methods = [m.with_options(recompute_attention_output=True) if m.kind == "upipe" else m for m in methods]
    if args.no_checkpointing:
        changes.update(checkpointing=False, offload_checkpoints=False, checkpoint_groups=0)
    elif args.no_offload:
        changes.update(offload_checkpoints=False)
    margins = {"reserve_gib": args.reserve, "host_os_gib": args.host_reserve}
    changes.update({k: v for k, v in margins.items() if v is not None})
    setup = replace(setup, kernel=args.kernel, **changes)
    if settings is not None and settings.upipe.enabled and settings.upipe.head_chunk_size == "auto":
        # the U the run's "auto" picks for this model, setup and settings (the same measurement)
        methods = [
            m.with_options(head_chunk_size=planner.auto_head_chunk_size(dims, setup, m, settings.upipe))
            if m.kind == "upipe"
            else m
            for m in methods
        ]
    # head_chunk_size null is U = C_u of the GPUs planned for (after --gpus, which overrides the config's sp)
    methods = [
        m.with_options(head_chunk_size=setup.ulysses_size)
        if m.kind == "upipe" and m.options.head_chunk_size is None
        else m
        for m in methods
    ]
    if auto_groups:
        upipe = [m for m in methods if m.kind == "upipe"]
        setup = planner.choose_group_size(dims, setup, (upipe or methods)[0])
    return dims, setup, methods


def _plan(args: argparse.Namespace) -> int:
    from . import planner

    dims, setup, methods = _plan_setup(args)
    seq_lens = args.seq or planner.PAPER_STEPS
    bad = [s for s in seq_lens if s < setup.gpus or s % setup.seq_multiple]
    if bad:
        what = (
            f"--gpus {setup.gpus}" if setup.ring_size == 1 else f"{setup.seq_multiple} (--ring-size {setup.ring_size})"
        )
        raise ValueError(f"--seq {bad}: every length must be a positive multiple of {what}")
    for method in methods:
        if not planner.predict(dims, setup, method, planner.context_step(setup)).fits:
            raise ValueError(planner.nothing_fits(dims, setup, method))
    print(planner.plan_table(dims, setup, seq_lens, methods))
    if args.checkpoint_group_size == "auto":
        for method in methods:
            print()
            print(planner.group_size_report(dims, setup, method))
    if args.tokens is not None and args.config is None:
        print()
        print(planner.which_head_chunk_report(dims, setup, args.tokens, methods))
    if args.breakdown:
        for method in methods:
            at = args.tokens or planner.max_context(dims, setup, method)
            if at:
                print()
                print(planner.breakdown_report(dims, setup, method, at))
    if args.json:
        payload = planner.to_json(dims, setup, seq_lens, methods)
        if args.tokens is not None:
            payload["at_tokens"] = [vars(planner.predict(dims, setup, m, args.tokens)) for m in methods]
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
        recompute_attention_output=args.recompute_attention_output,
        arch=args.arch,
        batch=args.batch,
        documents=args.documents,
        window=args.window,
        mixers=tuple(x.strip() for x in args.mixers.split(",") if x.strip()),
        ssm_state=args.ssm_state,
        ssm_chunk=args.ssm_chunk,
        dtype=dtype,
        head_chunk_sizes=args.head_chunk_sizes,
        repeats=args.repeats,
        warmup=args.warmup,
        device=device,
        ring_size=args.ring_size,
    )
    if spec.levels == (bench.OPS_LEVEL,):
        return _bench_ops(args, spec)
    rows = bench.run_bench(spec, show_progress=not args.no_progress)
    ring = f" ({spec.ulysses_size} x ring {spec.ring_size})" if spec.ring_size > 1 else ""
    json_path, png_path = args.out.with_suffix(".json"), args.out.with_suffix(".png")
    bench.write_json(json_path, spec, rows, {"command": "ds-upipe " + " ".join(args.argv)})
    bench.plot(
        png_path, rows, title=f"ds-upipe bench: C={spec.world}{ring}, H={spec.heads}, KV={spec.kv_heads}, {dtype}"
    )
    print(bench.format_table(rows))
    print(f"wrote {json_path} and {png_path}")
    return 0


def _bench_ops(args: argparse.Namespace, spec: Any) -> int:
    from . import opcount

    rows = opcount.run_opcount(spec, show_progress=not args.no_progress)
    json_path = args.out.with_suffix(".json")
    json_path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"command": "ds-upipe " + " ".join(args.argv), "git": _git(), "results": opcount.as_json(rows)}
    json_path.write_text(json.dumps(payload, indent=2) + "\n")
    print(opcount.format_opcount_table(rows))
    print(f"wrote {json_path}")
    return 0


def _git() -> str | None:
    from .bench import _git_state

    return _git_state()


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    try:
        return {"plan": _plan, "bench": _bench, "sweep": _sweep}[args.command](args)
    except ValueError as err:
        print(f"ds-upipe {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
