"""The memory planner: model dimensions, the replay allocator, whole-run predictions, the CLI,
and the decoder-layer replay against MemTracker on CPU (calibration points, within 10%)."""

from __future__ import annotations

import json

import pytest

from ds_upipe.tools import planner
from ds_upipe.tools.cli import main, parse_tokens
from ds_upipe.tools.ranks import run_ranks
from tests import bench_cases

LLAMA = planner.PRESETS["llama3-8b"]
QWEN = planner.PRESETS["qwen3-32b"]


def test_presets_match_the_published_parameter_counts():
    assert LLAMA.total_params == 8_030_261_248  # Meta-Llama-3-8B
    assert abs(QWEN.total_params / 32.76e9 - 1) < 0.01  # Qwen3-32B: 32.8B
    assert (LLAMA.q_size, LLAMA.kv_size) == (4096, 1024)


def test_dims_from_a_transformers_config_file(tmp_path):
    cfg = {
        "model_type": "qwen3",
        "hidden_size": 512,
        "intermediate_size": 1024,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 128,
        "num_hidden_layers": 3,
        "vocab_size": 1000,
        "tie_word_embeddings": True,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    dims = planner.model_dims(str(tmp_path))
    assert (dims.num_heads, dims.num_kv_heads, dims.head_dim, dims.qk_norm) == (8, 2, 128, True)
    assert dims.total_params == 1000 * 512 + 3 * dims.params_per_layer + 512  # tied LM head
    with pytest.raises(ValueError, match="not a preset"):
        planner.model_dims(str(tmp_path / "missing.json"))
    (tmp_path / "bad.json").write_text(json.dumps({"hidden_size": 4}))
    with pytest.raises(ValueError, match="num_attention_heads"):
        planner.model_dims(str(tmp_path / "bad.json"))


def test_sim_tracks_live_bytes_and_the_peak():
    sim = planner.Sim(10)
    a = sim.alloc("a", 5)
    b = sim.alloc("b", 7)
    sim.free(a)
    sim.free(a)  # double free is ignored
    sim.temp("c", 4)
    assert (sim.live, sim.peak, sim.peak_at) == (17, 22, "b")
    sim.free(b)
    assert sim.live == 10


def test_zero_partitions_the_model_states():
    p = LLAMA.total_params
    assert planner.model_state_bytes(LLAMA, planner.TrainSetup(zero_stage=3)) == -(-16 * p // 8)
    assert planner.model_state_bytes(LLAMA, planner.TrainSetup(zero_stage=0, checkpointing=True)) == 16 * p
    s1 = planner.model_state_bytes(LLAMA, planner.TrainSetup(zero_stage=1))
    s2 = planner.model_state_bytes(LLAMA, planner.TrainSetup(zero_stage=2))
    assert planner.model_state_bytes(LLAMA, planner.TrainSetup(zero_stage=3)) < s2 < s1


def test_memory_grows_with_length_and_max_context_is_the_boundary():
    setup = planner.TrainSetup()
    for method in planner.methods_for(LLAMA, 8):
        totals = [planner.predict(LLAMA, setup, method, s).total_gib for s in planner.PAPER_STEPS]
        assert totals == sorted(totals), method
        mc = planner.max_context(LLAMA, setup, method)
        assert planner.predict(LLAMA, setup, method, mc).fits
        assert not planner.predict(LLAMA, setup, method, mc + 2**14).fits


def test_upipe_peak_grows_with_the_head_chunk_in_the_attention_regime():
    # fused RMSNorm and tiled MLP: the attention block sets the peak, so U matters
    setup = planner.TrainSetup(fused_rmsnorm=True)
    peaks = [planner.predict(LLAMA, setup, m, 4 * 2**20).total_gib for m in planner.methods_for(LLAMA, 8)[1:]]
    assert peaks == sorted(peaks) and peaks[0] < peaks[-1]


def test_invalid_inputs_are_refused():
    with pytest.raises(ValueError, match="multiple of gpus"):
        planner.predict(LLAMA, planner.TrainSetup(), planner.AttentionScheme("ulysses"), 1001)
    with pytest.raises(ValueError, match="zero_stage"):
        planner.TrainSetup(zero_stage=4)
    with pytest.raises(ValueError, match="kernel"):
        planner.TrainSetup(kernel="fa9")
    with pytest.raises(ValueError, match="offload_checkpoints"):
        planner.TrainSetup(checkpointing=False, offload_checkpoints=True)
    with pytest.raises(ValueError, match="head_chunk_size"):
        planner.predict(LLAMA, planner.TrainSetup(), planner.AttentionScheme("upipe", 12), 2**20)


def test_parse_tokens():
    assert [parse_tokens(t) for t in ("4096", "128K", "1M", "2.5M")] == [4096, 131072, 2**20, 5 * 2**19]
    with pytest.raises(Exception, match="not a token count"):
        parse_tokens("lots")


def test_cli_plan_prints_the_table_answers_which_u_and_writes_json(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "--seq", "1M,2M", "--tokens", "3M", "--fused-rmsnorm", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "max context" in text and "upipe U=8" in text and "at 3M tokens" in text and "->" in text
    data = json.loads(out.read_text())
    assert set(data["max_context"]) == {"ulysses (ALST)", "upipe U=8", "upipe U=16", "upipe U=32"}
    assert len(data["predictions"]) == 4 * 2 and len(data["which_u"]) == 4
    assert main(["plan", "--model", "no-such-model"]) == 2
    assert "not a preset" in capsys.readouterr().err


def test_layer_replay_matches_memtracker_on_cpu():
    """The decoder-layer replay against MemTracker, per rank, C=2 gloo ranks: within 10%."""
    points = bench_cases.CALIBRATION_POINTS
    measured = run_ranks(bench_cases.measure_layer_peaks, bench_cases.CALIBRATION_WORLD, points, use_deepspeed=True)
    shape = bench_cases.CALIBRATION_SHAPE
    dims = planner.ModelDims(
        "calibration",
        shape["heads"],
        shape["kv_heads"],
        shape["head_dim"],
        shape["hidden"],
        shape["intermediate"],
        1,
        128,
    )
    report = []
    for i, (kind, u, fused, seq, dtype, tiled, overlap) in enumerate(points):
        method = (
            planner.AttentionScheme("ulysses")
            if kind == "alst"
            else planner.AttentionScheme("upipe", u, fused, overlap)
        )
        precision = {"float32": "fp32", "bfloat16": "bf16"}[dtype]
        pred, where = planner.layer_peak_bytes(
            dims, method, seq, bench_cases.CALIBRATION_WORLD, precision, tiled_mlp=tiled
        )
        worst = max(rank_peaks[i] for rank_peaks in measured)
        report.append((method.label, seq, dtype, worst, pred, pred / worst - 1, where))
    bad = [r for r in report if abs(r[5]) > 0.10]
    assert not bad, "\n".join(map(str, report))
