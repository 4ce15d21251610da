"""Markdown tables for docs/benchmarks.md from the committed results and the planner.

python benchmarks/report.py > /tmp/tables.md
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"

PAPER = {  # the paper's max context (tokens, K = 1024) on 80 GB GPUs; from the UPipe paper's context-length table
    ("llama3-8b", 8): {"ulysses": 3 * 2**20, "upipe": 5 * 2**20},
    ("qwen3-32b", 16): {"ulysses": 2 * 2**20, "upipe": 4 * 2**20},
}


def bench_tables(path: Path) -> str:
    data = json.loads(path.read_text())
    rows = data["results"]
    out = []
    for level in ("core", "layer"):
        lr = [r for r in rows if r["level"] == level]
        if not lr:
            continue
        seqs = sorted({r["seq_len"] for r in lr})
        methods = list(dict.fromkeys(r["method"] for r in lr))
        by = {(r["method"], r["seq_len"]): r for r in lr}
        mid = "intermediate" if level == "core" else "activation"
        out.append(
            f"**{level} level** — per-rank peak / {mid} memory (MiB, worst rank) and forward+backward time (s); "
            f"(x) = ratio to {methods[0]}\n"
        )
        head = "| method | " + " | ".join(f"{s} peak | {mid} | time" for s in seqs) + " |"
        out.append(head)
        out.append("|---|" + "---|---|---|" * len(seqs))
        for m in methods:
            cells = []
            for s in seqs:
                r = by[(m, s)]
                cells.append(
                    f"{r['peak_bytes'] / 2**20:.1f} ({r['peak_ratio']:.2f}) | {r['intermediate_bytes'] / 2**20:.1f} "
                    f"({r['intermediate_ratio']:.2f}) | {r['time_s']:.2f} ({r['time_ratio']:.2f})"
                )
            out.append(f"| {m} | " + " | ".join(cells) + " |")
        worst = max(r["max_abs_diff"] for r in lr)
        out.append(f"\nlargest |difference| of outputs and input gradients vs {methods[0]}: {worst:.1e} (fp32)\n")
    return "\n".join(out)


def validation_table(path: Path) -> str:
    data = json.loads(path.read_text())
    out = ["| method | seq | measured MiB | planner MiB | error | peak set by |", "|---|---|---|---|---|---|"]
    for p in data["points"]:
        out.append(
            f"| {p['method']} | {p['seq_len']} | {p['measured_bytes'] / 2**20:.2f} | {p['planner_bytes'] / 2**20:.2f} "
            f"| {p['relative_error']:+.2%} | `{p['peak_at']}` |"
        )
    worst = max(abs(p["relative_error"]) for p in data["points"])
    out.append(f"\n{len(data['points'])} points, worst |error| {worst:.2%}")
    return "\n".join(out)


def paper_tables() -> str:
    """Max context per method for the paper's two setups, with and without the long-context stack."""
    from ds_upipe.tools import planner

    out = []
    for (model, gpus), paper in PAPER.items():
        dims = planner.PRESETS[model]
        for stack in (True, False):
            setup = planner.TrainSetup(gpus=gpus, tiled_loss=stack, tiled_norm=stack, tiled_mlp=stack)
            rows = []
            for m in planner.methods_for(dims, gpus):
                mc = planner.max_context(dims, setup, m)
                ref = paper["ulysses" if m.kind == "ulysses" else "upipe"]
                rows.append(
                    f"| {m.label} | {planner.fmt_tokens(mc)} | {planner.paper_step(mc)} | {planner.fmt_tokens(ref)} |"
                )
            out.append(f"\n{model}, {gpus} x 80 GB, {setup.stack_label}\n")
            out.append("| method | planner max | on the paper's grid | paper |\n|---|---|---|---|\n" + "\n".join(rows))
    return "\n".join(out)


if __name__ == "__main__":
    for name in ("bench_cpu_c4.json",):
        if (RESULTS / name).exists():
            print(bench_tables(RESULTS / name))
    if (RESULTS / "planner_validation.json").exists():
        print(validation_table(RESULTS / "planner_validation.json"))
    print(paper_tables())
