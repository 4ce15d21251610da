"""The README's headline plot: the largest trainable context per setup, DeepSpeed ALST vs UPipe, from the
planner's committed results (``benchmarks/replan_issue20.py``: whole training steps on fake tensors, GPU
and host memory counted together; docs/benchmarks.md says what sets each limit).

python benchmarks/plot_max_context.py   # reads benchmarks/results/replan_issue20.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

#: (group label, bar label, the row's name in replan_issue20.json), in plot order; ALST first in each group
BARS = (
    ("Llama3-8B, 8 x 80 GB\nlong-context stack", "ALST", "llama3-8b 8 GPUs: ulysses_alst_long_context.json"),
    ("Llama3-8B, 8 x 80 GB\nlong-context stack", "UPipe", "llama3-8b 8 GPUs: upipe_long_context.json"),
    (
        "Llama3-8B, 8 x 80 GB\n+ optimizer offload, 3 checkpoint pairs",
        "ALST",
        "llama3-8b 8 GPUs: ALST, same stack, optimizer offload, 3 pairs",
    ),
    (
        "Llama3-8B, 8 x 80 GB\n+ optimizer offload, 3 checkpoint pairs",
        "UPipe",
        "llama3-8b 8 GPUs: upipe_llama3_8b_8m.json",
    ),
    ("Qwen3-32B, 16 x 80 GB\nlong-context stack", "ALST", "qwen3-32b 16 GPUs: ulysses_alst_long_context.json"),
    (
        "Qwen3-32B, 16 x 80 GB\nlong-context stack",
        "UPipe x Ring",
        "qwen3-32b 16 GPUs, Ulysses 8 x ring 2: upipe_long_context.json",
    ),
)


def bars(results: list[dict]) -> list[tuple[str, str, float]]:
    """(group, label, max context in M tokens) of each bar, from the planner's rows."""
    by_name = {row["name"]: row for row in results}
    return [(group, label, by_name[name]["max_context_M"]) for group, label, name in BARS]


def plot(rows: list[tuple[str, str, float]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = list(dict.fromkeys(group for group, _, _ in rows))
    fig, ax = plt.subplots(figsize=(8, 3.8), dpi=120)
    width = 0.38
    for i, group in enumerate(groups):
        pair = [(label, m) for g, label, m in rows if g == group]
        for j, (label, m) in enumerate(pair):
            x = i + (j - 0.5) * width
            color = "#9aa5b1" if label == "ALST" else "#2b6cb0"
            ax.bar(x, m, width, color=color)
            ax.text(x, m + 0.08, f"{label}\n{m:.2f}M", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(groups)), groups, fontsize=8)
    ax.set_ylabel("max context (M tokens)")
    ax.set_ylim(0, max(m for _, _, m in rows) * 1.3)
    ax.set_title("Largest trainable context, DeepSpeed ALST vs UPipe (planner, whole step, GPU + host)", fontsize=9)
    ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    fig.savefig(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", type=Path, default=RESULTS / "replan_issue20.json")
    p.add_argument("--out", type=Path, default=RESULTS / "max_context.png")
    opts = p.parse_args()
    rows = bars(json.loads(opts.results.read_text()))
    plot(rows, opts.out)
    for group, label, m in rows:
        print(f"{group.replace(chr(10), ' ')}: {label} {m:.2f}M")


if __name__ == "__main__":
    main()
