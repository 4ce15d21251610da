"""Rank-side bodies of the generic-path tests (issue 21): transformers families beyond the Llama four, built
from tiny configs, patched by ``apply_upipe`` found from their modules, against the same model unpatched in
one process (logits, loss and every parameter gradient, sinks and router weights included, float64).

Run inside the C = 2 and C = 4 parity spawns of tests/test_hf_parity.py (``family_matrix``), so the
families add no spawn of their own.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch
import torch.distributed as dist

import hf_patches
from ds_upipe.heads import layer_head_layouts
from ds_upipe.tools import sweep
from ds_upipe.tools.opcount import OpCounter
from tests import hf_cases

#: every family shares the sweep's tiny config (hidden 64, 2 layers, H = 8 query heads of head_dim 8, 2 KV heads:
#: KV < C at C = 4)
COMMON: dict[str, Any] = sweep.COMMON

_MOE = dict(num_experts_per_tok=2, output_router_logits=False, experts_implementation="eager")  # grouped_mm: no float64
_SLIDING_FULL = ["sliding_attention", "full_attention"]
#: latent attention's tiny shapes (``sweep.MLA``) with a small routed MoE
_MLA_MOE = dict(**sweep.MLA, n_routed_experts=4, n_shared_experts=1, moe_intermediate_size=32, **_MOE)

_GEMMA4: dict[str, Any] = dict(
    num_hidden_layers=4,
    layer_types=_SLIDING_FULL * 2,
    sliding_window=4,
    global_head_dim=16,
    num_kv_shared_layers=2,
    vocab_size_per_layer_input=101,
    hidden_size_per_layer_input=8,
    final_logit_softcapping=None,
    pad_token_id=0,
)

#: family -> (model_type, overrides, runs fused)
FAMILIES: dict[str, tuple[str, dict[str, Any], bool]] = {
    "llama": ("llama", {}, True),
    "mistral": ("mistral", dict(sliding_window=5), True),
    "qwen2": ("qwen2", dict(use_sliding_window=True, sliding_window=3, layer_types=_SLIDING_FULL), True),
    "qwen3": ("qwen3", {}, True),
    "qwen3_moe": ("qwen3_moe", dict(num_experts=4, moe_intermediate_size=32, **_MOE), True),
    "mixtral": ("mixtral", dict(num_local_experts=4, sliding_window=None, **_MOE), True),
    "granite": ("granite", dict(attention_multiplier=0.3, embedding_multiplier=2.0, residual_multiplier=0.5), True),
    "gemma3": (
        "gemma3_text",
        dict(query_pre_attn_scalar=24, sliding_window=4, layer_types=_SLIDING_FULL, final_logit_softcapping=None),
        True,
    ),
    "gpt_oss": ("gpt_oss", dict(num_local_experts=4, sliding_window=4, layer_types=_SLIDING_FULL, **_MOE), True),
    # Gemma 4: sliding layers of head_dim 8 and full layers of global_head_dim 16 (RoPE on a quarter of it), q/k/v
    # norms, scaling 1; layers 2 and 3 reuse the keys and values of layers 0 and 1 (num_kv_shared_layers)
    "gemma4": ("gemma4_text", _GEMMA4, False),
    # Gemma 4 26B/31B-style: its full-attention layers with their own key/value heads too (1, keys as values:
    # attention_k_eq_v), each layer run with the stage plan of its own heads at the one U
    "gemma4_kv": ("gemma4_text", dict(_GEMMA4, attention_k_eq_v=True, num_global_key_value_heads=1), False),
    "phi3": ("phi3", dict(sliding_window=None, pad_token_id=0), False),
    "olmo2": ("olmo2", {}, False),
    "glm4": ("glm4", dict(pad_token_id=0), False),
    "smollm3": ("smollm3", dict(no_rope_layer_interval=2, pad_token_id=0), False),
    # differential attention: two registry calls per layer (the halves of V), then head i paired with head
    # i + H/2, the lambda combination and the group norm on the rank's tokens with every head (stages need
    # not keep pairs together); its lambda is a float32 sum (sweep.TOLERANCES)
    "diffllama": ("diffllama", {}, False),
    # multi-head latent attention (unfused): q/k heads of 12, values of 8; DeepSeek-V3's layer 1 a routed MoE
    "deepseek_v3": ("deepseek_v3", dict(**_MLA_MOE, first_k_dense_replace=1), False),
    "minicpm3": ("minicpm3", dict(sweep.MLA), False),
    "deepseek_v2": ("deepseek_v2", dict(**_MLA_MOE, first_k_dense_replace=1), False),  # complex RoPE (freqs_cis)
    "glm4_moe_lite": ("glm4_moe_lite", dict(**_MLA_MOE, first_k_dense_replace=1), False),
    # its decoder layer names each argument of the attention call (no **kwargs passed on): one document per row
    # runs exactly; packed rows are refused (``stablelm_packed_refused``)
    "stablelm": ("stablelm", {}, False),
}


def build_family(family: str, dtype=torch.float64, seed: int = 0, **overrides):
    """The family's tiny causal LM (random weights; sinks random too so that they matter)."""
    import transformers

    model_type, family_overrides, _ = FAMILIES[family]
    config = transformers.AutoConfig.for_model(model_type, **{**COMMON, **family_overrides, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.normal_()
    return model


#: families whose norms upcast with ``x.float()`` (Gemma4RMSNorm) or whose routers cast to float32 (DeepSeek-V3's
#: ``Tensor.type``; a router weight's gradient, a float32 sum over a shard's tokens, would differ by ~1e-7), run
#: with those casts kept float64 (``hf_cases.float64_internals``, reference and patched alike) so that their parity
#: holds at 1e-10
FLOAT64_INTERNALS = ("gemma4", "gemma4_kv", "deepseek_v3", "deepseek_v2", "glm4_moe_lite")


def family_case(family, fused, world, u=None, seq=None, seed=0, checkpointing=None, packed=False, **overrides):
    """One family, patched, on sequence shards == unpatched on the whole sequence (float64)."""
    if family in FLOAT64_INTERNALS:
        with hf_cases.float64_internals():
            return _family_case(family, fused, world, u, seq, seed, checkpointing, packed, **overrides)
    return _family_case(family, fused, world, u, seq, seed, checkpointing, packed, **overrides)


def _family_case(family, fused, world, u, seq, seed, checkpointing, packed, **overrides):
    group = dist.group.WORLD
    seq = seq or 6 * world
    model = build_family(family, seed=seed, **overrides)
    ref_model = copy.deepcopy(model)
    state = hf_cases.patch_model(model, group, u, fused, False, False)
    errors = {"fused_ok": float(state.fused_projections != (fused and FAMILIES[family][2]))}
    if checkpointing is not None:
        hf_cases._checkpointing(model, checkpointing)
    if packed:
        batch, cus = hf_cases.packed_batch(seed, seq, world)
        ref = hf_cases.per_document_reference(ref_model, batch, cus)
    else:
        batch = hf_cases.make_batch(seed, 2, seq)
        ref = hf_cases.reference_step(ref_model, batch)
    errors.update(hf_cases.compare(ref, hf_cases.sharded_step(model, batch, group), seq))
    return errors


def shared_kv_reentrant_case(world) -> dict[str, float]:
    """Gemma 4 under reentrant HF checkpointing: its KV-shared layers would get the producer's keys and values
    without autograd (and the producer none of their gradient): refused by name at backward, on every rank."""
    words = ("Gemma4TextAttention (layer 3) is a KV-shared layer", "Use non-reentrant checkpointing")
    try:
        family_case("gemma4", False, world, checkpointing="reentrant")
    except ValueError as err:
        return {"refused": float(not all(w in str(err) for w in words))}
    return {"refused": 1.0}


def expected_all_to_alls(model, share: bool, checkpointed: bool) -> dict[str, int]:
    """The all-to-alls one float64 forward + backward of a patched Gemma 4 runs, by what the stage plans say (each layer
    N stages in R rounds): per layer 2N in forward (queries in, outputs back) and 2N in backward (queries, outputs
    and their gradients in; dQ back); the keys and values ("kv"): re-exchanging, R in forward, R again in backward
    and dK/dV back per stage (N, float64); holding (``share_exchanged_kv``), one exchange per producing layer in
    forward and one back in backward, none per KV-shared layer.  Non-reentrant checkpointing runs every layer's
    forward again in backward (a KV-shared layer's replay takes the held K/V too)."""
    state = hf_patches.upipe_state(model)
    layouts = layer_head_layouts(model.config)
    counts = {"stages": 0, "kv": 0}
    for layer, heads in zip(model.model.layers, layouts):
        attention = layer.self_attn
        plan = state.plan_for(heads.num_heads, heads.num_kv_heads)
        n, r = plan.num_stages, len(plan.rounds)
        forwards = 2 if checkpointed else 1
        if share and attention.is_kv_shared_layer:
            kv_forward, kv_backward = 0, 0
        elif share and attention.store_full_length_kv:
            kv_forward, kv_backward = 1, 1
        else:
            kv_forward, kv_backward = r, r + n
        counts["stages"] += forwards * 2 * n + 2 * n
        counts["kv"] += forwards * kv_forward + kv_backward
    return counts


def shared_kv_exchange_case(
    world: int, share: bool, checkpointing: str | None, overlap: bool = False
) -> dict[str, float]:
    """Gemma 4 (layers 0 and 1 produce the keys and values that layers 2 and 3 share) on shards == unpatched
    (float64), and its all-to-alls over forward + backward counted (``OpCounter``) == ``expected_all_to_alls``:
    holding the exchanged K/V (the default) or re-exchanging (``overlap``: with overlap_comm).  At C = 2 with 4
    key/value heads (2 rounds, so a layer reading another round's K/V is wrong), at C = 4 with the family's 2 (each
    replicated on 2 ranks)."""
    group = dist.group.WORLD
    seq = 6 * world
    batch = hf_cases.make_batch(0, 2, seq)
    with hf_cases.float64_internals():
        model = build_family("gemma4", num_key_value_heads=4 if world == 2 else 2)
        ref = hf_cases.reference_step(copy.deepcopy(model), batch)
        hf_cases.patch_model(model, group, None, False, overlap, False, share_exchanged_kv=share)
        if checkpointing is not None:
            hf_cases._checkpointing(model, checkpointing)
        with OpCounter() as counter:
            got = hf_cases.sharded_step(model, batch, group)
    all_to_alls = sum(n for name, n in counter.collectives.items() if "alltoall" in name or "all_to_all" in name)
    expected = expected_all_to_alls(model, share, checkpointing is not None)
    return {**hf_cases.compare(ref, got, seq), "all_to_alls": float(all_to_alls != sum(expected.values()))}


def family_ring_case(family, fused, layout, u=None, **overrides):
    """The family under UPipe x Ring (C_u x R = layout) on zigzag shards == unpatched, float64."""
    cu, r = layout
    ulysses, ring = hf_cases.ring_groups(cu, r)
    world = dist.group.WORLD
    seq = 6 * cu * r
    data = hf_cases.make_batch(40, 2, seq)
    model = build_family(family, **overrides)
    ref_model = copy.deepcopy(model)
    hf_patches.apply_upipe(model, ulysses, head_chunk_size=u, fused_projections=fused, ring_group=ring)
    got = hf_cases.sharded_step(model, data, world, ring_size=r)
    return hf_cases.compare(hf_cases.reference_step(ref_model, data), got, seq)


def kwargs_dropped_packed_case(world) -> dict[str, float]:
    """StableLM with packed rows: its layers do not pass the documents' boundaries on to their attention, so the
    forward is refused by name on every rank (never attention across documents)."""
    words = ("packed documents", "decoder layer 0 (StableLmDecoderLayer)", "pass one document per row")
    try:
        family_case("stablelm", False, world, packed=True)
    except ValueError as err:
        return {"refused": float(not all(w in str(err) for w in words))}
    return {"refused": 1.0}


def _cases(world: int) -> dict[str, tuple]:
    """name -> (function, args, kwargs).  Every family fused (where it applies) and unfused at U = C (at C = 4
    once, fused where it applies); at U = H and with windows smaller than / equal to / larger than a shard of
    6 tokens and crossing shards; at C = 2 packed rows and HF checkpointing; at C = 4 a ring of 2 x 2."""
    cases: dict[str, tuple] = {}
    for family, (_, _, fusable) in FAMILIES.items():
        # C = 4 (test time): each family once, fused where it applies; C = 2 has both modes
        for fused in ((True, False) if world == 2 else (True,)) if fusable else (False,):
            cases[f"{family}_{'fused' if fused else 'unfused'}"] = (family_case, (family, fused, world), {})
    h = COMMON["num_attention_heads"]
    cases["gpt_oss_fused_U=H_W6"] = (family_case, ("gpt_oss", True, world), dict(u=h, sliding_window=6))
    cases["gpt_oss_unfused_U=H_W9"] = (family_case, ("gpt_oss", False, world), dict(u=h, sliding_window=9))
    cases["gemma3_unfused_U=H_W6"] = (family_case, ("gemma3", False, world), dict(u=h, sliding_window=6))
    cases["gemma3_fused_W13"] = (family_case, ("gemma3", True, world), dict(sliding_window=13))
    cases["qwen3_moe_fused_U=H"] = (family_case, ("qwen3_moe", True, world), dict(u=h))
    cases["granite_unfused_U=H"] = (family_case, ("granite", False, world), dict(u=h))
    cases["phi3_unfused_W5"] = (family_case, ("phi3", False, world), dict(sliding_window=5))
    # Gemma 4 at U = H; fused requested falls back to unfused (its entry's reason), still exact
    cases["gemma4_unfused_U=H"] = (family_case, ("gemma4", False, world), dict(u=h))
    cases["gemma4_kv_unfused_U=H"] = (family_case, ("gemma4_kv", False, world), dict(u=h))
    cases["deepseek_v3_unfused_U=H"] = (family_case, ("deepseek_v3", False, world), dict(u=h))
    # Gemma 4's KV-shared layers: the producers' exchanged K/V held (the default) or exchanged again, with and
    # without checkpointing: parity and the count of all-to-alls
    for share in (True, False):
        for checkpointing in (None, "non_reentrant"):
            name = f"gemma4_{'held' if share else 'reexchanged'}_kv{'_checkpointing' if checkpointing else ''}"
            cases[name] = (shared_kv_exchange_case, (world, share, checkpointing), {})
    cases["gemma4_held_kv_overlap"] = (shared_kv_exchange_case, (world, True, None), dict(overlap=True))
    cases["minicpm3_unfused_U=H"] = (family_case, ("minicpm3", False, world), dict(u=h))
    if world == 4:  # packing and checkpointing at C = 2 only
        return {**cases, **_ring_cases(h)}
    cases["gpt_oss_fused_packed"] = (family_case, ("gpt_oss", True, world), dict(packed=True))
    cases["gemma3_unfused_packed"] = (family_case, ("gemma3", False, world), dict(packed=True))
    cases["gemma4_fused_requested"] = (family_case, ("gemma4", True, world), {})
    cases["gemma4_unfused_packed"] = (family_case, ("gemma4", False, world), dict(packed=True))
    cases["gemma4_unfused_checkpointing"] = (family_case, ("gemma4", False, world), dict(checkpointing="non_reentrant"))
    cases["gemma4_reentrant_refused"] = (shared_kv_reentrant_case, (world,), {})
    cases["deepseek_v3_unfused_packed"] = (family_case, ("deepseek_v3", False, world), dict(packed=True))
    cases["stablelm_packed_refused"] = (kwargs_dropped_packed_case, (world,), {})
    cases["mixtral_fused_packed_W5"] = (family_case, ("mixtral", True, world), dict(packed=True, sliding_window=5))
    cases["gpt_oss_fused_checkpointing"] = (family_case, ("gpt_oss", True, world), dict(checkpointing="reentrant"))
    cases["gemma3_fused_checkpointing"] = (family_case, ("gemma3", True, world), dict(checkpointing="non_reentrant"))
    cases["olmo2_unfused_checkpointing"] = (family_case, ("olmo2", False, world), dict(checkpointing="reentrant"))
    return cases


def _ring_cases(h: int) -> dict[str, tuple]:
    return {
        "gpt_oss_fused_ring_2x2_W5": (family_ring_case, ("gpt_oss", True, (2, 2)), dict(sliding_window=5)),
        "gemma3_unfused_ring_2x2": (family_ring_case, ("gemma3", False, (2, 2)), {}),
        "granite_fused_ring_2x2": (family_ring_case, ("granite", True, (2, 2)), dict(u=h)),
    }


def family_matrix(rank: int, world: int) -> dict[str, dict[str, float]]:
    """Every case of ``_cases(world)``: {name: errors}."""
    logger = logging.getLogger("hf_patches")
    level = logger.level
    logger.setLevel(logging.ERROR)  # the unfused families' one warning each
    try:
        return {name: fn(*args, **kwargs) for name, (fn, args, kwargs) in _cases(world).items()}
    finally:
        logger.setLevel(level)


def num_family_cases(world: int) -> int:
    return len(_cases(world))


def _tiny(model_type: str, **overrides):
    import transformers

    config = transformers.AutoConfig.for_model(model_type, **{**COMMON, **overrides})
    return transformers.AutoModelForCausalLM.from_config(config)


def layer_kv_heads_model():
    """Gemma 4 with 12 query heads, 6 key/value heads on its sliding layers and 4 on its full ones: U = 4 over 2
    ranks (2 heads per rank and stage) fits the sliding layers' KV groups of 2, not the full layers' of 3."""
    gqa = dict(num_attention_heads=12, num_key_value_heads=6, num_global_key_value_heads=4)
    return _tiny("gemma4_text", **{**_GEMMA4, "attention_k_eq_v": True, **gqa})


def refused_models() -> dict[str, Any]:
    """case -> a builder of a tiny model ``apply_upipe`` must refuse (messages checked in test_hf_parity)."""
    import transformers

    return {
        "refuse_softcapping": lambda: _tiny("gemma2", attn_logit_softcapping=50.0),
        # a linear-attention layer type of a mixer no kind shards (the gated delta net's is registered)
        "refuse_linear_attention": lambda: _tiny(
            "minimax", layer_types=["linear_attention", "full_attention"], num_local_experts=2
        ),
        "refuse_chunked": lambda: _tiny("llama4_text", attention_chunk_size=8),
        "refuse_hybrid_ssm": lambda: _tiny("falcon_h1"),
        "refuse_encoder_decoder": lambda: transformers.T5ForConditionalGeneration(
            transformers.T5Config(d_model=32, d_ff=32, num_layers=1, num_heads=2, vocab_size=50, d_kv=16)
        ),
        "refuse_dropout_gpt2": lambda: transformers.GPT2LMHeadModel(
            transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50, attn_pdrop=0.1)
        ),
    }
