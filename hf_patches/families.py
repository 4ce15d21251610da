"""The family registry: what ds_upipe knows of each transformers model family, one entry a family.

``apply_upipe`` needs no entry to run a model: any causal decoder whose attention modules call
transformers' attention registry runs unfused UPipe, found from its modules (``architectures``). An
entry says what holds beyond that, for the families the tests build (tests/family_cases.py):

- ``attention``: its attention class; unless ``unfused`` says why not, one whose forward fused per-stage
  projections reproduce exactly (plain ``nn.Linear`` q/k/v/o, rotate-half RoPE, the registry call;
  ``architectures.fused_blocker`` checks the module against it);
- ``qk_norm``: its per-head q/k norm, (the norm's class, its kind in ``fused.NormSpec``: ``"rms"`` or
  ``"gemma"``), or None;
- ``moe``: a sparse mixture-of-experts MLP (the planner counts every expert's parameters);
- ``planner_layer``: the dense model type whose layer the planner's fake step builds for it (None: not
  planned);
- ``unfused``: why fused per-stage projections cannot reproduce its attention forward (None: they can); such a
  family runs unfused (its module's own forward, the core attention through the registry) and its entry says what
  else holds for it (its case in tests/family_cases.py runs it unfused).

Everything that asks "which family" reads the views below; none keeps a table of its own.  Adding a
family: one entry here and a case in tests/family_cases.py.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    model_type: str
    causal_lm: str
    attention: str
    qk_norm: tuple[str, str] | None = None
    moe: bool = False
    planner_layer: str | None = None
    unfused: str | None = None


#: Gemma 4: per-layer head dims (full-attention layers: global_head_dim), KV-shared layers (their keys and values are
#: the producing layer's, through the forward's shared_kv_states: architectures.SHARED_KV_KWARG), scaling 1
def latent_unfused(attention: str) -> str:
    """Why fused mode cannot reproduce a multi-head latent attention module (``config.kv_lora_rank``): fused mode
    projects a stage's K/V heads from x on the tokens' own rank and sends them to the heads' rank; MLA's K/V of every
    head are up-projected (``kv_b_proj``) from one latent a token shared by all heads (``kv_a_layernorm`` of
    ``kv_lora_rank`` numbers and one roped key of ``qk_rope_head_dim``), with values of ``v_head_dim``.  Its fused
    form would gather that latent and up-project a stage's heads on their own rank: a K/V slot filled in head
    layout, which the core's stage loop does not have (the design and its numbers: docs/hf_patches.md,
    "Multi-head latent attention").  Unfused, the module's own projections, RoPE on the rope part and softmax
    scale run, then the registry call, whose q/k/v the stage loop carries at their own head dims."""
    return (
        f"{attention} is multi-head latent attention: its K/V of every head are up-projected from one latent a token "
        "(kv_lora_rank + qk_rope_head_dim) shared by all heads; fused per-stage projections compute a stage's K/V "
        "heads from x and send them, and a fused form gathering the latent needs a K/V stage source the stage loop "
        "does not have (docs/hf_patches.md, 'Multi-head latent attention')"
    )


_GEMMA4_UNFUSED = (
    "Gemma4TextAttention's forward takes the keys and values of its KV-shared layers from another layer "
    "(shared_kv_states), RMS-normalizes values (v_norm) and may reuse the key projection as values "
    "(attention_k_eq_v): fused per-stage projections compute none of these"
)

FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        Family("llama", "LlamaForCausalLM", "LlamaAttention", planner_layer="llama"),
        Family("mistral", "MistralForCausalLM", "MistralAttention", planner_layer="mistral"),
        Family("mixtral", "MixtralForCausalLM", "MixtralAttention", moe=True, planner_layer="mistral"),
        Family("qwen2", "Qwen2ForCausalLM", "Qwen2Attention", planner_layer="qwen2"),
        Family("qwen3", "Qwen3ForCausalLM", "Qwen3Attention", ("Qwen3RMSNorm", "rms"), planner_layer="qwen3"),
        Family(
            "qwen3_moe",
            "Qwen3MoeForCausalLM",
            "Qwen3MoeAttention",
            ("Qwen3MoeRMSNorm", "rms"),
            moe=True,
            planner_layer="qwen3",
        ),
        Family("granite", "GraniteForCausalLM", "GraniteAttention"),
        Family("gemma3_text", "Gemma3ForCausalLM", "Gemma3Attention", ("Gemma3RMSNorm", "gemma")),
        # GPT-OSS: the same rotate-half RoPE on half-dim cos/sin, and its sinks (s_aux)
        Family("gpt_oss", "GptOssForCausalLM", "GptOssAttention", moe=True, planner_layer="llama"),
        Family("gemma4_text", "Gemma4ForCausalLM", "Gemma4TextAttention", unfused=_GEMMA4_UNFUSED),
        # multi-head latent attention: DeepSeek-V3 (its first_k_dense_replace layers dense, then MoE), DeepSeek-V2,
        # MiniCPM3, GLM-4.7-Flash (glm4_moe_lite); LongCat-Flash (two attention modules a layer) is refused
        *(
            Family(t, lm, attention, moe=moe, unfused=latent_unfused(attention))
            for t, lm, attention, moe in (
                ("deepseek_v3", "DeepseekV3ForCausalLM", "DeepseekV3Attention", True),
                ("deepseek_v2", "DeepseekV2ForCausalLM", "DeepseekV2Attention", True),
                ("minicpm3", "MiniCPM3ForCausalLM", "MiniCPM3Attention", False),
                ("glm4_moe_lite", "Glm4MoeLiteForCausalLM", "Glm4MoeLiteAttention", True),
            )
        ),
    )
}

#: attention class -> the q/k norm kind fused mode applies (None: no q/k norm)
FUSED_ATTENTIONS: dict[str, str | None] = {
    f.attention: None if f.qk_norm is None else f.qk_norm[1] for f in FAMILIES.values() if f.unfused is None
}
#: attention class -> why fused mode cannot reproduce it (the registered families that run unfused)
UNFUSED_ATTENTIONS: dict[str, str] = {f.attention: f.unfused for f in FAMILIES.values() if f.unfused is not None}
#: the per-head norm classes fused mode reproduces -> their kind
NORM_KINDS: dict[str, str] = dict(f.qk_norm for f in FAMILIES.values() if f.qk_norm is not None)
#: model type -> the dense model type whose layer the planner's fake step builds
PLANNER_LAYERS: dict[str, str] = {f.model_type: f.planner_layer for f in FAMILIES.values() if f.planner_layer}
#: the planned model types with a sparse MoE MLP
MOE_TYPES: tuple[str, ...] = tuple(f.model_type for f in FAMILIES.values() if f.moe and f.planner_layer)
