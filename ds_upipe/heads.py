"""The head layout of a model and which group sizes and head chunk sizes it admits.

``HeadLayout.from_config`` is the one place that reads head counts from a transformers config (an
object or a config.json dict): ``head_dim`` falls back to ``hidden_size // num_attention_heads`` and a
missing ``num_key_value_heads`` means plain multi-head attention.  The validity rules themselves live
in ``ds_upipe.schedule`` (the stage plan is built from them); the methods here only call them, so
the config validation, the engine, ``hf_patches.apply_upipe``, the planner and the bench agree.
Pure Python: importing this module loads no torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

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
        """From a transformers config object or a config.json dict; a multimodal config's text part."""
        if isinstance(config, Mapping):
            config = config.get("text_config", config)
        elif hasattr(config, "get_text_config"):
            config = config.get_text_config()
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
        return cls(
            num_heads=num_heads, num_kv_heads=_field(config, "num_key_value_heads") or num_heads, head_dim=head_dim
        )

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
