"""Every ``"upipe"`` key reaches the runtime on every route, or is refused naming it.

The routes, in one spawn of 2 ranks (ZeRO-2, sp 2, a tiny Llama saved with ``save_pretrained`` and
loaded by path):

- ``engine``: ``ds_upipe.initialize(model=..., config=ds_config)``;
- ``accelerate``: ``hf_integration.enable()``, an ``Accelerator`` with the ds_config's DeepSpeed plugin
  and ``ParallelismConfig(sp_backend="deepspeed")``, ``accelerator.prepare(model, optimizer)`` (what
  the HF Trainer runs);
- ``alst_path``: DeepSpeed's ALST recipe after ``enable()``: the plugin's ds_config enables UPipe,
  ``register_with_transformers(model_name_or_path=PATH)``, the model loaded from PATH, then
  ``deepspeed.initialize(model=model, mpu=mpu)``.

Each route runs three block settings (``ON``: every model-level key on, ``head_chunk_size: "auto"``,
non-default kernel, overlap, accumulation; ``OFF``: all off; ``SECTION``: only an
``activation_checkpointing`` section), records
what the model runs (its ``UPipeState``, long-context stack, checkpointing, pairs) and trains one step.
On ``alst_path`` a model loaded from PATH but never given to ``deepspeed.initialize`` is refused at its
first training forward (naming the keys), and runs when every model-level key is off (then the
registered function honours U, kernel, overlap and ``accumulate_dtype``).

The same spawn checks that nothing process-global mixes models: two models patched in one process
with different U / recompute / accumulation each run with their own settings, and a UPipe model keeps
running after an ALST model was set up next to it, and after its group was re-created.
"""

from __future__ import annotations

import traceback
from pathlib import Path
from typing import Any

import pytest
import torch

from ds_upipe.tools.ranks import run_ranks

WORLD = 2
SEQ = 16
BASE = {
    "train_micro_batch_size_per_gpu": 1,
    "zero_optimization": {"stage": 2},
    # torch's Adam: DeepSpeed's FusedAdam is a C++ build of about a minute on CPU (no test here steps it)
    "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
}
#: every model-level key on, and U, kernel, overlap, accumulation off their defaults; "auto" with the budget
#: of ``_auto_budget`` (added in ``key_cases``): the model's fused + recompute + overlap layer fits no U
#: there, so "auto" picks C = 2, where the core-only measurement would pick 4 (each route must measure
#: the model's layer as it runs it)
ON = {
    "enabled": True,
    "head_chunk_size": "auto",
    "seq_length": SEQ,
    "kernel": "math",
    "overlap_comm": True,
    "fused_projections": True,
    "accumulate_dtype": "input",
    "recompute_attention_output": True,
    "share_exchanged_kv": False,
    "offload_checkpoints": True,
    "checkpoint_pairs": 1,
    "tiled_loss": {"tile_tokens": 6},
    "tiled_norm": {"tile_tokens": 4},
    "tiled_mlp": {"tile_tokens": 2},
}
OFF = {"enabled": True, "fused_projections": False}
SETTINGS = {
    "on": {**BASE, "upipe": ON},
    "off": {**BASE, "upipe": OFF},
    "section": {**BASE, "upipe": OFF, "activation_checkpointing": {}},
}
ROUTES = ("engine", "accelerate", "alst_path")
#: what each setting must give: (U, kernel, overlap, fused, input-dtype sums, recompute, shared K/V held, tiles,
#: checkpointed, pairs)
WANT = {
    "on": dict(
        U=2,
        kernel="MathKernel",
        overlap=True,
        fused=True,
        accumulate_input=True,
        recompute=True,
        share_kv=False,
        tiles=[6, 4, 2],
        checkpointing=True,
        pairs=1,
    ),
    "off": dict(
        U=2,
        kernel="TorchSDPAKernel",
        overlap=False,
        fused=False,
        accumulate_input=False,
        recompute=False,
        share_kv=True,
        tiles=None,
        checkpointing=False,
        pairs=0,
    ),
    "section": dict(
        U=2,
        kernel="TorchSDPAKernel",
        overlap=False,
        fused=False,
        accumulate_input=False,
        recompute=False,
        share_kv=True,
        tiles=None,
        checkpointing=True,
        pairs=0,
    ),
}


# ---------------------------------------------------------------------------------------------------
# rank side


def _batch(group: Any) -> dict[str, torch.Tensor]:
    from hf_patches import shard_batch

    ids = (torch.arange(SEQ) * 7 % 100 + 1).unsqueeze(0)
    return shard_batch({"input_ids": ids, "labels": ids.clone()}, group)


def _sp_group() -> Any:
    from deepspeed.utils import groups

    return groups._get_sequence_parallel_group()


def _record(model: torch.nn.Module) -> dict[str, Any]:
    """What the model runs, read from where the runtime reads it."""
    from hf_patches import long_context_stack, upipe_state

    hf = model.module if hasattr(model, "module") else model
    state = upipe_state(hf)
    stack = long_context_stack(hf)
    return {
        "U": state.head_chunk_size if state else None,
        "kernel": type(state.kernel).__name__ if state else None,
        "overlap": state.overlap_comm if state else None,
        "fused": state.fused_projections if state else None,
        "accumulate_input": state.accumulate_in_input_dtype if state else None,
        "recompute": state.recompute_attention_output if state else None,
        "share_kv": state.options.share_exchanged_kv if state else None,
        "tiles": [stack.loss_tile_tokens, stack.norm_tile_tokens, stack.mlp_tile_tokens] if stack else None,
        "checkpointing": bool(hf.is_gradient_checkpointing),
        "pairs": len(getattr(hf, "upipe_checkpoint_groups", None) or []),
    }


def _train_step(engine: Any, backward: Any) -> float:
    """One forward + backward on this rank's shard; the loss (UPipe stages must run: counted by the caller)."""
    engine.train()
    batch = _batch(_sp_group())
    out = engine(**batch)
    loss = out.loss  # the tiled loss's (from shift_labels); without it the rank's own, as ALST's recipe has it
    if loss is None:
        hf = engine.module if hasattr(engine, "module") else engine
        loss = hf.loss_function(out.logits, None, hf.config.vocab_size, shift_labels=batch["shift_labels"])
    backward(loss)
    return float(loss)


def _engine_route(path: str, config: dict[str, Any]) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM

    import ds_upipe

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa")
    engine, *_ = ds_upipe.initialize(
        model=model, config={**config, "sequence_parallel_size": WORLD}, model_parameters=model.parameters()
    )
    return engine, engine.backward


def _accelerate_route(path: str, config: dict[str, Any]) -> tuple[Any, Any]:
    from accelerate import Accelerator
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DeepSpeedPlugin, DeepSpeedSequenceParallelConfig
    from transformers import AutoModelForCausalLM

    from ds_upipe import hf_integration

    hf_integration.enable()
    handler = DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=True, sp_attn_implementation="sdpa")
    accelerator = Accelerator(
        deepspeed_plugin=DeepSpeedPlugin(hf_ds_config={k: v for k, v in config.items() if k != "optimizer"}),
        parallelism_config=ParallelismConfig(sp_backend="deepspeed", sp_size=WORLD, sp_handler=handler),
    )
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, _ = accelerator.prepare(model, optimizer)
    return model, accelerator.backward


def _alst_registration(path: str, config: dict[str, Any]) -> Any:
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin

    from ds_upipe import hf_integration

    hf_integration.enable()
    # as a user of the recipe imports it: after enable() (DeepSpeed's name, ds_upipe's class)
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=dict(config)))
    return UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=path,
        core_attn_implementation="sdpa",
        sequence_parallel_size=WORLD,
        micro_batch_size=1,
        seq_length_is_variable=True,
    )


def _alst_path_route(path: str, config: dict[str, Any]) -> tuple[Any, Any]:
    import deepspeed
    from transformers import AutoModelForCausalLM

    mpu = _alst_registration(path, config)
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa")
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters(), mpu=mpu)
    return engine, engine.backward


def _alst_path_without_initialize(path: str, config: dict[str, Any]) -> dict[str, Any]:
    """Registered by path, the model loaded from it and trained without deepspeed.initialize."""
    from transformers import AutoModelForCausalLM

    mpu = _alst_registration(path, config)
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa")
    model.train()
    batch = _batch(mpu.get_sequence_parallel_group())
    try:
        out = model(**batch)
        model.loss_function(out.logits, None, model.config.vocab_size, shift_labels=batch["shift_labels"]).backward()
    except ValueError as err:
        return {"error": str(err)}
    attention = model.model.layers[0].self_attn
    state = attention._upipe_state  # the registered function's (unfused) state
    return {
        "error": None,
        "U": state.head_chunk_size,
        "kernel": type(state.kernel).__name__,
        "overlap": state.overlap_comm,
        "accumulate_input": state.accumulate_in_input_dtype,
    }


def _two_models(path: str) -> dict[str, Any]:
    """Two models patched in one process with different settings, one group re-created in between,
    and an ALST model set up beside a UPipe one: each computes with its own settings."""
    import deepspeed.comm as ds_dist
    from transformers import AutoModelForCausalLM

    import ds_upipe
    from ds_upipe.integration.sp_setup import sequence_parallel_mpu
    from hf_patches import apply_upipe, upipe_state

    group = sequence_parallel_mpu(WORLD).get_sequence_parallel_group()
    a = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa")
    apply_upipe(a, group, head_chunk_size=2, recompute_attention_output=True, accumulate_in_input_dtype=True)
    b = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa")
    other = ds_dist.new_group(list(range(WORLD)))  # a second group of the same ranks
    apply_upipe(b, other, head_chunk_size=4, fused_projections=False)
    reference = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa")
    ids = (torch.arange(SEQ) * 7 % 100 + 1).unsqueeze(0)
    shard = slice(torch.distributed.get_rank() * SEQ // WORLD, (torch.distributed.get_rank() + 1) * SEQ // WORLD)
    with torch.no_grad():
        want = reference(input_ids=ids).logits[:, shard]
    out: dict[str, Any] = {}
    positions = torch.arange(SEQ).unsqueeze(0)[:, shard]
    for name, model in (("a", a), ("b", b), ("a_again", a)):
        state = upipe_state(model)
        before = state.stage_runs[0]
        with torch.no_grad():
            got = model(input_ids=ids[:, shard], position_ids=positions).logits
        out[name] = {
            "U": state.head_chunk_size,
            "recompute": state.recompute_attention_output,
            "accumulate_input": state.accumulate_in_input_dtype,
            "fused": state.fused_projections,
            "stages": state.stage_runs[0] - before,
            "max_err": float((got - want).abs().max()),
        }
    # an ALST engine (ds_upipe.initialize, enabled false) next to the UPipe models: a keeps its own attention
    alst = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa")
    ds_upipe.initialize(
        model=alst,
        config={**BASE, "sequence_parallel_size": WORLD, "upipe": {"enabled": False}},
        model_parameters=alst.parameters(),
    )
    state = upipe_state(a)
    before = state.stage_runs[0]
    with torch.no_grad():
        got = a(input_ids=ids[:, shard], position_ids=positions).logits
    out["a_after_alst"] = {"stages": state.stage_runs[0] - before, "max_err": float((got - want).abs().max())}
    with torch.no_grad():
        got = alst(input_ids=ids[:, shard], position_ids=positions).logits
    out["alst"] = {"stages": 0, "max_err": float((got - want).abs().max())}
    return out


def key_cases(rank: int, world: int, path: str, budget_gib: float) -> dict[str, Any]:
    import time

    from ds_upipe.pipeline import StageCounter
    from tests.test_alst_compat import _FreshProcessState

    fresh = _FreshProcessState()
    routes = {"engine": _engine_route, "accelerate": _accelerate_route, "alst_path": _alst_path_route}
    results: dict[str, Any] = {}

    def run(name: str, body: Any) -> None:
        start = time.perf_counter()
        try:
            results[name] = body()
        except BaseException:  # noqa: BLE001 - reported per case to the parent
            results[name] = {"traceback": traceback.format_exc()}
        finally:
            fresh.restore()
        results[name]["seconds"] = time.perf_counter() - start
        torch.distributed.barrier()

    settings = {**SETTINGS, "on": {**SETTINGS["on"], "upipe": {**ON, "memory_budget_gib": budget_gib}}}
    for route, setup in routes.items():
        for setting, config in settings.items():

            def body(setup: Any = setup, config: dict[str, Any] = config) -> dict[str, Any]:
                with StageCounter() as stages:
                    engine, backward = setup(path, config)
                    record = _record(engine)
                    record["loss"] = _train_step(engine, backward)
                record["stages"] = stages.count
                return record

            run(f"{route}/{setting}", body)
    for setting in ("on", "off"):
        run(f"alst_path_unloaded/{setting}", lambda s=setting: _alst_path_without_initialize(path, settings[s]))
    run("two_models", lambda: _two_models(path))
    return results


# ---------------------------------------------------------------------------------------------------
# pytest side


@pytest.fixture(scope="module")
def key_results(tmp_path_factory) -> list[dict[str, Any]]:
    from transformers import LlamaForCausalLM

    from ds_upipe.tools.models import tiny_config

    path = Path(tmp_path_factory.mktemp("keys")) / "tiny-llama"
    torch.manual_seed(0)
    config = tiny_config("llama", vocab_size=101, hidden_size=32, intermediate_size=64)
    LlamaForCausalLM(config).save_pretrained(path)
    return run_ranks(key_cases, WORLD, str(path), _auto_budget(config), use_deepspeed=True)


def _auto_budget(config: Any) -> float:
    """A budget (GiB) between the core-only measurement of ``ON`` (which fits U = 4) and the model's
    fused + recompute + overlap attention (which fits no U: "auto" picks C = 2)."""
    from ds_upipe.integration.auto_chunk import attention_stage_bytes_by_u, choose_head_chunk_size
    from ds_upipe.integration.config import UPipeConfig

    dims = dict(num_heads=4, num_kv_heads=2, head_dim=8, group_size=WORLD, micro_batch_size=1, dtype_bytes=4)
    block = UPipeConfig(**{**ON, "memory_budget_gib": 1.0})
    settings = dict(seq_length=SEQ, overlap_comm=True, accumulate_in_input_dtype=True)
    core = attention_stage_bytes_by_u([2, 4], **dims, **settings)
    layer = attention_stage_bytes_by_u(
        [2, 4], **dims, **settings, model_config=config, fused_projections=True, recompute_attention_output=True
    )
    budget = (max(core.values()) + min(layer.values())) // 2
    assert max(core.values()) < budget < min(layer.values()), (core, layer)
    block = block.model_copy(update={"memory_budget_gib": budget / 2**30})
    assert choose_head_chunk_size(block, **dims) == 4  # the core-only measurement (no model)
    assert choose_head_chunk_size(block, **dims, model_config=config) == WANT["on"]["U"]
    return budget / 2**30


def test_every_case_ran(key_results):
    failed = {name: row["traceback"] for name, row in key_results[0].items() if "traceback" in row}
    assert not failed, "\n".join(f"{name}:\n{tb}" for name, tb in failed.items())


def _result(key_results: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    rows = [r[name] for r in key_results]
    for rank, row in enumerate(rows):
        assert "traceback" not in row, f"rank {rank}: {name} failed:\n{row['traceback']}"
    return rows


KEYS = ("U", "kernel", "overlap", "fused", "accumulate_input", "recompute", "tiles", "checkpointing", "pairs")


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("key", KEYS)
@pytest.mark.parametrize("route", ROUTES)
def test_key_reaches_the_model(key_results, route, key, setting):
    """``key`` as the block sets it is what the model runs, on this route (and UPipe ran a training step)."""
    for rank, row in enumerate(_result(key_results, f"{route}/{setting}")):
        assert row[key] == WANT[setting][key], f"rank {rank}, {route}/{setting}: {key} = {row[key]!r}"
        assert row["stages"] > 0 and row["loss"] == row["loss"], (rank, row)


def test_alst_path_model_not_given_to_deepspeed_is_refused_naming_the_keys(key_results):
    for row in _result(key_results, "alst_path_unloaded/on"):
        msg = row["error"]
        assert msg is not None and "by name or path" in msg and "deepspeed.initialize(model=model, mpu=mpu)" in msg
        for key in ("upipe.fused_projections=true", "upipe.recompute_attention_output=true", "upipe.tiled_loss"):
            assert key in msg, msg
        assert "upipe.offload_checkpoints=true" in msg and "upipe.checkpoint_pairs=1" in msg, msg


def test_alst_path_without_model_keys_runs_the_registered_settings(key_results):
    for row in _result(key_results, "alst_path_unloaded/off"):
        assert row["error"] is None
        assert (row["U"], row["kernel"], row["overlap"], row["accumulate_input"]) == (
            2,
            "TorchSDPAKernel",
            False,
            False,
        )


def test_two_models_in_one_process_keep_their_own_settings(key_results):
    for rank, rows in enumerate(_result(key_results, "two_models")):
        a, b = rows["a"], rows["b"]
        assert (a["U"], a["recompute"], a["accumulate_input"], a["fused"]) == (2, True, True, True), (rank, a)
        assert (b["U"], b["recompute"], b["accumulate_input"], b["fused"]) == (4, False, False, False), (rank, b)
        # 2 rounds x ... stages: U = 2 runs 2 stages per layer, U = 4 one (2 layers)
        assert (a["stages"], b["stages"], rows["a_again"]["stages"]) == (4, 2, 4), rows
        for name in ("a", "b", "a_again", "a_after_alst", "alst"):
            assert rows[name]["max_err"] < 1e-5, (rank, name, rows[name])
        assert rows["a_after_alst"]["stages"] == 4
