"""Rank-side bodies of the planner and bench tests (importable by spawned processes)."""

from __future__ import annotations

import torch

#: the small decoder layer of the calibration points: C=2, H=8, KV=2 (GQA 4:1), d=32, hidden 256
CALIBRATION_SHAPE = {"heads": 8, "kv_heads": 2, "head_dim": 32, "hidden": 256, "intermediate": 512}
CALIBRATION_WORLD = 2

#: (kind, U, fused, global sequence length, dtype, tiled MLP, overlap_comm): the peaks land in the MLP,
#: the RMSNorm backward and the attention stage loop, for ALST and UPipe fused/unfused at U = C and
#: U = H, synchronous and overlapped.
CALIBRATION_POINTS = [
    ("alst", None, None, 1024, "float32", True, False),
    ("upipe", 2, True, 1024, "float32", True, False),
    ("upipe", 8, True, 2048, "float32", True, True),
    ("upipe", 4, False, 2048, "float32", True, True),
    ("upipe", 4, False, 1024, "float32", False, False),
    ("alst", None, None, 1024, "bfloat16", True, False),
    ("upipe", 8, True, 1024, "bfloat16", True, False),
]


def measure_layer_peaks(rank: int, world: int, points: list[tuple]) -> list[int]:
    """Per-rank peak bytes of one decoder layer forward+backward (MemTracker), one per point."""
    from ds_upipe.tools.bench import BenchSpec, Method, build_layer, layer_case

    peaks = []
    for kind, u, fused, seq, dtype, tiled, overlap in points:
        spec = BenchSpec(
            world=world,
            seq_lens=[seq],
            levels=("layer",),
            dtype=dtype,
            tiled_mlp=tiled,
            overlap_comm=overlap,
            repeats=0,
            **CALIBRATION_SHAPE,
        )
        method = Method(kind, kind, u, fused)
        layer, rotary = build_layer(method, spec, torch.device("cpu"))
        peaks.append(layer_case(layer, rotary, spec, seq, rank, torch.device("cpu"))["peak"])
    return peaks
