"""Issue 41's setups planned with checkpoint groups (the planner chooses k and N) at the default margins, UPipe
and ALST under the same rules (the offload config's stack, optimizer offloaded, checkpoints offloaded in the
exact pool); one process, results to JSON and a markdown table.

python benchmarks/plan_groups.py --out benchmarks/results/plan_groups.json [--only 0 1 ...]
python benchmarks/plan_groups.py --out - --table benchmarks/results/plan_groups*.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

#: nvidia-smi's total of an "80 GB" H100 (81559 MiB) and of a 141 GB H200 (143771 MiB), in GiB
H100, H200 = 79.6, 140.4
#: (name, model, GPUs, GiB per GPU, host GiB per node, ring size): Ulysses within a node x ring across nodes
SETUPS = [
    ("llama3-8b 8 x 80 GB, 2 TB", "llama3-8b", 8, H100, 2048, 1),
    ("llama3-8b 8 x 80 GB, 1 TB", "llama3-8b", 8, H100, 1024, 1),
    ("llama3-8b 8 x H200, 2 TB", "llama3-8b", 8, H200, 2048, 1),
    ("llama3-8b 16 x 80 GB (2 nodes), 2 TB/node", "llama3-8b", 16, H100, 2048, 2),
    ("llama3-8b 32 x 80 GB (4 nodes), 2 TB/node", "llama3-8b", 32, H100, 2048, 4),
    ("qwen3-32b 16 x 80 GB (2 nodes), 2 TB/node", "qwen3-32b", 16, H100, 2048, 2),
    ("llama3-8b 16 x 80 GB (2 nodes), 1 TB/node", "llama3-8b", 16, H100, 1024, 2),
]


def plan(name: str, model: str, gpus: int, gpu_gib: float, host_gib: float, ring: int) -> list[dict]:
    from ds_upipe.tools import planner

    dims = planner.model_dims(model)
    base = planner.TrainSetup(gpus=gpus, gpu_memory_gib=gpu_gib, host_memory_gib=host_gib)
    raw = json.loads(Path("ds_configs/upipe_llama3_8b_8m.json").read_text())
    raw["sequence_parallel_size"] = gpus
    raw["upipe"].update(ring_size=ring)
    setup, upipe, _ = planner.from_ds_config(raw, base)
    upipe = upipe.with_options(head_chunk_size=setup.ulysses_size)
    rows = []
    # ALST: Ulysses over every GPU (no ring: DeepSpeed's ALST has none), the same stack and offloads
    for method, s in ((upipe, setup), (planner.AttentionScheme("ulysses"), replace(setup, ring_size=1))):
        t0 = time.perf_counter()
        try:
            table = planner.group_size_rows(dims, s, method)
        except ValueError as err:  # a scheme the model cannot run at this degree
            rows.append({"setup": name, "method": method.label, "error": str(err)})
            continue
        k, best, mc, binds, extra = max(table, key=lambda r: (r[2], -r[4]))
        plain = next(r for r in table if r[0] == 1)
        p = planner.predict(dims, best, method, mc) if mc else None
        if p is not None and not p.fits:  # the search's answer must fit when planned on its own
            raise RuntimeError(
                f"{name}, {method.label}: {mc} tokens chosen but {p.total_gib:.2f} GiB / {p.host_gib:.1f} GiB"
            )
        rows.append(
            {
                "setup": name,
                "method": method.label,
                "gpus": gpus,
                "ring_size": s.ring_size,
                "max_context": mc,
                "k": k,
                "groups": best.checkpoint_groups,
                "binds": binds,
                "extra_compute": extra,
                "no_groups_max_context": plain[2],
                "no_groups_binds": plain[3],
                "gpu_gib": p.total_gib if p else None,
                "host_gib": p.host_gib if p else None,
                "gpu_reserve_gib": best.reserve_gib,
                "host_reserve_gib": best.host_os_gib,
                "per_k": [
                    {"k": r[0], "groups": r[1].checkpoint_groups, "max_context": r[2], "binds": r[3]} for r in table
                ],
                "seconds": round(time.perf_counter() - t0, 1),
            }
        )
        print(json.dumps({key: v for key, v in rows[-1].items() if key != "per_k"}), flush=True)
    return rows


def markdown(rows: list[dict]) -> str:
    from ds_upipe.tools.planner import fmt_tokens

    lines = [
        "| setup | method | max context | k x groups | binds | extra compute | without groups (binds) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['setup']} | {r['method']} | refused: {r['error'][:80]} | | | | |")
            continue
        kg = f"{r['k']} x {r['groups']}" if r["groups"] else "none"
        lines.append(
            f"| {r['setup']} | {r['method']} | **{fmt_tokens(r['max_context'])}** | {kg} | {r['binds']} | "
            f"+{100 * r['extra_compute']:.1f}% | {fmt_tokens(r['no_groups_max_context'])} ({r['no_groups_binds']}) |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--only", type=int, nargs="*", default=None, help="the setups to run (indices in SETUPS)")
    parser.add_argument("--table", type=Path, nargs="*", default=None, help="print the table of these JSON files")
    args = parser.parse_args()
    if args.table:
        print(markdown([r for path in args.table for r in json.loads(path.read_text())]))
        return
    rows = []
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for i, setup in enumerate(SETUPS):
        if args.only is None or i in args.only:
            rows += plan(*setup)
            args.out.write_text(json.dumps(rows, indent=1) + "\n")  # each setup as it is done
    print(markdown(rows))


if __name__ == "__main__":
    main()
