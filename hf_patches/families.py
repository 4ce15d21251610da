"""The family registry: what ds_upipe knows of each transformers model family, one entry a family.

``apply_upipe`` needs no entry to run a model: any causal decoder whose attention modules call
transformers' attention registry runs unfused UPipe, found from its modules (``architectures``). An
entry says what holds beyond that, for the families the tests build (tests/family_cases.py):

- ``attention``: the attention class whose forward fused per-stage projections reproduce exactly (plain
  ``nn.Linear`` q/k/v/o, rotate-half RoPE, the registry call; ``architectures.fused_blocker`` checks the
  module against it);
- ``qk_norm``: its per-head q/k norm, (the norm's class, its kind in ``fused.NormSpec``: ``"rms"`` or
  ``"gemma"``), or None;
- ``moe``: a sparse mixture-of-experts MLP (the planner counts every expert's parameters);
- ``planner_layer``: the dense model type whose layer the planner's fake step builds for it (None: not
  planned);
- ``latent``: multi-head latent attention (``config.kv_lora_rank``): low-rank q/kv projections whose
  up-projection gives values of ``v_head_dim``, narrower than the queries and keys (``qk_nope_head_dim +
  qk_rope_head_dim``).  It runs unfused: the module's own projections, RoPE on the rope part and softmax
  scale, then the registry call, whose q/k/v the stage loop carries at their own head dims (the flash
  kernels get the value zero-padded to the q/k head dim and the output sliced back).

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
    latent: bool = False


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
        # multi-head latent attention (unfused): DeepSeek-V3 (its first_k_dense_replace layers dense, then MoE),
        # DeepSeek-V2, MiniCPM3, GLM-4.7-Flash (glm4_moe_lite); LongCat-Flash (two attention modules a layer) is refused
        Family("deepseek_v3", "DeepseekV3ForCausalLM", "DeepseekV3Attention", moe=True, latent=True),
        Family("deepseek_v2", "DeepseekV2ForCausalLM", "DeepseekV2Attention", moe=True, latent=True),
        Family("minicpm3", "MiniCPM3ForCausalLM", "MiniCPM3Attention", latent=True),
        Family("glm4_moe_lite", "Glm4MoeLiteForCausalLM", "Glm4MoeLiteAttention", moe=True, latent=True),
    )
}

#: attention class -> the q/k norm kind fused mode applies (None: no q/k norm)
FUSED_ATTENTIONS: dict[str, str | None] = {
    f.attention: None if f.qk_norm is None else f.qk_norm[1] for f in FAMILIES.values() if not f.latent
}
#: the multi-head latent attention classes (unfused, ``Family.latent``)
LATENT_ATTENTIONS: tuple[str, ...] = tuple(f.attention for f in FAMILIES.values() if f.latent)
#: the per-head norm classes fused mode reproduces -> their kind
NORM_KINDS: dict[str, str] = dict(f.qk_norm for f in FAMILIES.values() if f.qk_norm is not None)
#: model type -> the dense model type whose layer the planner's fake step builds
PLANNER_LAYERS: dict[str, str] = {f.model_type: f.planner_layer for f in FAMILIES.values() if f.planner_layer}
#: the planned model types with a sparse MoE MLP
MOE_TYPES: tuple[str, ...] = tuple(f.model_type for f in FAMILIES.values() if f.moe and f.planner_layer)
