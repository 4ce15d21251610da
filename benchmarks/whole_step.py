"""Whole-training-step peak memory per rank: ALST and UPipe, each with and without the long-context stack.

One step = forward of every decoder layer + the loss + backward, on C ranks (gloo, CPU), measured
with ``ds_upipe.tools.memory.measure_peak`` (torch's MemTracker without module hooks, which do not
survive DeepSpeed's tiled Functions: every tensor storage the step allocates, plus the model's
parameters and their gradients).  The model is a Llama built from a config with Llama3-8B's
proportions scaled down (GQA 4:1, intermediate 3.5 x hidden, vocabulary 32K), in bfloat16.

- ALST: DeepSpeed's ``UlyssesSPAttentionHF`` registered through ``register_with_transformers``.
- UPipe: ``hf_patches.apply_upipe`` (fused projections, U = C).
- "stack": ``hf_patches.apply_long_context_stack`` with the tiled loss (forward_loss=
  "sequence_parallel"), tiled RMSNorms and the tiled MLP; without it the loss is
  ``sequence_parallel_loss`` on the full logits (what ships without the stack).

Tile sizes: the shipped ones by default, read from ``--config`` (ds_configs/upipe_long_context.json:
``true`` for each part, i.e. ``hf_patches.tiling.default_tile_tokens`` of the shard, the rule every
entry point uses); ``--loss-tile`` / ``--norm-tile`` / ``--mlp-tile`` override them.

    python benchmarks/whole_step.py                      # C=4, 16K tokens, 4 layers, vocab 32768
    python benchmarks/whole_step.py --out benchmarks/results/whole_step_cpu_c4.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CASES = (("alst", False), ("alst", True), ("upipe", False), ("upipe", True))


def build_model(args: argparse.Namespace) -> Any:
    import torch
    from transformers import LlamaForCausalLM

    from ds_upipe.tools.models import tiny_config

    config = tiny_config(
        "llama",
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        max_position_embeddings=max(args.seq, 8192),
        use_cache=False,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(getattr(torch, args.dtype))


def prepare(method: str, stack: bool, args: argparse.Namespace, group: Any) -> Any:
    """The model of one case, patched; returns (model, restore) with restore undoing ALST's override."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    import hf_patches
    from ds_upipe.tools.hf_memory import alst_attention_function

    model = build_model(args)
    original = ALL_ATTENTION_FUNCTIONS["sdpa"]
    if method == "alst":
        ALL_ATTENTION_FUNCTIONS["sdpa"] = alst_attention_function(model.model, batch=1)
    else:
        hf_patches.apply_upipe(model, group)
    if stack:
        hf_patches.apply_long_context_stack(
            model,
            tiled_loss=True,
            tiled_norm=True,
            tiled_mlp=True,
            loss_tile_tokens=args.loss_tile,
            norm_tile_tokens=args.norm_tile,
            mlp_tile_tokens=args.mlp_tile,
            forward_loss="sequence_parallel",
            loss_group=group,
        )
    return model, lambda: ALL_ATTENTION_FUNCTIONS.__setitem__("sdpa", original)


def run_case(method: str, stack: bool, args: argparse.Namespace, rank: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    import hf_patches
    from ds_upipe.tools.memory import measure_peak

    group = dist.group.WORLD
    model, restore = prepare(method, stack, args, group)
    try:
        gen = torch.Generator().manual_seed(1)
        ids = torch.randint(0, args.vocab, (1, args.seq), generator=gen)
        shard = hf_patches.shard_batch({"input_ids": ids, "labels": ids.clone()}, group)
        losses = []

        def step() -> None:
            if stack:
                out = model(
                    input_ids=shard["input_ids"], position_ids=shard["position_ids"], shift_labels=shard["shift_labels"]
                )
                loss = out.loss
            else:
                out = model(input_ids=shard["input_ids"], position_ids=shard["position_ids"])
                loss = hf_patches.sequence_parallel_loss(out.logits, shard["shift_labels"], group)
            del out
            loss.backward()
            losses.append(loss.item())

        start = time.perf_counter()
        peak = measure_peak(step, [model, *shard.values()], torch.device("cpu"))
        seconds = time.perf_counter() - start
    finally:
        restore()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return {
        "method": method,
        "stack": stack,
        "rank": rank,
        "peak_bytes": peak,
        "parameter_bytes": params,
        "loss": losses[0],
        "seconds": seconds,
    }


#: (checkpoint_groups N, checkpoint_group_size k) of the checkpointed whole-step cases, on N k + 1 layers: every
#: layer but the top one grouped (DeepSpeed keeps the newest checkpoint on the GPU: the top layer's, as planned)
GROUP_CASES = ((3, 2), (2, 3))


def run_group_case(groups: int, size: int, args: argparse.Namespace, rank: int) -> dict[str, Any]:
    """One whole step of UPipe (no stack) on ``groups * size + 1`` layers, checkpointed as the run installs it
    (``sp_setup.configure_activation_checkpointing``: DeepSpeed's reentrant checkpoint with the replayed output
    released, the lowest ``groups * size`` layers in checkpoint groups), measured twice:

    - ``device``: as a CPU run keeps them, every checkpoint in (device) memory: the step's peak;
    - ``offloaded``: the groups' inputs in their host stores (``install_checkpoint_groups(offload=True)``, as on
      CUDA with cpu_checkpointing): ``host`` = the bytes the stores hold, ``offloaded`` = the step's peak less them.
      A first step fills the stores' pools; the measured second one reuses them (asserted), so its tracker sees
      them from the start, as the constant ``host`` bytes.  (On CUDA a restored input is a device copy; here it
      is the host buffer itself: the device side can be lower by one layer input while a group's layer replays.)"""
    import torch
    import torch.distributed as dist

    import hf_patches
    from ds_upipe.integration.checkpoint_groups import install_checkpoint_groups
    from ds_upipe.integration.config import parse_config
    from ds_upipe.integration.sp_setup import configure_activation_checkpointing
    from ds_upipe.tools.memory import measure_peak

    group = dist.group.WORLD
    case = argparse.Namespace(**{**vars(args), "layers": groups * size + 1})
    model, restore = prepare("upipe", False, case, group)
    model.train()
    grouping = {"checkpoint_groups": groups, "checkpoint_group_size": size}
    ds_config = {"train_micro_batch_size_per_gpu": 1, "activation_checkpointing": {}, "upipe": grouping}
    try:
        assert configure_activation_checkpointing(model, ds_config, parse_config(ds_config), None) == "reentrant"
        gen = torch.Generator().manual_seed(1)
        ids = torch.randint(0, args.vocab, (1, args.seq), generator=gen)
        shard = hf_patches.shard_batch({"input_ids": ids, "labels": ids.clone()}, group)

        def step() -> None:
            model.zero_grad(set_to_none=True)
            out = model(input_ids=shard["input_ids"], position_ids=shard["position_ids"])
            loss = hf_patches.sequence_parallel_loss(out.logits, shard["shift_labels"], group)
            del out
            loss.backward()

        device = measure_peak(step, [model, *shard.values()], torch.device("cpu"))
        installed = install_checkpoint_groups(model, groups, size, offload=True)
        stores = [g.store for g in installed] + [installed[0].inner_store]
        step()  # fills the pools
        pools = [buffer for store in stores for buffer in store._free]
        host = sum(store.allocated_bytes for store in stores)
        model.zero_grad(set_to_none=True)
        peak = measure_peak(step, [model, *shard.values(), *pools], torch.device("cpu"))
        assert sum(store.allocated_bytes for store in stores) == host, "the measured step allocated host buffers"
    finally:
        restore()
    return {"device": device, "offloaded": peak - host, "host": host}


def planner_prediction(
    args: dict[str, Any], method: str, stack: bool, groups: tuple[int, int] | None = None, offload: bool = False
) -> Any:
    """The planner's prediction for one case of benchmarks/whole_step.py: no ZeRO, no checkpointing,
    no optimizer (gradients from None), CPU (no kernel workspace, no reserve), gloo.  ``args``: this
    script's arguments as a dict.  ``groups`` (N, k): a ``run_group_case`` instead (N k + 1 layers,
    checkpointed, N groups of k; ``offload``: checkpoints offloaded, exact-size host buffers; host terms per
    rank, without the OS).  Runs the fake-tensor phases in this process (it must have no process group)."""
    from ds_upipe.options import UPipeOptions
    from ds_upipe.tools import planner

    n, k = groups or (0, 2)
    dims = planner.ModelDims(
        "whole-step",
        args["heads"],
        args["kv_heads"],
        args["hidden"] // args["heads"],
        args["hidden"],
        args["intermediate"],
        n * k + 1 if groups else args["layers"],
        args["vocab"],
    )
    setup = planner.TrainSetup(
        gpus=args["world"],
        gpu_memory_gib=1e6,
        zero_stage=0,
        checkpointing=groups is not None,
        offload_checkpoints=offload,
        checkpoint_groups=n,
        checkpoint_group_size=k,
        checkpoint_pinning="exact",
        gpus_per_node=1,
        host_os_gib=0.0,
        host_per_rank_gib=0.0,
        tiled_mlp=stack,
        tiled_norm=stack,
        tiled_loss=stack,
        loss_tile_tokens=args["loss_tile"],
        norm_tile_tokens=args["norm_tile"],
        mlp_tile_tokens=args["mlp_tile"],
        dtype=planner.PLANNER_DTYPES[args["dtype"]],
        kernel="none",
        reserve_gib=0,
        comm_backend="gloo",
        optimizer=False,
    )
    scheme = planner.measured_scheme(method, UPipeOptions(head_chunk_size=args["world"]))
    return planner.predict(dims, setup, scheme, args["seq"])


def rank_body(rank: int, world: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """All cases on one rank (run by ds_upipe.tools.ranks.run_ranks over deepspeed.comm: ALST needs it)."""
    rows = []
    for method, stack in CASES:
        rows.append(run_case(method, stack, args, rank))
        if rank == 0:
            print(f"  {method:<6} stack={stack!s:<5} {rows[-1]['peak_bytes'] / 2**20:9.1f} MiB", flush=True)
    return rows


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    from ds_upipe.tools.ranks import run_ranks

    per_rank = run_ranks(rank_body, args.world, args, use_deepspeed=True, timeout=args.timeout)
    return [row for rows in per_rank for row in rows]


def summarize(rows: list[dict[str, Any]], args: dict[str, Any]) -> dict[str, Any]:
    """Worst rank per case, the stack's reduction per method, UPipe vs ALST with the stack, and the
    planner's prediction of each case (``planner_prediction``) with its relative error."""
    worst = {}
    for row in rows:
        key = f"{row['method']}{'+stack' if row['stack'] else ''}"
        if key not in worst or row["peak_bytes"] > worst[key]["peak_bytes"]:
            worst[key] = row
    predicted = {k: planner_prediction(args, v["method"], v["stack"]).total_gib * 2**30 for k, v in worst.items()}
    return {
        "peak_mib": {k: v["peak_bytes"] / 2**20 for k, v in worst.items()},
        "planner_mib": {k: predicted[k] / 2**20 for k in worst},
        "planner_error": {k: predicted[k] / worst[k]["peak_bytes"] - 1 for k in worst},
        "loss": {k: v["loss"] for k, v in worst.items()},
        "seconds_rank0": {k: v["seconds"] for k, v in worst.items()},
        "parameter_mib": next(iter(worst.values()))["parameter_bytes"] / 2**20,
        "stack_reduction": {m: worst[m]["peak_bytes"] / worst[f"{m}+stack"]["peak_bytes"] for m in ("alst", "upipe")},
        "upipe_vs_alst_with_stack": worst["upipe+stack"]["peak_bytes"] / worst["alst+stack"]["peak_bytes"],
    }


def config_tiles(path: Path) -> dict[str, int | None]:
    """The tile size of each long-context part as the ds_config ships it (None: the default rule,
    ``hf_patches.tiling.default_tile_tokens``, which ``true`` and ``{"tile_tokens": null}`` mean)."""
    from ds_upipe.integration.config import parse_upipe_block, tiled

    block = parse_upipe_block(json.loads(path.read_text()).get("upipe") or {})
    return {part: tiled(getattr(block, f"tiled_{part}"))[1] for part in ("loss", "norm", "mlp")}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--seq", type=int, default=16384, help="global tokens (seq / world per rank)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=896)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument(
        "--config",
        type=Path,
        default=Path(__file__).resolve().parents[1] / "ds_configs" / "upipe_long_context.json",
        help="ds_config whose upipe.tiled_* tile sizes the stack cases use (default: the shipped long-context one)",
    )
    p.add_argument("--loss-tile", type=int, default=None, help="tokens per loss tile (default: --config's)")
    p.add_argument("--norm-tile", type=int, default=None, help="tokens per RMSNorm tile (default: --config's)")
    p.add_argument("--mlp-tile", type=int, default=None, help="tokens per MLP tile (default: --config's)")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    shipped = config_tiles(args.config)
    for part in ("loss", "norm", "mlp"):
        if getattr(args, f"{part}_tile") is None:
            setattr(args, f"{part}_tile", shipped[part])
    start = time.perf_counter()
    rows = run(args)
    summary = summarize(rows, vars(args))
    print(json.dumps(summary, indent=1))
    print(f"wall time {time.perf_counter() - start:.0f} s")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        payload = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}
        args.out.write_text(json.dumps({**payload, "summary": summary, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
