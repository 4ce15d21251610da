"""UPipe through the HF Trainer (torchrun) and ``accelerate launch``: real launchers, CPU, gloo, float32.

Per entry point three launches of the same example script: UPipe (2 processes, ZeRO-3, SP=2), the
same with ``"upipe": {"enabled": false}`` (DeepSpeed ALST's Ulysses) and without sequence parallelism
(1 process).  The 5 training losses, the gradient norms and the eval loss must agree within 1e-5
relative; the UPipe launches must have run UPipe stages on every rank, in training and in
evaluation, on sequence-sharded eval batches; the ALST launches none.  A ZeRO-2 UPipe Trainer launch
checks the gradient average (DeepSpeed issue #5248: without ds_upipe's correction its gradient norms
come out 2x).  Two Trainer launches with ``--model PATH`` (a checkpoint saved with ``save_pretrained``,
loaded under ZeRO-3's ``zero.Init``), with SP 2 and without SP, must agree the same way.  Per entry
point one 4-process UPipe x Ring launch (Ulysses 2 x ring 2) must equal that entry point's non-SP run.

All launches of the file run in one pool, a few processes deep (tests/launches.py, ``run_pool``): each
is the same real launch as alone, started as soon as the ranks running leave room for its own.

The Trainer's eval set has 5 sequences on 2 ranks, so accelerate pads one rank's last batch with a
duplicate and ``gather_for_metrics`` drops it again: the SP eval loss must still equal the non-SP one.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from ds_upipe.integration import hf_integration
from tests.launches import run_pool

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
RTOL = 1e-5
STEPS = 5
SEQ_LEN = 64


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "PARALLELISM_CONFIG_"))}
    env.update(DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="", PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    return env


def _pool(launches: dict[str, tuple[list[str], Path, int]]) -> dict[str, dict[str, Any]]:
    """The launches (name -> (command, metrics file, ranks)) in one pool a few ranks deep
    (tests/launches.py: each its own launcher and rendezvous); each must exit 0; their metrics by name."""
    results = run_pool([(cmd, ranks) for cmd, _, ranks in launches.values()], cwd=ROOT, env=_env(), timeout=1500)
    metrics = {}
    for (name, (cmd, out, _)), (code, output, wall) in zip(launches.items(), results, strict=True):
        assert code == 0, f"{name}: {' '.join(cmd)} failed:\n{output[-6000:]}"
        result = json.loads(out.read_text())
        result["launch_s"] = wall
        print(f"{name}: launch {wall:.1f}s, losses {result['train_losses']}, eval {result['eval_loss']}")
        metrics[name] = result
    return metrics


def _torchrun(nproc: int, out: Path, *args: str) -> tuple[list[str], Path, int]:
    cmd = [str(BIN / "torchrun"), "--standalone", f"--nproc_per_node={nproc}", "examples/finetune_trainer.py"]
    return [*cmd, "--metrics_out", str(out), "--output_dir", str(out.parent / out.stem), *args], out, nproc


def _accelerate(out: Path, *flags: str, nproc: int = 2) -> tuple[list[str], Path, int]:
    """``accelerate launch`` with examples/accelerate_config.yaml (2 processes unless ``flags`` say ``nproc``)."""
    cmd = [str(BIN / "accelerate"), "launch", "--config_file", "examples/accelerate_config.yaml", *flags]
    return [*cmd, "examples/train_accelerate.py", "--metrics_out", str(out)], out, nproc


#: the long-context stack with tiles smaller than a rank's 32 tokens (uneven last loss tile)
STACK = {"tiled_loss": {"tile_tokens": 12}, "tiled_norm": {"tile_tokens": 8}, "tiled_mlp": {"tile_tokens": 8}}


def _with_stack(source: str, path: Path) -> str:
    """``source`` (an example ds_config) with the long-context stack in its "upipe" block, written to ``path``."""
    config = json.loads((ROOT / source).read_text())
    config["upipe"] = {**config["upipe"], **STACK}
    path.write_text(json.dumps(config))
    return str(path)


def _save_checkpoint(path: Path) -> Path:
    """A tiny Llama checkpoint (save_pretrained) with other weights than the examples' config-built model."""
    import importlib.util

    import torch
    from transformers import LlamaForCausalLM

    spec = importlib.util.spec_from_file_location("tiny_llama", ROOT / "examples/tiny_llama.py")
    tiny_llama = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tiny_llama)
    torch.manual_seed(1)  # the examples build theirs after manual_seed(0)
    LlamaForCausalLM(tiny_llama.tiny_llama_config(SEQ_LEN)).save_pretrained(path)
    return path


def _ring_config(path: Path) -> str:
    """examples/ds_config_upipe.json with ``"upipe": {"ring_size": 2}`` (UPipe x Ring), written to ``path``."""
    ring = json.loads((ROOT / "examples/ds_config_upipe.json").read_text())
    ring["upipe"]["ring_size"] = 2
    path.write_text(json.dumps(ring))
    return str(path)


#: the MoE launches: family -> extra example flags (GPT-OSS has no sdpa in transformers; on CPU its own
#: eager attention, which applies the sinks, runs under a registered name)
MOE_LAUNCHES = {
    "qwen3_moe": (),
    "gpt_oss": ("--attn_implementation", "gpt_oss_eager", "--own_eager_attention"),
}


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> dict[str, dict[str, Any]]:
    """Every launch of this file, in one pool (tests/launches.py: 4 ranks deep, the 4-process UPipe x Ring
    launches first, each alone; each 1-process non-SP run beside 2-process ones); metrics by
    "entry/name" (the fixtures below pick theirs)."""
    from tests.moe_cases import save_moe_checkpoint

    work = tmp_path_factory.mktemp("launches")
    trainer, ring, packing, acc, moe = (work / d for d in ("trainer", "trainer_ring", "packing", "accelerate", "moe"))
    for d in (trainer, ring, packing, acc, moe):
        d.mkdir()
    zero2 = json.loads((ROOT / "examples/ds_config_upipe.json").read_text())
    zero2["zero_optimization"]["stage"] = 2
    (trainer / "ds_config_upipe_zero2.json").write_text(json.dumps(zero2))
    model = str(_save_checkpoint(trainer / "checkpoint"))
    upipe = ("--deepspeed", "examples/ds_config_upipe.json")
    alst_stack = _with_stack("examples/ds_config_alst.json", acc / "ds_config_alst_stack.json")
    launches = {
        # UPipe x Ring, 4 processes, sp_size 4 = Ulysses 2 x ring 2 (the ds_config's "upipe": {"ring_size": 2})
        "trainer_ring/upipe_ring": _torchrun(
            4, ring / "upipe_ring.json", "--deepspeed", _ring_config(ring / "ring.json"), "--sp_size", "4"
        ),
        "accelerate/upipe_ring": _accelerate(
            acc / "upipe_ring.json",
            *("--num_processes", "4", "--parallelism_config_sp_size", "4"),
            *("--deepspeed_config_file", _ring_config(acc / "ds_config_upipe_ring.json")),
            nproc=4,
        ),
        "trainer/upipe": _torchrun(2, trainer / "upipe.json", *upipe, "--sp_size", "2"),
        "trainer/no_sp": _torchrun(1, trainer / "no_sp.json", *upipe, "--sp_size", "1"),
        # --model PATH: from_pretrained runs under ZeRO-3's zero.Init
        "trainer/upipe_model": _torchrun(2, trainer / "upipe_model.json", *upipe, "--sp_size", "2", "--model", model),
        "trainer/no_sp_model": _torchrun(1, trainer / "no_sp_model.json", *upipe, "--sp_size", "1", "--model", model),
        "trainer/alst": _torchrun(
            2, trainer / "alst.json", "--deepspeed", "examples/ds_config_alst.json", "--sp_size", "2"
        ),
        "trainer/upipe_zero2": _torchrun(
            2,
            trainer / "upipe_zero2.json",
            "--deepspeed",
            str(trainer / "ds_config_upipe_zero2.json"),
            "--sp_size",
            "2",
        ),
        # the long-context stack from the ds_config (UPipe, ZeRO-3): the Trainer's loss is the tiled one
        "trainer/upipe_stack": _torchrun(
            2,
            trainer / "upipe_stack.json",
            *("--deepspeed", _with_stack("examples/ds_config_upipe.json", trainer / "ds_config_upipe_stack.json")),
            *("--sp_size", "2"),
        ),
        "packing/upipe_packing": _torchrun(2, packing / "upipe_packing.json", *upipe, "--packing", "--sp_size", "2"),
        "packing/no_sp": _torchrun(1, packing / "no_sp.json", *upipe, "--packing", "--sp_size", "1"),
        "accelerate/upipe": _accelerate(acc / "upipe.json"),  # the YAML as shipped: ds_config_upipe.json, sp_size 2
        "accelerate/no_sp": _accelerate(
            acc / "no_sp.json", "--num_processes", "1", "--parallelism_config_sp_size", "1", nproc=1
        ),
        "accelerate/alst": _accelerate(acc / "alst.json", "--deepspeed_config_file", "examples/ds_config_alst.json"),
        # the long-context stack from the ds_config with ALST (ZeRO-3)
        "accelerate/alst_stack": _accelerate(acc / "alst_stack.json", "--deepspeed_config_file", alst_stack),
    }
    # per MoE family (tests/moe_cases.py, a save_pretrained checkpoint loaded under ZeRO-3's zero.Init): UPipe
    # (SP 2, ZeRO-3) with the long-context stack from the ds_config, and the plain non-SP run
    stack = _with_stack("examples/ds_config_upipe.json", moe / "ds_config_upipe_stack.json")
    for family, flags in MOE_LAUNCHES.items():
        args = ("--model", str(save_moe_checkpoint(family, moe / family)), *flags)
        launches[f"{family}/upipe_stack"] = _torchrun(
            2, moe / f"{family}_stack.json", "--deepspeed", stack, "--sp_size", "2", *args
        )
        launches[f"{family}/no_sp"] = _torchrun(1, moe / f"{family}_no_sp.json", *upipe, "--sp_size", "1", *args)
    return _pool(launches)


def _entry(launched: dict[str, dict[str, Any]], entry: str) -> dict[str, dict[str, Any]]:
    return {key.split("/", 1)[1]: run for key, run in launched.items() if key.startswith(f"{entry}/")}


@pytest.fixture(scope="module")
def trainer_runs(launched) -> dict[str, dict[str, Any]]:
    """Trainer launches: UPipe (SP 2, ZeRO-3), ALST, UPipe at ZeRO-2, UPipe with the long-context stack, the
    non-SP run; --model PATH with SP 2 and without."""
    return _entry(launched, "trainer")


@pytest.fixture(scope="module")
def trainer_ring_runs(launched) -> dict[str, dict[str, Any]]:
    """UPipe x Ring through the Trainer: 4 processes, sp_size 4 = Ulysses 2 x ring 2 (the ds_config's
    ``"upipe": {"ring_size": 2}``), against trainer_runs' non-SP run (the same command)."""
    return {"no_sp": launched["trainer/no_sp"], **_entry(launched, "trainer_ring")}


@pytest.fixture(scope="module")
def trainer_packing_runs(launched) -> dict[str, dict[str, Any]]:
    """``--packing``: rows of 4 random-length documents (DataCollatorWithFlattening, padded to 64
    tokens), UPipe with SP 2 against the non-SP run (whose SDPA mask transformers builds from the
    restarting position_ids)."""
    return _entry(launched, "packing")


@pytest.fixture(scope="module")
def accelerate_runs(launched) -> dict[str, dict[str, Any]]:
    """``accelerate launch``: UPipe (the YAML as shipped), ALST, the non-SP run, UPipe x Ring (4 processes),
    ALST with the long-context stack."""
    return _entry(launched, "accelerate")


def _assert_close(got: list[float] | float, want: list[float] | float, what: str) -> None:
    got_l, want_l = (got, want) if isinstance(got, list) else ([got], [want])
    assert len(got_l) == len(want_l), f"{what}: {got_l} vs {want_l}"
    worst = max(abs(g - w) / abs(w) for g, w in zip(got_l, want_l))
    assert worst <= RTOL, f"{what}: relative difference {worst:.3e} > {RTOL}: {got_l} vs {want_l}"


def _check_parity(runs: dict[str, dict[str, Any]], names: tuple[str, ...]) -> None:
    ref = runs["no_sp"]
    assert len(ref["train_losses"]) == STEPS and len(ref["grad_norms"]) == STEPS
    for name in names:
        run = runs[name]
        _assert_close(run["train_losses"], ref["train_losses"], f"{name} training losses")
        _assert_close(run["grad_norms"], ref["grad_norms"], f"{name} gradient norms")
        _assert_close(run["eval_loss"], ref["eval_loss"], f"{name} eval loss")


def _check_what_ran(runs: dict[str, dict[str, Any]], upipe: tuple[str, ...]) -> None:
    for name in upipe:
        run = runs[name]
        assert run["world_size"] == 2 and run["sp_size"] == 2
        # every rank ran UPipe stages in training (forward + backward) and in evaluation (forward)
        assert len(run["stage_runs_train"]) == 2 and min(run["stage_runs_train"]) > 0, run
        assert min(run["stage_runs_eval"]) > 0, run
        # evaluation saw this rank's half of each sequence, never the full sequence
        assert run["eval_local_seq_lens"] == [SEQ_LEN // 2], run
    alst = runs["alst"]
    assert alst["stage_runs_train"] == [0, 0] and alst["stage_runs_eval"] == [0, 0], alst
    assert alst["eval_local_seq_lens"] == [SEQ_LEN // 2], alst
    assert runs["no_sp"]["eval_local_seq_lens"] == [SEQ_LEN], runs["no_sp"]


@pytest.mark.slow
def test_trainer_upipe_equals_alst_and_no_sp(trainer_runs):
    _check_parity(trainer_runs, ("upipe", "alst", "upipe_zero2"))


@pytest.mark.slow
def test_trainer_runs_upipe_attention(trainer_runs):
    _check_what_ran(trainer_runs, ("upipe", "upipe_zero2"))
    for name in ("upipe", "upipe_zero2"):  # fused projections, U = C = 2 (two stages per layer)
        assert trainer_runs[name]["upipe"] == {"fused": True, "head_chunk_size": 2}
    assert trainer_runs["alst"]["upipe"] is None and trainer_runs["no_sp"]["upipe"] is None
    # 2 layers x 2 stages x (forward + backward) x 5 steps; eval: 2 layers x 2 stages x 6 micro-batches
    assert trainer_runs["upipe"]["stage_runs_train"] == [40, 40]
    assert trainer_runs["upipe"]["stage_runs_eval"] == [24, 24]


@pytest.mark.slow
def test_trainer_model_path_under_zero3(trainer_runs):
    """``--model PATH`` with ZeRO-3 and sp_size 2 (the documented Trainer path; on CPU zero.Init used to
    refuse the batch size): the non-SP run's losses of the same checkpoint, whose weights were loaded
    (its losses differ from the config-built model's)."""
    _check_parity({"no_sp": trainer_runs["no_sp_model"], "upipe_model": trainer_runs["upipe_model"]}, ("upipe_model",))
    assert trainer_runs["upipe_model"]["upipe"] == {"fused": True, "head_chunk_size": 2}
    assert min(trainer_runs["upipe_model"]["stage_runs_train"]) > 0
    loaded, built = trainer_runs["no_sp_model"]["train_losses"], trainer_runs["no_sp"]["train_losses"]
    assert min(abs(a - b) for a, b in zip(loaded, built)) > 1e-3, (loaded, built)


@pytest.mark.slow
def test_trainer_upipe_x_ring(trainer_ring_runs):
    """Training losses, gradient norms and the eval loss of Ulysses 2 x ring 2 equal the non-SP run;
    every rank ran UPipe stages (U = C_u = 2) in training and evaluation, on zigzag shards of S / 4."""
    _check_parity(trainer_ring_runs, ("upipe_ring",))
    run = trainer_ring_runs["upipe_ring"]
    assert run["world_size"] == 4 and run["sp_size"] == 4 and run["upipe"] == {"fused": True, "head_chunk_size": 2}
    assert min(run["stage_runs_train"]) > 0 and min(run["stage_runs_eval"]) > 0, run
    assert run["eval_local_seq_lens"] == [SEQ_LEN // 4], run


@pytest.mark.slow
def test_trainer_packing_equals_no_sp(trainer_packing_runs):
    """Packed rows through the Trainer: UPipe attends per document (4 per row, from the global
    position_ids) and its losses, gradient norms and eval loss equal the non-SP run's."""
    _check_parity(trainer_packing_runs, ("upipe_packing",))
    run = trainer_packing_runs["upipe_packing"]
    assert run["packing"] and run["upipe_documents_per_row"] == [4], run
    assert min(run["stage_runs_train"]) > 0 and min(run["stage_runs_eval"]) > 0, run
    assert run["eval_local_seq_lens"] == [SEQ_LEN // 2], run


@pytest.mark.slow
def test_accelerate_upipe_equals_alst_and_no_sp(accelerate_runs):
    _check_parity(accelerate_runs, ("upipe", "alst"))


@pytest.mark.slow
def test_accelerate_upipe_x_ring(accelerate_runs):
    """``accelerate launch`` with Ulysses 2 x ring 2: losses, gradient norms and the eval loss equal the
    non-SP run; every rank ran UPipe stages (U = C_u = 2: 2 layers x 2 stages x (fwd + bwd) x 5 steps) on
    zigzag shards of S / 4 (the loaders accelerate wraps follow the ring's order)."""
    _check_parity(accelerate_runs, ("upipe_ring",))
    run = accelerate_runs["upipe_ring"]
    assert (run["world_size"], run["sp_size"], run["upipe_block"]["ring_size"]) == (4, 4, 2), run
    assert run["stage_runs_train"] == [40] * 4 and run["stage_runs_eval"] == [16] * 4, run
    assert run["eval_local_seq_lens"] == [SEQ_LEN // 4], run


@pytest.mark.slow
def test_accelerate_runs_upipe_attention(accelerate_runs):
    _check_what_ran(accelerate_runs, ("upipe",))
    assert accelerate_runs["upipe"]["upipe_block"]["enabled"] is True
    assert accelerate_runs["alst"]["upipe_block"] == {"enabled": False}
    assert accelerate_runs["upipe"]["stage_runs_train"] == [40, 40]
    assert accelerate_runs["upipe"]["stage_runs_eval"] == [16, 16]  # 4 eval sequences


@pytest.mark.slow
@pytest.mark.parametrize("entry, name", [("trainer", "upipe_stack"), ("accelerate", "alst_stack")])
def test_long_context_stack_equals_no_sp(trainer_runs, accelerate_runs, entry, name):
    """tiled_loss/tiled_norm/tiled_mlp in the ds_config: applied at accelerate's registration, the loss of
    deepspeed_sp_compute_loss is the tiled one (the model returns no logits), in training and evaluation;
    losses, gradient norms and the eval loss equal the non-SP run without the stack."""
    runs = trainer_runs if entry == "trainer" else accelerate_runs
    _check_parity({"no_sp": runs["no_sp"], name: runs[name]}, (name,))
    run = runs[name]
    assert run["long_context"] == {"tiled_loss": True, "tiled_norm": True, "tiled_mlp": True, "logits": None}, run
    assert runs["no_sp"]["long_context"] is None
    assert (min(run["stage_runs_train"]) > 0) == name.startswith("upipe")


@pytest.fixture(scope="module")
def moe_runs(launched) -> dict[str, dict[str, dict[str, Any]]]:
    """Per MoE family: UPipe (SP 2, ZeRO-3) with the long-context stack, and the plain non-SP run."""
    return {family: _entry(launched, family) for family in MOE_LAUNCHES}


@pytest.mark.slow
@pytest.mark.parametrize("family", list(MOE_LAUNCHES))
def test_moe_long_context_stack_equals_no_sp(moe_runs, family):
    """Qwen3-MoE and GPT-OSS (sinks, alternating sliding windows, biased experts) through the Trainer:
    UPipe (SP 2, ZeRO-3) with the tiled loss, norms and MoE MLPs (router and experts per token tile, the
    blocks ZeRO-3 leaf modules) == the plain non-SP run: losses, gradient norms, eval loss."""
    runs = moe_runs[family]
    _check_parity(runs, ("upipe_stack",))
    run = runs["upipe_stack"]
    assert run["long_context"] == {"tiled_loss": True, "tiled_norm": True, "tiled_mlp": True, "logits": None}, run
    assert min(run["stage_runs_train"]) > 0 and run["upipe"]["fused"], run
    block = {"qwen3_moe": "Qwen3MoeSparseMoeBlock", "gpt_oss": "GptOssMLP"}[family]
    assert run["z3_leaf_modules"] == [block], run
    # DeepSpeed's zero_optimization.leaf_module defaults list Qwen3-MoE's block, not GPT-OSS's: the stack marks it
    assert runs["no_sp"]["z3_leaf_modules"] == ([block] if family == "qwen3_moe" else []), runs["no_sp"]
    assert runs["no_sp"]["long_context"] is None


# ---------------------------------------------------------------------------------------------------
# in-process: what enable() changes, and the config rules (same ValueError on every rank: pure functions)


def test_enable_routes_accelerates_lookup_and_disable_restores():
    from deepspeed.runtime.sequence_parallel import ulysses_sp
    from transformers import Trainer

    patched = ("evaluation_loop", "compute_loss", "get_batch_samples", "get_eval_dataloader", "get_test_dataloader")
    originals = {name: getattr(Trainer, name) for name in patched}
    hf_integration.enable()
    try:
        hf_integration.enable()  # idempotent
        # what accelerate's _prepare_deepspeed imports at call time
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter

        assert UlyssesSPAttentionHF is hf_integration.UPipeSPAttentionHF
        # the training loaders accelerate wraps: zigzag shards when UPipe x Ring is registered
        assert UlyssesSPDataLoaderAdapter is hf_integration.UPipeSPDataLoaderAdapter
        assert all(getattr(Trainer, name) is not original for name, original in originals.items())
    finally:
        hf_integration.disable()
    assert ulysses_sp.UlyssesSPAttentionHF is not hf_integration.UPipeSPAttentionHF
    assert ulysses_sp.UlyssesSPDataLoaderAdapter is not hf_integration.UPipeSPDataLoaderAdapter
    assert all(getattr(Trainer, name) is original for name, original in originals.items())
    assert not hf_integration.is_enabled()


def test_enable_keeps_the_upipe_block_out_of_accelerates_auto_pass(monkeypatch):
    """accelerate fills every "auto" of the ds_config from its own values and refuses one it has none for:
    under ``enable()`` ``"upipe": {"head_chunk_size": "auto"}`` (ours, measured at registration) passes
    and stays "auto", accelerate's own "auto" values are still filled.  Mutation: dropping the
    ``DeepSpeedPlugin.deepspeed_config_process`` patch from ``enable()`` raises accelerate's
    "`upipe.head_chunk_size` not found in kwargs"."""
    from accelerate.utils import DeepSpeedPlugin

    for key in [k for k in os.environ if k.startswith("ACCELERATE_")]:
        monkeypatch.delenv(key)
    block = {"head_chunk_size": "auto", "memory_budget_gib": 1.0, "seq_length": 64}

    def processed() -> dict[str, Any]:
        config = {"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 3}, "upipe": dict(block)}
        plugin = DeepSpeedPlugin(hf_ds_config=config)
        plugin.deepspeed_config_process(must_match=False, train_micro_batch_size_per_gpu=2)
        return plugin.deepspeed_config

    hf_integration.enable()
    try:
        config = processed()
        assert config["upipe"] == block and config["train_micro_batch_size_per_gpu"] == 2, config
    finally:
        hf_integration.disable()
    with pytest.raises(ValueError, match="upipe.head_chunk_size` not found in kwargs"):
        processed()  # accelerate alone


def test_upipe_settings_rules():
    zero3 = {"zero_optimization": {"stage": 3}}
    settings = hf_integration.upipe_settings({**zero3, "upipe": {"head_chunk_size": 4}}, 2)
    assert settings.sequence_parallel_size == 2 and settings.upipe.enabled and settings.upipe.head_chunk_size == 4
    assert hf_integration.upipe_settings({**zero3, "sequence_parallel_size": 2}, 2).upipe.fused_projections
    with pytest.raises(ValueError, match=r"sequence_parallel_size: got 4 but ParallelismConfig.sp_size is 2"):
        hf_integration.upipe_settings({**zero3, "sequence_parallel_size": 4}, 2)
    ring = hf_integration.upipe_settings({**zero3, "upipe": {"ring_size": 2}}, 4)
    assert (ring.ring_size, ring.ulysses_size) == (2, 2)
    with pytest.raises(ValueError, match=r"upipe.ring_size: got 4 for sequence_parallel_size=2"):
        hf_integration.upipe_settings({**zero3, "upipe": {"ring_size": 4}}, 2)
    with pytest.raises(ValueError, match=r"upipe.chunk: unknown key"):
        hf_integration.upipe_settings({**zero3, "upipe": {"chunk": 2}}, 2)
    with pytest.raises(ValueError, match=r"zero_optimization.stage: got 0 with sequence_parallel_size=2"):
        hf_integration.upipe_settings({"upipe": {"enabled": True}}, 2)
