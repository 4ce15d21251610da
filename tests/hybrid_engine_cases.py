"""Rank-side bodies of tests/test_hybrid_engine.py, run in the shared spawn of 4 DeepSpeed ranks
(tests/four_ranks.py): hybrid models (Qwen3.5: gated delta net + gated attention; Nemotron-H: Mamba-2 +
attention + MLP) through ``ds_upipe.initialize`` at ZeRO-3, SP 2 x DP 2, with and without activation
checkpointing, trained a few AdamW steps == the same model trained in one process without SP; the
ds_config refusals of the mixers before any collective."""

from __future__ import annotations

import copy
from typing import Any

import torch

import hf_patches
from tests import mixer_gated_delta_cases, mixer_mamba2_cases
from tests.hf_cases import make_batch, reference_loss, relative_error

SP = 2
SEQ = 16
STEPS = 3
#: DeepSpeed builds ``torch.optim.AdamW(params, **ADAMW)`` with ``torch_adam``; the reference the same
ADAMW = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
#: DeepSpeed's default gradient_clipping (1.0), set explicitly; the reference clips as DeepSpeed does (the
#: global norm's max_norm / (norm + 1e-6), torch's clip_grad_norm_): these tiny models' norms are above it
CLIP = 1.0


def build(family: str) -> torch.nn.Module:
    """A tiny float32 hybrid of the float64 mixer tests (their per-head parameters perturbed, 2 to 4 layers)."""
    if family == "qwen3_5":
        return mixer_gated_delta_cases.build_model("qwen3_5").float()
    return mixer_mamba2_cases.build("nemotron_h").float()


def ds_config(checkpointing: bool, **upipe: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        # DeepSpeed keeps parameters under 1e5 elements whole on every rank (the default persistence
        # threshold): all of a tiny model's; 0 partitions every one, as a real model's large weights are
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "AdamW", "params": {**ADAMW, "torch_adam": True}},
        "gradient_clipping": CLIP,
        "sequence_parallel_size": SP,
        "upipe": {"enabled": True, **upipe},
    }
    if checkpointing:
        config["activation_checkpointing"] = {}
    return config


def samples(step: int, dp: int) -> list[dict[str, torch.Tensor]]:
    """The step's sample of each data-parallel replica (one row of SEQ tokens; equal label counts, so the
    replicas' average gradient is the gradient of the mean token loss over both rows)."""
    return [make_batch(100 * step + d, 1, SEQ) for d in range(dp)]


def reference(model: torch.nn.Module, dp: int) -> tuple[list[list[float]], dict[str, torch.Tensor]]:
    """One process, no SP: per step each replica's loss, the mean's backward, torch's AdamW; final parameters."""
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    losses = []
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        step_losses = [reference_loss(model(input_ids=s["input_ids"]).logits, s["labels"]) for s in samples(step, dp)]
        torch.stack(step_losses).mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        losses.append([loss.item() for loss in step_losses])
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def engine_run(
    model: torch.nn.Module, config: dict[str, Any]
) -> tuple[list[list[float]], dict[str, torch.Tensor], dict[str, Any]]:
    """``ds_upipe.initialize`` and STEPS steps on this rank's shard of its replica's sample; per step every
    replica's loss (gathered), the full float32 parameters after the steps, and what ran (the mixers' U,
    the layers' activation checkpointing)."""
    import deepspeed.comm as dist
    from deepspeed.utils import safe_get_full_fp32_param

    import ds_upipe

    engine, *_ = ds_upipe.initialize(model=model, model_parameters=model.parameters(), config=config)
    group = engine.seq_parallel_group
    world = dist.get_world_size()
    dp, replica = world // SP, dist.get_rank() // SP  # parallel_state_sp: contiguous ranks form a group
    registered = external_params(engine.module)
    # an evaluation forward of the module itself first, then the training steps
    shard = hf_patches.shard_batch(samples(0, dp)[replica], group)
    with torch.no_grad():
        logits = engine.module(input_ids=shard["input_ids"], position_ids=shard["position_ids"]).logits
    eval_logits = hf_patches.gather_sequence(logits, group)
    losses = []
    for step in range(STEPS):
        shard = hf_patches.shard_batch(samples(step, dp)[replica], group)
        out = engine(input_ids=shard["input_ids"], position_ids=shard["position_ids"])
        loss = hf_patches.sequence_parallel_loss(out.logits, shard["shift_labels"], group)
        engine.backward(loss)
        engine.step()
        gathered = [torch.zeros(()) for _ in range(world)]
        dist.all_gather(gathered, loss.detach().float())
        losses.append([gathered[d * SP].item() for d in range(dp)])
    params = {n: safe_get_full_fp32_param(p).detach().clone() for n, p in engine.module.named_parameters()}
    # DeepSpeed registers a partitioned parameter read outside its module's forward when its getter meets it
    # (ZeROOrderedDict, in eager forwards only, not under torch.compile): nothing may be left for it to find
    discovered = external_params(engine.module) - registered
    ran = {
        "registered": len(registered),
        "discovered": len(discovered),
        "mixer_u": hf_patches.upipe_state(engine.module).options.mixer_head_chunk_size,
        "checkpointing": engine.upipe_checkpointing,
    }
    engine.destroy()
    return losses, params, {**ran, "eval_logits": eval_logits}


def external_params(model: torch.nn.Module) -> set[tuple[str, int]]:
    """(module name, parameter id) of every parameter registered as read outside its own module with a module
    apply_upipe patched (attention, mixers).  Others are transformers' own: Nemotron-H's block reads its norm's
    weight (its dtype) before calling the norm, which DeepSpeed's getter registers with the block."""
    return {
        (name, key)
        for name, m in model.named_modules()
        # patched layers carry the run's state; so do the model and its base (the input hook's), which hold none
        if getattr(m, "_upipe_state", None) is not None and m is not model and not hasattr(m, "_upipe_input_hook")
        for key in getattr(m, "_external_params", {})
    }


def zero3_case(family: str, checkpointing: bool, world: int, **upipe: Any) -> dict[str, Any]:
    """Largest relative loss error over the steps and replicas, and over the parameters after the steps
    (each tensor's max |difference| over its max |value|), ZeRO-3 SP 2 vs one process without SP."""
    model = build(family)
    replica = torch.distributed.get_rank() // SP
    with torch.no_grad():
        ref_logits = copy.deepcopy(model)(input_ids=samples(0, world // SP)[replica]["input_ids"]).logits
    ref_losses, ref_params = reference(copy.deepcopy(model), world // SP)
    losses, params, ran = engine_run(model, ds_config(checkpointing, **upipe))
    initial = build(family).state_dict()
    moved = max((params[n] - initial[n]).abs().max().item() for n in ref_params)
    return {
        "eval_logits": relative_error(ran.pop("eval_logits"), ref_logits),
        "losses": max(relative_error(torch.tensor(a), torch.tensor(b)) for a, b in zip(losses, ref_losses)),
        "params": max(relative_error(params[n], ref_params[n]) for n in ref_params),
        "param_names": float(set(params) != set(ref_params)),
        # the steps changed the parameters (a run that never updates them would match a reference that did not)
        "moved": moved,
        **ran,
    }


#: name -> (family, checkpointing, upipe keys)
ZERO3_CASES: dict[str, tuple[str, bool, dict[str, Any]]] = {
    "qwen3_5": ("qwen3_5", False, {}),
    # "auto" resolved by the engine route (a child process measures the mixer layer): a budget every U fits picks
    # U = all 8 value heads, trained at that U
    "qwen3_5_checkpointing_u=auto": (
        "qwen3_5",
        True,
        {"mixer_head_chunk_size": "auto", "memory_budget_gib": 1, "seq_length": SEQ},
    ),
    "nemotron_h": ("nemotron_h", False, {}),
    "nemotron_h_checkpointing": ("nemotron_h", True, {}),
}


def zero3_matrix(rank: int, world: int) -> dict[str, Any]:
    return {name: zero3_case(family, ckpt, world, **upipe) for name, (family, ckpt, upipe) in ZERO3_CASES.items()}


#: name -> (family, sequence_parallel_size, upipe keys): ds_configs a hybrid model cannot run
REFUSALS: dict[str, tuple[str, int, dict[str, Any]]] = {
    # 3 is not a multiple of C = 2 (gated delta net, 8 value heads)
    "gated_delta_u": ("qwen3_5", 2, {"mixer_head_chunk_size": 3}),
    # 6 is a multiple of C = 2 but does not divide the 8 Mamba-2 heads (the attention's U stays valid)
    "mamba2_u": ("nemotron_h", 2, {"mixer_head_chunk_size": 6}),
    # UPipe x Ring (2 Ulysses x 2 ring ranks) shards attention only
    "ring": ("qwen3_5", 4, {"ring_size": 2}),
}


def refusals(rank: int, world: int) -> dict[str, Any]:
    """Each refused ds_config through ds_upipe.initialize: its ValueError text, and the sequence-parallel size
    of DeepSpeed's groups afterwards (unchanged: refused before the groups are built); then one valid
    initialize, to show no rank was left inside a collective."""
    from deepspeed.runtime.sequence_parallel import parallel_state_sp

    import ds_upipe

    out: dict[str, Any] = {}
    for name, (family, sp, upipe) in REFUSALS.items():
        model = build(family)
        config = {**ds_config(False, **upipe), "sequence_parallel_size": sp}
        before = parallel_state_sp.get_sequence_parallel_world_size()
        try:
            ds_upipe.initialize(model=model, model_parameters=model.parameters(), config=config)
            out[name] = None
        except ValueError as err:
            out[name] = str(err)
        out[f"{name}:groups_unchanged"] = parallel_state_sp.get_sequence_parallel_world_size() == before
    model = build("qwen3_5")
    engine, *_ = ds_upipe.initialize(model=model, model_parameters=model.parameters(), config=ds_config(False))
    out["valid"] = engine.upipe_head_chunk_size
    engine.destroy()
    return out


def spawn_body(rank: int, world: int) -> dict[str, Any]:
    """This file's part of the shared 4-rank spawn: the ZeRO-3 cases first (they build the SP 2 groups the
    refusals must leave as they are), then the refusals."""
    return {"zero3": zero3_matrix(rank, world), "refusals": refusals(rank, world)}
