"""The README's headline table and plot: the largest trainable context per setup, DeepSpeed ALST vs UPipe
under the same rules and stack, at the planner's default margins, from the committed results of
``benchmarks/plan_groups.py`` (whole training steps on fake tensors, GPU and host memory counted together,
checkpoint groups chosen by the planner; docs/benchmarks.md, "Checkpoint groups and margins").

python benchmarks/plot_max_context.py   # reads benchmarks/results/plan_groups_*.json, seconds
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
ALST = "ulysses (ALST)"

#: (row label, plan_groups.SETUPS names whose results must agree), in table and plot order
ROWS = (
    ("Llama3-8B, 8 x 80 GB, 1 TB or 2 TB of host", ("llama3-8b 8 x 80 GB, 1 TB", "llama3-8b 8 x 80 GB, 2 TB")),
    ("Llama3-8B, 8 x H200, 2 TB of host", ("llama3-8b 8 x H200, 2 TB",)),
    (
        "Llama3-8B, 16 x 80 GB (UPipe: Ulysses 8 x Ring 2), 1 TB or 2 TB of host per node",
        ("llama3-8b 16 x 80 GB (2 nodes), 1 TB/node", "llama3-8b 16 x 80 GB (2 nodes), 2 TB/node"),
    ),
    ("Qwen3-32B, 16 x 80 GB (UPipe: Ulysses 8 x Ring 2)", ("qwen3-32b 16 x 80 GB (2 nodes), 2 TB/node",)),
    ("Llama3-8B, 32 x 80 GB (UPipe: Ulysses 8 x Ring 4)", ("llama3-8b 32 x 80 GB (4 nodes), 2 TB/node",)),
)


def load(paths: list[Path]) -> dict[tuple[str, str], dict]:
    """plan_groups rows by (setup, "ALST" or "UPipe"); a row planned twice must give one answer."""
    found: dict[tuple[str, str], dict] = {}
    for path in paths:
        for row in json.loads(path.read_text()):
            key = (row["setup"], "ALST" if row["method"] == ALST else "UPipe")
            old = found.setdefault(key, row)
            if old.get("max_context") != row.get("max_context"):
                raise ValueError(f"{key} planned twice with different results in {[str(p) for p in paths]}")
    return found


def rows(found: dict[tuple[str, str], dict]) -> list[tuple[str, int, int]]:
    """(row label, ALST max context, UPipe max context) in tokens, one per headline row."""
    out = []
    for label, setups in ROWS:
        pair = []
        for method in ("ALST", "UPipe"):
            values = {found[(s, method)]["max_context"] for s in setups}
            if len(values) != 1:  # the label says one number holds for all of them
                raise ValueError(f"{label}: {method} differs between {setups}: {sorted(values)}")
            pair.append(values.pop())
        out.append((label, *pair))
    return out


def markdown(table: list[tuple[str, int, int]]) -> str:
    from ds_upipe.tools.planner import fmt_tokens

    lines = [
        "| setup (ZeRO-3, bf16, long-context stack, optimizer offloaded, checkpoint groups) | DeepSpeed ALST | UPipe |",
        "|---|---|---|",
    ]
    lines += [f"| {label} | {fmt_tokens(a)} | **{fmt_tokens(u)}** |" for label, a, u in table]
    return "\n".join(lines)


def plot(table: list[tuple[str, int, int]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8.5, 3.8), dpi=120)
    width = 0.38
    top = max(u for _, _, u in table) / 2**20
    for i, (_, alst, upipe) in enumerate(table):
        for j, (name, tokens, color) in enumerate((("ALST", alst, "#9aa5b1"), ("UPipe", upipe, "#2b6cb0"))):
            m = tokens / 2**20
            x = i + (j - 0.5) * width
            ax.bar(x, m, width, color=color)
            ax.text(x, m + top * 0.01, f"{name}\n{m:.2f}M", ha="center", va="bottom", fontsize=8)
    groups = [label.replace(", ", "\n", 1).replace(" (", "\n(") for label, _, _ in table]
    ax.set_xticks(range(len(table)), groups, fontsize=7.5)
    ax.set_ylabel("max context (M tokens)")
    ax.set_ylim(0, top * 1.25)
    ax.set_title(
        "Largest trainable context, DeepSpeed ALST vs UPipe\n"
        "(planner: whole step, GPU + host, default margins, optimizer offloaded, checkpoint groups)",
        fontsize=9,
    )
    ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    fig.savefig(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", type=Path, nargs="+", default=sorted(RESULTS.glob("plan_groups_*.json")))
    p.add_argument("--out", type=Path, default=RESULTS / "max_context.png")
    opts = p.parse_args()
    table = rows(load(opts.results))
    plot(table, opts.out)
    print(markdown(table))


if __name__ == "__main__":
    main()
