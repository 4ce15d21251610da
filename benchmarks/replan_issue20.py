"""Re-plan the issue-20 setups with the joint two-layer step (one process, results to JSON).

python benchmarks/replan_issue20.py --out benchmarks/results/replan_issue20.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def cases():
    """(name, model, setup, scheme) of every row."""
    from ds_upipe.tools import planner

    def load(path: str, **overrides):
        raw = json.loads(Path(path).read_text())
        for key, value in overrides.items():
            if key == "upipe":
                raw["upipe"].update(value)
            elif key == "zero_optimization":
                raw["zero_optimization"].update(value)
            else:
                raw[key] = value
        return planner.from_ds_config(raw)

    llama = planner.model_dims("llama3-8b")
    qwen = planner.model_dims("qwen3-32b")
    offload = {"offload_optimizer": {"device": "cpu"}}
    rows = []
    s, m, _ = load("ds_configs/upipe_llama3_8b_8m.json")
    rows.append(("llama3-8b 8 GPUs: upipe_llama3_8b_8m.json", llama, s, m))
    s, m, _ = load(
        "ds_configs/ulysses_alst_long_context.json",
        sequence_parallel_size=8,
        upipe={"checkpoint_pairs": 3},
        zero_optimization=offload,
    )
    rows.append(("llama3-8b 8 GPUs: ALST, same stack, optimizer offload, 3 pairs", llama, s, m))
    s, m, _ = load("ds_configs/upipe_long_context_offload.json", sequence_parallel_size=8)
    rows.append(("llama3-8b 8 GPUs: upipe_long_context_offload.json", llama, s, m))
    s, m, _ = load("ds_configs/upipe_long_context.json", sequence_parallel_size=8)
    rows.append(("llama3-8b 8 GPUs: upipe_long_context.json", llama, s, m))
    s, m, _ = load("ds_configs/ulysses_alst_long_context.json", sequence_parallel_size=8)
    rows.append(("llama3-8b 8 GPUs: ulysses_alst_long_context.json", llama, s, m))
    # ALST's published recipe (3.7M, 8 x H100): plain DeepSpeed (power-of-two pinned checkpoints), optimizer
    # offloaded, Liger's fused linear CE (our tiled loss) and fused RMSNorm (no float32 copies of the hidden
    # state: our tiled norm is the closest stand-in; HF's eager norm as a bound), TiledMLP, checkpoints
    # offloaded, FA2; host 1.9 TB (ALST's README) read as TiB and as 1e12 bytes
    for norm, label in ((True, "fused-norm stand-in (tiled)"), (False, "HF eager norm")):
        s, m, _ = load(
            "ds_configs/ulysses_alst_long_context.json",
            sequence_parallel_size=8,
            upipe={"tiled_norm": norm},
            zero_optimization=offload,
        )
        for host in (1945.6, 1769.5, 1e9):
            rows.append(
                (
                    f"llama3-8b 8 GPUs: ALST's published recipe, {label}, pow2 pinning, host {host:g} GiB",
                    llama,
                    replace(s, checkpoint_pinning="pow2", host_memory_gib=host),
                    m,
                )
            )
    for cfg in ("upipe_long_context_offload.json", "upipe_long_context.json", "upipe_llama3_8b_8m.json"):
        s, m, _ = load(f"ds_configs/{cfg}", sequence_parallel_size=16, upipe={"ring_size": 2})
        rows.append((f"qwen3-32b 16 GPUs, Ulysses 8 x ring 2: {cfg}", qwen, s, m))
    s, m, _ = load("ds_configs/ulysses_alst_long_context.json", sequence_parallel_size=16)
    rows.append(("qwen3-32b 16 GPUs: ulysses_alst_long_context.json", qwen, s, m))
    return rows


def main() -> int:
    from ds_upipe.tools import planner

    p = argparse.ArgumentParser()
    p.add_argument("--only", default="", help="substring of the row names to run")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    results = []
    for name, dims, setup, scheme in cases():
        if args.only not in name:
            continue
        start = time.time()
        mc = planner.max_context(dims, setup, scheme)
        binds = planner.binding_limit(dims, setup, scheme, mc) if mc else "-"
        pred = asdict(planner.predict(dims, setup, scheme, mc)) if mc else None
        row = {
            "name": name,
            "method": scheme.label,
            "max_context": mc,
            "max_context_M": mc / 2**20,
            "binds": binds,
            "at_max": pred,
            "setup": asdict(setup),
            "seconds": time.time() - start,
        }
        results.append(row)
        print(f"{name:<90} {scheme.label:<28} {mc / 2**20:6.2f}M  {binds}  ({row['seconds']:.0f} s)", flush=True)
        if args.out:
            args.out.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
