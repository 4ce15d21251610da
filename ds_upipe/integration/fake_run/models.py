"""The models a fake step builds: a Llama-family shape (``ModelShape``) or a transformers config
(``HFModelConfig``)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModelShape:
    """A Llama-family decoder as transformers builds it: ``model_type`` and the config keys that set sizes."""

    model_type: str  # llama, mistral, qwen2, qwen3
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    attention_bias: bool = False

    def config(self, layers: int = 1) -> Any:
        from transformers import AutoConfig

        return AutoConfig.for_model(
            self.model_type,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            vocab_size=self.vocab_size,
            attention_bias=self.attention_bias,
            num_hidden_layers=layers,
            max_position_embeddings=1 << 26,
            tie_word_embeddings=False,
            use_cache=False,
            attn_implementation="sdpa",
        )


#: model types whose config forces the last layer to full attention (Gemma 4's ``__post_init__``)
_LAST_LAYER_FULL = ("gemma4_text",)


@dataclass(frozen=True)
class HFModelConfig:
    """A real model's transformers (text) config, as JSON: the fake run builds its decoder layer from
    it (any architecture transformers knows, not only ``ModelShape``'s Llama family), so ``"auto"``
    measures the attention modules the model has (q/k norms, biases, each kind of layer's window ...)."""

    json_text: str

    @classmethod
    def of(cls, config: Any) -> HFModelConfig | None:
        """From a ``PretrainedConfig`` (its text config: a multimodal model's language model); None for a
        model type transformers cannot build from its name (remote code)."""
        from transformers import CONFIG_MAPPING

        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        values = text.to_dict()
        if values.get("model_type") not in CONFIG_MAPPING:  # what ``config()`` rebuilds it from
            return None
        # not part of the architecture: where the weights came from, remote code, quantization, dtype
        for key in ("_name_or_path", "architectures", "auto_map", "quantization_config", "dtype", "torch_dtype"):
            values.pop(key, None)
        return cls(json.dumps(values, sort_keys=True, default=str))

    @property
    def hidden_size(self) -> int:
        return int(json.loads(self.json_text)["hidden_size"])

    def layer_kinds(self) -> list[HFModelConfig]:
        """One config per distinct entry of ``layer_types`` (e.g. sliding and full attention), each
        whose first layer is of that kind, in order of first appearance; [self] without per-layer
        types.  ``"auto"`` measures each and keeps the largest, since every layer runs at the chosen U."""
        values = json.loads(self.json_text)
        kinds = values.get("layer_types")
        if not isinstance(kinds, list) or len(set(kinds)) <= 1:
            return [self]
        overrides = values.get("per_layer_config")  # a heterogeneous config's (Gemma 4's head dims), by layer
        configs = []
        for kind in dict.fromkeys(kinds):
            first = kinds.index(kind)
            values["layer_types"] = [*kinds[first:], *kinds[:first]]  # same length, ``kind`` first
            if isinstance(overrides, dict):  # rotated with the layers: each layer keeps its own settings
                values["per_layer_config"] = {str((int(i) - first) % len(kinds)): v for i, v in overrides.items()}
            configs.append(HFModelConfig(json.dumps(values, sort_keys=True, default=str)))
        return configs

    def config(self, layers: int = 1) -> Any:
        from transformers import AutoConfig

        values = json.loads(self.json_text)
        model_type = values.pop("model_type")
        if isinstance(values.get("layer_types"), list):  # per-layer attention types: those of the first layers
            values["layer_types"] = values["layer_types"][:layers]
        if isinstance(values.get("per_layer_config"), dict):  # per-layer settings: those of the first layers
            values["per_layer_config"] = {i: v for i, v in values["per_layer_config"].items() if int(i) < layers}
        if values.get("num_kv_shared_layers"):  # the layers built compute their own keys and values (a KV-shared
            values["num_kv_shared_layers"] = 0  # layer's UPipe call runs on the same shapes)
        values.update(num_hidden_layers=layers, use_cache=False, attn_implementation="sdpa")
        kinds = values.get("layer_types")
        if model_type in _LAST_LAYER_FULL and isinstance(kinds, list) and kinds[-1] != "full_attention":
            # its config turns a last sliding layer into a full one: one full layer more keeps the measured ones
            values.update(layer_types=[*kinds, "full_attention"], num_hidden_layers=layers + 1)
        return AutoConfig.for_model(model_type, **values)
