"""The tiny HuggingFace model configs of the examples, the bench and the tests: one function.

No download: a config built in memory, small enough for CPU runs of several ranks.  Every caller
states only what it changes (heads, sizes, layers, vocabulary).
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


def tiny_config(arch: str = "llama", **overrides: Any) -> Any:
    """A transformers config of ``arch`` (llama, mistral, qwen2, qwen3): ``TINY_DEFAULTS`` updated by
    ``overrides``."""
    import transformers  # lazily: heavy to import

    classes = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
    }
    if arch not in classes:
        raise ValueError(f"arch={arch!r}: choose one of {list(classes)}")
    return classes[arch](**{**TINY_DEFAULTS, **overrides})
