"""The head layout of a model and which group sizes and head chunk sizes it admits.

``layer_head_layouts`` is the one place that reads head counts from a transformers config (an object or a
config.json dict), layer by layer: ``head_dim`` falls back to ``hidden_size // num_attention_heads``, a
missing ``num_key_value_heads`` means plain multi-head attention, and a heterogeneous config (transformers'
``per_layer_config``: Gemma 4's full-attention layers have their own head dim and may have their own key/value
heads) is read per layer through transformers' per-layer view (its global ``head_dim`` raises there; a
config.json dict is read as it stands: the planner, its one reader of dicts, does not plan Gemma 4).
``HeadLayout.from_config`` is the model's first layer's layout; ``head_counts`` its distinct (H, Hkv), each run
with its own stage plan, and ``per_head_counts`` the one rule that checks every one of them and names the layer.
The validity rules themselves live in ``ds_upipe.schedule`` (the stage plan is built from them); the methods
here only call them, so the config validation, the engine, ``hf_patches.apply_upipe``, the planner and the
bench agree.
Pure Python: importing this module loads no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from .schedule import check_head_counts, resolve_head_chunk_size, valid_group_sizes, valid_head_chunk_sizes


def _field(config: Any, name: str) -> Any:
    if isinstance(config, Mapping):
        return config.get(name)
    return getattr(config, name, None)


@dataclass(frozen=True)
class HeadLayout:
    """Attention heads of one model: H query heads, Hkv key/value heads, each of ``head_dim``."""

    num_heads: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def from_config(cls, config: Any) -> HeadLayout:
        """The model's first attention layer's head counts (a config object or a config.json dict; a multimodal
        config's text part) with the largest head dim of its layers (what bounds a stage's buffers; the plan does
        not depend on it).  Layers whose head counts differ (Gemma 4's num_global_key_value_heads with
        attention_k_eq_v) run their own stage plans: ``head_counts`` lists them, ``per_head_counts`` checks each."""
        layers = layer_head_layouts(config)
        return cls(layers[0].num_heads, layers[0].num_kv_heads, max(h.head_dim for h in layers))

    def check(self, group_size: int) -> None:
        """ValueError unless the heads can be split over a sequence-parallel group of ``group_size``."""
        check_head_counts(self.num_heads, self.num_kv_heads, group_size)

    def valid_group_sizes(self) -> list[int]:
        """Every sequence-parallel size these heads can be split over."""
        return valid_group_sizes(self.num_heads, self.num_kv_heads)

    def valid_head_chunk_sizes(self, group_size: int) -> list[int]:
        """Every accepted U for this group size, smallest (least memory) first."""
        return valid_head_chunk_sizes(self.num_heads, self.num_kv_heads, group_size)

    def resolve_head_chunk_size(self, group_size: int, head_chunk_size: int | None) -> int:
        """U itself (validated), or C for None."""
        return resolve_head_chunk_size(self.num_heads, self.num_kv_heads, group_size, head_chunk_size)


def _text_config(config: Any) -> Any:
    if isinstance(config, Mapping):
        return config.get("text_config", config)
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _layout(config: Any) -> HeadLayout:
    num_heads = _field(config, "num_attention_heads")
    hidden = _field(config, "hidden_size")
    if not num_heads or not hidden:
        raise ValueError(
            f"config lacks num_attention_heads/hidden_size (got {num_heads}, {hidden}): "
            "not a Llama-family transformers config"
        )
    head_dim = _field(config, "head_dim") or hidden // num_heads
    if _field(config, "kv_lora_rank"):  # latent attention: config.head_dim is the rope part of its q/k heads
        head_dim = _field(config, "qk_nope_head_dim") + _field(config, "qk_rope_head_dim")
    return HeadLayout(
        num_heads=num_heads, num_kv_heads=_field(config, "num_key_value_heads") or num_heads, head_dim=head_dim
    )


def layer_head_layouts(config: Any) -> list[HeadLayout]:
    """The head layout of each layer (one entry for a homogeneous config): a heterogeneous transformers config
    (``is_heterogeneous``) is read through its own per-layer configs (``config.per_layer_config[i]``, what each
    attention module reads), whose global per-layer attributes raise ``AmbiguousGlobalPerLayerAttributeError``."""
    config = _text_config(config)
    if not getattr(config, "is_heterogeneous", False):
        return [_layout(config)]
    return [_layout(layer) for layer in config.per_layer_config]


_T = TypeVar("_T")


def head_counts(config: Any) -> dict[tuple[int, int], int]:
    """The model's distinct (query heads, key/value heads) -> the first layer with them: one entry unless its
    layers differ (Gemma 4's full-attention layers with num_global_key_value_heads); each runs its own plan."""
    counts: dict[tuple[int, int], int] = {}
    for i, h in enumerate(layer_head_layouts(config)):
        counts.setdefault((h.num_heads, h.num_kv_heads), i)
    return counts


def per_head_counts(
    counts: Mapping[tuple[int, int], int], check: Callable[[int, int], _T]
) -> dict[tuple[int, int], _T]:
    """``check(H, Hkv)`` for each of a model's head counts (``head_counts``): where its layers differ, a
    ValueError names the first layer whose heads fail (pure: every rank raises it before any collective)."""
    out: dict[tuple[int, int], _T] = {}
    for (h, kv), layer in counts.items():
        try:
            out[(h, kv)] = check(h, kv)
        except ValueError as err:
            if len(counts) == 1:
                raise
            raise ValueError(
                f"decoder layer {layer} ({h} query and {kv} key/value heads; the model's attention layers differ "
                f"in head counts, each runs its own stage plan at the one U): {err}"
            ) from None
    return out
