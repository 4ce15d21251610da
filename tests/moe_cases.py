"""Tiny sparse mixture-of-experts models (Qwen3-MoE, Mixtral, GPT-OSS) for the tiled MLP's parity
tests (tests/test_moe_tiling.py) and the Trainer launch (examples/hf_trainer_moe.py)."""

from __future__ import annotations

import torch

#: family -> (config class, causal LM class, base model class) names in transformers
MOE_FAMILIES = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", "Qwen3MoeModel"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", "MixtralModel"),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", "GptOssModel"),
}
_COMMON = dict(
    vocab_size=101,
    hidden_size=32,
    intermediate_size=24,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    attn_implementation="eager",
    # transformers' default, grouped_mm, takes no float64; "eager" is its per-expert loop
    experts_implementation="eager",
)
_FAMILY = {
    "qwen3_moe": dict(
        num_experts=6,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    ),
    "mixtral": dict(num_local_experts=6, num_experts_per_tok=2, router_jitter_noise=0.0),
    # GPT-OSS: alternating sliding / full layers, sinks, biased experts with clamped SwiGLU
    # (max_position_embeddings: its YaRN RoPE's 4,096 x 32, as the real model)
    "gpt_oss": dict(
        num_local_experts=6,
        num_experts_per_tok=2,
        sliding_window=4,
        intermediate_size=16,
        max_position_embeddings=131072,
    ),
}


def make_moe_config(family: str, **overrides):
    import transformers

    options = {**_COMMON, **_FAMILY[family], "router_aux_loss_coef": 0.25, **overrides}
    attn = options.pop("attn_implementation")
    config = getattr(transformers, MOE_FAMILIES[family][0])(**options)
    config._attn_implementation = attn
    return config


def build_moe_model(family: str, dtype=torch.float64, seed: int = 0, base: bool = False, **overrides):
    """A tiny MoE model with random (not zero) router weights, so that routing varies per token."""
    import transformers

    config = make_moe_config(family, **overrides)
    torch.manual_seed(seed)
    model = getattr(transformers, MOE_FAMILIES[family][2 if base else 1])(config).to(dtype)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "router" in name or ".gate." in name or name.endswith("sinks") or "expert" in name:
                param.normal_(0.0, 0.5 if ("router" in name or ".gate." in name) else 0.1)
    return model


def save_moe_checkpoint(family: str, path, seed: int = 1):
    """A tiny float32 MoE checkpoint (save_pretrained) with transformers' default experts implementation
    (grouped_mm), for ``examples/finetune_trainer.py --model PATH``."""
    model = build_moe_model(family, torch.float32, seed=seed, experts_implementation=None)
    model.save_pretrained(path)
    return path
