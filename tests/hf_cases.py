"""Rank-side bodies of the hf_patches tests (importable by spawned processes).

Every case compares a patched model on sequence shards with the same unpatched model run on the
whole sequence in one process (each rank runs that reference itself; the models are tiny).
"""

from __future__ import annotations

import copy
import logging
import shutil
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F

import hf_patches
from ds_upipe import pipeline
from ds_upipe.tools.parity import (  # noqa: F401 - the cases' step helpers, re-exported for the case files
    compare,
    float64_internals,
    make_batch,
    reference_loss,
    reference_step,
    relative_error,
    sharded_step,
    summed_grads,
)

TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}

# GQA everywhere; H=8 with Hkv=2 has fewer KV heads than ranks at C=4; qwen3 has head_dim != hidden / H.
ARCH_CONFIGS = {
    "llama": dict(num_attention_heads=8, num_key_value_heads=2),
    "mistral": dict(num_attention_heads=8, num_key_value_heads=4, sliding_window=None),
    "qwen2": dict(num_attention_heads=8, num_key_value_heads=2),
    "qwen3": dict(num_attention_heads=8, num_key_value_heads=4, head_dim=16),
}


def make_config(arch: str, **overrides):
    from ds_upipe.tools.models import tiny_config

    fields = dict(vocab_size=101, intermediate_size=96, initializer_range=0.1, use_cache=False)
    return tiny_config(arch, **{**fields, **ARCH_CONFIGS[arch], **overrides})


def build_model(arch: str, dtype=torch.float64, seed: int = 0, base: bool = False, **overrides):
    import transformers

    config = make_config(arch, **overrides)
    prefix = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}[arch]
    cls = getattr(transformers, f"{prefix}Model" if base else f"{prefix}ForCausalLM")
    torch.manual_seed(seed)
    return cls(config).to(dtype)


def patch_model(model, group, u, fused, overlap, recompute, **kwargs):
    """apply_upipe with the cases' settings; returns the model's UPipeState (the recompute flag checked)."""
    hf_patches.apply_upipe(
        model,
        group,
        head_chunk_size=u,
        fused_projections=fused,
        overlap_comm=overlap,
        recompute_attention_output=recompute,
        **kwargs,
    )
    state = hf_patches.upipe_state(model)
    assert state.recompute_attention_output == recompute
    return state


def parity_case(
    arch,
    fused,
    dtype,
    u=None,
    seq=None,
    batch=2,
    world=2,
    seed=0,
    base_model=False,
    overlap=False,
    recompute=False,
    accumulate_input=False,
    **overrides,
):
    group = dist.group.WORLD
    seq = seq if seq is not None else 6 * world
    data = make_batch(seed, batch, seq)
    model = build_model(arch, dtype, seed=seed, base=base_model, **overrides)
    ref_model = copy.deepcopy(model)
    state = patch_model(model, group, u, fused, overlap, recompute, accumulate_in_input_dtype=accumulate_input)
    assert state.fused_projections == fused and state.overlap_comm == overlap, (
        state.fused_projections,
        state.fallback_reason,
    )
    if base_model:
        return _base_model_case(model, ref_model, data, group, seq)
    before = state.stage_runs[0]
    errors = compare(reference_step(ref_model, data), sharded_step(model, data, group), seq)
    layers = model.config.num_hidden_layers
    errors["stage_runs_ok"] = float(state.stage_runs[0] - before != 2 * layers * state.plan.num_stages)
    return errors


def packed_batch(seed: int, seq: int, world: int, rows: int = 1, vocab: int = 101) -> tuple[dict, list[list[int]]]:
    """A packed batch built by transformers' DataCollatorWithFlattening (position_ids restart per
    document, -100 at each document's first label) from random documents of ``seq`` tokens per row
    (lengths from tests.core_cases.packed_documents: a one-token document, one shorter than a shard,
    one crossing a shard boundary); several rows are stacked.  Returns (batch, cu_seqlens per row)."""
    from transformers import DataCollatorWithFlattening

    from tests.core_cases import packed_documents

    gen = torch.Generator().manual_seed(seed)
    batches, cus = [], []
    for r in range(rows):
        cu = packed_documents(seq, world, seed + r)
        docs = [torch.randint(0, vocab, (e - s,), generator=gen).tolist() for s, e in zip(cu, cu[1:])]
        batches.append(DataCollatorWithFlattening()([{"input_ids": d, "labels": d} for d in docs]))
        cus.append(cu)
    batch = {k: torch.cat([b[k] for b in batches]) for k in ("input_ids", "labels", "position_ids")}
    return batch, cus


def per_document_reference(model, batch, cus):
    """Every document run as its own unpacked sequence by the unpatched model (one process): the
    logits concatenated, the mean loss over all documents' predicted tokens, the gradients."""
    model.zero_grad(set_to_none=True)
    logits, labels = [], []
    for r, cu in enumerate(cus):
        for s, e in zip(cu, cu[1:]):
            logits.append(model(input_ids=batch["input_ids"][r : r + 1, s:e]).logits)
            labels.append(hf_patches.shift_labels(batch["input_ids"][r : r + 1, s:e]))
    flat = torch.cat([t.reshape(-1, t.shape[-1]) for t in logits])
    loss = F.cross_entropy(flat, torch.cat([t.reshape(-1) for t in labels]), ignore_index=-100)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    rows = [torch.cat(logits[i : i + len(cu) - 1], dim=1) for i, cu in zip(_row_offsets(cus), cus)]
    return torch.cat(rows).detach(), loss.detach(), grads


def _row_offsets(cus):
    offsets, n = [], 0
    for cu in cus:
        offsets.append(n)
        n += len(cu) - 1
    return offsets


def packed_case(arch, fused, u, overlap, world, rows=1, seq=None, seed=0, recompute=False):
    """A packed row (or rows) through apply_upipe == every document alone in one process, float64."""
    group = dist.group.WORLD
    seq = seq or 6 * world
    batch, cus = packed_batch(seed, seq, world, rows)
    model = build_model(arch, torch.float64, seed=seed)
    ref_model = copy.deepcopy(model)
    state = patch_model(model, group, u, fused, overlap, recompute)
    seen = []  # the boundaries the first attention module is handed with its forward's kwargs
    model.model.layers[0].self_attn.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs.get(hf_patches.state.DOCUMENTS_KWARG)), with_kwargs=True
    )
    errors = compare(per_document_reference(ref_model, batch, cus), sharded_step(model, batch, group), seq)
    want = tuple(tuple(cu) for cu in cus)
    padded = -seq % world
    if padded:  # the right padding joins the last document
        want = tuple((*cu[:-1], seq + padded) for cu in want)
    errors["documents_ok"] = float(len(seen) != 1 or seen[0] is None or seen[0].rows != want)
    errors["documents_report_ok"] = float(state.last_documents_per_row != tuple(len(cu) - 1 for cu in cus))
    return errors


def packed_matrix(rank, world):
    """Packed rows, fused and unfused, U in {C, H}, overlap on and off, GQA (Llama: KV < C at C=4),
    Qwen3 (C=2), two rows with different documents, a row padded at the end, fused with the attention
    output recomputed in backward; returns {case: errors}."""
    h = ARCH_CONFIGS["llama"]["num_attention_heads"]
    cases = {
        "llama_fused_u=C": ("llama", True, None, False, {}),
        "llama_unfused_u=H_overlap": ("llama", False, h, True, {}),
        "llama_fused_u=H_overlap_2rows": ("llama", True, h, True, {"rows": 2}),
        "llama_unfused_u=C_padded": ("llama", False, None, False, {"seq": 6 * world - 1}),
        # fused recompute_attention_output: each stage's output recomputed in backward, per document
        "llama_fused_u=H_overlap_recompute": ("llama", True, h, True, {"recompute": True, "seed": 2}),
    }
    if world == 2:  # Qwen3 (q/k norms) at C=2 only: test time
        cases["qwen3_fused_u=C_overlap"] = ("qwen3", True, None, True, {})
        cases["qwen3_unfused_u=H"] = ("qwen3", False, h, False, {"seed": 1})
    return {name: packed_case(a, f, u, o, world, **kw) for name, (a, f, u, o, kw) in cases.items()}


def group_of_four(rank, world):
    """The C=4 parity spawn: the model matrix, the packed rows, and sequence-parallel DPO / GRPO
    (tests/rl_cases.py; in this spawn to save a spawn of four)."""
    from tests import family_cases, rl_cases

    return {
        "families": family_cases.family_matrix(rank, world),
        "parity": parity_matrix(rank, world),
        "packed": packed_matrix(rank, world),
        "rl": rl_cases.in_spawn_of_four(rank, world),
    }


def _base_model_case(model, ref_model, data, group, seq):
    full = ref_model(input_ids=data["input_ids"]).last_hidden_state
    shard = hf_patches.shard_batch(data, group)
    out = model(input_ids=shard["input_ids"], position_ids=shard["position_ids"]).last_hidden_state
    got = hf_patches.gather_sequence(out.detach(), group)
    return {"hidden": relative_error(got[:, :seq], full.detach())}


def parity_matrix(rank, world):
    """All four architectures, fused and unfused, float64 (some float32, U = 2C, U = H, overlapped
    communication, fused with the attention output recomputed in backward); returns (failures, count,
    process-wide stage runs)."""
    failures, count = [], 0
    cases = [(arch, fused, torch.float64, None) for arch in ARCH_CONFIGS for fused in (True, False)]
    cases += [("llama", True, torch.float32, None), ("qwen3", False, torch.float32, None)]
    cases += [("qwen2", True, torch.float64, 2 * world), ("mistral", True, torch.float64, 8)]  # U = 2C, U = H
    cases = [(*case, False, {}) for case in cases]
    cases += [("qwen3", True, torch.float64, None, True, {}), ("llama", False, torch.float64, None, True, {})]
    # Qwen3 fused with fewer KV heads than ranks: the replicas' dK must be summed before the float32 k_norm
    cases += [("qwen3", True, torch.float64, None, False, {"num_key_value_heads": world // 2})]
    # recompute_attention_output: Qwen3 with k-norm, KV replicas and overlap; Qwen2 (q/k/v bias) at U = 2C
    cases += [
        ("qwen3", True, torch.float64, None, True, {"num_key_value_heads": world // 2, "recompute": True}),
        ("qwen2", True, torch.float64, 2 * world, False, {"recompute": True}),
    ]
    # accumulate_in_input_dtype: the fused source takes dK/dV per stage (no round accumulator), here with
    # KV replicas and overlap, and with recompute at U = 2C
    cases += [
        ("llama", True, torch.float64, None, True, {"num_key_value_heads": world // 2, "accumulate_input": True}),
        ("qwen2", True, torch.float64, 2 * world, False, {"recompute": True, "accumulate_input": True}),
    ]
    with pipeline.StageCounter() as stages:
        for arch, fused, dtype, u, overlap, overrides in cases:
            errors = parity_case(arch, fused, dtype, u=u, world=world, overlap=overlap, **overrides)
            count += 1
            if max(errors.values()) > TOLERANCE[dtype]:
                failures.append((arch, fused, str(dtype), u, overlap, overrides, errors))
    return failures, count, stages.count


# RoPE types and their scaling threshold T = 12 tokens (dynamic: max_position_embeddings; the others:
# original_max_position_embeddings). Steps of 16 tokens (beyond T: at C=2 rank 0's shard, positions
# 0-7, stays below it; at C=4 ranks 0-2 do) and then 8 tokens (below T: dynamic resets).
ROPE_THRESHOLD = 12
ROPE_STEPS = (16, 8)
_ROPE_BASE = {"rope_theta": 10000.0, "original_max_position_embeddings": ROPE_THRESHOLD}
ROPE_TYPES = {
    "dynamic": dict(
        max_position_embeddings=ROPE_THRESHOLD,
        rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4},
    ),
    "longrope": dict(
        max_position_embeddings=4 * ROPE_THRESHOLD,
        rope_parameters={
            **_ROPE_BASE,
            "rope_type": "longrope",
            "factor": 4.0,
            "short_factor": [1.0, 1.1, 1.2, 1.3],  # head_dim / 2 factors (Llama 8, Qwen3 16: repeated below)
            "long_factor": [1.5, 2.0, 3.0, 4.0],
        },
    ),
    "yarn": dict(
        max_position_embeddings=4 * ROPE_THRESHOLD, rope_parameters={**_ROPE_BASE, "rope_type": "yarn", "factor": 4.0}
    ),
    "llama3": dict(
        max_position_embeddings=4 * ROPE_THRESHOLD,
        rope_parameters={
            **_ROPE_BASE,
            "rope_type": "llama3",
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
        },
    ),
    "linear": dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}),
}


def rope_overrides(arch: str, rope: str) -> dict:
    overrides = copy.deepcopy(ROPE_TYPES[rope])
    params = overrides["rope_parameters"]
    head_dim = ARCH_CONFIGS[arch].get("head_dim", 64 // ARCH_CONFIGS[arch]["num_attention_heads"])
    for key in ("short_factor", "long_factor"):
        if key in params:
            params[key] = (params[key] * head_dim)[: head_dim // 2]
    return overrides


def rope_case(arch: str, rope: str, fused: bool, group) -> dict[str, float]:
    """The same models through ROPE_STEPS (the dynamic RoPE state carries over between the steps)."""
    world = dist.get_world_size(group)
    model = build_model(arch, torch.float64, num_hidden_layers=1, **rope_overrides(arch, rope))
    assert model.config.rope_parameters["rope_type"] == rope
    ref_model = copy.deepcopy(model)
    hf_patches.apply_upipe(model, group, fused_projections=fused)
    errors = {}
    for step, seq in enumerate(ROPE_STEPS):
        data = make_batch(20 + step, 2, seq)
        got = compare(reference_step(ref_model, data), sharded_step(model, data, group), seq)
        errors.update({f"{k}_{step}": v for k, v in got.items()})
    errors["shards_below_threshold"] = float(ROPE_STEPS[0] // world > ROPE_THRESHOLD)
    return errors


#: (architecture, RoPE type): every type on Llama; on Qwen3 the types whose frequencies depend on the input
ROPE_CASES = [("llama", rope) for rope in ROPE_TYPES] + [("qwen3", "dynamic"), ("qwen3", "longrope")]


def rope_cases(rank, world):
    """ROPE_CASES fused and unfused at C=4 (the world) and C=2 (two subgroups of it, explicit groups
    as ds_upipe.initialize creates); returns (failures, count)."""
    pairs = [dist.new_group([r, r + 1]) for r in range(0, world, 2)]
    groups = {world: dist.group.WORLD, 2: pairs[rank // 2]}
    failures, count = [], 0
    for size, group in groups.items():
        for arch, rope in ROPE_CASES:
            for fused in (True, False):
                errors = rope_case(arch, rope, fused, group)
                count += 1
                if max(errors.values()) > TOLERANCE[torch.float64]:
                    failures.append((size, arch, rope, fused, {k: v for k, v in errors.items() if v > 1e-10}))
    return failures, count


def qk_norm_tiles_case(world):
    """Fused Qwen3 with its per-head q/k RMSNorm run over token tiles of 5 tokens (tests' shards are
    otherwise one tile): forward and backward (KV < C, with and without the recompute) still equal the
    single-process model."""
    import hf_patches.fused as fused

    tile_bytes, fused.QK_NORM_TILE_BYTES = fused.QK_NORM_TILE_BYTES, 0
    try:
        # 0 bytes: one token per tile; then a few tokens per tile (shards of 6 and 7 tokens: a short last tile)
        one = parity_case("qwen3", True, torch.float64, world=world, num_key_value_heads=1)
        fused.QK_NORM_TILE_BYTES = 5 * 4 * 2 * 2 * 16  # 5 tokens of batch 2, 2 heads, head_dim 16 in float32
        few = parity_case("qwen3", True, torch.float64, seq=7 * world, world=world, recompute=True)
    finally:
        fused.QK_NORM_TILE_BYTES = tile_bytes
    return {f"one_token_{k}": v for k, v in one.items()} | {f"five_tokens_{k}": v for k, v in few.items()}


def misc_cases(rank, world):
    """Padding, base models, save/reload, gradient checkpointing (no DeepSpeed), PEFT fallback."""
    results = {}
    # sequence not a multiple of C: padded at the end with ignored labels
    results["padding"] = parity_case("llama", True, torch.float64, seq=6 * world - 1, world=world)
    results["base_model_fused"] = parity_case("qwen2", True, torch.float64, world=world, base_model=True)
    results["base_model_unfused"] = parity_case("mistral", False, torch.float64, world=world, base_model=True)
    results["reload"] = reload_case(world)
    for reentrant in (True, False):
        for fused in (True, False):
            results[f"checkpointing_reentrant={reentrant}_fused={fused}"] = checkpointing_case(
                "qwen3", fused, reentrant, world
            )
    # HF's checkpointing reruns the layer forward, then UPipe's backward reruns each stage's attention
    results["checkpointing_reentrant=True_fused_recompute"] = checkpointing_case(
        "llama", True, True, world, recompute=True
    )
    # per-forward data (packed boundaries) with the forward: other forwards between forward and backward
    for arch, fused, kind in (
        ("llama", True, "reentrant"),
        ("llama", False, "non_reentrant"),
        ("qwen3", True, "deepspeed"),
    ):
        results[f"interleaved_forwards_{arch}_fused={fused}_{kind}"] = interleaved_forwards_case(
            arch, fused, kind, world
        )
    results["qwen3_fused_qk_norm_tiles"] = qk_norm_tiles_case(world)
    results["peft_lora"] = peft_case(world)
    results["two_models"] = two_models_case(world)
    results["recreated_group"] = recreated_group_case(world)
    results["right_padding_mask"] = right_padding_case(world)
    results["autocast_fallback"] = autocast_case(world)
    results["deepcopy"] = deepcopy_case(world)
    results.update(sliding_window_cases(world))
    results.update(sinks_function_cases(world))
    return results


class _GptOssLike(torch.nn.Module):
    """What GPT-OSS's ``eager_attention_forward`` reads of its attention module: sinks and the GQA ratio."""

    def __init__(self, sinks, num_key_value_groups):
        super().__init__()
        self.sinks = torch.nn.Parameter(sinks)
        self.num_key_value_groups = num_key_value_groups


def sinks_function_cases(world):
    """The "upipe" attention function with GPT-OSS's attention sinks (``s_aux``, as GptOssAttention passes
    them), on a patched Llama layer's attention module, against transformers' own GPT-OSS
    ``eager_attention_forward`` on the whole sequence with an explicit causal (and sliding-window)
    additive mask, float64: output, dq, dk, dv and the sinks' gradient (summed over the ranks)."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    from hf_patches.attention import upipe_attention_function

    group, rank = dist.group.WORLD, dist.get_rank()
    model = build_model("llama")  # H = 8, KV = 2
    patch_model(model, group, None, False, False, False)
    module = model.model.layers[0].self_attn
    heads, kv_heads, head_dim = 8, 2, module.head_dim
    seq, shard = 6 * world, 6
    results = {}
    for window in (None, 5):
        gen = torch.Generator().manual_seed(window or 0)
        q, dout = (torch.randn(2, heads, seq, head_dim, generator=gen, dtype=torch.float64) for _ in range(2))
        k, v = (torch.randn(2, kv_heads, seq, head_dim, generator=gen, dtype=torch.float64) for _ in range(2))
        sinks = torch.randn(heads, generator=gen, dtype=torch.float64)
        ref_module = _GptOssLike(sinks.clone(), heads // kv_heads).eval()
        full = [t.clone().requires_grad_(True) for t in (q, k, v)]
        i, j = torch.arange(seq)[:, None], torch.arange(seq)[None, :]
        visible = (j <= i) & ((j > i - window) if window else True)
        mask = torch.zeros(seq, seq, dtype=torch.float64).masked_fill(~visible, float("-inf"))
        ref, _ = eager_attention_forward(ref_module, *full, mask[None, None], module.scaling)
        ref.backward(dout.transpose(1, 2))
        local = [t[:, :, rank * shard : (rank + 1) * shard].clone().requires_grad_(True) for t in (q, k, v)]
        my_sinks = torch.nn.Parameter(sinks.clone())
        out, _ = upipe_attention_function(
            module, *local, None, scaling=module.scaling, sliding_window=window, s_aux=my_sinks
        )
        out.backward(dout[:, :, rank * shard : (rank + 1) * shard].transpose(1, 2))
        sink_grad = my_sinks.grad.clone()
        dist.all_reduce(sink_grad)
        part = slice(rank * shard, (rank + 1) * shard)
        errors = {
            "out": relative_error(out, ref.detach()[:, part]),
            "dsinks": relative_error(sink_grad, ref_module.sinks.grad),
        }
        for name, loc, glob in zip("qkv", local, full):
            errors[f"d{name}"] = relative_error(loc.grad, glob.grad[:, :, part])
        results[f"sinks_function_window={window}"] = errors
    return results


def sliding_window_cases(world):
    """Sliding windows layer by layer against the unpatched model (transformers' own sliding-window mask),
    float64, shards of 6 tokens: Mistral (config.sliding_window, every layer) below and above a shard, fused
    and unfused; Qwen2 with use_sliding_window and max_window_layers=1 (layer 0 full, layer 1 sliding), fused
    and unfused; Qwen3 with explicit layer_types (sliding first, then full) at U = H."""
    cases = {
        "window_mistral_fused_W5": ("mistral", True, None, dict(sliding_window=5)),
        "window_mistral_unfused_W8": ("mistral", False, None, dict(sliding_window=8)),
        "window_qwen2_unfused_layer_types": (
            "qwen2",
            False,
            None,
            dict(use_sliding_window=True, sliding_window=3, max_window_layers=1, num_hidden_layers=2),
        ),
        "window_qwen2_fused_layer_types": (
            "qwen2",
            True,
            None,
            dict(use_sliding_window=True, sliding_window=7, max_window_layers=1, num_hidden_layers=2),
        ),
        "window_qwen3_unfused_U=H": (
            "qwen3",
            False,
            8,
            dict(
                use_sliding_window=True,
                sliding_window=4,
                layer_types=["sliding_attention", "full_attention"],
                num_hidden_layers=2,
            ),
        ),
    }
    return {
        name: parity_case(arch, fused, torch.float64, u=u, world=world, **overrides)
        for name, (arch, fused, u, overrides) in cases.items()
    }


def deepcopy_case(world):
    """copy.deepcopy of a model patched with an explicit group (as ds_upipe.initialize and the Trainer
    hook pass one): the copy shares the group object, has its own UPipe state and parameters, and its
    forward/backward equal the original's."""
    group = dist.new_group(list(range(world)))
    seq = 6 * world
    data = make_batch(7, 2, seq)
    errors = {}
    for fused in (True, False):
        model = build_model("llama", torch.float64, rope_parameters={"rope_type": "dynamic", "factor": 2.0})
        hf_patches.apply_upipe(model, group, fused_projections=fused)
        clone = copy.deepcopy(model)
        want = sharded_step(model, data, group)
        model.zero_grad(set_to_none=True)
        state, clone_state = hf_patches.upipe_state(model), hf_patches.upipe_state(clone)
        runs = state.stage_runs[0]
        got = sharded_step(clone, data, group)
        errors[f"own_counter_fused={fused}"] = float(state.stage_runs[0] != runs or clone_state.stage_runs[0] != runs)
        attention_states = {id(m._upipe_state) for m in clone.modules() if hasattr(m, "q_proj")}
        errors.update({f"{k}_fused={fused}": v for k, v in compare(want, got, seq).items()})
        errors[f"shares_group_fused={fused}"] = float(clone_state.group is not group)
        errors[f"own_state_fused={fused}"] = float(clone_state is state or attention_states != {id(clone_state)})
        errors[f"original_untouched_fused={fused}"] = float(any(p.grad is not None for p in model.parameters()))
    return errors


def autocast_case(world):
    """Under torch.autocast fused mode runs the unfused path (autocast-safe) and says so once."""
    group = dist.group.WORLD
    data = make_batch(6, 2, 6 * world)
    model = build_model("llama", torch.float32)
    ref_model = copy.deepcopy(model)
    hf_patches.apply_upipe(model, group)
    shard = hf_patches.shard_batch(data, group)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = ref_model(input_ids=data["input_ids"]).logits.float().detach()
        out = model(input_ids=shard["input_ids"], position_ids=shard["position_ids"]).logits.float()
    out.sum().backward()
    logits = hf_patches.gather_sequence(out.detach(), group)
    state = hf_patches.upipe_state(model)
    # bf16 rounding differs between the sharded and the full run: compare at bf16 precision
    return {"logits_bf16": max(relative_error(logits, ref) - 2e-2, 0.0), "warned": float(not state.autocast_warned)}


def reload_case(world):
    """save_pretrained -> from_pretrained -> patch: logits equal the unpatched original's."""
    import transformers

    group = dist.group.WORLD
    model = build_model("qwen3", torch.float64)
    data = make_batch(1, 2, 6 * world)
    ref_logits = model(input_ids=data["input_ids"]).logits.detach()
    # transformers writes checkpoints on global rank 0 only: rank 0 saves, every rank loads
    holder = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(holder)
    path = holder[0]
    model.save_pretrained(path)
    dist.barrier()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, attn_implementation="sdpa")
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(path)
    hf_patches.apply_upipe(loaded, group)
    shard = hf_patches.shard_batch(data, group)
    logits = loaded(input_ids=shard["input_ids"], position_ids=shard["position_ids"]).logits.detach()
    return {"logits": relative_error(hf_patches.gather_sequence(logits, group), ref_logits)}


def checkpointing_case(arch, fused, reentrant, world, recompute=False):
    group = dist.group.WORLD
    data = make_batch(2, 2, 6 * world)
    model = build_model(arch, torch.float64)
    ref_model = copy.deepcopy(model)
    hf_patches.apply_upipe(model, group, fused_projections=fused, recompute_attention_output=recompute)
    assert hf_patches.upipe_state(model).recompute_attention_output == recompute
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    return compare(reference_step(ref_model, data), sharded_step(model, data, group), 6 * world)


def _checkpointing(model, kind: str) -> None:
    """HF gradient checkpointing, reentrant or not, or DeepSpeed's reentrant checkpoint with the
    replayed output released, as ds_upipe installs it for a ds_config's activation checkpointing."""
    model.train()
    if kind == "deepspeed":
        from deepspeed.runtime.activation_checkpointing import checkpointing as ds_checkpointing

        from ds_upipe.integration.checkpointing import releasing

        model._set_gradient_checkpointing(
            enable=True, gradient_checkpointing_func=releasing(ds_checkpointing.checkpoint)
        )
        model.enable_input_require_grads()
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": kind == "reentrant"})


def _sharded_loss(model, batch, group):
    shard = hf_patches.shard_batch(batch, group)
    out = model(input_ids=shard["input_ids"], position_ids=shard["position_ids"])
    return hf_patches.sequence_parallel_loss(out.logits, shard["shift_labels"], group, grad_reduction="sum")


#: (arch, fused, checkpointing) of the interleaved-forwards cases
INTERLEAVED_CASES = (("llama", True, "reentrant"), ("llama", False, "non_reentrant"), ("qwen3", True, "deepspeed"))


def interleaved_forwards_case(arch, fused, checkpointing, world):
    """Per-forward data travels with the forward: a checkpointed forward on packed rows A, a training
    forward on other packed rows B of another length, an eval forward on unpacked rows, then A's
    backward and B's backward: each equals its own float64 per-document reference (the replay of A's
    layers in backward must attend within A's documents, not the last forward's)."""
    group = dist.group.WORLD
    batch_a, cus_a = packed_batch(0, 6 * world, world)
    batch_b, cus_b = packed_batch(5, 8 * world, world)
    model = build_model(arch, torch.float64)
    ref_model = copy.deepcopy(model)
    refs = [per_document_reference(ref_model, b, c)[1:] for b, c in ((batch_a, cus_a), (batch_b, cus_b))]
    hf_patches.apply_upipe(model, group, fused_projections=fused)
    _checkpointing(model, checkpointing)
    model.zero_grad(set_to_none=True)
    losses = [_sharded_loss(model, b, group) for b in (batch_a, batch_b)]
    model.eval()
    with torch.no_grad():
        shard = hf_patches.shard_batch(make_batch(3, 2, 4 * world), group)
        model(input_ids=shard["input_ids"], position_ids=shard["position_ids"])
    model.train()
    errors = {}
    for name, loss, (ref_loss, ref_grads) in zip("ab", losses, refs):
        loss.backward()
        grads = summed_grads(model, group)
        model.zero_grad(set_to_none=True)
        errors[f"loss_{name}"] = relative_error(loss.detach(), ref_loss)
        errors[f"grads_{name}"] = max(relative_error(grads[n], ref_grads[n]) for n in ref_grads)
    return errors


def two_models_case(world):
    """Two differently configured models in one process (each its own runtime: U, overlap, fused,
    kernel), interleaved: forward A, forward B, backward A, backward B; each equals its own float64
    reference.  Fails if a runtime's settings or per-call data leak between the models (e.g. one
    process-wide plan or kernel: A's U = C run with B's U = H mismatches the stages)."""
    group = dist.group.WORLD
    data = make_batch(7, 2, 6 * world)
    model_a, model_b = build_model("llama"), build_model("qwen3", seed=1)
    refs = [reference_step(copy.deepcopy(m), data) for m in (model_a, model_b)]
    patch_model(model_a, group, None, True, False, False)
    patch_model(model_b, group, 8, False, True, False, kernel="math")
    states = [hf_patches.upipe_state(m) for m in (model_a, model_b)]
    assert states[0] is not states[1] and states[0].settings() != states[1].settings()
    assert (states[0].head_chunk_size, states[1].head_chunk_size) == (world, 8)
    shard = hf_patches.shard_batch(data, group)
    losses, logits = [], []
    for model in (model_a, model_b):
        model.zero_grad(set_to_none=True)
        out = model(input_ids=shard["input_ids"], position_ids=shard["position_ids"])
        logits.append(hf_patches.gather_sequence(out.logits.detach(), group))
        losses.append(hf_patches.sequence_parallel_loss(out.logits, shard["shift_labels"], group, grad_reduction="sum"))
    errors = {}
    for name, model, loss, logit, (r_logits, r_loss, r_grads) in zip("ab", (model_a, model_b), losses, logits, refs):
        loss.backward()
        grads = summed_grads(model, group)
        errors[f"logits_{name}"] = relative_error(logit, r_logits)
        errors[f"loss_{name}"] = relative_error(loss.detach(), r_loss)
        errors[f"grads_{name}"] = max(relative_error(grads[n], r_grads[n]) for n in r_grads)
    return errors


def recreated_group_case(world):
    """A sequence-parallel group destroyed and a new one created in its place: a model patched on the
    new group computes right (nothing of the old group's is found again by the new one, e.g. through
    an id() reused by the new group object)."""
    data = make_batch(8, 1, 6 * world)
    errors = {}
    for attempt in range(2):
        group = dist.new_group(list(range(world)))
        model = build_model("llama", seed=attempt)
        ref = reference_step(copy.deepcopy(model), data)
        patch_model(model, group, None, attempt == 0, attempt == 1, False)
        for name, err in compare(ref, sharded_step(model, data, group), 6 * world).items():
            errors[f"{name}_{attempt}"] = err
        dist.destroy_process_group(group)
    return errors


def peft_case(world):
    """A LoRA-wrapped Llama falls back to unfused mode (one log line) and matches the LoRA gradients."""
    from peft import LoraConfig, get_peft_model

    group = dist.group.WORLD
    data = make_batch(3, 2, 6 * world)
    base = build_model("llama", torch.float64)
    torch.manual_seed(1)
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    ref_model = copy.deepcopy(model)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("hf_patches").addHandler(handler)
    try:
        hf_patches.apply_upipe(model, group, fused_projections=True)
    finally:
        logging.getLogger("hf_patches").removeHandler(handler)
    state = hf_patches.upipe_state(model)
    errors = compare(reference_step(ref_model, data), sharded_step(model, data, group), 6 * world)
    errors["fell_back"] = float(state.fused_projections)
    errors["reason_names_lora"] = float("peft" not in (state.fallback_reason or ""))
    errors["log_lines"] = float(len(records) != (1 if dist.get_rank() == 0 else 0))
    errors["trainable_only_lora"] = float(any("lora" not in n for n, p in model.named_parameters() if p.requires_grad))
    return errors


def right_padding_case(world):
    """A 2-D right-padding attention_mask is honoured: real-token logits and the loss match HF with the mask."""
    group = dist.group.WORLD
    seq = 6 * world
    data = make_batch(4, 2, seq)
    mask = torch.ones(2, seq, dtype=torch.long)
    mask[1, seq - 5 :] = 0
    data["attention_mask"] = mask
    model = build_model("llama", torch.float64)
    ref_model = copy.deepcopy(model)
    ref = ref_model(input_ids=data["input_ids"], attention_mask=mask).logits.detach()
    ref_labels = data["labels"].masked_fill(mask == 0, -100)
    ref_loss = reference_loss(ref, ref_labels)
    hf_patches.apply_upipe(model, group)
    shard = hf_patches.shard_batch(data, group)
    out = model(
        input_ids=shard["input_ids"], position_ids=shard["position_ids"], attention_mask=shard["attention_mask"]
    )
    loss = hf_patches.sequence_parallel_loss(out.logits, shard["shift_labels"], group)
    logits = hf_patches.gather_sequence(out.logits.detach(), group)
    real = mask.bool()
    return {"logits": relative_error(logits[real], ref[real]), "loss": relative_error(loss.detach(), ref_loss)}


def error_recorder(messages: dict[str, str]):  # noqa: ANN201
    """``expect(name, fn)``: records fn's ValueError text (or "NO ERROR") under ``name`` in ``messages``."""

    def expect(name, fn):
        try:
            fn()
        except ValueError as e:
            messages[name] = str(e)
        else:
            messages[name] = "NO ERROR"

    return expect


def refusal_cases(rank, world):
    """Each unsupported input raises the same ValueError on every rank; returns {case: message}."""
    import transformers

    group = dist.group.WORLD
    messages = {}
    expect = error_recorder(messages)

    expect(
        "mistral_sliding_window_zero", lambda: hf_patches.apply_upipe(build_model("mistral", sliding_window=0), group)
    )
    bert = transformers.BertModel(
        transformers.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    )
    expect("unsupported_arch", lambda: hf_patches.apply_upipe(bert, group))
    from tests import family_cases

    for name, build in family_cases.refused_models().items():
        expect(name, lambda build=build: hf_patches.apply_upipe(build(), group))
    expect("bad_head_chunk", lambda: hf_patches.apply_upipe(build_model("llama"), group, head_chunk_size=3))
    # a U that fits one layer's heads but not another's (each layer runs its own stage plan at the one U)
    expect(
        "refuse_layer_kv_heads",
        lambda: hf_patches.apply_upipe(family_cases.layer_kv_heads_model(), group, head_chunk_size=4),
    )
    moe = hf_patches.apply_upipe(family_cases.build_family("qwen3_moe"), group)
    moe_ids = torch.randint(0, 50, (1, 4))
    moe_pos = torch.arange(rank * 4, (rank + 1) * 4)[None]
    expect("moe_aux_loss", lambda: moe(input_ids=moe_ids, position_ids=moe_pos, output_router_logits=True))
    moe.config.output_router_logits = True
    expect("moe_aux_loss_config", lambda: moe(input_ids=moe_ids, position_ids=moe_pos))
    expect("attention_dropout", lambda: hf_patches.apply_upipe(build_model("llama", attention_dropout=0.1), group))
    expect(
        "recompute_unfused",
        lambda: hf_patches.apply_upipe(
            build_model("llama"), group, fused_projections=False, recompute_attention_output=True
        ),
    )

    model = hf_patches.apply_upipe(build_model("llama"), group)
    seq = 4
    ids = torch.randint(0, 101, (1, seq))
    pos = torch.arange(rank * seq, (rank + 1) * seq)[None]
    expect("double_patch", lambda: hf_patches.apply_upipe(model, group))
    expect("no_position_ids", lambda: model(input_ids=ids))
    left = torch.ones(1, seq, dtype=torch.long)
    if rank == 0:
        left[0, 0] = 0  # left padding, only on rank 0: all ranks must still raise
    expect("left_padding", lambda: model(input_ids=ids, position_ids=pos, attention_mask=left))
    expect("mask_4d", lambda: model(input_ids=ids, position_ids=pos, attention_mask=torch.ones(1, 1, seq, seq)))
    expect("use_cache", lambda: model(input_ids=ids, position_ids=pos, use_cache=True))
    expect("generate", lambda: model.generate(input_ids=ids, position_ids=pos, max_new_tokens=2))
    cached = hf_patches.apply_upipe(build_model("qwen2", use_cache=True), group)
    expect("generate_use_cache", lambda: cached.generate(input_ids=ids, max_new_tokens=2))
    uneven = torch.randint(0, 101, (1, seq + (rank == 0)))
    uneven_pos = torch.arange(uneven.shape[1])[None] + rank * (seq + 1)
    expect("uneven_shards", lambda: model(input_ids=uneven, position_ids=uneven_pos))
    expect("rank_head_chunk", lambda: _patched_per_rank(rank, head_chunk_size=2 if rank == 0 else 4)(ids, pos))
    expect(
        "rank_flags",
        lambda: _patched_per_rank(
            rank,
            fused_projections=rank == 0,
            overlap_comm=rank == 1,
            accumulate_in_input_dtype=rank == 0,
            recompute_attention_output=rank == 0,  # on only where fused: no refusal at apply_upipe
            share_exchanged_kv=rank == 1,
        )(ids, pos),
    )
    # the model still works after the refused calls (no rank left behind in a collective)
    out = model(input_ids=ids, position_ids=pos)
    messages["still_works"] = str(tuple(out.logits.shape))
    return messages


def _patched_per_rank(rank, **settings):
    """A Llama patched with this rank's apply_upipe arguments; returns a call on (ids, position_ids)."""
    model = hf_patches.apply_upipe(build_model("llama"), dist.group.WORLD, **settings)
    return lambda ids, pos: model(input_ids=ids, position_ids=pos)


ZERO3_CONFIG = {
    "train_micro_batch_size_per_gpu": 1,
    # every parameter partitioned: DeepSpeed keeps parameters under 1e5 elements (all of a tiny model's) whole
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
}


def _count_reductions(engine) -> dict[int, int]:
    """Count ZeRO-3's per-parameter gradient reductions (the original method still runs)."""
    counts: dict[int, int] = {}
    optimizer = engine.optimizer
    original = optimizer.reduce_ready_partitions_and_remove_grads

    def counting(param):
        counts[id(param)] = counts.get(id(param), 0) + 1
        return original(param)

    optimizer.reduce_ready_partitions_and_remove_grads = counting
    return counts


def zero3_case(arch, fused, checkpointing, world, apply_after_initialize=False, reduce_scatter=True):
    """One ZeRO-3 step with DeepSpeed's sequence-parallel mpu: loss and full gradients equal the
    unpatched single-process model's; every parameter's gradient is reduced exactly once.

    ZeRO-3 averages gradients over the ranks with its default reduce-scatter but sums them with
    ``reduce_scatter: false`` (deepspeed 0.19.8, stage3.py), hence the loss's grad_reduction."""
    import deepspeed
    from deepspeed.runtime.sequence_parallel import parallel_state_sp as mpu
    from deepspeed.utils import safe_get_full_grad

    if mpu._SEQUENCE_PARALLEL_GROUP is None:
        mpu.initialize_sequence_parallel(sequence_parallel_size=world)
    group = mpu.get_sequence_parallel_group()
    seq = 6 * world
    data = make_batch(5, 2, seq)
    model = build_model(arch, torch.float32)
    ref = reference_step(copy.deepcopy(model), data)
    if checkpointing is not None:
        model.train()
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": checkpointing == "reentrant"}
        )
    if not apply_after_initialize:
        hf_patches.apply_upipe(model, group, fused_projections=fused)
    config = copy.deepcopy(ZERO3_CONFIG)
    config["zero_optimization"]["reduce_scatter"] = reduce_scatter
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config, mpu=mpu)
    if apply_after_initialize:
        hf_patches.apply_upipe(engine, group, fused_projections=fused)
    counts = _count_reductions(engine)
    shard = hf_patches.shard_batch(data, group)
    out = engine(input_ids=shard["input_ids"], position_ids=shard["position_ids"])
    loss = hf_patches.sequence_parallel_loss(
        out.logits, shard["shift_labels"], group, grad_reduction="mean" if reduce_scatter else "sum"
    )
    engine.backward(loss)
    names = [n for n, _ in engine.module.named_parameters()]
    grads = {n: safe_get_full_grad(p).detach().clone() for n, p in engine.module.named_parameters()}
    logits = hf_patches.gather_sequence(out.logits.detach(), group)
    reduced = [counts.get(id(p), 0) for p in engine.module.parameters()]
    engine.step()
    errors = compare(ref, (logits, loss.detach(), grads), seq)
    errors["reduced_once"] = float(any(c != 1 for c in reduced))
    errors["grad_names"] = float(sorted(names) != sorted(ref[2]))
    engine.destroy()
    return errors


def zero3_cases(rank, world):
    results = {}
    for arch, fused, checkpointing, after, reduce_scatter in (
        ("qwen3", True, None, False, True),
        ("qwen2", False, None, False, True),
        ("llama", True, "reentrant", False, True),
        ("mistral", True, "non_reentrant", True, True),
        ("qwen3", False, "reentrant", False, True),
        ("qwen2", True, None, False, False),
    ):
        name = f"{arch} fused={fused} checkpointing={checkpointing} after_init={after} reduce_scatter={reduce_scatter}"
        results[name] = zero3_case(arch, fused, checkpointing, world, after, reduce_scatter)
    return results


def dataloader_case(rank, world):
    """sequence_parallel_dataloader (padding + DeepSpeed's UlyssesSPDataLoaderAdapter): micro-batch i
    on every rank is rank i's sample, sharded; the patched model on it gives the unpatched logits and loss."""
    from torch.utils.data import DataLoader

    group = dist.group.WORLD
    # not a multiple of C (padding); equal over ranks: the adapter's uneven all_gather fails on gloo
    lengths = [6 * world - 1] * world
    samples = []
    for r in range(world):
        data = make_batch(10 + r, 1, lengths[r])
        samples.append({"input_ids": data["input_ids"][0], "labels": data["labels"][0]})
    loader = DataLoader([samples[rank]], batch_size=1)
    sp_loader = hf_patches.sequence_parallel_dataloader(loader, group)
    model = build_model("qwen2", torch.float64)
    ref_model = copy.deepcopy(model)
    hf_patches.apply_upipe(model, group)
    errors = {"len": float(len(sp_loader) != world)}
    for src, micro in enumerate(sp_loader):
        seq = lengths[src]
        ids = samples[src]["input_ids"][None]
        labels = samples[src]["labels"][None]
        full_ids = hf_patches.gather_sequence(micro["input_ids"], group)
        errors[f"ids_{src}"] = float(not torch.equal(full_ids[:, :seq], ids) or full_ids.shape[1] % world != 0)
        full_pos = hf_patches.gather_sequence(micro["position_ids"], group)
        errors[f"pos_{src}"] = float(not torch.equal(full_pos, torch.arange(full_ids.shape[1])[None]))
        out = model(input_ids=micro["input_ids"], position_ids=micro["position_ids"])
        loss = hf_patches.sequence_parallel_loss(out.logits, micro["shift_labels"], group)
        ref_logits = ref_model(input_ids=ids).logits.detach()
        logits = hf_patches.gather_sequence(out.logits.detach(), group)
        errors[f"logits_{src}"] = relative_error(logits[:, :seq], ref_logits)
        errors[f"loss_{src}"] = relative_error(loss.detach(), reference_loss(ref_logits, labels))
    errors["batches"] = float(len([k for k in errors if k.startswith("logits_")]) != world)
    return errors


def deepspeed_cases(rank, world):
    return {"zero3": zero3_cases(rank, world), "dataloader": dataloader_case(rank, world)}


def c2_group(rank, world):
    """Everything of the C=2 test group in one spawn."""
    from tests import family_cases

    return {
        "families": family_cases.family_matrix(rank, world),
        "parity": parity_matrix(rank, world),
        "misc": misc_cases(rank, world),
        "refusals": refusal_cases(rank, world),
        "packed": packed_matrix(rank, world),
    }


# Smaller than the measurement (head_dim 8, hidden 256 instead of 16 / 512) to fit the test
# time, with the same heads (H=32, KV=8, C=4, so the same per-stage buffer share C*d/hidden = 1/8)
# and the same activation dominance (local sequence = 8 x hidden).
MEMORY_TEST_SHAPES = dict(seq_local=2048, head_dim=8, hidden_size=256, intermediate_size=256, warmup=False)


def memory_case(rank, world):
    from ds_upipe.tools.hf_memory import measure_peak_activation

    units = {
        # two tracked steps, the least peak: gloo's worker thread may free a collective's buffers late
        (method, part): measure_peak_activation(method, part, repeats=2, **MEMORY_TEST_SHAPES).units
        for method in ("upipe_fused", "upipe_fused_recompute", "alst")
        for part in ("attention", "layer")
    }
    for method in ("upipe_fused", "upipe_fused_recompute"):  # accumulate_dtype "input": dK/dV per stage
        measured = measure_peak_activation(
            method, "attention", repeats=2, accumulate_in_input_dtype=True, **MEMORY_TEST_SHAPES
        )
        units[(f"{method}+input", "attention")] = measured.units
    return units


# -- UPipe x Ring (C_u x R over the whole world) ---------------------------------------------------

_RING_GROUPS: dict[tuple[int, int], tuple] = {}


def ring_groups(ulysses_size: int, ring_size: int):
    """(Ulysses group, ring group) of this rank for C_u x R = the world (built once per process)."""
    from ds_upipe.ring import build_sequence_groups

    key = (ulysses_size, ring_size)
    if key not in _RING_GROUPS:
        _RING_GROUPS[key] = build_sequence_groups(ulysses_size * ring_size, ring_size)
    return _RING_GROUPS[key]


def ring_parity_case(arch, fused, layout, u=None, overlap=False, seq=None, recompute=False, **overrides):
    """The patched model with a ring on zigzag shards == the unpatched model on the whole sequence."""
    cu, r = layout
    ulysses, ring = ring_groups(cu, r)
    world = dist.group.WORLD
    seq = seq if seq is not None else 6 * cu * r
    data = make_batch(30 + cu, 2, seq)
    model = build_model(arch, torch.float64, **overrides)
    ref_model = copy.deepcopy(model)
    state = patch_model(model, ulysses, u, fused, overlap, recompute, ring_group=ring)
    assert (state.fused_projections, state.ring_size, state.group_size) == (fused, r, cu), state
    before = state.stage_runs[0]
    errors = compare(reference_step(ref_model, data), sharded_step(model, data, world, ring_size=r), seq)
    errors["stage_runs_ok"] = float(
        state.stage_runs[0] - before != 2 * model.config.num_hidden_layers * state.plan.num_stages
    )
    return errors


def ring_cases_for(layout):
    """(name, kwargs) of the ring parity cases of one C_u x R layout: Llama (GQA 8/2, and MHA) and Qwen3
    (8/4, q/k norms), fused and unfused, U in {C_u, 2 C_u, H}, overlap on and off, KV < C_u where C_u > 1,
    a sequence that needs padding, and fused with the attention output recomputed in backward."""
    cu, _ = layout
    cases = [
        (f"{arch} fused={fused}", dict(arch=arch, fused=fused))
        for arch in ("llama", "qwen3")
        for fused in (True, False)
    ]
    cases += [
        ("llama fused U=H", dict(arch="llama", fused=True, u=8)),
        ("qwen3 unfused U=H", dict(arch="qwen3", fused=False, u=8)),
        ("llama unfused overlap", dict(arch="llama", fused=False, overlap=True)),
        ("qwen3 fused overlap U=H", dict(arch="qwen3", fused=True, overlap=True, u=8)),
        ("llama fused padding", dict(arch="llama", fused=True, seq=6 * 4 - 3)),
        # MHA (KV = H) and U = 2 C_u
        ("llama fused MHA U=2C_u", dict(arch="llama", fused=True, u=2 * cu, num_key_value_heads=8)),
        ("qwen3 unfused U=2C_u overlap", dict(arch="qwen3", fused=False, u=2 * cu, overlap=True)),
        # the attention output recomputed in backward: one more ring pass per stage
        (
            "qwen3 fused recompute U=2C_u overlap",
            dict(arch="qwen3", fused=True, u=2 * cu, overlap=True, recompute=True),
        ),
    ]
    # sliding windows on zigzag shards (chunks of 6 tokens): below a chunk on every layer (Mistral, fused), and
    # across chunks on layer 1 only (Qwen2 max_window_layers=1, unfused)
    cases += [
        ("mistral fused window=5", dict(arch="mistral", fused=True, sliding_window=5)),
        (
            "qwen2 unfused layer 1 window=8",
            dict(arch="qwen2", fused=False, use_sliding_window=True, sliding_window=8, max_window_layers=1),
        ),
    ]
    if cu > 1:
        kv = dict(num_key_value_heads=cu // 2)
        cases += [
            ("llama fused KV<C_u", dict(arch="llama", fused=True, **kv)),
            # fused Qwen3 sums the KV replicas' gradients before its float32 k_norm (as HF's repeat_kv does)
            ("qwen3 fused KV<C_u", dict(arch="qwen3", fused=True, **kv)),
            ("qwen3 unfused KV<C_u overlap", dict(arch="qwen3", fused=False, overlap=True, **kv)),
        ]
    return cases


def ring_cases_compact(layout):
    """A compact case set for large layouts (C_u x R = 4 x 2: 8 processes on few cores): fused and
    unfused Llama and Qwen3, GQA with KV >= C_u and KV < C_u, U in {C_u, H}, one overlapped case, one
    with the attention output recomputed in backward, on the shortest sequence the zigzag split allows
    (2 tokens per rank)."""
    cu, r = layout
    seq = 2 * cu * r
    gqa, kv_lt = dict(num_key_value_heads=cu), dict(num_key_value_heads=cu // 2)
    return [
        ("llama fused KV<C_u", dict(arch="llama", fused=True, seq=seq, **kv_lt)),
        ("llama unfused GQA U=H", dict(arch="llama", fused=False, u=8, seq=seq, **gqa)),
        ("qwen3 fused GQA U=H overlap", dict(arch="qwen3", fused=True, u=8, overlap=True, seq=seq, **gqa)),
        ("qwen3 fused KV<C_u", dict(arch="qwen3", fused=True, seq=seq, **kv_lt)),
        ("qwen3 unfused KV<C_u", dict(arch="qwen3", fused=False, seq=seq, **kv_lt)),
        ("llama fused KV<C_u recompute", dict(arch="llama", fused=True, seq=seq, recompute=True, **kv_lt)),
    ]


def ring_suite(rank, world, layouts, compact=False):
    """Every ring parity case of each layout, plus the ring data loader (``compact``: the compact case
    set, no loader); returns {layout: {case: errors}}."""
    out = {}
    for layout in layouts:
        cases = ring_cases_compact(layout) if compact else ring_cases_for(layout)
        results = {name: ring_parity_case(layout=layout, **kwargs) for name, kwargs in cases}
        if not compact:
            results["dataloader"] = ring_dataloader_case(layout)
            results["packed_refused"] = ring_packed_refusal(layout)
        out[layout] = results
    return out


def ring_packed_refusal(layout):
    """Packed rows with a ring group are refused, with the same ValueError on every rank."""
    cu, r = layout
    ulysses, ring = ring_groups(cu, r)
    world = dist.group.WORLD
    batch, _ = packed_batch(5, 6 * cu * r, cu * r)
    model = hf_patches.apply_upipe(build_model("llama", torch.float64), ulysses, ring_group=ring)
    shard = hf_patches.shard_batch(batch, world, ring_size=r)
    messages = {}
    error_recorder(messages)("packed", lambda: model(input_ids=shard["input_ids"], position_ids=shard["position_ids"]))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, messages["packed"])
    same = len(set(gathered)) == 1
    return {"refused": float(not same or "not supported with a ring group" not in messages["packed"])}


def ring_dataloader_case(layout):
    """sequence_parallel_dataloader with a ring: rank r's micro-batch i is sample i's zigzag shard
    (global positions, shift_labels shifted in sequence order); the patched model on it gives the
    unpatched loss and logits."""
    from torch.utils.data import DataLoader

    cu, r = layout
    ulysses, ring = ring_groups(cu, r)
    world, rank = dist.group.WORLD, dist.get_rank()
    size = cu * r
    length = 6 * size - 3  # padded to a multiple of R x lcm(2, C_u)
    samples = []
    for src in range(size):
        data = make_batch(40 + src, 1, length)
        samples.append({"input_ids": data["input_ids"][0], "labels": data["labels"][0]})
    sp_loader = hf_patches.sequence_parallel_dataloader(DataLoader([samples[rank]], batch_size=1), world, ring_size=r)
    model = build_model("qwen3", torch.float64)
    ref_model = copy.deepcopy(model)
    hf_patches.apply_upipe(model, ulysses, ring_group=ring)
    errors = {"len": float(len(sp_loader) != size)}
    for src, micro in enumerate(sp_loader):
        ids, labels = samples[src]["input_ids"][None], samples[src]["labels"][None]
        full_ids = hf_patches.gather_sequence(micro["input_ids"], world, ring_size=r)
        errors[f"ids_{src}"] = float(not torch.equal(full_ids[:, :length], ids))
        full_pos = hf_patches.gather_sequence(micro["position_ids"], world, ring_size=r)
        errors[f"pos_{src}"] = float(not torch.equal(full_pos, torch.arange(full_ids.shape[1])[None]))
        out = model(input_ids=micro["input_ids"], position_ids=micro["position_ids"])
        loss = hf_patches.sequence_parallel_loss(out.logits, micro["shift_labels"], world)
        ref_logits = ref_model(input_ids=ids).logits.detach()
        logits = hf_patches.gather_sequence(out.logits.detach(), world, ring_size=r)
        errors[f"logits_{src}"] = relative_error(logits[:, :length], ref_logits)
        errors[f"loss_{src}"] = relative_error(loss.detach(), reference_loss(ref_logits, labels))
    errors["batches"] = float(len([k for k in errors if k.startswith("logits_")]) != size)
    return errors
