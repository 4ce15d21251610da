"""The memory planner: model dimensions, ds_config reading, whole-run predictions from fake-tensor
runs plus the analytic terms, the CLI, and the fake-tensor layer against MemTracker on CPU (within 5%)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from benchmarks.whole_step import planner_prediction
from ds_upipe.tools import planner
from ds_upipe.tools.cli import main, parse_tokens
from ds_upipe.tools.ranks import run_ranks
from tests import bench_cases

GiB = planner.GiB
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


def test_zero_partitions_the_model_states():
    p = LLAMA.total_params
    assert planner.model_state_bytes(LLAMA, planner.TrainSetup(zero_stage=3)) == -(-16 * p // 8)
    assert planner.model_state_bytes(LLAMA, planner.TrainSetup(zero_stage=0, checkpointing=True)) == 16 * p
    s1 = planner.model_state_bytes(LLAMA, planner.TrainSetup(zero_stage=1))
    s2 = planner.model_state_bytes(LLAMA, planner.TrainSetup(zero_stage=2))
    assert planner.model_state_bytes(LLAMA, planner.TrainSetup(zero_stage=3)) < s2 < s1


#: a small Llama whose fake runs take a fraction of a second (the CLI and search tests)
SMALL = planner.ModelDims("small", 8, 2, 32, 256, 512, 2, 1024)


def test_max_context_is_the_boundary_and_memory_grows_with_length():
    setup = planner.TrainSetup(
        gpus=2, gpu_memory_gib=0.25, reserve_gib=0.0, kernel="none", tiled_mlp=False, tiled_norm=False
    )
    method = planner.AttentionScheme.upipe(2)
    totals = [planner.predict(SMALL, setup, method, s).total_gib for s in (4096, 8192, 16384)]
    assert totals == sorted(totals)
    mc = planner.max_context(SMALL, setup, method, granularity=1024)
    assert mc > 0 and planner.predict(SMALL, setup, method, mc).fits
    assert not planner.predict(SMALL, setup, method, mc + 1024).fits


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
        planner.predict(LLAMA, planner.TrainSetup(), planner.AttentionScheme.upipe(12), 2**20)


def test_parse_tokens():
    assert [parse_tokens(t) for t in ("4096", "128K", "1M", "2.5M")] == [4096, 131072, 2**20, 5 * 2**19]
    with pytest.raises(Exception, match="not a token count"):
        parse_tokens("lots")


def test_ds_config_sets_what_is_planned():
    cfg = json.loads(open("ds_configs/upipe_zero3.json").read())
    setup, scheme, _ = planner.from_ds_config(cfg)
    assert (setup.gpus, setup.zero_stage, setup.dtype, setup.checkpointing, setup.offload_checkpoints) == (
        4,
        3,
        "bf16",
        True,
        False,
    )
    assert not (setup.tiled_loss or setup.tiled_norm or setup.tiled_mlp)  # the config has no stack
    assert scheme == planner.AttentionScheme.upipe(None)
    stack = {**cfg, "upipe": {**cfg["upipe"], "enabled": False, "offload_checkpoints": True}}
    stack["upipe"].update(tiled_loss=True, tiled_norm=True, tiled_mlp={"tile_tokens": 512})
    setup, scheme, _ = planner.from_ds_config(stack)
    assert scheme.kind == "ulysses" and setup.offload_checkpoints and setup.tiled_loss and setup.mlp_tile_tokens == 512
    _, scheme, _ = planner.from_ds_config({**cfg, "upipe": {**cfg["upipe"], "accumulate_dtype": "input"}})
    assert scheme == planner.AttentionScheme.upipe(None, accumulate_in_input_dtype=True)


def test_planner_reads_the_runtimes_validated_settings():
    """One config reader: ``from_ds_config`` plans what ``parse_config`` (the runtime's reader) returns:
    tile sizes, ring size, checkpoint pairs, checkpoint and ZeRO offload survive, from a dict or from
    the ``SPSettings`` object itself; an unknown upipe key is refused as the runtime refuses it."""
    from ds_upipe.integration.config import parse_config

    cfg = json.loads(open("ds_configs/upipe_long_context.json").read())
    cfg["sequence_parallel_size"] = 8
    cfg["zero_optimization"] = {**cfg["zero_optimization"], "offload_optimizer": {"device": "cpu", "pin_memory": True}}
    cfg["upipe"] = {
        **cfg["upipe"],
        "ring_size": 2,
        "checkpoint_pairs": 2,
        "head_chunk_size": 4,
        "tiled_loss": {"tile_tokens": 1024},
        "tiled_norm": {"tile_tokens": 2048},
        "tiled_mlp": {"tile_tokens": 4096},
    }
    settings = parse_config(cfg)
    for given in (cfg, settings):
        setup, scheme, _ = planner.from_ds_config(given)
        assert (setup.loss_tile_tokens, setup.norm_tile_tokens, setup.mlp_tile_tokens) == (1024, 2048, 4096)
        assert (setup.tiled_loss, setup.tiled_norm, setup.tiled_mlp) == (True, True, True)
        assert (setup.gpus, setup.ring_size, setup.checkpoint_groups, setup.checkpoint_group_size) == (8, 2, 2, 2)
        assert (setup.checkpointing, setup.offload_checkpoints, setup.checkpoint_pinning) == (True, True, "exact")
        assert (setup.offload_optimizer, setup.offload_pin_memory, setup.offload_param) == (True, True, False)
        assert (setup.dtype, setup.zero_stage) == ("bf16", 3)
        assert scheme == planner.AttentionScheme.upipe(
            4, accumulate_in_input_dtype=True, recompute_attention_output=True
        )
    plain = planner.from_ds_config({**cfg, "upipe": {**cfg["upipe"], "tiled_mlp": True}})[0]
    assert plain.tiled_mlp and plain.mlp_tile_tokens is None  # on, with the stack's default tile
    with pytest.raises(ValueError, match="upipe.tiled_mlps: unknown key"):
        planner.from_ds_config({**cfg, "upipe": {**cfg["upipe"], "tiled_mlps": True}})


def test_ring_layouts_are_planned_by_running_the_ring(capsys):
    """``ring_size``: UPipe x Ring at the U valid for C_u = gpus / R (U = H is Ulysses x Ring; ALST has no
    ring), from the flag or the ds_config, and the CLI's ``--ring-size``.  (That the fake ring run is the
    measured memory: tests/test_ring.py::test_planner_fake_run_of_the_ring_matches_memtracker.)"""
    with pytest.raises(ValueError, match="ring_size=3 must be a positive divisor of gpus=4"):
        planner.TrainSetup(gpus=4, ring_size=3)
    assert [m.label for m in planner.methods_for(SMALL, 4, ring_size=2)] == ["upipe U=2", "upipe U=4", "upipe U=8"]
    cfg = json.loads(open("ds_configs/upipe_zero3.json").read())
    setup, _, _ = planner.from_ds_config({**cfg, "upipe": {**cfg["upipe"], "ring_size": 2}})
    assert (setup.gpus, setup.ring_size, setup.ulysses_size, setup.seq_multiple) == (4, 2, 2, 4)
    small = planner.TrainSetup(gpus=4, ring_size=2, kernel="none", reserve_gib=0.0)
    with pytest.raises(ValueError, match="DeepSpeed ALST has no ring"):
        planner.layer_peak(SMALL, small, planner.AttentionScheme("ulysses"), 4096)
    with pytest.raises(ValueError, match="head_chunk_size=1 is not valid"):
        planner.layer_peak(SMALL, small, planner.AttentionScheme.upipe(1), 4096)
    assert "4 GPUs x 79.6 GiB (Ulysses 2 x ring 2)" in planner.describe(SMALL, small)
    args = ["plan", "--model", "qwen3-32b", "--gpus", "16", "--ring-size", "2", "--seq", "128K,1000"]
    assert main(args) == 2  # refused before any run: the CLI reads --ring-size
    assert "--seq [1000]: every length must be a positive multiple of 16 (--ring-size 2)" in capsys.readouterr().err


@pytest.mark.parametrize(
    "option, share",
    [
        # upipe.accumulate_dtype="input": the fused path's float32 dx accumulator (b x S/C x hidden x 4
        # bytes) becomes bf16 (x 2): the peak drops by at least one bf16 hidden state
        ("accumulate_in_input_dtype", 1.0),
        # upipe.recompute_attention_output: the fused block's saved attention output (b x S/C x H x d, one
        # bf16 hidden state for Llama3-8B) is gone from the layer's backward peak (o_proj's gradient buffer
        # lives through the stages instead)
        ("recompute_attention_output", 0.9),
    ],
)
def test_memory_options_are_planned_by_running_them(option, share):
    """Each UPipe memory option reaches the fake run and takes (about) one hidden state off the layer peak."""
    setup = planner.TrainSetup()
    seq = 2**20
    off, on = (
        planner.layer_peak(LLAMA, setup, planner.AttentionScheme.upipe(8, **{option: flag}), seq)
        for flag in (False, True)
    )
    hidden_state = seq // 8 * LLAMA.hidden_size * 2
    assert off.total - on.total >= share * hidden_state, (off.total, on.total)


def test_which_head_chunk_report_plans_the_given_methods():
    """``plan --tokens`` reports the methods the CLI built (its flags applied), not a rebuilt default set."""
    methods = [planner.AttentionScheme("ulysses"), planner.AttentionScheme.upipe(8, recompute_attention_output=True)]
    report = planner.which_head_chunk_report(LLAMA, planner.TrainSetup(), 2**20, methods)
    assert "upipe+recompute U=8" in report and "ulysses (ALST)" in report, report
    assert "upipe U=16" not in report, report


def test_cli_plan_with_a_config_breakdown_and_json(tmp_path, capsys):
    model = tmp_path / "config.json"
    model.write_text(
        json.dumps(
            {
                "model_type": "llama",
                "hidden_size": 256,
                "intermediate_size": 512,
                "num_attention_heads": 8,
                "num_key_value_heads": 4,
                "head_dim": 32,
                "num_hidden_layers": 2,
                "vocab_size": 1024,
            }
        )
    )
    out = tmp_path / "plan.json"
    args = ["plan", "--model", str(model), "--config", "ds_configs/upipe_zero3.json", "--gpu-memory", "0.3"]
    assert main([*args, "--reserve", "0", "--seq", "8K,16K", "--tokens", "16K", "--breakdown", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "upipe U=4" in text and "ulysses" not in text  # only what the config runs
    assert "peak set by:" in text and "alive at the peak" in text and "model states" in text
    data = json.loads(out.read_text())
    assert set(data["max_context"]) == {"upipe U=4"} and len(data["predictions"]) == 2
    assert main(["plan", "--model", "no-such-model"]) == 2
    assert "not a preset" in capsys.readouterr().err
    # refused before any fake run: only fused UPipe can recompute the attention output
    assert main(["plan", "--model", "qwen3-32b", "--unfused", "--recompute-attention-output"]) == 2
    assert "--recompute-attention-output needs fused projections (drop --unfused" in capsys.readouterr().err


def test_fake_run_at_paper_scale_is_the_plan_less_the_analytic_terms():
    """Llama3-8B, 8 GPUs, 1M tokens: the plan is the two-layer step's fake-tensor run (its peak phase)
    plus the documented analytic terms, and the peak phase is the step's own peak."""
    from ds_upipe.integration import fake_run

    setup = planner.TrainSetup()
    method = planner.AttentionScheme.upipe(8)
    seq = 2**20
    p = planner.predict(LLAMA, setup, method, seq)
    run = fake_run.model_step(planner.step_spec(LLAMA, setup, method, seq))
    assert set(run.phases) == set(fake_run.STEP_PHASES)
    assert p.peak_phase == max(run.phases, key=run.phases.get) and p.phase_gib * GiB == run.total - run.weights
    assert p.other_layers_gib == 0  # offloaded checkpoints: the other layers keep nothing on the GPU
    analytic = (
        planner.model_state_bytes(LLAMA, setup) + planner.zero_buffer_bytes(LLAMA, setup) + setup.reserve_gib * GiB
    )
    assert p.total_gib * GiB == analytic + run.total - run.weights
    # without offload each of the other 30 layers keeps its input on the GPU, in every phase above it
    kept = planner.predict(LLAMA, replace(setup, offload_checkpoints=False), method, seq)
    x = seq // 8 * LLAMA.hidden_size * 2
    assert kept.other_layers_gib * GiB == 30 * x and kept.total_gib * GiB == p.total_gib * GiB + 30 * x
    # the kernel workspace is the one analytic term inside the run: flash-attn 2's fp32 dq accumulator of a
    # stage (U/C = 1 query head over the full sequence) while the attention backward op runs
    layer = fake_run.layer_step(planner.step_spec(LLAMA, setup, method, seq))
    cpu = fake_run.layer_step(planner.step_spec(LLAMA, replace(setup, kernel="none"), method, seq))
    assert layer.workspace == 4 * seq * 1 * 128 and layer.total - layer.workspace >= cpu.total - 4 * seq * 128


def test_step_plan_matches_an_independent_fake_measurement():
    """The planner (two-layer step + the other layers' named terms) against benchmarks/check_planner_step.py's
    independent measurement of a four-layer model through the public API (hf_patches, the run's own
    checkpointing, torch's MemTracker), UPipe's and ALST's shipped long-context configs: within 3%.  Fails
    when the planner measures the loss and layer phases apart, or drops the other layers' checkpoints."""
    from benchmarks.check_planner_step import check

    for config in ("ds_configs/upipe_long_context.json", "ds_configs/ulysses_alst_long_context.json"):
        row = check("llama3-8b", config, 4, 2**17)
        assert abs(row["error"]) <= 0.03, row


@pytest.fixture(scope="module")
def calibration():
    """Per-rank MemTracker peaks of the whole-step cases and the layer points, one spawn of C=2 ranks."""
    return run_ranks(
        bench_cases.calibration_group,
        bench_cases.CALIBRATION_WORLD,
        bench_cases.CALIBRATION_POINTS,
        bench_cases.WHOLE_STEP_ARGS,
        bench_cases.GROUP_STEP_ARGS,
        use_deepspeed=True,
    )


def calibration_dims(arch: str = "llama") -> planner.ModelDims:
    """The planner's dims of bench_cases' calibration model (one layer, vocabulary 128; Qwen3: q/k norms)."""
    shape = bench_cases.CALIBRATION_SHAPE
    return planner.ModelDims(
        "calibration",
        shape["heads"],
        shape["kv_heads"],
        shape["head_dim"],
        shape["hidden"],
        shape["intermediate"],
        1,
        128,
        qk_norm=arch == "qwen3",
        model_type=arch,
    )


def measured_scheme(point: bench_cases.CalibrationPoint) -> planner.AttentionScheme:
    """The planner's scheme of a calibration point."""
    return planner.measured_scheme(point.kind, point.options)


def test_layer_plan_matches_memtracker_on_cpu(calibration):
    """The fake-tensor planner against the real decoder layer measured with MemTracker, per rank, C=2
    gloo ranks (ALST and UPipe fused/unfused, fp32 and bf16, tiled MLP or not): within 5%."""
    points = bench_cases.CALIBRATION_POINTS
    measured = [r["layers"] for r in calibration]
    report = []
    for i, point in enumerate(points):
        method = measured_scheme(point)
        # the measured layer runs plain forward + backward (no replay)
        setup = planner.measured_layer_setup(
            bench_cases.CALIBRATION_WORLD,
            point.dtype,
            point.tiled_mlp,
            hidden_size=bench_cases.CALIBRATION_SHAPE["hidden"],
        )
        peak = planner.layer_peak(calibration_dims(point.arch), setup, method, point.seq)
        worst = max(rank_peaks[i] for rank_peaks in measured)
        report.append((point.arch, method.label, point.seq, point.dtype, worst, peak.total, peak.total / worst - 1))
    bad = [r for r in report if abs(r[-1]) > 0.05]
    assert not bad, "\n".join(map(str, report))


def test_real_runs_around_planner_runs_in_one_process():
    """The plan indices are cached per process, never across a fake-tensor mode: real runs before and
    after the planner's fake runs of the same plans (both orders) get real indices, and the fake runs
    fake ones."""
    import torch

    from ds_upipe import TorchSDPAKernel, UPipeDistributedAttention
    from ds_upipe.integration import fake_run
    from ds_upipe.kernels import gqa_native_sdpa

    def real_run(u: int) -> None:  # one rank, no process group: the same plan as a fake world of 1
        attn = UPipeDistributedAttention(TorchSDPAKernel(), None, head_chunk_size=u)
        q, k, v = (torch.randn(1, 16, h, 8, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
        out = attn(q, k, v, 0)
        assert (out - gqa_native_sdpa(q, k, v)).abs().max() < 1e-12
        out.sum().backward()
        assert q.grad is not None

    real_run(1)  # cached before the fake run of the same plan
    for u in (1, 2):
        assert fake_run.core_step(4, 2, 8, 1, u, 16, dtype="fp64").total > 0
        real_run(u)  # U=2: first asked for under the fake mode


def test_checkpoint_replay_plan_matches_memtracker_on_cpu(calibration):
    """With checkpointing the planner runs the layer as the checkpoint's replay (output stand-in, x and
    dy alive): against the same replay measured with MemTracker (UPipe fused, U = C, tiled MLP), within
    5%, and below the plain layer's peak by about the layer output it no longer holds."""
    point = bench_cases.REPLAY_POINT
    dims = calibration_dims(point.arch)
    setup = planner.measured_layer_setup(
        bench_cases.CALIBRATION_WORLD,
        point.dtype,
        point.tiled_mlp,
        checkpointing=True,
        hidden_size=bench_cases.CALIBRATION_SHAPE["hidden"],
    )
    method = measured_scheme(point)
    peak = planner.layer_peak(dims, setup, method, point.seq)
    plain = planner.layer_peak(dims, replace(setup, checkpointing=False), method, point.seq)
    worst = max(r["replay"] for r in calibration)
    assert abs(peak.total / worst - 1) <= 0.05, (worst, peak.total, peak.at)
    assert peak.total < plain.total


def test_whole_step_plan_matches_memtracker_on_cpu(calibration):
    """The planner's whole-step prediction (fake-tensor layer and loss phases + the weights, the other
    layers' saved tensors and the gradients made so far) against benchmarks/whole_step.py's MemTracker
    peak, worst rank, ALST and UPipe with and without the long-context stack: within 5%."""
    args = bench_cases.WHOLE_STEP_ARGS
    report = []
    for key in calibration[0]["whole_step"]:
        worst = max(r["whole_step"][key] for r in calibration)
        pred = planner_prediction(args, key.split("+")[0], key.endswith("+stack"))
        report.append(
            (key, worst, pred.total_gib * GiB, pred.total_gib * GiB / worst - 1, pred.peak_phase, pred.peak_at)
        )
    assert len(report) == 4
    assert all(abs(r[3]) <= 0.05 for r in report), "\n".join(map(str, report))


def test_grouped_step_plan_matches_memtracker_on_cpu(calibration):
    """Checkpoint groups on (benchmarks/whole_step.py's GROUP_CASES: N groups of k = 2 and 3 below a top layer, UPipe,
    installed by the run's configure_activation_checkpointing): the planner's whole step against the real one's
    MemTracker peak, worst rank, with every checkpoint in memory (as a CPU run keeps them) and with the groups'
    inputs in their host stores (offloaded, as on CUDA; the device side is the peak less what the stores hold), and
    its host term against the bytes the stores hold: within 5%.  Fails when the planner ignores k or the groups
    (one layer input is ~3.5% of this step: 3 more fail the device side, 1 more the host side) or counts L - 1
    offloaded inputs."""
    from benchmarks.whole_step import GROUP_CASES

    args = bench_cases.GROUP_STEP_ARGS
    report = []
    for n, k in GROUP_CASES:
        measured = {
            part: max(r["groups"][f"{n}x{k}"][part] for r in calibration) for part in ("device", "offloaded", "host")
        }
        kept = planner_prediction(args, "upipe", False, (n, k), offload=False)
        offloaded = planner_prediction(args, "upipe", False, (n, k), offload=True)
        host = sum(offloaded.host_terms_gib.values()) * GiB
        for part, pred in (("device", kept.total_gib * GiB), ("offloaded", offloaded.total_gib * GiB), ("host", host)):
            report.append((f"{n} groups of {k}", part, measured[part], pred, pred / measured[part] - 1))
    assert all(abs(r[-1]) <= 0.05 for r in report), "\n".join(map(str, report))


def test_host_memory_is_planned_and_bounds_the_max_context():
    """Offloaded checkpoints: layers - 1 layer inputs per rank (DeepSpeed keeps the newest on the GPU),
    rounded up to a power of two as torch's pinned allocator does, or exact with ds_upipe's pool; the
    node's ranks share --host-memory; the max context fits both and the table says which binds."""
    setup = planner.TrainSetup(gpus=8, kernel="none", reserve_gib=0.0)
    x = planner.hidden_state_bytes(LLAMA, setup, 7 * 2**20)  # 7M tokens: 7 GiB per layer input
    assert x == 7 * GiB and planner.pinned_block_bytes(x, "pow2") == 8 * GiB
    assert planner.pinned_block_bytes(x, "exact") == x
    terms = planner.host_terms(LLAMA, setup, 7 * 2**20)
    (ckpt,) = [v for k, v in terms.items() if k.startswith("checkpoints")]
    assert ckpt == 8 * 31 * 8 * GiB  # 1,984 GiB on a node of 8 ranks
    exact = planner.host_terms(LLAMA, replace(setup, checkpoint_pinning="exact"), 7 * 2**20)
    assert sum(exact.values()) < sum(terms.values())
    # host-bound (the small model, quick fake runs): a roomy GPU, 10 MiB of host for 2 ranks
    roomy = planner.TrainSetup(
        gpus=2, gpu_memory_gib=1.0, reserve_gib=0.0, kernel="none", host_memory_gib=10 / 1024, host_os_gib=0.0
    )
    roomy = replace(roomy, host_per_rank_gib=0.0)
    method = planner.AttentionScheme.upipe(2)
    mc = planner.max_context(SMALL, roomy, method, granularity=1024)
    assert 0 < mc and planner.predict(SMALL, roomy, method, mc).fits
    nxt = planner.predict(SMALL, roomy, method, mc + 1024)
    assert nxt.gpu_fits and not nxt.host_fits and nxt.binding == "host"
    assert planner.binding_limit(SMALL, roomy, method, mc) == "host"
    # exact pinning: 10 MiB / 2 ranks / (256 hidden x 2 bytes) = 10,240 tokens per rank; pow2: 8,192
    assert mc == 2 * 8192
    assert planner.max_context(SMALL, replace(roomy, checkpoint_pinning="exact"), method, granularity=1024) == 2 * 10240


def test_the_planner_chooses_the_group_size():
    """Host-bound (a roomy GPU, 10 MiB of host for 2 ranks, exact pinning) with 8 layers: without groups 7 layer
    inputs per rank; 3 pairs keep 4 (1 in DeepSpeed's pool below the top layer, 3 saved), as do 2 groups of 3 or 4
    (at more compute), so the planner picks 3 pairs, and the context grows by 7/4; 2 pairs (5 inputs) would not
    reach it."""
    dims = planner.ModelDims("small8", 8, 2, 32, 256, 512, 8, 1024)
    # a GPU that stops at 25,600 tokens (a roomier one only makes its search longer), 5x what the host allows
    roomy = planner.TrainSetup(
        gpus=2, gpu_memory_gib=0.12, reserve_gib=0.0, kernel="none", host_memory_gib=10 / 1024, host_os_gib=0.0
    )
    roomy = replace(roomy, host_per_rank_gib=0.0, checkpoint_pinning="exact")
    method = planner.AttentionScheme.upipe(2)
    # searched up to 64K tokens (the default search first probes 1M tokens, a slow fake run of this model)
    table = planner.group_size_rows(dims, roomy, method, granularity=256, limit=2**16)
    rows = {k: (s, mc, binds) for k, s, mc, binds, _ in table}
    token_inputs = 10 * 2**20 // 2 // (256 * 2)  # per rank: 10,240 tokens x layer inputs
    assert rows[1][1] == 2 * (token_inputs // 7) // 256 * 256 and rows[1][2] == "host"
    assert rows[2][1] == 2 * (token_inputs // 4) // 256 * 256 == rows[3][1] == rows[4][1]
    assert rows[2][0].checkpoint_groups == 3 and rows[2][2] == "host"
    assert rows[3][0].checkpoint_groups == 2  # 8 - 6 - 1 + 2 + 1 = 4 inputs
    best = max(table, key=lambda r: (r[2], -r[4]))
    assert (best[0], best[1].checkpoint_groups, best[4]) == (2, 3, 3 / 32)
    two = planner.grouped(dims, roomy, 2, 2)
    assert planner.host_max_context(dims, two, 256) < rows[2][1]  # host alone stops 2 pairs short of it


def test_offload_settings_are_planned_or_refused_by_name():
    cfg = json.loads(open("ds_configs/upipe_zero3.json").read())
    zero = cfg["zero_optimization"]
    offload = {**cfg, "zero_optimization": {**zero, "offload_optimizer": {"device": "cpu", "pin_memory": True}}}
    setup, _, _ = planner.from_ds_config(offload)
    assert setup.offload_optimizer and setup.offload_pin_memory and not setup.offload_param
    plain, _, _ = planner.from_ds_config(cfg)
    p = LLAMA.total_params
    assert planner.model_state_bytes(LLAMA, plain) - planner.model_state_bytes(LLAMA, setup) == 12 * p // 4 + 0 * p
    host = planner.host_terms(LLAMA, setup, 2**16)
    assert host["optimizer states (offload_optimizer)"] >= 4 * 16 * p // 4  # 4 ranks x 16 B per parameter / 4
    for bad, words in (
        ({"offload_optimizer": {"device": "nvme"}}, ["offload_optimizer.device='nvme'", "NVMe"]),
        ({"offload_param": {"device": "cpu", "pinned": True}}, ["offload_param", "unknown keys ['pinned']"]),
        ({"offload_optimizer": "cpu"}, ["offload_optimizer='cpu'", "must be an object"]),
        ({"stage": 2, "offload_param": {"device": "cpu"}}, ["offload_param with zero_stage=2", "stage 3"]),
    ):
        with pytest.raises(ValueError) as err:
            planner.from_ds_config({**cfg, "zero_optimization": {**zero, **bad}})
        for word in words:
            assert word in str(err.value), (bad, str(err.value))


def test_cli_refuses_a_setup_where_nothing_fits_naming_the_term(capsys):
    args = ["plan", "--model", "llama3-8b", "--config", "ds_configs/upipe_long_context.json", "--seq", "64K"]
    assert main([*args, "--host-memory", "16"]) == 2
    err = capsys.readouterr().err
    assert "nothing fits" in err and "host" in err and "--host-memory 16" in err and "OS and processes" in err
    assert main([*args, "--gpu-memory", "8"]) == 2
    err = capsys.readouterr().err
    assert "nothing fits" in err and "--gpu-memory 8" in err and "model states" in err


def test_exact_pinned_pool_pins_what_the_planner_counts():
    """ds_upipe's checkpoint pool (DeepSpeed's offload engine with exact-size host buffers) on a CPU
    run: one buffer per offloaded layer input, of exactly its bytes, reused the next step; the
    planner's exact host term for a rank is those bytes.  (On CUDA the buffers are cudaHostRegister'ed;
    torch's pinned allocator would have rounded each 3 x 2^k-byte block to 4 x 2^k.)"""
    import torch

    from ds_upipe.integration.checkpointing import exact_pinned_offload_engine

    dims = planner.ModelDims("pool", 8, 2, 32, 96, 128, 5, 64)  # hidden 96 = 3 x 32: not a power of two
    setup = planner.TrainSetup(gpus=2, gpus_per_node=1, checkpoint_pinning="exact", host_os_gib=0.0)
    setup = replace(setup, host_per_rank_gib=0.0)
    seq = 4096
    engine = exact_pinned_offload_engine(use_streams=False)
    checkpoint = torch.empty(1, seq // 2, 96, dtype=torch.bfloat16)
    for _ in range(2):  # two steps
        buffers = [engine._empty_cpu_like(checkpoint) for _ in range(dims.num_layers - 1)]
        for host, key in buffers:
            engine._pool_cpu_buffer(key, host)
    assert engine.pinned_bytes == (dims.num_layers - 1) * checkpoint.numel() * 2
    assert len(engine.registered) == dims.num_layers - 1  # reused in the second step
    (host_ckpt,) = [v for k, v in planner.host_terms(dims, setup, seq).items() if k.startswith("checkpoints")]
    assert host_ckpt == engine.pinned_bytes
    pow2 = planner.host_terms(dims, replace(setup, checkpoint_pinning="pow2"), seq)
    assert sum(pow2.values()) == 4 * engine.pinned_bytes // 3
    engine.release()
    assert engine.pinned_bytes == 0 and not engine.registered


def test_the_input_below_the_top_layer_is_planned_on_the_host():
    """ds_upipe's offload engine keeps no forward stash (DeepSpeed's own, max_fwd_stash_count=2, keeps the
    device copy of the newest offloaded layer input, so the top two layers' inputs are on the GPU through the
    top layer's backward, where a long-context step peaks): with its exact pool the planner has the two-layer
    step's bottom-layer input on the host in the top layer's backward, one hidden state below the same step
    with DeepSpeed's engine (pow2), the other phases unchanged; not where the groups reach the top two
    layers.  Mutations: the engine's default stash kept, or the planner not
    subtracting it, fail."""
    from ds_upipe.integration.checkpointing import exact_pinned_offload_engine

    assert exact_pinned_offload_engine(use_streams=False).max_fwd_stash_count == 0
    dims = planner.ModelDims("stash", 8, 2, 8, 64, 128, 5, 101)
    setup = planner.TrainSetup(gpus=2, gpus_per_node=1, checkpoint_pinning="exact", dtype="fp32")
    seq = 256
    x = planner.hidden_state_bytes(dims, setup, seq) / GiB
    method = planner.AttentionScheme.upipe(2, fused_projections=True)
    exact = planner.predict(dims, setup, method, seq).phases_gib
    pow2 = planner.predict(dims, replace(setup, checkpoint_pinning="pow2"), method, seq).phases_gib
    assert {k: pow2[k] - v for k, v in exact.items()} == pytest.approx(
        {"forward": 0, "loss": 0, "top layer": x, "bottom layer": 0}, abs=1e-12
    )
    assert not planner.offloaded_below_top(dims, replace(setup, checkpoint_groups=2, checkpoint_group_size=2), seq)
    assert planner.offloaded_below_top(dims, replace(setup, checkpoint_groups=1, checkpoint_group_size=3), seq)


@pytest.mark.parametrize("groups,size", [(2, 2), (1, 4)])
def test_checkpoint_groups_are_planned_from_what_the_stores_keep(groups, size):
    """upipe.checkpoint_groups N of k (pairs: k = 2): the host term is the bytes the groups' pools really hold
    in a CPU run of the real groups (one exact buffer per group, k - 2 inner ones in the shared pool),
    DeepSpeed's engine pins layers - N k - 1; on the GPU (no offload) N (k - 1) layer inputs fewer and k - 2
    inner ones; the config key reaches the plan; N k beyond L is refused."""
    import functools

    import torch
    import transformers

    from ds_upipe.integration.checkpoint_groups import install_checkpoint_groups
    from ds_upipe.tools.models import tiny_config

    dims = planner.ModelDims("groups", 8, 2, 8, 64, 64, 5, 101)
    setup = planner.TrainSetup(gpus=2, gpus_per_node=1, checkpoint_pinning="exact", host_os_gib=0.0, dtype="fp32")
    setup = replace(setup, host_per_rank_gib=0.0, checkpoint_groups=groups, checkpoint_group_size=size)
    seq = 64
    config = tiny_config("llama", num_hidden_layers=5, hidden_size=64, intermediate_size=64, vocab_size=101)
    model = transformers.LlamaForCausalLM(config).train()
    checkpoint = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=True)
    model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=checkpoint)
    model.enable_input_require_grads()
    installed = install_checkpoint_groups(model, groups, size, offload=True)
    ids = torch.randint(0, 101, (1, seq // 2))  # this rank's shard of seq tokens
    model(input_ids=ids, labels=ids).loss.backward()
    terms = planner.host_terms(dims, setup, seq)
    x = planner.hidden_state_bytes(dims, setup, seq)
    pinned = sum(g.store.allocated_bytes for g in installed) + installed[0].inner_store.allocated_bytes
    label = f"checkpoint groups of {size} ({groups} saved + {size - 2} inner layer inputs/rank, exact pinned)"
    assert terms[label] == pinned == (groups + size - 2) * x
    engine = 5 - groups * size - 1  # the top layer's input: DeepSpeed keeps it on the GPU
    assert terms[f"checkpoints ({engine} layer inputs/rank, exact pinned)"] == engine * x
    plain = planner.host_terms(dims, replace(setup, checkpoint_groups=0), seq)
    assert sum(plain.values()) - sum(terms.values()) == (groups * (size - 1) - (size - 2)) * x
    on_gpu = replace(setup, offload_checkpoints=False)
    # on the GPU: 5 layers -> besides the two measured layers' inputs 3, less N (k - 1), plus k - 2 inner ones
    below = (max(0, 3 - groups * (size - 1)) + size - 2) * x
    others = planner.other_layers(dims, on_gpu, seq, 0)
    assert {k: v[0] for k, v in others.items()} == {
        "forward": below,
        "loss": below,
        "top layer": below,
        "bottom layer": 0,
    }
    cfg = json.loads(open("ds_configs/upipe_llama3_8b_8m.json").read())
    assert planner.from_ds_config(cfg)[0].checkpoint_groups > 0
    with pytest.raises(ValueError, match=f"checkpoint_groups={groups + 1} of {size}: groups has 5 layers"):
        planner.host_terms(dims, replace(setup, checkpoint_groups=groups + 1), seq)


def test_moe_presets_count_every_expert_and_plan_a_step(tmp_path):
    """Qwen3-30B-A3B and GPT-OSS-20B: published sizes (30.5B total / 3.3B active; 20.9B total), every
    expert in the model states and in ZeRO-3's gathered layer, the fake run's dense stand-in MLP of
    top-k x (expert intermediate + 3/4 hidden), the same dims from their config.json, one step
    planned at 128K tokens on the preset's GPUs (fits 80 GB) with the basis in the breakdown."""
    qwen, oss = planner.model_dims("qwen3-30b-a3b"), planner.model_dims("gpt-oss-20b")
    assert abs(qwen.total_params / 30.53e9 - 1) < 0.005 and abs(qwen.active_params_per_token / 3.35e9 - 1) < 0.01
    assert abs(oss.total_params / 20.91e9 - 1) < 0.005  # the gpt-oss model card: 20.91B
    # the card's 3.61B active excludes the embedding (its unembedding counts)
    assert abs((oss.active_params_per_token - oss.embedding_params) / 3.61e9 - 1) < 0.01
    experts = 128 * 3 * 2048 * 768
    assert qwen.params_per_layer == experts + 128 * 2048 + 2 * 2048 * 4096 + 2 * 2048 * 512 + 2 * 2048 + 2 * 128
    setup = planner.TrainSetup(gpus=planner.PRESET_GPUS["qwen3-30b-a3b"])
    assert planner.zero_buffer_bytes(qwen, setup) >= 2 * 2 * experts  # the gathered block: all experts, bf16
    assert qwen.shape().intermediate_size == 8 * (768 + 1536) and qwen.shape().model_type == "qwen3"
    assert oss.shape().intermediate_size == 4 * (2880 + 2160) and oss.shape().attention_bias
    config = {
        "model_type": "gpt_oss", "hidden_size": 2880, "intermediate_size": 2880, "num_attention_heads": 64,
        "num_key_value_heads": 8, "head_dim": 64, "num_hidden_layers": 24, "vocab_size": 201088,
        "num_local_experts": 32, "num_experts_per_tok": 4, "sliding_window": 128, "attention_bias": True,
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert planner.model_dims(str(tmp_path)) == replace(oss, name=str(tmp_path / "config.json"))
    for dims, name in ((qwen, "qwen3-30b-a3b"), (oss, "gpt-oss-20b")):
        setup = planner.TrainSetup(gpus=planner.PRESET_GPUS[name])
        method = planner.AttentionScheme.upipe(setup.gpus)
        p = planner.predict(dims, setup, method, 128 * 2**10)
        assert p.fits and p.model_states_gib * GiB == planner.model_state_bytes(dims, setup), (name, p)
        assert "stand-in" in planner.describe(dims, setup) and "experts" in planner.moe_basis(dims)
    assert "full causal (an upper bound)" in planner.moe_basis(oss)


def test_cli_plan_config_auto_plans_the_u_auto_picks(tmp_path):
    """``plan --config`` with ``"head_chunk_size": "auto"`` plans the U the run's "auto" picks for the
    planned model (``planner.auto_head_chunk_size``: the runtime's measurement of the model's attention
    layer at ``upipe.seq_length``), not U = C; the config is read once (``parse_config``), tile sizes kept.
    Only the setup is built (``cli._plan_setup``: the auto measurement, no plan).  Mutation: dropping the
    replay in ``_plan_setup`` plans U = 4 (C) and fails."""
    from ds_upipe.integration.auto_chunk import choose_head_chunk_size
    from ds_upipe.integration.config import UPipeConfig
    from ds_upipe.tools.cli import _plan_setup, build_parser

    fields = dict(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=4, head_dim=32)
    model = tmp_path / "config.json"
    model.write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2, "vocab_size": 1024, **fields}))
    ds = json.loads((Path(__file__).resolve().parents[1] / "ds_configs" / "upipe_zero3.json").read_text())
    ds["upipe"].update(head_chunk_size="auto", memory_budget_gib=1.0, seq_length=8192, tiled_mlp={"tile_tokens": 4096})
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    cfg = UPipeConfig(**{**ds["upipe"], "tiled_mlp": True})
    dims = dict(num_heads=8, num_kv_heads=4, head_dim=32, group_size=4, micro_batch_size=1, dtype_bytes=2)
    # the planned model's config as the planner builds it (so the measurement is shared, not run twice)
    want = choose_head_chunk_size(cfg, **dims, model_config=planner.model_dims(str(model)).shape().config(1))
    assert want == 8  # a large budget: the largest valid U (C = 4 would be U = 4)
    args = build_parser().parse_args(["plan", "--model", str(model), "--config", str(tmp_path / "ds.json")])
    _, setup, methods = _plan_setup(args)
    assert [m.options.head_chunk_size for m in methods] == [want] and setup.mlp_tile_tokens == 4096


def test_vision_language_configs_plan_their_text_model(tmp_path):
    """A VLM's config.json (Qwen2.5-VL's, as transformers writes it and with the hub's top-level text keys; Qwen3-VL,
    Qwen3.5 (hybrid), LLaVA): its text model's dims, the tower and projector counted in the parameters (equal to the
    built model's); vision tokens counted as sequence tokens, the merged whole sample and the images' tower
    activations shared out over the ranks (``vision_terms``); the plan's statement of both; images given for a text
    model refused; the CLI's flags.
    Mutations: every rank counting all images (``images_per_rank`` without the share) fails the tower term; the
    tower's parameters left out of ``total_params`` fail the counts."""
    from tests import vlm_cases

    for build, text_type in ((vlm_cases.build_qwen2_5_vl, "qwen2"), (vlm_cases.build_qwen3_vl, "qwen3")):
        model = build()
        folder = tmp_path / text_type
        folder.mkdir()
        model.config.to_json_file(folder / "config.json")
        dims = planner.model_dims(str(folder))
        text = sum(p.numel() for n, p in model.named_parameters() if "language_model" in n or "lm_head" in n)
        assert dims.model_type == text_type and dims.vision_model_type == model.config.model_type
        assert (dims.hidden_size, dims.num_layers, dims.num_heads, dims.num_kv_heads) == (64, 2, 8, 2)
        assert dims.vision_params == sum(p.numel() for p in model.parameters()) - text
        assert dims.total_params == sum(p.numel() for p in model.parameters())
    assert planner.model_dims(str(tmp_path / "qwen2")).attention_bias and dims.qk_norm  # Qwen2's biases, Qwen3's norms
    for moe in (False, True):  # Qwen3.5: a hybrid text model planned as itself; its MoE refused (the aux loss)
        folder = tmp_path / f"qwen3_5_{moe}"
        folder.mkdir()
        model = vlm_cases.build_qwen3_5_vl(moe=moe)
        model.config.to_json_file(folder / "config.json")
        if moe:
            with pytest.raises(ValueError, match="a vision-language model with a mixture-of-experts text model"):
                planner.model_dims(str(folder))
        else:
            hybrid = planner.model_dims(str(folder))
            assert hybrid.layer_types == ("linear_attention", "full_attention") and hybrid.vision_params
            assert hybrid.total_params == sum(p.numel() for p in model.parameters())
    # the hub's Qwen2.5-VL config.json: text keys at the top level (transformers moves them into text_config)
    hub = {k: v for k, v in vlm_cases.TEXT.items() if k not in ("pad_token_id", "bos_token_id", "eos_token_id")}
    hub.update(model_type="qwen2_5_vl", vision_config={"depth": 1, "hidden_size": 32, "out_hidden_size": 64})
    (tmp_path / "hub.json").write_text(json.dumps(hub))
    flat = planner.model_dims(str(tmp_path / "hub.json"))
    assert (flat.hidden_size, flat.num_layers, flat.vocab_size, flat.model_type) == (64, 2, 128, "qwen2")
    llava = vlm_cases.build_llava()
    (tmp_path / "llava").mkdir()
    llava.config.to_json_file(tmp_path / "llava" / "config.json")
    assert planner.model_dims(str(tmp_path / "llava")).total_params == sum(p.numel() for p in llava.parameters())

    dims = planner.model_dims(str(tmp_path / "qwen2"))
    assert [planner.images_per_rank(planner.TrainSetup(gpus=4, images=n)) for n in (0, 1, 3, 8, 9)] == [0, 1, 1, 2, 3]
    seq, vision, tower = 2048, 256, 3 << 20
    setup = planner.TrainSetup(gpus=4, zero_stage=3, reserve_gib=0, kernel="none")
    vlm = replace(setup, images=6, vision_tokens=vision, tower_bytes_per_image=tower)
    row = 64 * 2  # bf16 hidden of one token
    terms = planner.vision_terms(dims, vlm, seq)
    assert terms["resident"][0] == vision * row + 2 * tower  # 6 images over 4 ranks: 2 a rank
    assert terms["forward"][0] == seq * row + vision * row  # the whole merged sample, in the forward only
    assert terms["merge"][0] == 2 * seq * row + 2 * vision * row + 2 * tower
    method = planner.AttentionScheme.upipe(4)
    text_only = replace(dims, vision_model_type="", vision_params=0)
    plain, p = planner.predict(text_only, setup, method, seq), planner.predict(dims, vlm, method, seq)
    assert p.phases_gib["vision merge"] * GiB == pytest.approx(terms["merge"][0])
    for phase, gib in plain.phases_gib.items():  # every phase of the text model holds the resident terms
        forward = terms["forward"][0] if phase == "forward" else 0
        assert (p.phases_gib[phase] - gib) * GiB == pytest.approx(terms["resident"][0] + forward), phase
    note = planner.describe(dims, vlm)
    assert "Vision tokens are sequence tokens" in note and "each length counts the 256 vision tokens" in note
    assert "6 images a sample are shared out over 4 ranks, at most 2 a rank: 2 x 3.0 MiB" in note
    with pytest.raises(ValueError, match="a text model: they plan a vision-language model's config.json"):
        planner.predict(SMALL, replace(setup, images=2), method, seq)
    # the CLI's flags reach the setup (``cli._plan_setup``: no fake run), with and without --config
    from ds_upipe.tools.cli import _plan_setup, build_parser

    flags = ["plan", "--model", str(tmp_path / "qwen2"), "--images", "6", "--vision-tokens", "1K"]
    for extra in ([], ["--config", "ds_configs/upipe_zero3.json"]):
        _, got, _ = _plan_setup(build_parser().parse_args([*flags, "--tower-mib-per-image", "3", *extra]))
        assert (got.images, got.vision_tokens, got.tower_bytes_per_image) == (6, 1024, tower), extra


def test_readme_headline_is_the_committed_plan(tmp_path):
    """The README's headline table is what ``benchmarks/plot_max_context.py`` makes of the committed plan
    results (``plan_groups_*.json``: default margins, checkpoint groups); a setup planned twice with two
    answers, or a row whose setups must agree (the 1 TB and 2 TB node) but differ, is refused.  Mutations:
    one number changed in the README, or either check removed from the script, fail."""
    from benchmarks import plot_max_context as headline

    root = Path(__file__).resolve().parents[1]
    paths = sorted((root / "benchmarks" / "results").glob("plan_groups_*.json"))
    found = headline.load(paths)
    assert headline.markdown(headline.rows(found)) in (root / "README.md").read_text()
    rerun = json.loads(paths[0].read_text())
    rerun[0]["max_context"] += 1024
    (tmp_path / "rerun.json").write_text(json.dumps(rerun))
    with pytest.raises(ValueError, match="planned twice"):
        headline.load([*paths, tmp_path / "rerun.json"])
    key = ("llama3-8b 8 x 80 GB, 1 TB", "UPipe")
    found[key] = {**found[key], "max_context": found[key]["max_context"] - 1024}
    with pytest.raises(ValueError, match="UPipe differs between"):
        headline.rows(found)
