"""Rank-side bodies of the planner and bench tests (importable by spawned processes)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ds_upipe.options import UPipeOptions

#: the small decoder layer of the calibration points: C=2, H=8, KV=2 (GQA 4:1), d=32, hidden 256
CALIBRATION_SHAPE = {"heads": 8, "kv_heads": 2, "head_dim": 32, "hidden": 256, "intermediate": 512}
CALIBRATION_WORLD = 2


@dataclass(frozen=True)
class CalibrationPoint:
    """One decoder layer measured with MemTracker on CPU gloo ranks and planned by the fake run."""

    kind: str  # "alst" or "upipe"
    head_chunk_size: int | None
    fused: bool | None
    seq: int  # global tokens
    dtype: str
    tiled_mlp: bool
    overlap_comm: bool = False
    recompute_attention_output: bool = False
    arch: str = "llama"  # "qwen3": the fused path's per-head q/k RMSNorms

    @property
    def options(self) -> UPipeOptions:
        """The point's UPipe settings (kind "upipe")."""
        return UPipeOptions(
            head_chunk_size=self.head_chunk_size,
            fused_projections=bool(self.fused),
            overlap_comm=self.overlap_comm,
            recompute_attention_output=self.recompute_attention_output,
        )


#: the peaks land in the MLP, the RMSNorm backward and the attention stage loop, for ALST and UPipe
#: fused/unfused at U = C and U = H, synchronous and overlapped, fused with the output recomputed, and
#: Qwen3 (q/k norms) fused and under ALST.
CALIBRATION_POINTS = [
    CalibrationPoint("alst", None, None, 1024, "float32", True),
    CalibrationPoint("upipe", 2, True, 1024, "float32", True),
    CalibrationPoint("upipe", 8, True, 2048, "float32", True, overlap_comm=True),
    CalibrationPoint("upipe", 4, False, 2048, "float32", True, overlap_comm=True),
    CalibrationPoint("upipe", 4, False, 1024, "float32", False),
    CalibrationPoint("alst", None, None, 1024, "bfloat16", True),
    CalibrationPoint("upipe", 8, True, 1024, "bfloat16", True),
    CalibrationPoint("upipe", 2, True, 1024, "bfloat16", True, recompute_attention_output=True),
    CalibrationPoint("upipe", 2, True, 1024, "bfloat16", True, recompute_attention_output=True, arch="qwen3"),
    CalibrationPoint("alst", None, None, 1024, "bfloat16", True, arch="qwen3"),
]


def measure_layer_peaks(rank: int, world: int, points: list[CalibrationPoint]) -> list[int]:
    """Per-rank peak bytes of one decoder layer forward+backward (MemTracker), one per point."""
    from ds_upipe.tools.bench import layer_case

    peaks = []
    for point in points:
        layer, rotary, spec = calibration_layer(world, point)
        peaks.append(layer_case(layer, rotary, spec, point.seq, rank, torch.device("cpu"))["peak"])
    return peaks


def calibration_layer(world: int, point: CalibrationPoint) -> tuple:
    """(layer, rotary embedding, BenchSpec) of one calibration point, built by the bench on the CPU."""
    from ds_upipe.tools.bench import BenchSpec, Method, build_layer

    spec = BenchSpec(
        world=world,
        seq_lens=[point.seq],
        levels=("layer",),
        dtype=point.dtype,
        tiled_mlp=point.tiled_mlp,
        overlap_comm=point.overlap_comm,
        repeats=0,
        arch=point.arch,
        **CALIBRATION_SHAPE,
    )
    kind = point.kind
    method = Method(kind, kind) if kind == "alst" else Method(kind, kind, point.options)
    layer, rotary = build_layer(method, spec, torch.device("cpu"))
    return layer, rotary, spec


#: benchmarks/whole_step.py at test size: C=2, the calibration heads (ALST registers one head layout
#: per process), 2 layers, vocabulary 4096, bf16, each case with and without the long-context stack
WHOLE_STEP_ARGS = dict(
    world=CALIBRATION_WORLD,
    seq=4096,
    layers=2,
    hidden=CALIBRATION_SHAPE["hidden"],
    intermediate=CALIBRATION_SHAPE["intermediate"],
    heads=CALIBRATION_SHAPE["heads"],
    kv_heads=CALIBRATION_SHAPE["kv_heads"],
    vocab=4096,
    dtype="bfloat16",
    loss_tile=128,
    norm_tile=256,
    mlp_tile=256,
)


#: benchmarks/whole_step.py's checkpoint-group cases (run_group_case): a model small enough that a layer input is a few
#: percent of the step (so that one checkpoint more or less shows), float32, vocabulary 128
GROUP_STEP_ARGS = {
    **WHOLE_STEP_ARGS,
    **dict(seq=2048, hidden=64, intermediate=128, heads=4, kv_heads=2, vocab=128, dtype="float32"),
}


def calibration_group(rank: int, world: int, points: list[tuple], whole_step_args: dict, group_step_args: dict) -> dict:
    """One spawn for the planner's measurements: the decoder-layer points, then every whole-step case
    (benchmarks/whole_step.py's run_case: per-rank peak bytes), then the checkpoint-group cases
    (run_group_case).  The layer points register ALST in
    transformers' registry (ds_upipe.tools.hf_memory's cached registration); the registry is restored,
    the cache dropped and DeepSpeed's sequence-parallel groups released, so that the whole step's ALST
    registers as it does on its own."""
    import argparse
    import sys

    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from benchmarks import whole_step
    from ds_upipe.tools import hf_memory

    layers = measure_layer_peaks(rank, world, points)
    replay = measure_replay_peak(rank, world, REPLAY_POINT)
    ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa_attention_forward
    hf_memory.forget_alst_registrations()
    sys.modules["deepspeed.runtime.sequence_parallel.parallel_state_sp"]._release_sequence_parallel_groups()
    args = argparse.Namespace(**whole_step_args)
    steps = {
        f"{m}{'+stack' if s else ''}": whole_step.run_case(m, s, args, rank)["peak_bytes"] for m, s in whole_step.CASES
    }
    group_args = argparse.Namespace(**group_step_args)
    groups = {f"{n}x{k}": whole_step.run_group_case(n, k, group_args, rank) for n, k in whole_step.GROUP_CASES}
    return {"whole_step": steps, "layers": layers, "replay": replay, "groups": groups}


#: a checkpointed layer's replay in backward
REPLAY_POINT = CalibrationPoint("upipe", 2, True, 1024, "float32", True)


def measure_replay_peak(rank: int, world: int, point: CalibrationPoint) -> int:
    """Per-rank peak bytes of what the checkpoint's backward runs for one layer: the replay through
    ``integration.checkpointing.without_recomputed_outputs`` (its output a stand-in) and the backward
    from dy, with x and dy alive throughout (DeepSpeed's CheckpointFunction.backward holds them)."""
    import functools

    from ds_upipe.integration.checkpointing import without_recomputed_outputs
    from ds_upipe.tools.memory import measure_peak

    seq, dtype = point.seq, point.dtype
    layer, rotary, spec = calibration_layer(world, point)
    s, t = seq // world, getattr(torch, dtype)
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(1, s, spec.hidden_size, generator=gen).to(t).requires_grad_(True)
    dy = torch.randn(1, s, spec.hidden_size, generator=gen).to(t)
    pos = torch.arange(rank * s, (rank + 1) * s).unsqueeze(0)
    with torch.no_grad():
        cos, sin = rotary(x, pos)
    call = functools.partial(layer, position_embeddings=(cos, sin), position_ids=pos)

    def step() -> None:
        without_recomputed_outputs(call, x).backward(dy)

    return measure_peak(step, [layer, x, dy, cos, sin, pos], torch.device("cpu"))
