"""examples/train_deepspeed.py under the real ``deepspeed`` launcher on CPU (gloo), float32.

Launches, each running many configurations in sequence (--runs):

* 2 processes (two such launches at once, the runs split between them): the non-SP run (data
  parallel over the 2 ranks) and, with sequence_parallel_size=2 and twice the gradient accumulation
  (one sequence group trains the two ranks' batches in turn, so a step covers the same samples),
  UPipe and DeepSpeed ALST's Ulysses at ZeRO 1, 2 and 3; the ds_configs with optimizer offload,
  unfused projections, overlapped all-to-alls, HF gradient checkpointing, "auto" head chunk size, a
  local HF checkpoint (--model) on a text file (--data); save / resume, and checkpoints loaded across
  SP and non-SP runs; bf16 with float32 gradient accumulation at ZeRO-1 (DeepSpeed's BF16_Optimizer),
  UPipe and ALST.
* 4 processes: SP=4 (fewer KV heads than ranks) and SP=2 x 2 data-parallel replicas against the
  non-SP run on 4 ranks; UPipe x Ring at C_u x R = 2 x 2 and 1 x 4; the main job's ds_config
  unmodified (bf16); a config error.

The 4-process launch uses the master port of one of the 2-process launches: it maps the segment names
that launch's ranks 0 and 1 had (the clean exit on a reused port, formerly two launches of its own in
test_clean_exit.py).
Loss trajectories and gradient norms must agree within 1e-5 relative (float32 runs).
"""

import pytest

from ds_upipe.integration.auto_chunk import attention_stage_bytes_by_u, choose_head_chunk_size
from ds_upipe.integration.config import UPipeConfig
from ds_upipe.tools.ranks import free_port
from tests.engine_cases import FP32_RTOL, REPO, TORCH_ADAM, launch, launch_many, max_rel, run

pytestmark = pytest.mark.slow
STEPS = 4  # resume at step 2 leaves two steps to compare
#: the long-context stack with tiles smaller than a rank's 128 (SP 2) or 64 (SP 4) tokens, uneven last tiles
STACK = (
    'upipe.tiled_loss={"tile_tokens": 40}',
    'upipe.tiled_norm={"tile_tokens": 24}',
    'upipe.tiled_mlp={"tile_tokens": 16}',
)
AUTO = {"memory_budget_gib": 0.0, "seq_length": 256}  # budget filled in below


def _auto_budget() -> float:
    """A budget that fits U=8 of the example's model (H=8, Hkv=2, d=16, hidden 128, fused) at SP=2, where the
    core-only measurement (``UPipeDistributedAttention`` on q, k, v, no model) would pick U=4: the launch's
    U = 8 shows ``ds_upipe.initialize`` measuring the model's attention layer as it runs it."""
    from ds_upipe.tools.models import tiny_config

    model = tiny_config(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=8,
        max_position_embeddings=256,
        rope_theta=10000.0,
    )
    dims = dict(num_heads=8, num_kv_heads=2, head_dim=16, group_size=2, micro_batch_size=1, dtype_bytes=4)
    core = attention_stage_bytes_by_u([2, 4, 8], **dims, seq_length=256)
    layer = attention_stage_bytes_by_u([2, 4, 8], **dims, seq_length=256, model_config=model, fused_projections=True)
    assert max(layer.values()) < core[8], (layer, core)
    budget = (max(layer.values()) + core[8]) / 2 / 2**30
    cfg = UPipeConfig(head_chunk_size="auto", memory_budget_gib=budget, seq_length=256)
    assert choose_head_chunk_size(cfg, **dims) == 4  # core only
    assert choose_head_chunk_size(cfg, **dims, model_config=model) == 8
    return budget


def _local_checkpoint(path) -> str:
    """A local HF checkpoint (no tokenizer: the example then trains on bytes), 4 heads, 4 KV heads."""
    import torch
    from transformers import LlamaForCausalLM

    from ds_upipe.tools.models import tiny_config

    torch.manual_seed(1)
    config = tiny_config(vocab_size=256, num_key_value_heads=4)
    LlamaForCausalLM(config).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def port() -> int:
    """The master port of the 4-process launch and of the first 2-process one (test_repeated_launch_on_one_port)."""
    return free_port()


@pytest.fixture(scope="module")
def two_procs_launch(tmp_path_factory, port):
    work = tmp_path_factory.mktemp("launch2")
    ref_ckpt, up_ckpt = str(work / "ckpt_ref"), str(work / "ckpt_upipe")
    auto = f'upipe={{"head_chunk_size": "auto", "memory_budget_gib": {_auto_budget()!r}, "seq_length": 256}}'
    local = {"model": _local_checkpoint(work / "local_llama"), "data": str(REPO / "docs" / "config.md")}
    runs = [
        run("ref_z1", "upipe_zero2", stage=1),
        run("ref_z2", "upipe_zero2"),
        run("ref_z3", save_dir=ref_ckpt, save_every=2),
        run("upipe_z1", "upipe_zero2", sp=2, gas=2, stage=1),
        run("upipe_z2", "upipe_zero2", sp=2, gas=2),
        run("upipe_z3", sp=2, gas=2, save_dir=up_ckpt, save_every=2),
        # ZeRO's all-reduce paths (reduce_scatter off), which divide by world / sp in DeepSpeed
        run("upipe_z2_allreduce", "upipe_zero2", sp=2, gas=2, extra=("zero_optimization.reduce_scatter=false",)),
        run("upipe_z3_allreduce", sp=2, gas=2, extra=("zero_optimization.reduce_scatter=false",)),
        run("alst_z1", "ulysses_alst_zero3", sp=2, gas=2, stage=1),
        run("alst_z2", "ulysses_alst_zero3", sp=2, gas=2, stage=2),
        run("alst_z3", "ulysses_alst_zero3", sp=2, gas=2),
        run("ref_z3_offload", "upipe_zero3_offload", extra=tuple(TORCH_ADAM)),
        run("upipe_z3_offload", "upipe_zero3_offload", sp=2, gas=2, extra=tuple(TORCH_ADAM)),
        run("upipe_z3_unfused", sp=2, gas=2, extra=("upipe.fused_projections=false",)),
        run("upipe_z3_hf_ckpt", sp=2, gas=2, extra=("activation_checkpointing=null",), hf_gradient_checkpointing=True),
        run("upipe_z3_auto", sp=2, gas=2, extra=(auto,)),
        # --model PATH (a local HF checkpoint, multi-head attention) and --data FILE
        run("ref_local", **local),
        run("upipe_local", sp=2, gas=2, **local),
        # resume at step 2 from the SP and the non-SP checkpoints, in SP and non-SP runs
        run("upipe_from_upipe", sp=2, gas=2, resume=up_ckpt, resume_tag="step2"),
        run("upipe_from_ref", sp=2, gas=2, resume=ref_ckpt, resume_tag="step2"),
        run("ref_from_upipe", resume=up_ckpt, resume_tag="step2"),
    ]
    runs.append(run("upipe_z3_overlap", sp=2, gas=2, extra=("upipe.overlap_comm=true",)))
    # packed rows: 8 documents of random lengths per sequence (position_ids restart), UPipe and ALST (sdpa);
    # 3 steps (test time)
    runs += [
        run("ref_z3_packed", packing=8, steps=3),
        run("upipe_z3_packed", sp=2, gas=2, packing=8, steps=3),
        run("alst_z3_packed", "ulysses_alst_zero3", sp=2, gas=2, packing=8, steps=3),
    ]
    # the long-context stack (tiled loss, norms, MLPs) from the ds_config, UPipe and ALST, ZeRO-2 and 3
    runs += [
        run("ref_z3_stack", extra=STACK),
        run("upipe_z2_stack", "upipe_zero2", sp=2, gas=2, extra=STACK),
        run("upipe_z3_stack", "upipe_long_context", sp=2, gas=2, extra=STACK),
        run("alst_z2_stack", "ulysses_alst_long_context", sp=2, gas=2, stage=2, extra=STACK),
        run("alst_z3_stack", "ulysses_alst_long_context", sp=2, gas=2, extra=STACK),
        # both layers as one checkpoint group of 2 (upipe.checkpoint_groups; checkpoint_pairs under ALST)
        run("upipe_z3_pairs", "upipe_long_context", sp=2, gas=2, extra=(*STACK, "upipe.checkpoint_groups=1")),
        run("alst_z2_pairs", "ulysses_alst_long_context", sp=2, gas=2, stage=2, extra=("upipe.checkpoint_pairs=1",)),
    ]
    # bf16 with float32 gradient accumulation at ZeRO-1: DeepSpeed's BF16_Optimizer, not a ZeRO optimizer
    bf16_acc = dict(stage=1, fp32=False, extra=("data_types.grad_accum_dtype=fp32",))
    runs += [
        run("ref_z1_bf16_fp32acc", "upipe_zero2", **bf16_acc),
        run("upipe_z1_bf16_fp32acc", "upipe_zero2", sp=2, gas=2, **bf16_acc),
        run("alst_z1_bf16_fp32acc", "ulysses_alst_zero3", sp=2, gas=2, **bf16_acc),
    ]
    # two 2-process launches at once (tests/launches.py): the checkpointing runs and those resuming from them,
    # with the ZeRO-stage and variant runs, on the shared port; the rest beside them on a port of their own
    # (the runs are independent: each builds its model and data from fixed seeds)
    apart = ("packed", "stack", "pairs", "bf16", "offload", "local")
    second = [r for r in runs if any(word in r["name"] for word in apart)]
    first = [r for r in runs if r not in second]
    specs = [dict(num_procs=2, runs=first, workdir=work, steps=STEPS, port=port)]
    specs.append(dict(num_procs=2, runs=second, workdir=work / "second", steps=STEPS))
    by_name, output = {}, ""
    for rc, out, metrics in launch_many(specs):
        assert rc == 0 and metrics["error"] is None, out[-6000:]
        by_name.update(metrics["by_name"])
        output += out
    assert len(by_name) == len(runs)
    return by_name, output


@pytest.fixture(scope="module")
def two_procs(two_procs_launch):
    return two_procs_launch[0]


@pytest.fixture(scope="module")
def four_procs(tmp_path_factory, port):
    work = tmp_path_factory.mktemp("launch4")
    runs = [
        run("ref_z1", "upipe_zero2", stage=1),
        run("ref_z3"),
        run("upipe_sp4_z3", sp=4, gas=4),
        run("alst_sp4_z3", "ulysses_alst_zero3", sp=4, gas=4),
        run("upipe_sp2_z1", "upipe_zero2", sp=2, gas=2, stage=1),
        run("upipe_sp2_z3", sp=2, gas=2),
        # UPipe x Ring: Ulysses 2 x ring 2 (fused, ZeRO-3), and ring only 1 x 4 (unfused, overlapped, ZeRO-1)
        run("upipe_ring2x2_z3", sp=4, gas=4, extra=("upipe.ring_size=2",)),
        run(
            "upipe_ring1x4_z1",
            "upipe_zero2",
            sp=4,
            gas=4,
            stage=1,
            extra=("upipe.ring_size=4", "upipe.fused_projections=false", "upipe.overlap_comm=true"),
        ),
        # the main job's config as shipped (bf16, sequence_parallel_size 4), two steps
        {"name": "shipped_upipe_zero3", "deepspeed_config": "ds_configs/upipe_zero3.json", "steps": 2},
        # the long-context configs (ZeRO-3, SP 4), float32 with small tiles, and UPipe's as shipped (bf16)
        run("upipe_sp4_stack", "upipe_long_context", sp=4, gas=4, extra=STACK),
        run("alst_sp4_stack", "ulysses_alst_long_context", sp=4, gas=4, extra=STACK),
        {"name": "shipped_upipe_long_context", "deepspeed_config": "ds_configs/upipe_long_context.json", "steps": 2},
        run("bad_sp", sp=3),  # last: a config error ends the launch
    ]
    rc, output, metrics = launch(4, runs, work, steps=STEPS, port=port)
    return rc, output, metrics


def _check_same(runs, name, ref_name, steps=None):
    got, want = runs[name], runs[ref_name]
    if steps is not None:  # compare the steps the run made (a resumed run starts later)
        want = {k: [v for s, v in zip(want["steps"], want[k]) if s in steps] for k in ("losses", "grad_norms")}
    assert max_rel(got["losses"], want["losses"]) <= FP32_RTOL, (name, got["losses"], want["losses"])
    assert max_rel(got["grad_norms"], want["grad_norms"]) <= FP32_RTOL, (name, got["grad_norms"], want["grad_norms"])


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_upipe_and_alst_equal_non_sp_at_zero_stage(two_procs, stage):
    ref = two_procs[f"ref_z{stage}"]
    assert ref["sequence_parallel_size"] == 1 and ref["zero_stage"] == stage and len(ref["losses"]) == STEPS
    for name in (f"upipe_z{stage}", f"alst_z{stage}"):
        r = two_procs[name]
        assert (r["sequence_parallel_size"], r["zero_stage"], r["train_batch_size"]) == (2, stage, 2)
        _check_same(two_procs, name, f"ref_z{stage}")
    # UPipe really ran (stages counted) with U = C; the ALST run used ALST's attention wrapper
    assert two_procs[f"upipe_z{stage}"]["upipe_stage_runs"] > 0
    assert two_procs[f"upipe_z{stage}"]["head_chunk_size"] == 2 and two_procs[f"upipe_z{stage}"]["upipe_fused"]
    assert two_procs[f"alst_z{stage}"]["upipe_stage_runs"] == 0
    assert "uattn_wrapper" in two_procs[f"alst_z{stage}"]["attention_function"]
    # the runs learn: a test on equal trajectories would also pass on runs that do nothing
    assert ref["losses"][-1] < ref["losses"][0] - 0.5


def test_gradient_norms_equal_across_stages(two_procs):
    """Gradient clipping (1.0) is active in these runs: norms above it are the unclipped norms."""
    norms = two_procs["ref_z3"]["grad_norms"]
    assert min(norms) > 1.0
    for stage in (1, 2):
        assert max_rel(two_procs[f"upipe_z{stage}"]["grad_norms"], norms) <= FP32_RTOL


@pytest.mark.parametrize("name, ref_name", [("upipe_z2_allreduce", "ref_z2"), ("upipe_z3_allreduce", "ref_z3")])
def test_zero_all_reduce_paths(two_procs, name, ref_name):
    _check_same(two_procs, name, ref_name)


@pytest.mark.parametrize("name", ["upipe_z3_unfused", "upipe_z3_hf_ckpt", "upipe_z3_auto"])
def test_variants_equal_non_sp(two_procs, name):
    _check_same(two_procs, name, "ref_z3")
    assert two_procs[name]["upipe_stage_runs"] > 0
    assert two_procs["upipe_z3_unfused"]["upipe_fused"] is False
    assert two_procs["upipe_z3_auto"]["head_chunk_size"] == 8  # the model's fused layer (core only: 4)


def test_local_checkpoint_and_text_file(two_procs):
    _check_same(two_procs, "upipe_local", "ref_local")
    r = two_procs["upipe_local"]
    assert r["upipe_stage_runs"] > 0 and r["head_chunk_size"] == 2
    assert max_rel(r["losses"], two_procs["upipe_z3"]["losses"]) > 1e-3  # another model, other data


def test_overlap_comm(two_procs):
    _check_same(two_procs, "upipe_z3_overlap", "ref_z3")
    assert two_procs["upipe_z3_overlap"]["upipe_stage_runs"] > 0


def test_packed_rows_equal_non_sp(two_procs):
    """ds_upipe.initialize on packed rows: UPipe (per-document kernel) and ALST (its sdpa core run per
    document, ``hf_patches.packing``) equal the non-SP run, whose SDPA mask transformers builds from
    the restarting positions; UPipe saw the 8 documents."""
    for name in ("upipe_z3_packed", "alst_z3_packed"):
        _check_same(two_procs, name, "ref_z3_packed")
    assert len(two_procs["upipe_z3_packed"]["losses"]) == 3 and two_procs["upipe_z3_packed"]["upipe_documents"] == [8]
    assert two_procs["upipe_z3_packed"]["upipe_stage_runs"] > 0
    assert (
        max_rel(two_procs["ref_z3_packed"]["losses"], two_procs["ref_z3"]["losses"][:3]) > 1e-3
    )  # packing changes them


def test_offload_config(two_procs):
    _check_same(two_procs, "upipe_z3_offload", "ref_z3_offload")
    _check_same(two_procs, "ref_z3_offload", "ref_z3")


@pytest.mark.parametrize("name", ["upipe_z1_bf16_fp32acc", "alst_z1_bf16_fp32acc"])
def test_bf16_optimizer_equals_non_sp(two_procs_launch, name):
    """ZeRO-1 + bf16 + grad_accum_dtype fp32 selects DeepSpeed's BF16_Optimizer, whose gradient average
    and norm ds_upipe.initialize corrects separately (engine.py, _fix_bf16_optimizer): without that the
    SP run stops at the first step (rank 1 has no gradient to measure), or its norm is 2.00x.  bf16
    rounding differs between sharded and unsharded compute (measured: up to 1.4e-4 at the first step,
    6e-4 over five), so the first step (same weights) is compared to 1e-3 and all steps to 5e-3."""
    runs, output = two_procs_launch
    got, want = runs[name], runs["ref_z1_bf16_fp32acc"]
    assert (got["sequence_parallel_size"], got["zero_stage"], want["zero_stage"]) == (2, 1, 1)
    assert output.count("begin bf16_optimizer") == 3  # the three runs above, and only they, used it
    for key in ("losses", "grad_norms"):
        assert len(got[key]) == len(want[key]) == STEPS
        assert max_rel(got[key][:1], want[key][:1]) <= 1e-3, (name, key, got[key], want[key])
        assert max_rel(got[key], want[key]) <= 5e-3, (name, key, got[key], want[key])
    assert min(want["grad_norms"]) > 1.0  # clipping (1.0) is active: the unclipped norm is compared
    assert (got["upipe_stage_runs"] > 0) == name.startswith("upipe")


@pytest.mark.parametrize(
    "name, uninterrupted",
    [("upipe_from_upipe", "upipe_z3"), ("upipe_from_ref", "ref_z3"), ("ref_from_upipe", "upipe_z3")],
)
def test_resume_continues_trajectory(two_procs, name, uninterrupted):
    r = two_procs[name]
    assert r["resumed_from"] == 2 and r["steps"] == list(range(3, STEPS + 1))
    _check_same(two_procs, name, uninterrupted, steps=set(range(3, STEPS + 1)))


@pytest.mark.parametrize("name, ref_name", [("upipe_sp4_z3", "ref_z3"), ("alst_sp4_z3", "ref_z3")])
def test_four_procs_sp4(four_procs, name, ref_name):
    _, output, metrics = four_procs
    runs = metrics["by_name"]
    assert runs[name]["sequence_parallel_size"] == 4 and runs[ref_name]["world_size"] == 4
    _check_same(runs, name, ref_name)


@pytest.mark.parametrize("name, ref_name", [("upipe_sp2_z1", "ref_z1"), ("upipe_sp2_z3", "ref_z3")])
def test_four_procs_sp2_times_dp2(four_procs, name, ref_name):
    runs = four_procs[2]["by_name"]
    assert runs[name]["sequence_parallel_size"] == 2 and runs[name]["train_batch_size"] == 4
    _check_same(runs, name, ref_name)
    assert runs[name]["upipe_stage_runs"] > 0


@pytest.mark.parametrize(
    "name, ref_name, layout, fused", [("upipe_ring2x2_z3", "ref_z3", 2, True), ("upipe_ring1x4_z1", "ref_z1", 4, False)]
)
def test_four_procs_upipe_x_ring(four_procs, name, ref_name, layout, fused):
    """``"upipe": {"ring_size": R}``: zigzag data shards, UPipe over C_u = 4 / R ranks and ring attention
    over R; losses and gradient norms equal the non-SP run on 4 ranks."""
    runs = four_procs[2]["by_name"]
    r = runs[name]
    assert (r["sequence_parallel_size"], r["upipe_ring_size"], r["upipe_fused"]) == (4, layout, fused)
    assert r["head_chunk_size"] == 4 // layout and r["upipe_stage_runs"] > 0  # U = C_u
    _check_same(runs, name, ref_name)


def test_shipped_config_runs_as_it_is(four_procs):
    """(Every ds_configs/*.json also runs, float32, in the 2-process launch.)"""
    r = four_procs[2]["by_name"]["shipped_upipe_zero3"]
    assert r["sequence_parallel_size"] == 4 and len(r["losses"]) == 2
    assert r["losses"][1] < r["losses"][0]  # bf16: a step that learns
    assert r["upipe_stage_runs"] > 0 and r["upipe_fused"] and r["head_chunk_size"] == 4


@pytest.mark.parametrize(
    "name, ref_name, stage",
    [
        ("ref_z3_stack", "ref_z3", 3),
        ("upipe_z2_stack", "ref_z2", 2),
        ("upipe_z3_stack", "ref_z3", 3),
        ("alst_z2_stack", "ref_z2", 2),
        ("alst_z3_stack", "ref_z3", 3),
    ],
)
def test_long_context_stack_equals_non_sp(two_procs, name, ref_name, stage):
    """The ds_config's tiled_loss/tiled_norm/tiled_mlp, through ds_upipe.initialize and the example's
    loss (tiled, no logits), against the non-SP run without the stack."""
    r = two_procs[name]
    assert r["zero_stage"] == stage and r["sequence_parallel_size"] == (1 if name.startswith("ref") else 2)
    _check_same(two_procs, name, ref_name)
    # 2 layers x (2 norms + MLP) + the final norm + the loss forward were replaced
    want_loss = "local" if name.startswith("ref") else "sequence_parallel"
    assert r["long_context"] == {
        "tiled_loss": True, "tiled_norm": True, "tiled_mlp": True, "forward_loss": want_loss, "patched": 8
    }  # fmt: skip
    assert r["checkpointing"] == "reentrant"  # DeepSpeed's, per decoder layer: see docs/config.md
    assert (r["upipe_stage_runs"] > 0) == name.startswith("upipe")
    assert two_procs[ref_name]["long_context"] is None


@pytest.mark.parametrize("name,ref_name", [("upipe_z3_pairs", "ref_z3"), ("alst_z2_pairs", "ref_z2")])
def test_checkpoint_pairs_equal_non_sp(two_procs, name, ref_name):
    """upipe.checkpoint_pairs=1 (the example's two layers as one pair) through ds_upipe.initialize
    and a real ZeRO engine: the same losses and gradient norms as the non-SP run, and the pair's
    backward ran once per micro-step (4 steps x 2 micro-steps)."""
    _check_same(two_procs, name, ref_name)
    assert two_procs[name]["checkpoint_pairs"] == [STEPS * 2]
    assert two_procs[name]["checkpointing"] == "reentrant"


@pytest.mark.parametrize("name", ["upipe_sp4_stack", "alst_sp4_stack"])
def test_four_procs_long_context_configs(four_procs, name):
    runs = four_procs[2]["by_name"]
    assert runs[name]["sequence_parallel_size"] == 4 and runs[name]["long_context"]["patched"] == 8
    _check_same(runs, name, "ref_z3")
    assert (runs[name]["upipe_stage_runs"] > 0) == name.startswith("upipe")


def test_shipped_long_context_config_runs(four_procs):
    r = four_procs[2]["by_name"]["shipped_upipe_long_context"]
    assert r["sequence_parallel_size"] == 4 and len(r["losses"]) == 2 and r["losses"][1] < r["losses"][0]
    assert r["long_context"]["forward_loss"] == "sequence_parallel" and r["upipe_stage_runs"] > 0


def test_config_error_ends_launch(four_procs):
    """(That every rank raises it is tested deterministically in test_engine_errors.py.)"""
    rc, output, metrics = four_procs
    assert rc != 0
    assert "got 3 for a world of 4 processes; allowed: a divisor of the world size [1, 2, 4]" in metrics["error"]
    assert len(metrics["runs"]) == 12  # every run before it finished


def test_repeated_launch_on_one_port_exits_cleanly(two_procs_launch, four_procs):
    """A launch leaves nothing behind, also when the next launch reuses its port (the 2- and 4-process
    launches share one: whichever runs second maps segment names of ranks 0 and 1 the first one had).

    DeepSpeed's CPU shm-allreduce segments (/dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>,
    66 MB each) used to outlive every ``deepspeed`` launch; a later launch on the same port then mapped
    a stale peer's segment.  ``tests/engine_cases.launch`` asserts after every launch that none is left;
    here both launches on the one port end through their own exit path: the 2-process one with 0, the
    4-process one with the example's configuration-error code 2 after its last run (every UPipe and
    ALST run before it finished; their results are checked against the non-SP runs above)."""
    runs, _ = two_procs_launch  # (its fixture asserts exit code 0 of both 2-process launches)
    assert len(runs) == 35 and all(r["losses"] for r in runs.values())
    rc, output, metrics = four_procs
    assert rc == 2, output[-4000:]
    assert len(metrics["runs"]) == 12 and all(r["losses"] for r in metrics["runs"]), metrics["runs"]
