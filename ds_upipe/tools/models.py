"""The tiny HuggingFace model configs of the examples, the bench and the tests: one function.

No download: a config built in memory, small enough for CPU runs of several ranks.  Every caller
states only what it changes (heads, sizes, layers, vocabulary).  Hybrid architectures (sequence mixers
that are not softmax attention, ``hf_patches.mixers``) get a short layer pattern mixing their mixer
layers with softmax attention, with mixer heads that split over 2 and 4 ranks.
"""

from __future__ import annotations

from typing import Any

#: the defaults every tiny model shares: GQA (4 query heads, 2 KV heads), two layers, sdpa attention
TINY_DEFAULTS: dict[str, Any] = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    attn_implementation="sdpa",
)

#: gated delta net layers (Qwen3.5, Qwen3-Next, OLMo hybrid): 2 key heads, 4 value heads of 16
_GATED_DELTA: dict[str, Any] = dict(
    layer_types=["linear_attention", "full_attention"],
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
)
#: a small sparse MoE block (Qwen3-Next's MLPs)
_MOE: dict[str, Any] = dict(
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32
)

#: arch -> (transformers config class, causal LM class, the arch's own defaults over TINY_DEFAULTS)
ARCHS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    # hybrids: a mixer layer, then softmax attention
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", _GATED_DELTA),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", {**_GATED_DELTA, **_MOE, "output_router_logits": False}),
    "olmo_hybrid": (
        "OlmoHybridConfig",
        "OlmoHybridForCausalLM",
        {**_GATED_DELTA, "pad_token_id": None, "eos_token_id": None},
    ),
    # Mamba-2, attention, then an MLP-only layer; 4 SSM heads in 2 B/C groups, chunks of 8 (a shard spans several)
    "nemotron_h": (
        "NemotronHConfig",
        "NemotronHForCausalLM",
        dict(
            num_hidden_layers=3,
            layers_block_type=["linear_attention", "full_attention", "mlp"],
            head_dim=16,
            mamba_num_heads=4,
            mamba_head_dim=16,
            n_groups=2,
            ssm_state_size=8,
            chunk_size=8,
        ),
    ),
    # short gated convs around an attention layer
    "lfm2": (
        "Lfm2Config",
        "Lfm2ForCausalLM",
        dict(
            num_hidden_layers=3,
            layer_types=["conv", "full_attention", "conv"],
            conv_L_cache=3,
            block_auto_adjust_ff_dim=False,
        ),
    ),
}


def tiny_config(arch: str = "llama", **overrides: Any) -> Any:
    """A transformers config of ``arch`` (a key of ``ARCHS``): ``TINY_DEFAULTS``, then the arch's own
    defaults, updated by ``overrides``."""
    import transformers  # lazily: heavy to import

    if arch not in ARCHS:
        raise ValueError(f"arch={arch!r}: choose one of {list(ARCHS)}")
    config_class, _, defaults = ARCHS[arch]
    return getattr(transformers, config_class)(**{**TINY_DEFAULTS, **defaults, **overrides})


def tiny_causal_lm(arch: str = "llama", **overrides: Any) -> Any:
    """The causal LM of ``arch`` built from ``tiny_config(arch, **overrides)`` (weights from the torch seed)."""
    import transformers

    config = tiny_config(arch, **overrides)
    return getattr(transformers, ARCHS[arch][1])(config)
