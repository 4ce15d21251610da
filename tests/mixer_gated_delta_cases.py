"""Rank-side bodies of tests/test_mixer_gated_delta.py: gated delta net models (Qwen3.5 dense and MoE,
Qwen3-Next, OLMo hybrid) through apply_upipe on sequence shards == the unpatched model on the whole
sequence in one process (each rank runs the reference itself), float64: logits, loss, every gradient."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

import hf_patches
from hf_patches.mixers import gated_delta
from tests import mixer_bf16
from tests.hf_cases import (
    make_batch,
    packed_batch,
    per_document_reference,
    reference_step,
    relative_error,
    sharded_step,
)

TOLERANCE = 1e-10
#: RMSNorms that reduce their weight's gradient over the tokens in float32 (``1 + weight.float()``) even in a
#: float64 model: their gradients summed over shards match to float32 rounding only
FLOAT32_GRAD_NORMS = ("Qwen3_5RMSNorm", "Qwen3_5MoeRMSNorm", "Qwen3NextRMSNorm")
FLOAT32_TOLERANCE = 1e-6

#: tiny hybrid configs: one gated delta layer, one softmax attention layer; H_v = 8, H_k = 4, K = V = 8
_COMMON = dict(
    vocab_size=101,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    layer_types=["linear_attention", "full_attention"],
    linear_num_key_heads=4,
    linear_num_value_heads=8,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    initializer_range=0.1,
    use_cache=False,
)
# transformers' default experts implementation, grouped_mm, takes no float64; "eager" is its per-expert loop
_MOE = dict(
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=16,
    experts_implementation="eager",
)
FAMILIES = {
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", {}),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", _MOE),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", {**_MOE, "output_router_logits": False}),
    "olmo_hybrid": ("OlmoHybridConfig", "OlmoHybridForCausalLM", {"pad_token_id": None, "eos_token_id": None}),
}


def build_model(family: str, seed: int = 0, **overrides) -> torch.nn.Module:
    import transformers

    config_name, model_name, extra = FAMILIES[family]
    config = getattr(transformers, config_name)(**{**_COMMON, **extra, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).to(torch.float64)
    with torch.no_grad():  # away from the init values (dt_bias ones, norm weights ones): per-head values differ
        for name, p in model.named_parameters():
            if name.endswith(("dt_bias", "A_log", "norm.weight")):
                p.add_(0.3 * torch.randn_like(p))
    return model


def _float32_grads(model: torch.nn.Module, a_log: bool) -> set[str]:
    names = {f"{name}.weight" for name, m in model.named_modules() if type(m).__name__ in FLOAT32_GRAD_NORMS}
    return names | ({n for n, _ in model.named_parameters() if n.endswith(".A_log")} if a_log else set())


def compare(model: torch.nn.Module, ref: tuple, got: tuple, seq: int, a_log_f32: bool = False) -> dict[str, float]:
    """Relative errors: logits, loss, every gradient (``grads``; ``grads_f32``: FLOAT32_GRAD_NORMS' weights
    and, with ``a_log_f32``, A_log: the module's ``A_log.float().exp()`` backward runs in float32 once per
    forward, and the per-document reference runs one forward a document), and a flag for a gradient
    missing on either side; each against ``tolerance_of`` its key."""
    (r_logits, r_loss, r_grads), (g_logits, g_loss, g_grads) = ref, got
    f32 = _float32_grads(model, a_log_f32)
    errors = {"logits": relative_error(g_logits[:, :seq], r_logits), "loss": relative_error(g_loss, r_loss)}
    errors["grad_names"] = float(set(r_grads) != set(g_grads) or not any("A_log" in n for n in r_grads))
    errors["grads"] = max(relative_error(g_grads[n], r_grads[n]) for n in r_grads if n not in f32)
    errors["grads_f32"] = max((relative_error(g_grads[n], r_grads[n]) for n in r_grads if n in f32), default=0.0)
    return errors


def tolerance_of(key: str) -> float:
    return FLOAT32_TOLERANCE if key == "grads_f32" else TOLERANCE


def parity_case(family: str, u: int | None, seed: int = 0, seq: int = 16, checkpointing: bool = False, **overrides):
    """The model on shards (mixer_head_chunk_size=u) == the unpatched model on the whole sequence."""
    model = build_model(family, seed, **overrides)
    ref_model = copy.deepcopy(model)
    if checkpointing:
        for m in (model, ref_model):
            m.gradient_checkpointing_enable()
            m.train()
    hf_patches.apply_upipe(model, None, mixer_head_chunk_size=u)
    data = make_batch(seed, 2, seq)
    return compare(ref_model, reference_step(ref_model, data), sharded_step(model, data, dist.group.WORLD), seq)


def packed_case(family: str, u: int | None, world: int, seed: int = 0, rows: int = 2) -> dict[str, float]:
    """Packed rows (position_ids restart at document starts) == every document alone in one process."""
    seq = 8 * world
    batch, cus = packed_batch(seed, seq, world, rows)
    model = build_model(family, seed)
    ref_model = copy.deepcopy(model)
    hf_patches.apply_upipe(model, None, mixer_head_chunk_size=u)
    reference = per_document_reference(ref_model, batch, cus)
    return compare(ref_model, reference, sharded_step(model, batch, dist.group.WORLD), seq, a_log_f32=True)


def mrope_case(world: int, rows: int) -> dict[str, float]:
    """Qwen3.5's multimodal RoPE positions of a text batch, [3, b, s] (equal rows) or [4, b, s] (text positions
    first), on a packed row: the documents come from the text positions, and every document alone in one
    process is the reference (as with [b, s])."""
    from hf_patches import gather_sequence, sequence_parallel_loss, shard_batch
    from tests.hf_cases import summed_grads

    group = dist.group.WORLD
    seq = 8 * world
    batch, cus = packed_batch(0, seq, world, 1)
    model = build_model("qwen3_5")
    ref_model = copy.deepcopy(model)
    reference = per_document_reference(ref_model, batch, cus)
    hf_patches.apply_upipe(model, None)
    shard = shard_batch(batch, group)
    positions = shard["position_ids"][None].expand(rows, *shard["position_ids"].shape)
    out = model(input_ids=shard["input_ids"], position_ids=positions)
    loss = sequence_parallel_loss(out.logits, shard["shift_labels"], group, grad_reduction="sum")
    loss.backward()
    got = (gather_sequence(out.logits.detach(), group), loss.detach(), summed_grads(model, group))
    return compare(ref_model, reference, got, seq, a_log_f32=True)


def vision_positions_refused(world: int) -> str:
    """[3, b, s] positions whose rows differ (vision tokens without the text positions): refused on every rank."""
    group = dist.group.WORLD
    model = build_model("qwen3_5")
    hf_patches.apply_upipe(model, None)
    shard = hf_patches.shard_batch(make_batch(0, 1, 8 * world), group)
    positions = shard["position_ids"][None].repeat(3, 1, 1)
    positions[1] += 1
    try:
        model(input_ids=shard["input_ids"], position_ids=positions)
    except ValueError as err:
        return str(err)
    return "not refused"


def refusals(world: int) -> dict[str, str]:
    """apply_upipe's messages for U not a multiple of C and U not dividing H_v (before any collective)."""
    messages = {}
    for name, u in (("not_multiple", world + 1), ("not_dividing", 3 * world)):
        try:
            hf_patches.apply_upipe(build_model("qwen3_5"), None, mixer_head_chunk_size=u)
            messages[name] = ""
        except ValueError as error:
            messages[name] = str(error)
    return messages


def cases(world: int) -> dict[str, tuple]:
    """name -> (family, U, keyword arguments) of the spawn of ``world`` ranks."""
    h = _COMMON["linear_num_value_heads"]
    found = {f"{family}_u=C": (family, None, {}) for family in FAMILIES}
    found |= {f"{family}_u=H": (family, h, {"seed": 1}) for family in FAMILIES}
    if world == 4:  # fewer key heads than ranks: q/k replicated; Qwen3-Next's interleaved layout too
        found["qwen3_5_kv2_u=C"] = ("qwen3_5", None, {"linear_num_key_heads": 2})
        found["qwen3_next_kv2_u=H"] = ("qwen3_next", h, {"linear_num_key_heads": 2, "seed": 2})
    else:  # value groups of 3 straddling ranks (H_v = 12, H_k = 4, u = 2): a key copy per value head
        found["qwen3_next_groups_of_3_u=4"] = ("qwen3_next", 4, {"linear_num_value_heads": 12, "seed": 3})
        found["olmo_hybrid_groups_of_3_u=C"] = ("olmo_hybrid", None, {"linear_num_value_heads": 12, "seed": 4})
    found["qwen3_5_checkpointing_u=C"] = ("qwen3_5", None, {"checkpointing": True, "seed": 5})
    return found


def bf16_case() -> dict[str, dict[str, float]]:
    """Qwen3.5's gated delta net layer in bf16 under SP (U=C and U=all value heads) against the unpatched layer
    and its own spread (tests/mixer_bf16.py)."""
    layer = build_model("qwen3_5").to(torch.bfloat16).model.layers[0].linear_attn
    us = {"u=C": None, "u=H": _COMMON["linear_num_value_heads"]}
    return mixer_bf16.bf16_spread(layer, gated_delta.sharded_forward, us, seq=32)


def spawn_body(rank: int, world: int) -> dict:
    """Every parity case, the packed rows (Qwen3.5 U=C, Qwen3-Next U=H) and the refusals of one spawn; at C=2
    the bf16 layer case."""
    results = {name: parity_case(family, u, **kw) for name, (family, u, kw) in cases(world).items()}
    h = _COMMON["linear_num_value_heads"]
    results["packed_qwen3_5_u=C"] = packed_case("qwen3_5", None, world)
    results["packed_qwen3_next_u=H"] = packed_case("qwen3_next", h, world, seed=1)
    for rows in (3, 4):
        results[f"packed_qwen3_5_mrope_{rows}_rows"] = mrope_case(world, rows)
    messages = {**refusals(world), "vision_positions": vision_positions_refused(world)}
    return {"parity": results, "refusals": messages, "bf16": bf16_case() if world == 2 else None}
