"""TRL's SFTTrainer under UPipe (torchrun, CPU, gloo, float32): ``examples/sft_trl.py`` with
``hf_integration.enable()``, against the same script without sequence parallelism (1 process).

Each UPipe launch (2 processes, SP 2) must log what its non-SP run logs: the same entries (every
training step, every evaluation, the run's summary) with the same keys, every value within 1e-5
relative: loss, grad_norm, learning_rate, entropy, mean_token_accuracy, num_tokens, epoch, train_loss
and each eval_* metric.  Not compared: wall-clock keys (``*_runtime``, ``*_per_second``), and
``total_flos``: under ZeRO-3 the Trainer's estimate multiplies by ``num_parameters()``, which counts
only the parameters gathered at the moment of the call (``p.numel()`` is 0 for a partitioned one), so it
depends on when ZeRO-3 gathers, not on the data.  Every rank must have run UPipe stages in training and in
evaluation.  The cases, one launch each with its non-SP reference beside it (all in one pool a few
processes deep: tests/launches.py, ``run_pool``):

- plain text, batch 2, TRL's dynamic padding (rows of different lengths on the two ranks), ZeRO-3, weights
  drawn with std 0.5 (peaked logits: entropy varies from token to token) and learning rate 0 (so that
  float32 rounding is not amplified by updates at these logits); eval every 2 steps with batch size 1 on
  9 samples: accelerate repeats a whole batch (sample 0, 64 tokens) on one rank in the last round, so the
  last sample (43 tokens) is padded to 64 and half of it is on the second rank, where accelerate's
  ``gather_for_metrics`` would keep 1 gathered value of 2 (its ``remainder``) and drop that shard
  (``trainer_sp.per_batch_metrics`` gathers without that cut);
- prompt-completion (loss on the completion only), gradient accumulation 2, ZeRO-2, rows padded to 64;
  eval batches of 2 rows on 7 samples: the last round repeats one row of a batch;
- TRL's packing (bfd) with the long-context stack (tiled loss, norms and MLP) in the ds_config, ZeRO-3;
- hybrid models (``HYBRID_CASES``, their own fixture): a tiny Qwen3.5 and a tiny Nemotron-H (``--arch``), plain text,
  ZeRO-3, the long-context stack, TRL's activation checkpointing, eval every 2 steps;
- a vision-language model (``VLM``, ``tests/vlm_sft_script.py``): a tiny float32 Qwen2.5-VL, ZeRO-3, samples of 1
  or 2 images padded per batch by the script's collator (no processor offline), eval every 2 steps: each rank of
  the group gets each whole sample and its shard of the shifted labels;
- padding-free, batch 2 (TRL's varlen keys cu_seq_lens_* / max_length_* / seq_idx), accumulation 4, on
  22 training samples (11 batches: the last round repeats a batch in training) and 7 eval samples (the
  last eval row holds a sample and a repeated one, end to end).  ``epoch`` is left out here: the
  Trainer's epoch fraction divides by accelerate's padded loader length (12 micro-batches, not 11).

Before ds_upipe's trainer_sp (measured with this script): ``eval_loss`` 12.9% off in the plain case
(the mean of the ranks' shard losses), gradient norms 12.6% off with accumulation 2 (the mean of the
micro-batch means), dynamic padding and padding-free refused by gloo ("allgather: invalid tensor
size"), the tiled loss an AttributeError in TRL's metrics (``label_mask``).  Before the source batches
(``hf_patches.data.SourceBatch``, ``trainer_sp.per_batch_metrics``): eval token accuracy 0.0099 vs
0.0068 and entropy 1.2e-5 off in the plain case (accelerate's truncation of per-sample values cutting
the ranks' shard sums, and a repeated batch's 0.0 entry), ``num_tokens`` 832 vs 1004 padding-free
(ds_upipe's padding counted).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("trl")

from tests.launches import run_pool  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
RTOL = 1e-5
STACK = {"tiled_loss": {"tile_tokens": 12}, "tiled_norm": {"tile_tokens": 8}, "tiled_mlp": {"tile_tokens": 8}}
#: name -> (the non-SP reference, the UPipe launch's ds_config changes ({} / "zero2" / "stack"), script flags)
CASES: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "plain": (
        "plain",
        "",
        (
            "--data",
            "plain",
            "--eval_steps",
            "2",
            "--eval_batch_size",
            "1",
            "--eval_samples",
            "9",
            "--init_std",
            "0.5",
            "--lr",
            "0",
        ),
    ),
    "prompt_completion_ga2_zero2": (
        "prompt_completion_ga2",
        "zero2",
        ("--data", "prompt_completion", "--grad_accum", "2", "--eval_samples", "7", "--pad_to_multiple_of", "64"),
    ),
    "packing_stack": ("packing", "stack", ("--data", "packing")),
    "padding_free_ga4": (
        "padding_free_ga4",
        "",
        ("--data", "padding_free", "--grad_accum", "4", "--train_samples", "22", "--eval_samples", "7")
        + ("--eval_steps", "2"),
    ),
}
#: hybrid models (``--arch``, ``ds_upipe.tools.models``): their mixers (Qwen3.5's gated delta net, Nemotron-H's
#: Mamba-2) run head-sharded, with the long-context stack (Qwen3.5's MLPs, Nemotron-H's MLP-only layers and
#: block norms); plain text, TRL's dynamic padding, ZeRO-3, TRL's activation checkpointing (SFTConfig's default)
HYBRID_CASES: dict[str, tuple[str, str, tuple[str, ...]]] = {
    f"{arch}_stack": (arch, "stack", ("--arch", arch, "--eval_steps", "2")) for arch in ("qwen3_5", "nemotron_h")
}
#: a vision-language model through TRL's SFTTrainer (tests/vlm_sft_script.py: a tiny float32 Qwen2.5-VL, samples
#: and collator built there, no processor), its launches in the pool of ``CASES``
VLM = "qwen2_5_vl"
#: logged keys that are not the model's numbers: wall-clock times and rates, and the Trainer's FLOP
#: estimate under ZeRO-3 (module docstring)
NOT_COMPARED = ("_runtime", "_per_second", "total_flos")
#: and per case: the epoch fraction where accelerate repeats a training batch (module docstring)
NOT_COMPARED_IN = {"padding_free_ga4": ("epoch",)}


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "PARALLELISM_CONFIG_"))}
    env.update(DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="", PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    return env


def _torchrun(nproc: int, out: Path, *args: str, script: str = "examples/sft_trl.py") -> tuple[list[str], Path, int]:
    cmd = [str(BIN / "torchrun"), "--standalone", f"--nproc_per_node={nproc}", script]
    return [*cmd, "--metrics_out", str(out), "--output_dir", str(out.parent / out.stem), *args], out, nproc


def _pool(launches: dict[str, tuple[list[str], Path, int]]) -> dict[str, dict[str, Any]]:
    """The launches (name -> (command, metrics file, ranks)) in one pool a few ranks deep (tests/launches.py);
    each must exit 0; their metrics by name."""
    results = run_pool([(cmd, ranks) for cmd, _, ranks in launches.values()], cwd=ROOT, env=_env(), timeout=1200)
    for (name, (cmd, _, _)), (code, output, _) in zip(launches.items(), results, strict=True):
        assert code == 0, f"{name}: {' '.join(cmd)} failed:\n{output[-6000:]}"
    return {name: json.loads(out.read_text()) for name, (_, out, _) in launches.items()}


def _ds_config(work: Path, change: str) -> str:
    config = json.loads((ROOT / "examples/ds_config_upipe.json").read_text())
    if change == "zero2":
        config["zero_optimization"]["stage"] = 2
    elif change == "stack":
        config["upipe"] = {**config["upipe"], **STACK}
    path = work / f"ds_config_{change or 'upipe'}.json"
    path.write_text(json.dumps(config))
    return str(path)


def _vlm_launches(work: Path) -> dict[str, tuple[list[str], Path, int]]:
    """``tests/vlm_sft_script.py``: the VLM under UPipe (SP 2, ZeRO-3) and its non-SP reference (1 process)."""
    script = {"script": "tests/vlm_sft_script.py"}
    return {
        VLM: _torchrun(2, work / f"{VLM}.json", "--sp_size", "2", "--deepspeed", _ds_config(work, ""), **script),
        f"no_sp:{VLM}": _torchrun(1, work / f"no_sp_{VLM}.json", "--sp_size", "1", **script),
    }


def _run_cases(
    work: Path, cases: dict[str, tuple[str, str, tuple[str, ...]]], vlm: bool = False
) -> dict[str, dict[str, Any]]:
    """Each case's UPipe launch (SP 2) and its non-SP reference (1 process, "no_sp:<reference>"), in one pool
    (with ``vlm``, the VLM's pair too)."""
    launches: dict[str, tuple[list[str], Path, int]] = _vlm_launches(work) if vlm else {}
    for name, (reference, change, flags) in cases.items():
        config = _ds_config(work, change)
        launches[name] = _torchrun(2, work / f"{name}.json", "--sp_size", "2", "--deepspeed", config, *flags)
        if f"no_sp:{reference}" not in launches:  # the non-SP reference (1 process), started beside the SP launch
            launches[f"no_sp:{reference}"] = _torchrun(1, work / f"no_sp_{reference}.json", "--sp_size", "1", *flags)
    return _pool(launches)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict[str, Any]]:
    return _run_cases(tmp_path_factory.mktemp("trl"), CASES, vlm=True)


@pytest.fixture(scope="module")
def hybrid_runs(tmp_path_factory) -> dict[str, dict[str, Any]]:
    return _run_cases(tmp_path_factory.mktemp("trl_hybrid"), HYBRID_CASES)


def _relative(got: float, want: float) -> float:
    return abs(got - want) / max(abs(want), 1e-12)


def _compared(name: str, entry: dict[str, float]) -> dict[str, float]:
    skipped = NOT_COMPARED + NOT_COMPARED_IN.get(name, ())
    return {k: v for k, v in entry.items() if not any(part in k for part in skipped)}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_sft_under_upipe_equals_no_sp(runs, name):
    """Every entry TRL and the Trainer log, every key of it, equal to the run without SP."""
    _check_equals_no_sp(runs, name, CASES[name][0])


@pytest.mark.slow
@pytest.mark.parametrize("name", list(HYBRID_CASES))
def test_hybrid_sft_under_upipe_equals_no_sp(hybrid_runs, name):
    """A hybrid model (Qwen3.5, Nemotron-H) through TRL's SFTTrainer under UPipe, ZeRO-3, the long-context stack
    and activation checkpointing: every logged entry (training losses, grad norms, eval losses, ...) equal to
    the run without SP at the float32 tolerance of the other cases (Nemotron-H's float32 internals are float32
    in both runs), with the stack on the model TRL trained."""
    arch = HYBRID_CASES[name][0]
    _check_equals_no_sp(hybrid_runs, name, arch)
    run = hybrid_runs[name]
    assert run["arch"] == arch and hybrid_runs[f"no_sp:{arch}"]["arch"] == arch, run
    assert run["long_context"] == {"tiled_loss": True, "tiled_norm": True, "tiled_mlp": True}, run
    assert [k for entry in run["logs"] for k in entry].count("eval_loss") == 3, run[
        "logs"
    ]  # steps 2, 3 (the last), evaluate()


def _check_equals_no_sp(runs: dict[str, dict[str, Any]], name: str, reference_name: str) -> None:
    reference = runs[f"no_sp:{reference_name}"]
    run = runs[name]
    assert len(reference["train_losses"]) == 3, reference
    assert len(run["logs"]) == len(reference["logs"]), (run["logs"], reference["logs"])
    for i, (got, want) in enumerate(zip(run["logs"], reference["logs"])):
        got, want = _compared(name, got), _compared(name, want)
        assert sorted(got) == sorted(want), f"{name} log entry {i}: keys {sorted(got)} vs {sorted(want)}"
        worst = max(_relative(got[k], want[k]) for k in want)
        assert worst <= RTOL, f"{name} log entry {i}: {worst:.2e}:\n{got}\n{want}"
    # the metrics the issue named, present in the entries compared
    keys = {k for entry in reference["logs"] for k in entry}
    for key in ("mean_token_accuracy", "entropy", "num_tokens", "eval_mean_token_accuracy", "eval_num_tokens"):
        assert key in keys, (key, keys)
    # UPipe ran on both ranks, in training and in evaluation; the reference ran none
    assert run["world_size"] == 2 and min(run["stage_runs_train"]) > 0 and min(run["stage_runs_eval"]) > 0, run
    assert reference["stage_runs_train"] == [0] and reference["stage_runs_eval"] == [0], reference


@pytest.mark.slow
def test_vlm_sft_under_upipe_equals_no_sp(runs):
    """A VLM through TRL's SFTTrainer under UPipe, ZeRO-3, SP 2: each rank of the group is given each whole sample
    (images, grids, input_ids) and its shard of the shifted labels, encodes its share of the images and trains its
    shard of the merged sequence; every logged entry (training losses, grad norms, TRL's entropy, token accuracy
    and num_tokens, eval losses) equals the run without SP within the float32 tolerance of the text cases."""
    _check_equals_no_sp(runs, VLM, VLM)
    assert [k for entry in runs[VLM]["logs"] for k in entry].count("eval_loss") == 3, runs[VLM]["logs"]


@pytest.mark.slow
def test_the_stack_ran_with_trl(runs):
    """The ds_config's stack is on the model TRL trained (TRL's fused LM head computes the loss)."""
    assert runs["packing_stack"]["long_context"] == {"tiled_loss": True, "tiled_norm": True, "tiled_mlp": True}
    assert runs["plain"]["long_context"] is None


def test_sequence_level_trl_trainers_are_refused_under_sp():
    """DPO's (and the other RL trainers') losses need whole sequences; under SP each rank holds a
    shard, so they are refused by name before the loader's first collective.  The trainers are TRL's
    classes (not built: only their type and the accelerator's ParallelismConfig are read)."""
    import types

    from accelerate.utils import DeepSpeedSequenceParallelConfig, ParallelismConfig
    from trl import DPOTrainer, GRPOTrainer, SFTTrainer

    from ds_upipe.integration import trainer_sp

    sp = ParallelismConfig(
        sp_backend="deepspeed", sp_size=2, sp_handler=DeepSpeedSequenceParallelConfig(sp_attn_implementation="sdpa")
    )
    for cls in (DPOTrainer, GRPOTrainer):
        trainer = cls.__new__(cls)
        trainer.accelerator = types.SimpleNamespace(parallelism_config=sp)
        with pytest.raises(ValueError) as refused:
            trainer_sp.refuse_sequence_level_trl_losses(trainer)
        for words in (
            f"{cls.__name__} under sequence parallelism (sp_size=2) is not supported",
            "SequenceParallelDPOTrainer",
            "hf_patches.rl_loss",
        ):
            assert words in str(refused.value)
    sft = SFTTrainer.__new__(SFTTrainer)
    sft.accelerator = types.SimpleNamespace(parallelism_config=sp)
    trainer_sp.refuse_sequence_level_trl_losses(sft)  # SFTTrainer is supported


def test_linear_attention_refusal_follows_the_ds_config(monkeypatch):
    """accelerate refuses linear-attention layers under SP before the registration; enable()'s replacement lifts
    that under UPipe (its mixers run head-sharded) and, under ALST, refuses every mixer kind, also Nemotron-H's,
    which accelerate's ``layer_types`` test misses.  Real tiny models; the active ds_config is set by hand."""
    from accelerate import accelerator

    from ds_upipe.integration import hf_integration
    from ds_upipe.tools.models import tiny_causal_lm

    refuse = hf_integration._wrap_recurrent_refusal(accelerator._refuse_recurrent_layers_under_sequence_parallelism)
    models = {arch: tiny_causal_lm(arch) for arch in ("llama", "qwen3_5", "nemotron_h")}
    for upipe_block in (None, {"enabled": True}):  # UPipe: a block that does not say "enabled": false
        monkeypatch.setattr(hf_integration, "_active_ds_config", lambda block=upipe_block: {"upipe": block})
        for model in models.values():
            refuse(model)
    monkeypatch.setattr(hf_integration, "_active_ds_config", lambda: {"upipe": {"enabled": False}})
    refuse(models["llama"])
    for arch, mixer in (("qwen3_5", "Qwen3_5GatedDeltaNet"), ("nemotron_h", "NemotronHMamba2Mixer")):
        with pytest.raises(ValueError) as refused:
            refuse(models[arch])
        for words in ("upipe.enabled: got false", mixer, "DeepSpeed ALST", '"upipe": {"enabled": true}'):
            assert words in str(refused.value), (arch, str(refused.value))
