"""HF attention block and decoder layer: peak activation memory per rank, every method, in hidden states.

The block metric of docs/benchmarks.md ("HF block / decoder-layer activation memory"), measured by
``ds_upipe.tools.hf_memory.measure_peak_activation`` on C gloo ranks for UPipe fused (with and without
``recompute_attention_output``), UPipe unfused and DeepSpeed ALST (``UlyssesSPAttentionHF`` around
transformers' sdpa), at U = C, and the two fused ones again with ``accumulate_dtype: "input"`` (rows
"+input"); prints the markdown table and writes the JSON.

    python benchmarks/block_memory.py --out benchmarks/results/hf_memory_c4.json   # about 10 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _rank_main(rank: int, world: int, shape: dict[str, Any], repeats: int) -> list[Any]:
    from dataclasses import replace

    from ds_upipe.tools.hf_memory import measure_memory_table

    rows = measure_memory_table(repeats=repeats, **shape)
    # accumulate_dtype "input" (the long-context config's): the fused source takes dK/dV per stage, no
    # round-sized accumulator (rows "<method>+input")
    fused = ("upipe_fused", "upipe_fused_recompute")
    rows += [
        replace(r, method=f"{r.method}+input")
        for r in measure_memory_table(methods=fused, repeats=repeats, accumulate_in_input_dtype=True, **shape)
    ]
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--seq-local", type=int, default=4096, help="tokens per rank")
    parser.add_argument("--head-dim", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=2, help="tracked steps per case; the least peak is kept")
    parser.add_argument("--out", type=Path, default=None, help="JSON output")
    args = parser.parse_args(argv)

    from ds_upipe.tools.hf_memory import format_memory_table
    from ds_upipe.tools.ranks import run_ranks

    shape = dict(
        seq_local=args.seq_local, head_dim=args.head_dim, hidden_size=args.hidden, intermediate_size=args.intermediate
    )
    per_rank = run_ranks(_rank_main, args.world, shape, args.repeats, use_deepspeed=True)
    # the ranks are symmetric; report the worst rank per case
    worst = [max(rows, key=lambda r: r.peak_total) for rows in zip(*per_rank)]
    print(format_memory_table(worst))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "command": "python benchmarks/block_memory.py " + " ".join(argv or sys.argv[1:]),
            "world": args.world,
        }
        payload.update(shape=shape, rows=[r.as_dict() for r in worst])
        args.out.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
