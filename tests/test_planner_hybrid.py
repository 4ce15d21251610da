"""``ds-upipe plan`` for hybrid models: the layer kinds and their parameters, a fake-run layer of each mixer kind
against the same layer measured with MemTracker on CPU gloo ranks (within the calibration's 5%), the mixer U and
ALST refusals, and the max-context search over every kind of layer."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from ds_upipe.options import UPipeOptions
from ds_upipe.tools import planner
from ds_upipe.tools.planner.models import ATTENTION_LAYER, MIXER_LAYER, MLP_LAYER, MixerDims
from ds_upipe.tools.ranks import run_ranks

WORLD, SEQ = 2, 512
#: the bench's mixer level at test size (``ds_upipe.tools.bench.mixer_config``): 8 mixer heads on 4 key heads /
#: B-C groups, head dims 16, Mamba-2 state 16 and chunk 16, hidden 64 (TINY_DEFAULTS' 4 / 2 attention heads)
MIXER = dict(heads=8, kv_heads=4, head_dim=16, ssm_state=16, ssm_chunk=16, hidden=64, intermediate=128)
POINTS = [(kind, u) for kind in ("gated_delta", "mamba2") for u in (WORLD, MIXER["heads"])]


def measure_mixer_peaks(rank: int, world: int, points: list[tuple[str, int]]) -> list[int]:
    """Per-rank MemTracker peak of the bench's mixer layer (``run_mixer_case``), fp32, one per (kind, U)."""
    from ds_upipe.tools.bench import BenchSpec, Method, run_mixer_case

    spec = BenchSpec(world=world, seq_lens=[SEQ], levels=("mixer",), dtype="float32", repeats=0, **MIXER)
    peaks = []
    for kind, u in points:
        method = Method(f"{kind}[U={u}]", "upipe", UPipeOptions(mixer_head_chunk_size=u), mixer=kind)
        peaks.append(run_mixer_case(method, spec, SEQ, rank, torch.device("cpu"))["peak"])
    return peaks


def bench_dims(kind: str) -> planner.ModelDims:
    """The planner's dims of the bench's mixer model of ``kind`` (Qwen3.5 or Nemotron-H, TINY_DEFAULTS' attention)."""
    h = MIXER
    if kind == "gated_delta":
        mixer = MixerDims(kind, h["heads"], h["kv_heads"], h["head_dim"], key_head_dim=h["head_dim"])
        return planner.ModelDims(
            "tiny-qwen3.5",
            4,
            2,
            256,
            h["hidden"],
            h["intermediate"],
            2,
            128,
            qk_norm=True,
            model_type="qwen3_5_text",
            layer_types=(MIXER_LAYER, ATTENTION_LAYER),
            mixer=mixer,
        )
    mixer = MixerDims(
        kind, h["heads"], h["kv_heads"], h["head_dim"], state_size=h["ssm_state"], chunk_size=h["ssm_chunk"]
    )
    return planner.ModelDims(
        "tiny-nemotron-h",
        4,
        2,
        16,
        h["hidden"],
        h["intermediate"],
        3,
        128,
        model_type="nemotron_h",
        layer_types=(MIXER_LAYER, ATTENTION_LAYER, MLP_LAYER),
        mixer=mixer,
    )


def test_mixer_layer_plan_matches_memtracker_on_cpu():
    """The planner's fake run of one mixer layer (transformers' own class, patched by prepare_model with the mixer U)
    against the bench's mixer layer measured with MemTracker on C=2 gloo ranks, worst rank: within 5%, for a gated
    delta net and a Mamba-2 mixer at U = C and U = all heads.  (Measured below; the fake run is the torch fallback's
    memory, as the measurement on CPU is.)"""
    measured = run_ranks(measure_mixer_peaks, WORLD, POINTS)
    report = []
    for i, (kind, u) in enumerate(POINTS):
        setup = planner.measured_layer_setup(WORLD, "float32", tiled_mlp=False)
        scheme = planner.AttentionScheme.upipe(None, mixer_head_chunk_size=u)
        peak = planner.layer_peak(bench_dims(kind), setup, scheme, SEQ, kind=MIXER_LAYER)
        worst = max(r[i] for r in measured)
        report.append((kind, u, worst, peak.total, peak.total / worst - 1))
    assert all(abs(r[-1]) <= 0.05 for r in report), "\n".join(map(str, report))
    print("\n".join(map(str, report)))
    by = {(kind, u): planned for kind, u, _, planned, _ in report}
    for kind in ("gated_delta", "mamba2"):  # the stages cut the planned memory as they cut the measured
        assert by[(kind, WORLD)] < by[(kind, MIXER["heads"])], report


def test_hybrid_dims_count_each_kind_of_layer():
    """Per-kind parameters from transformers' own modules (meta device), each kind's layers counted once; the
    presets' published sizes; a layer list that does not match the layers, and a mixer U or ALST the run refuses,
    are refused by name."""
    nemo, qwen = planner.PRESETS["nemotron-h-8b"], planner.PRESETS["qwen3.5-9b"]
    assert nemo.layer_counts == {MIXER_LAYER: 24, MLP_LAYER: 24, ATTENTION_LAYER: 4}
    assert qwen.layer_counts == {MIXER_LAYER: 24, ATTENTION_LAYER: 8}
    assert abs(nemo.total_params / 8.1e9 - 1) < 0.01  # Nemotron-H-8B: "8B" (8.10B counted)
    assert nemo.total_params == 2 * 131072 * 4096 + 4096 + sum(
        n * nemo.kind_params(k) for k, n in nemo.layer_counts.items()
    )
    assert nemo.kind_params(MLP_LAYER) == 2 * 4096 * 21504 + 4096  # up, down (relu2: no gate), its norm
    assert nemo.params_per_layer == max(nemo.kind_params(k) for k in nemo.layer_counts)
    big = planner.PRESETS["qwen3.5-27b"]
    assert abs(big.total_params / 27e9 - 1) < 0.01, big.total_params  # Qwen3.5-27B: "27B" (26.90B counted, text only)
    # a hybrid's config.json (Qwen3.5's composite one, Nemotron-H's) read back into the same dims
    from transformers import AutoConfig

    for preset in (big, nemo):
        values = preset.hf_values(MIXER_LAYER, layers=preset.num_layers, stand_in=False)
        model_type, kinds = values.pop("model_type"), list(preset.layer_types)
        values.update({"layers_block_type" if model_type == "nemotron_h" else "layer_types": kinds})
        if model_type == "nemotron_h":
            values.pop("layer_types")
        text = AutoConfig.for_model(model_type, num_hidden_layers=preset.num_layers, **values).to_dict()
        config = {"model_type": "qwen3_5", "text_config": text} if model_type == "qwen3_5_text" else text
        assert planner.ModelDims.from_config(config, name=preset.name) == preset
    moe = planner.PRESETS["qwen3-next-80b-a3b"]
    assert abs(moe.total_params / 80e9 - 1) < 0.01, moe.total_params  # Qwen3-Next-80B-A3B: 80B (79.67B counted)
    with pytest.raises(ValueError, match="layer_types has 2 entries for num_layers=3"):
        replace(bench_dims("mamba2"), layer_types=(MIXER_LAYER, MLP_LAYER))
    setup = planner.TrainSetup(gpus=2)
    with pytest.raises(ValueError, match="ALST cannot run"):
        planner.step_spec(bench_dims("mamba2"), setup, planner.AttentionScheme("ulysses"), 1024)
    # the mixer layers' step does not depend on the attention's U: schemes differing only there share its fake run
    one, all_heads = (planner.AttentionScheme.upipe(u, mixer_head_chunk_size=8) for u in (2, 4))
    mamba = bench_dims("mamba2")
    assert planner.step_spec(mamba, setup, one, 1024, MIXER_LAYER) == planner.step_spec(
        mamba, setup, all_heads, 1024, MIXER_LAYER
    )
    assert planner.step_spec(mamba, setup, one, 1024, ATTENTION_LAYER) != planner.step_spec(
        mamba, setup, all_heads, 1024, ATTENTION_LAYER
    )
    with pytest.raises(ValueError, match="mixer_head_chunk_size=3 is not valid for 8 mixer heads"):
        planner.step_spec(
            bench_dims("mamba2"), setup, planner.AttentionScheme.upipe(None, mixer_head_chunk_size=3), 1024
        )


def test_max_context_search_runs_over_every_kind_of_layer():
    """A tiny Nemotron-H (a Mamba-2, an attention and an MLP block): the search's answer fits and the next length
    does not; the peak is the largest kind's (the mixer's); all heads in one mixer stage do not fit there."""
    dims = bench_dims("mamba2")
    setup = planner.TrainSetup(
        gpus=2,
        gpu_memory_gib=0.05,
        reserve_gib=0.0,
        kernel="none",
        tiled_mlp=False,
        tiled_norm=False,
        host_memory_gib=1e6,
    )
    scheme = planner.AttentionScheme.upipe(None, mixer_head_chunk_size=2)
    mc = planner.max_context(dims, setup, scheme, granularity=1024)
    p = planner.predict(dims, setup, scheme, mc)
    assert mc > 0 and p.fits and not planner.predict(dims, setup, scheme, mc + 1024).fits
    assert p.peak_at.startswith(f"{MIXER_LAYER} layers"), p.peak_at  # the Mamba-2 layers hold the most
    # all heads in one mixer stage (Ulysses without stages) do not fit there
    assert not planner.predict(dims, setup, planner.AttentionScheme.upipe(None, mixer_head_chunk_size=8), mc).fits
