"""Shared pieces of the engine tests: launches of examples/train_deepspeed.py through the real
``deepspeed`` launcher (one launch runs many configurations with ``--runs``), and the rank body of
the config-error test (run with ds_upipe.tools.ranks.run_ranks)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from ds_upipe.tools.ranks import free_port

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "train_deepspeed.py"
CONFIGS = REPO / "ds_configs"
DEEPSPEED = Path(sys.executable).parent / "deepspeed"
FP32_RTOL = 1e-5
#: the offload config's DeepSpeed CPU Adam is a C++ build of minutes on first use; torch's AdamW
#: runs the same offloaded ZeRO-3 path without it
TORCH_ADAM = ["optimizer.params.torch_adam=true", "zero_force_ds_cpu_optimizer=false"]


def run(
    name: str,
    config: str = "upipe_zero3",
    *,
    sp: int = 1,
    stage: int | None = None,
    gas: int = 1,
    fp32: bool = True,
    extra: tuple[str, ...] = (),
    **options: Any,
) -> dict[str, Any]:
    """One entry of the example's --runs file."""
    overrides = [f"sequence_parallel_size={sp}", f"gradient_accumulation_steps={gas}"]
    if fp32:
        overrides.append("bf16.enabled=false")
    if stage is not None:
        overrides.append(f"zero_optimization.stage={stage}")
    return {
        "name": name,
        "deepspeed_config": str(CONFIGS / f"{config}.json"),
        "set": overrides + list(extra),
        **options,
    }


def launch(
    num_procs: int,
    runs: list[dict[str, Any]],
    workdir: Path,
    *,
    steps: int = 5,
    seq_len: int = 256,
    timeout: int = 900,
    port: int | None = None,
) -> tuple[int, str, dict[str, Any]]:
    """``deepspeed --num_gpus N examples/train_deepspeed.py --runs ...`` on CPU; returns
    (exit code, combined output, metrics JSON with runs by name).  Every launch must leave no
    DeepSpeed shm-allreduce segment behind (see ds_upipe/integration/process_exit.py)."""
    spec = dict(num_procs=num_procs, runs=runs, workdir=workdir, steps=steps, seq_len=seq_len, port=port)
    return launch_many([spec], timeout=timeout)[0]


def launch_many(specs: list[dict[str, Any]], *, timeout: int = 900) -> list[tuple[int, str, dict[str, Any]]]:
    """Independent launches (``launch``'s arguments as dicts, each its own port and folder) at the same
    time, a few ranks deep (tests/launches.py ``run_pool``); per launch what ``launch`` returns."""
    from tests.launches import run_pool

    commands, files = [], []
    for spec in specs:
        workdir, port = spec["workdir"], spec.get("port") or free_port()
        workdir.mkdir(parents=True, exist_ok=True)
        runs_file, metrics_file, log_file = workdir / "runs.json", workdir / "metrics.json", workdir / "launch.log"
        runs_file.write_text(json.dumps(spec["runs"], indent=1))
        cmd = [
            str(DEEPSPEED),
            "--num_gpus",
            str(spec["num_procs"]),
            "--master_port",
            str(port),
            str(EXAMPLE),
            "--deepspeed_config",
            str(CONFIGS / "upipe_zero3.json"),
            "--runs",
            str(runs_file),
            "--steps",
            str(spec.get("steps", 5)),
            "--seq_len",
            str(spec.get("seq_len", 256)),
            "--metrics_out",
            str(metrics_file),
            "--no_progress",
        ]
        commands.append((cmd, spec["num_procs"]))
        files.append((port, metrics_file, log_file))
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    results = []
    for (code, output, _), (port, metrics_file, log_file) in zip(
        run_pool(commands, cwd=REPO, env=env, timeout=timeout), files, strict=True
    ):
        log_file.write_text(output)
        left = shm_segments(port)
        assert not left, f"the launch left DeepSpeed shm segments behind: {left}"
        metrics = json.loads(metrics_file.read_text()) if metrics_file.exists() else {"runs": [], "error": None}
        metrics["by_name"] = {r["name"]: r for r in metrics["runs"]}
        results.append((code, output, metrics))
    return results


def shm_segments(port: int) -> list[str]:
    """DeepSpeed CPU shm-allreduce segments of this user for a launch on ``port``."""
    return sorted(p.name for p in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*"))


def max_rel(got: list[float], want: list[float]) -> float:
    """Largest relative difference of two equally long sequences."""
    assert len(got) == len(want) and got, (got, want)
    return max(abs(a - b) / max(abs(b), 1e-30) for a, b in zip(got, want))


# ---------------------------------------------------------------- config errors (run_ranks body)

BASE = {
    "train_micro_batch_size_per_gpu": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
    "zero_optimization": {"stage": 3},
    "sequence_parallel_size": 2,
}
ERROR_CASES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {  # name -> (config changes, model changes)
    "unknown_key": ({"upipe": {"enabled": True, "chunk": 2}}, {}),
    "bad_head_chunk_size": ({"upipe": {"head_chunk_size": 3}}, {}),
    "head_chunk_size_type": ({"upipe": {"head_chunk_size": "big"}}, {}),
    "auto_without_budget": ({"upipe": {"head_chunk_size": "auto"}}, {}),
    "sp_not_dividing_world": ({"sequence_parallel_size": 3}, {}),
    "heads_incompatible": ({}, {"num_attention_heads": 6, "num_key_value_heads": 3, "hidden_size": 96}),
    "heads_incompatible_alst": (
        {"upipe": {"enabled": False}},
        {"num_attention_heads": 6, "num_key_value_heads": 3, "hidden_size": 96},
    ),
    "partition_activations": ({"activation_checkpointing": {"partition_activations": True}}, {}),
    "zero_stage_0": ({"zero_optimization": {"stage": 0}}, {}),
    "data_parallel_size": ({"data_parallel_size": 2}, {}),
    "not_hf_model": ({}, {"_linear": True}),
    # UPipe x Ring: R must divide the SP size; ALST has no ring; U is checked against C_u = sp / R
    "ring_not_dividing_sp": ({"upipe": {"ring_size": 3}}, {}),
    "ring_size_zero": ({"upipe": {"ring_size": 0}}, {}),
    "ring_with_alst": ({"upipe": {"enabled": False, "ring_size": 2}}, {}),
    "ring_head_chunk_size": ({"upipe": {"ring_size": 2, "head_chunk_size": 3}}, {}),
    "tiled_loss_without_lm_head": ({"upipe": {"enabled": False, "tiled_loss": True}}, {"_base": True}),
    "tiled_mlp_bad_tile": ({"upipe": {"tiled_mlp": {"tile_tokens": 0}}}, {}),
    # hybrids: ALST would run the mixers on each rank's shard from a zero state; a U the mixers cannot take
    "hybrid_with_alst": ({"upipe": {"enabled": False}}, {"_arch": "nemotron_h"}),
    "hybrid_mixer_head_chunk_size": ({"upipe": {"mixer_head_chunk_size": 3}}, {"_arch": "qwen3_5"}),
}


def tiny_llama(**changes: Any) -> Any:
    import torch
    from transformers import LlamaForCausalLM

    from ds_upipe.tools.models import tiny_config

    if changes.pop("_linear", False):
        return torch.nn.Linear(4, 4)
    arch = changes.pop("_arch", None)
    if arch is not None:  # a hybrid (tiny_config's layer pattern)
        from ds_upipe.tools.models import tiny_causal_lm

        torch.manual_seed(0)
        return tiny_causal_lm(arch, **changes)
    base = changes.pop("_base", False)
    fields = dict(
        vocab_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=8, max_position_embeddings=2048
    )
    torch.manual_seed(0)
    if base:  # the base model: no lm_head
        from transformers import LlamaModel

        return LlamaModel(tiny_config(**{**fields, **changes}))
    return LlamaForCausalLM(tiny_config(**{**fields, **changes}))


def _samples(lengths: list[int], labels: bool = True) -> list[dict[str, Any]]:
    import torch

    out = []
    for n in lengths:
        ids = torch.arange(n) % 64
        out.append({"input_ids": ids, "labels": ids.clone()} if labels else {"input_ids": ids})
    return out


#: name -> (dataset, config changes): training data that fails at the first batch of the loader
LOADER_CASES: dict[str, tuple[list[dict[str, Any]], dict[str, Any]]] = {
    # one sample per batch: the two ranks' samples differ in length: accepted, padded to the longer
    "samples_of_different_lengths": (_samples([8, 10, 12, 14]), {}),
    # two samples per batch: the default collate cannot stack them, on each rank
    "batch_of_different_lengths": (_samples([8, 10, 12, 14]), {"train_micro_batch_size_per_gpu": 2}),
    "no_labels": (_samples([8, 8, 8, 8], labels=False), {}),
}


def loader_error(dataset: list[dict[str, Any]], config_changes: dict[str, Any]) -> str | None:
    """The ValueError text of the first batch of ds_upipe.initialize's training loader, or, when it is
    accepted, "accepted: " and the first micro-batch's global position_ids of this rank's shard."""
    import ds_upipe

    model = tiny_llama()
    config = {**BASE, **config_changes}
    engine, _, loader, _ = ds_upipe.initialize(
        model=model, model_parameters=model.parameters(), config=config, training_data=dataset
    )
    try:
        batch = next(iter(loader))
        return f"accepted: {batch['position_ids'].tolist()}"
    except ValueError as err:
        return str(err)
    finally:
        engine.destroy()


#: name -> config changes on rank 1 only (rank 0 runs BASE): each used to hang or abort a collective
RANK_MISMATCH_CASES: dict[str, dict[str, Any]] = {
    "sequence_parallel_size": {"sequence_parallel_size": 1},
    "enabled": {"upipe": {"enabled": False}},
    "tiled_loss": {"upipe": {"tiled_loss": True}},
    "offload_checkpoints": {"upipe": {"offload_checkpoints": True}},
    "ring_size": {"upipe": {"ring_size": 2}},
    "invalid_on_one_rank": {"upipe": {"chunk": 2}},
}


def config_errors(rank: int, world: int) -> dict[str, Any]:
    """Each error case through ds_upipe.initialize on this rank: the ValueError text (None if none),
    each case of configs that differ across ranks (key "ranks:NAME"), each loader error case (key
    "loader:NAME"), then one valid initialize, to show that no rank was left inside a collective."""
    import ds_upipe

    out: dict[str, Any] = {}
    for name, (config_changes, model_changes) in ERROR_CASES.items():
        model = tiny_llama(**model_changes)
        try:
            ds_upipe.initialize(model=model, model_parameters=model.parameters(), config={**BASE, **config_changes})
            out[name] = None
        except ValueError as err:
            out[name] = str(err)
    for name, changes in RANK_MISMATCH_CASES.items():
        model = tiny_llama()
        try:
            ds_upipe.initialize(
                model=model, model_parameters=model.parameters(), config={**BASE, **(changes if rank == 1 else {})}
            )
            out[f"ranks:{name}"] = None
        except ValueError as err:
            out[f"ranks:{name}"] = str(err)
    # the same exchange on the Trainer / accelerate route (ParallelismConfig.sp_size per rank)
    from ds_upipe.integration import hf_integration

    for name, changes in RANK_MISMATCH_CASES.items():
        config = {**BASE, **(changes if rank == 1 else {})}
        sp_size = config.pop("sequence_parallel_size")
        try:
            hf_integration._settings_agreed_by_all_ranks(config, sp_size)
            out[f"accelerate:{name}"] = None
        except ValueError as err:
            out[f"accelerate:{name}"] = str(err)
    for name, (dataset, config_changes) in LOADER_CASES.items():
        out[f"loader:{name}"] = loader_error(dataset, config_changes)
    model = tiny_llama()
    engine, *_ = ds_upipe.initialize(model=model, model_parameters=model.parameters(), config=BASE)
    out["valid_head_chunk_size"] = engine.upipe_head_chunk_size
    engine.destroy()
    return out
