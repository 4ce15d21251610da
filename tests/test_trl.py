"""TRL's SFTTrainer under UPipe (torchrun, CPU, gloo, float32): ``examples/sft_trl.py`` with
``hf_integration.enable()``, against the same script without sequence parallelism (1 process).

Each UPipe launch (2 processes, SP 2) must equal its non-SP run, within 1e-5 relative, in every number
TRL reports from the loss path: the logged training losses, gradient norms, ``mean_token_accuracy``
and ``entropy``, and ``eval_loss``, ``eval_mean_token_accuracy`` and ``eval_entropy``; and every rank
must have run UPipe stages in training and in evaluation.  The cases, one launch each with its non-SP
reference beside it (all in one pool a few processes deep: tests/launches.py, ``run_pool``):

- plain text, batch 2, TRL's dynamic padding (rows of different lengths on the two ranks), ZeRO-3;
- prompt-completion (loss on the completion only), gradient accumulation 2, ZeRO-2;
- TRL's packing (bfd) with the long-context stack (tiled loss, norms and MLP) in the ds_config, ZeRO-3;
- padding-free, batch 2 (TRL's varlen keys cu_seq_lens_* / max_length_* / seq_idx), accumulation 4.

Before ds_upipe's trainer_sp (measured with this script): ``eval_loss`` 12.9% off in the plain case
(the mean of the ranks' shard losses), gradient norms 12.6% off with accumulation 2 (the mean of the
micro-batch means), dynamic padding and padding-free refused by gloo ("allgather: invalid tensor
size"), the tiled loss an AttributeError in TRL's metrics (``label_mask``).
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
    "plain": ("plain", "", ("--data", "plain")),
    "prompt_completion_ga2_zero2": (
        "prompt_completion_ga2",
        "zero2",
        ("--data", "prompt_completion", "--grad_accum", "2"),
    ),
    "packing_stack": ("packing", "stack", ("--data", "packing")),
    "padding_free_ga4": ("padding_free_ga4", "", ("--data", "padding_free", "--grad_accum", "4")),
}
COMPARED = ("train_losses", "grad_norms", "train_mean_token_accuracy", "train_entropy")
COMPARED_EVAL = ("eval_loss", "eval_mean_token_accuracy", "eval_entropy")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "PARALLELISM_CONFIG_"))}
    env.update(DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="", PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    return env


def _torchrun(nproc: int, out: Path, *args: str) -> tuple[list[str], Path, int]:
    cmd = [str(BIN / "torchrun"), "--standalone", f"--nproc_per_node={nproc}", "examples/sft_trl.py"]
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


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict[str, Any]]:
    work = tmp_path_factory.mktemp("trl")
    launches: dict[str, tuple[list[str], Path, int]] = {}
    for name, (reference, change, flags) in CASES.items():
        config = _ds_config(work, change)
        launches[name] = _torchrun(2, work / f"{name}.json", "--sp_size", "2", "--deepspeed", config, *flags)
        if f"no_sp:{reference}" not in launches:  # the non-SP reference (1 process), started beside the SP launch
            launches[f"no_sp:{reference}"] = _torchrun(1, work / f"no_sp_{reference}.json", "--sp_size", "1", *flags)
    return _pool(launches)


def _relative(got: float, want: float) -> float:
    return abs(got - want) / max(abs(want), 1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_sft_under_upipe_equals_no_sp(runs, name):
    reference = runs[f"no_sp:{CASES[name][0]}"]
    run = runs[name]
    assert len(reference["train_losses"]) == 3, reference
    for key in COMPARED:
        assert len(run[key]) == len(reference[key]), (key, run[key], reference[key])
        worst = max(_relative(g, w) for g, w in zip(run[key], reference[key]))
        assert worst <= RTOL, f"{name} {key}: {worst:.2e}: {run[key]} vs {reference[key]}"
    for key in COMPARED_EVAL:
        assert _relative(run[key], reference[key]) <= RTOL, f"{name} {key}: {run[key]} vs {reference[key]}"
    # UPipe ran on both ranks, in training and in evaluation; the reference ran none
    assert run["world_size"] == 2 and min(run["stage_runs_train"]) > 0 and min(run["stage_runs_eval"]) > 0, run
    assert reference["stage_runs_train"] == [0] and reference["stage_runs_eval"] == [0], reference


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
