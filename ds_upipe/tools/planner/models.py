"""The model catalogue: a model's dimensions (``ModelDims``), the presets and a config.json reader."""

from __future__ import annotations

import functools
import json
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hf_patches.families import MOE_TYPES, PLANNER_LAYERS

from ...heads import HeadLayout

if TYPE_CHECKING:
    pass

# -- model dimensions --------------------------------------------------------------------------


#: transformers model types the planner reads -> the dense stand-in its fake run builds (see ModelDims): the
#: family registry's view (hf_patches.families)
MODEL_TYPES = PLANNER_LAYERS


#: the text decoders of vision-language models (their config.json's ``text_config``) -> the planned model type whose
#: layer they are: Qwen2-VL's and Qwen2.5-VL's text layer is Qwen2's (q/k/v biases; mrope changes the positions,
#: not the tensors), Qwen3-VL's is Qwen3's (q/k norms); LLaVA's and Mistral 3's text configs are Llama / Mistral /
#: Qwen2 ones already
VISION_LANGUAGE_TEXT_TYPES = {"qwen2_vl_text": "qwen2", "qwen2_5_vl_text": "qwen2", "qwen3_vl_text": "qwen3"}
#: (Qwen3.5's text model is a hybrid the planner runs as itself: ``HYBRID_TYPES``)

#: a hybrid's layer kinds, by transformers' ``layer_types`` names: softmax attention, a sequence mixer (transformers 5
#: names gated delta nets and Mamba-2 layers both "linear_attention"), an MLP-only block (Nemotron-H)
ATTENTION_LAYER, MIXER_LAYER, MLP_LAYER = "full_attention", "linear_attention", "mlp"
#: hybrid model types the planner builds (transformers' classes) -> the type its fake run builds (the dense stand-in
#: of an MoE family: Qwen3.5-MoE's mixer and attention are Qwen3.5's; Qwen3-Next keeps its own with dense MLPs)
HYBRID_TYPES = {
    "qwen3_5_text": "qwen3_5_text",
    "qwen3_5_moe_text": "qwen3_5_text",
    "qwen3_next": "qwen3_next",
    "nemotron_h": "nemotron_h",
}


@dataclass(frozen=True)
class MixerDims:
    """A hybrid's sequence mixer (``hf_patches.mixers`` kind): ``num_heads`` is what its U counts (gated delta: value
    heads; Mamba-2: SSM heads), ``num_groups`` what they share (key heads; B/C groups)."""

    kind: str  # "gated_delta" | "mamba2"
    num_heads: int
    num_groups: int
    head_dim: int  # value head dim / SSM head dim P
    key_head_dim: int = 0  # gated delta
    state_size: int = 0  # Mamba-2 N
    conv_kernel: int = 4
    chunk_size: int = 0  # Mamba-2 scan chunk

    def config_values(self) -> dict[str, int]:
        """This mixer's keys in its family's transformers config (``MIXER_CONFIG_KEYS``)."""
        return {key: getattr(self, name) for name, key in MIXER_CONFIG_KEYS[self.kind].items()}

    @staticmethod
    def from_config(kind: str, config: Any) -> MixerDims:
        """The mixer of a transformers config (``MIXER_CONFIG_KEYS``, the inverse of ``config_values``)."""
        return MixerDims(kind, **{name: getattr(config, key) for name, key in MIXER_CONFIG_KEYS[kind].items()})

    def __post_init__(self) -> None:
        if self.kind not in ("gated_delta", "mamba2"):
            raise ValueError(f"mixer kind={self.kind!r}: the planner runs 'gated_delta' and 'mamba2'")
        if self.num_heads < 1 or self.num_groups < 1 or self.num_heads % self.num_groups:
            raise ValueError(
                f"mixer num_heads={self.num_heads} must be a positive multiple of num_groups={self.num_groups}"
            )


#: per mixer kind, ``MixerDims`` field -> the transformers config key holding it (Nemotron-H's Mamba-2; the gated
#: delta net of Qwen3.5 / Qwen3-Next): the one map the planner reads a config.json with and writes its fake runs' with
MIXER_CONFIG_KEYS: dict[str, dict[str, str]] = {
    "mamba2": dict(
        num_heads="mamba_num_heads",
        num_groups="n_groups",
        head_dim="mamba_head_dim",
        state_size="ssm_state_size",
        conv_kernel="conv_kernel",
        chunk_size="chunk_size",
    ),
    "gated_delta": dict(
        num_heads="linear_num_value_heads",
        num_groups="linear_num_key_heads",
        head_dim="linear_value_head_dim",
        key_head_dim="linear_key_head_dim",
        conv_kernel="linear_conv_kernel_dim",
    ),
}


@dataclass(frozen=True)
class ModelDims:
    """What the planner needs to know about a Llama-family decoder, dense or sparse MoE.

    An MoE model (``num_experts`` > 0: Qwen3-MoE, Mixtral, GPT-OSS) is counted with all its experts in
    the parameters (model states, ZeRO-3's gathered block), and its fake run builds the dense layer of
    ``MODEL_TYPES`` whose MLP has ``mlp_stand_in_intermediate``: the activations one token makes in its
    top-k experts (the sparse block's routing is data dependent, which fake tensors cannot run)."""

    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    vocab_size: int
    tie_word_embeddings: bool = False
    qk_norm: bool = False  # Qwen3: per-head RMSNorm on q and k
    attention_bias: bool = False  # Qwen2: q/k/v biases
    model_type: str = "llama"
    #: sparse MoE MLP: experts per layer (0: dense), experts per token (top-k); ``intermediate_size`` is
    #: then each expert's
    num_experts: int = 0
    experts_per_token: int = 0
    output_bias: bool = False  # GPT-OSS: o_proj bias too
    expert_bias: bool = False  # GPT-OSS: router and expert biases
    attention_sinks: bool = False  # GPT-OSS: one sink logit per head
    #: sliding-window layers (GPT-OSS: every other layer, 128 tokens): planned as full causal attention
    sliding_window: int = 0
    #: a hybrid (``HYBRID_TYPES``): each layer's kind (``ATTENTION_LAYER``, ``MIXER_LAYER``, ``MLP_LAYER``), its mixer,
    #: an MoE's shared expert width; empty for a Llama-family model (every layer attention + MLP)
    layer_types: tuple[str, ...] = ()
    mixer: MixerDims | None = None
    shared_expert_intermediate: int = 0
    #: a vision-language model (its config.json's ``model_type``, e.g. "qwen2_5_vl"; "" for a text model): the
    #: planned layers are its text model's; ``vision_params``: its vision tower's and projector's parameters
    #: (counted on transformers' own modules, ``_vision_language_dims``), in the model states
    vision_model_type: str = ""
    vision_params: int = 0

    def __post_init__(self) -> None:
        for name in ("num_heads", "num_kv_heads", "head_dim", "hidden_size", "intermediate_size", "num_layers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")
        if self.model_type not in (HYBRID_TYPES if self.layer_types else MODEL_TYPES):
            known = ", ".join([*MODEL_TYPES, *HYBRID_TYPES])
            raise ValueError(
                f"model_type={self.model_type!r} (layer_types={bool(self.layer_types)}): the planner runs {known}"
            )
        if self.layer_types:
            if len(self.layer_types) != self.num_layers:
                raise ValueError(f"layer_types has {len(self.layer_types)} entries for num_layers={self.num_layers}")
            unknown = set(self.layer_types) - {ATTENTION_LAYER, MIXER_LAYER, MLP_LAYER}
            if unknown or (MIXER_LAYER in self.layer_types) != (self.mixer is not None):
                raise ValueError(
                    f"layer_types {sorted(unknown)}: a hybrid has {ATTENTION_LAYER!r}, {MLP_LAYER!r} "
                    f"and {MIXER_LAYER!r} layers, the last with ``mixer`` dims (mixer={self.mixer})"
                )
        if self.num_experts and not 0 < self.experts_per_token <= self.num_experts:
            raise ValueError(f"experts_per_token={self.experts_per_token} must be in 1..num_experts={self.num_experts}")

    @property
    def mlp_stand_in_intermediate(self) -> int:
        """The fake run's dense MLP width.  Dense: the model's.  MoE: per token and expert, the eager
        expert loop keeps the gathered input, gate/up (2 x I), the activation and product (2 x I), the
        expert output and its weighted copy: 4 x I + 3 x hidden elements, where a dense SwiGLU MLP of
        width I' keeps about 4 x I'; so I' = top_k x (I + 3/4 x hidden)."""
        if not self.num_experts:
            return self.intermediate_size
        routed = self.experts_per_token * (self.intermediate_size + 3 * self.hidden_size // 4)
        return routed + self.shared_expert_intermediate  # a shared expert is a dense MLP beside them

    @property
    def is_hybrid(self) -> bool:
        return bool(self.layer_types)

    @property
    def layer_counts(self) -> dict[str, int]:
        """Layers per kind (a Llama-family model: {"": num_layers}), in order of first appearance."""
        return dict(Counter(self.layer_types)) if self.layer_types else {"": self.num_layers}

    def hf_values(self, kind: str, layers: int = 2, stand_in: bool = True) -> dict[str, Any]:
        """A hybrid's transformers config of ``layers`` layers of ``kind``: ``stand_in`` the fake run's (an MoE MLP
        as its dense stand-in, ``mlp_stand_in_intermediate``), else the architecture itself (its parameters)."""
        m, kinds = self.mixer, [kind] * layers
        moe = bool(self.num_experts) and not stand_in
        values: dict[str, Any] = dict(
            model_type=HYBRID_TYPES[self.model_type] if stand_in else self.model_type,
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            vocab_size=self.vocab_size,
            tie_word_embeddings=self.tie_word_embeddings,
            max_position_embeddings=1 << 26,
            intermediate_size=self.mlp_stand_in_intermediate if stand_in else self.intermediate_size,
            layer_types=kinds,
        )
        if m is not None:
            values.update(m.config_values())
        if self.model_type == "nemotron_h":
            return values
        if moe:
            values.update(
                num_experts=self.num_experts,
                num_experts_per_tok=self.experts_per_token,
                moe_intermediate_size=self.intermediate_size,
                shared_expert_intermediate_size=self.shared_expert_intermediate,
            )
        if values["model_type"] == "qwen3_next":  # dense stand-in: every layer MLP-only; else every layer sparse
            values.update(decoder_sparse_step=1, mlp_only_layers=[] if moe else list(range(layers)))
        return values

    def kind_params(self, kind: str) -> int:
        """Parameters of one layer of ``kind``: counted on transformers' own module, built on the meta device."""
        return _layer_params(json.dumps(self.hf_values(kind, layers=1, stand_in=False), sort_keys=True))

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def layer_param_counts(self) -> dict[str, int]:
        h, q, kv, i = self.hidden_size, self.q_size, self.kv_size, self.intermediate_size
        counts = {
            "q_proj": h * q + (q if self.attention_bias else 0),
            "k_proj": h * kv + (kv if self.attention_bias else 0),
            "v_proj": h * kv + (kv if self.attention_bias else 0),
            "o_proj": q * h + (h if self.output_bias else 0),
            "gate_proj": h * i,
            "up_proj": h * i,
            "down_proj": i * h,
            "norms": 2 * h + (2 * self.head_dim if self.qk_norm else 0),
        }
        if self.attention_sinks:
            counts["sinks"] = self.num_heads
        if self.num_experts:
            e, bias = self.num_experts, self.expert_bias
            for name in ("gate_proj", "up_proj", "down_proj"):
                counts[name] = e * (counts[name] + ((h if name == "down_proj" else i) if bias else 0))
            counts["router"] = e * h + (e if bias else 0)
        return counts

    @property
    def active_params_per_token(self) -> int:
        """Parameters one token uses (an MoE layer's top-k experts and its router; all of a dense one)."""
        if not self.num_experts:
            return self.total_params
        counts = self.layer_param_counts()
        experts = sum(counts[n] for n in ("gate_proj", "up_proj", "down_proj"))
        per_layer = self.params_per_layer - experts + experts * self.experts_per_token // self.num_experts
        lm_head = 0 if self.tie_word_embeddings else self.embedding_params
        return self.embedding_params + lm_head + self.num_layers * per_layer + self.hidden_size

    @property
    def params_per_layer(self) -> int:
        """A layer's parameters (a hybrid: its largest kind's, what ZeRO-3 gathers at once)."""
        if self.is_hybrid:
            return max(self.kind_params(k) for k in self.layer_counts)
        return sum(self.layer_param_counts().values())

    @property
    def layers_params(self) -> int:
        """Every decoder layer's parameters."""
        if self.is_hybrid:
            return sum(n * self.kind_params(k) for k, n in self.layer_counts.items())
        return self.num_layers * self.params_per_layer

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def total_params(self) -> int:
        lm_head = 0 if self.tie_word_embeddings else self.embedding_params
        return self.embedding_params + lm_head + self.layers_params + self.hidden_size + self.vision_params

    def shape(self, kind: str = "") -> Any:
        """The fake run's ModelShape (transformers builds the layer from it); a hybrid's: an ``HFModelConfig``
        whose layers are all of ``kind``."""
        from ...integration.fake_run import HFModelConfig, ModelShape

        if self.is_hybrid:
            if kind not in self.layer_counts:
                raise ValueError(f"layer kind {kind!r}: {self.name} has {list(self.layer_counts)}")
            return HFModelConfig(json.dumps(self.hf_values(kind), sort_keys=True))

        return ModelShape(
            model_type=MODEL_TYPES[self.model_type],
            hidden_size=self.hidden_size,
            intermediate_size=self.mlp_stand_in_intermediate,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            vocab_size=self.vocab_size,
            attention_bias=self.attention_bias,
        )

    @staticmethod
    def from_config(config: dict, name: str = "config") -> ModelDims:
        """From a transformers config dict (config.json of a Llama/Mistral/Qwen2/Qwen3 model, of the
        sparse MoE Qwen3-MoE / Mixtral / GPT-OSS, or of a hybrid of ``HYBRID_TYPES``: ``_hybrid_dims``)."""
        if "vision_config" in config:
            return _vision_language_dims(config, name)
        cfg = config.get("text_config", config)
        if cfg.get("model_type") in HYBRID_TYPES:
            return _hybrid_dims(config, name)
        missing = [k for k in ("hidden_size", "num_attention_heads", "num_hidden_layers") if k not in cfg]
        if missing:
            raise ValueError(f"config lacks {missing}: not a Llama-family transformers config")
        heads = HeadLayout.from_config(cfg)
        model_type = cfg.get("model_type", "llama")
        if model_type not in MODEL_TYPES:
            raise ValueError(f"model_type={model_type!r}: the planner runs {', '.join(MODEL_TYPES)} layers")
        experts = cfg.get("num_experts", cfg.get("num_local_experts", 0)) if model_type in MOE_TYPES else 0
        if model_type == "qwen3_moe" and (cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1):
            raise ValueError("a Qwen3-MoE config with dense layers (mlp_only_layers, decoder_sparse_step != 1)")
        gpt_oss = model_type == "gpt_oss"
        intermediate = cfg.get("moe_intermediate_size" if model_type == "qwen3_moe" else "intermediate_size")
        window = cfg.get("sliding_window") or 0
        if model_type == "qwen3_moe" and not cfg.get("use_sliding_window"):
            window = 0
        return ModelDims(
            name=name,
            num_heads=heads.num_heads,
            num_kv_heads=heads.num_kv_heads,
            head_dim=heads.head_dim,
            hidden_size=cfg["hidden_size"],
            intermediate_size=intermediate or 4 * cfg["hidden_size"],
            num_layers=cfg["num_hidden_layers"],
            vocab_size=cfg.get("vocab_size", 32000),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            model_type=model_type,
            num_experts=experts,
            experts_per_token=cfg.get("num_experts_per_tok", 0) if experts else 0,
            output_bias=gpt_oss and bool(cfg.get("attention_bias", True)),
            expert_bias=gpt_oss,
            attention_sinks=gpt_oss,
            sliding_window=window,
        )

    @staticmethod
    def from_file(path: str | Path) -> ModelDims:
        return ModelDims.from_config(json.loads(Path(path).read_text()), name=str(path))


def _vision_language_dims(config: dict, name: str) -> ModelDims:
    """A vision-language model's text model as the planner plans any decoder (``VISION_LANGUAGE_TEXT_TYPES``), with
    its vision tower's and projector's parameters: its config.json read by transformers' own config class (which
    moves a Qwen2.5-VL config's top-level text keys into ``text_config``), the inner model built on the meta device
    and counted without its ``language_model``."""
    import torch
    from transformers import AutoConfig, AutoModel

    values = {k: v for k, v in config.items() if k not in ("architectures", "transformers_version")}
    vlm_type = values.pop("model_type", None)
    if vlm_type is None:
        raise ValueError(f"{name}: a config with a vision_config but no model_type")
    vlm = AutoConfig.for_model(vlm_type, **values)
    text = vlm.get_text_config().to_dict()
    text["model_type"] = VISION_LANGUAGE_TEXT_TYPES.get(text.get("model_type"), text.get("model_type"))
    text["tie_word_embeddings"] = bool(getattr(vlm, "tie_word_embeddings", False))
    if not text.get("use_sliding_window", True):
        text["sliding_window"] = None  # Qwen-VL text configs carry a window they do not use
    dims = ModelDims.from_config(text, name)
    if dims.num_experts:  # its own forward adds the router aux loss, which the tiled loss refuses
        raise ValueError(f"{name}: a vision-language model with a mixture-of-experts text model is not planned yet")
    with torch.device("meta"):
        inner = AutoModel.from_config(vlm)
    text_params = {id(p) for p in inner.get_decoder().parameters()}
    vision = sum(p.numel() for p in inner.parameters() if id(p) not in text_params)
    return replace(dims, vision_model_type=vlm_type, vision_params=vision)


def _hybrid_dims(config: dict, name: str) -> ModelDims:
    """A hybrid's dims (``HYBRID_TYPES``) from its config.json, read by transformers' own config class (which maps
    legacy keys, e.g. Nemotron-H's ``hybrid_override_pattern``, to ``layers_block_type``)."""
    from transformers import AutoConfig

    values = {k: v for k, v in config.items() if k not in ("architectures", "transformers_version")}
    text = AutoConfig.for_model(values.pop("model_type"), **values).get_text_config()
    kinds = tuple(getattr(text, "layer_types", None) or getattr(text, "layers_block_type", ()))
    unknown = sorted(set(kinds) - {ATTENTION_LAYER, MIXER_LAYER, MLP_LAYER})
    if unknown:
        raise ValueError(
            f"{name}: layer kinds {unknown}: the planner runs {ATTENTION_LAYER}, {MIXER_LAYER}, {MLP_LAYER}"
        )
    heads = HeadLayout.from_config(text)
    mixer = MixerDims.from_config("mamba2" if text.model_type == "nemotron_h" else "gated_delta", text)
    experts = getattr(text, "num_experts", 0) or 0
    return ModelDims(
        name, heads.num_heads, heads.num_kv_heads, heads.head_dim, text.hidden_size,
        getattr(text, "moe_intermediate_size", None) if experts else text.intermediate_size,
        text.num_hidden_layers, text.vocab_size, tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        qk_norm=text.model_type != "nemotron_h", model_type=text.model_type, num_experts=experts,
        experts_per_token=getattr(text, "num_experts_per_tok", 0) if experts else 0,
        shared_expert_intermediate=getattr(text, "shared_expert_intermediate_size", 0) if experts else 0,
        layer_types=kinds, mixer=mixer if MIXER_LAYER in kinds else None,
    )  # fmt: skip


@functools.lru_cache(maxsize=64)
def _layer_params(values_json: str) -> int:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    values = json.loads(values_json)
    config = AutoConfig.for_model(values.pop("model_type"), num_hidden_layers=1, **values)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.model.layers[0].parameters())


def _nemotron_pattern(pattern: str) -> tuple[str, ...]:
    """Nemotron-H's ``hybrid_override_pattern`` (M: Mamba-2, *: attention, -: MLP) as layer kinds."""
    kinds = {"M": MIXER_LAYER, "*": ATTENTION_LAYER, "-": MLP_LAYER}
    return tuple(kinds[c] for c in pattern)


def _every_fourth_attention(layers: int) -> tuple[str, ...]:
    """Qwen3.5 / Qwen3-Next: ``full_attention_interval`` 4 (three gated delta layers, then one attention layer)."""
    return tuple(ATTENTION_LAYER if (i + 1) % 4 == 0 else MIXER_LAYER for i in range(layers))


#: the gated delta net of every Qwen3.5 / Qwen3-Next preset: 16 key heads, 32 value heads, dims 128, conv 4
_QWEN_GDN = MixerDims("gated_delta", 32, 16, 128, key_head_dim=128, conv_kernel=4)

HYBRID_PRESETS = {
    # Qwen/Qwen3.5-9B text_config (a config.json of a Qwen3.5-9B fine-tune naming it, huggingface.co/khtsly/Mini-Coder:
    # hidden 4096, intermediate 12288, 32 layers, full_attention_interval 4, head_dim 256, linear 16 key / 32 value
    # heads of 128, conv 4); attention heads 16 / KV 4, vocabulary 248320, untied: transformers 5.25's
    # Qwen3_5TextConfig defaults (whose hidden, intermediate and layers are the 9B's)
    "qwen3.5-9b": ModelDims("qwen3.5-9b", 16, 4, 256, 4096, 12288, 32, 248320, qk_norm=True,
                            model_type="qwen3_5_text", layer_types=_every_fourth_attention(32), mixer=_QWEN_GDN),
    # Qwen/Qwen3.5-35B-A3B: transformers 5.25's Qwen3_5MoeTextConfig defaults (auto_docstring checkpoint
    # "Qwen/Qwen3.5-35B-A3B"): hidden 2048, 40 layers, 16 heads / KV 2 of 256, 256 experts of 512 top-8, shared 512
    "qwen3.5-35b-a3b": ModelDims("qwen3.5-35b-a3b", 16, 2, 256, 2048, 512, 40, 248320, qk_norm=True,
                                 model_type="qwen3_5_moe_text", num_experts=256, experts_per_token=8,
                                 shared_expert_intermediate=512, layer_types=_every_fourth_attention(40),
                                 mixer=_QWEN_GDN),
    # Qwen/Qwen3-Next-80B-A3B: transformers 5.25's Qwen3NextConfig defaults (auto_docstring checkpoint
    # "Qwen/Qwen3-Next-80B-A3B-Instruct"): hidden 2048, 48 layers, 16 heads / KV 2 of 256, 512 experts of 512 top-10,
    # shared 512, vocabulary 151936
    "qwen3-next-80b-a3b": ModelDims("qwen3-next-80b-a3b", 16, 2, 256, 2048, 512, 48, 151936, qk_norm=True,
                                    model_type="qwen3_next", num_experts=512, experts_per_token=10,
                                    shared_expert_intermediate=512, layer_types=_every_fourth_attention(48),
                                    mixer=_QWEN_GDN),
    # nvidia/Nemotron-H-8B: NVIDIA Megatron-Bridge's model page (docs.nvidia.com/nemo/megatron-bridge/latest/models/
    # llm/nemotronh.html: 52 layers of this pattern, hidden 4096, FFN 21504, 32 heads / 8 KV of 128, 128 Mamba heads
    # of 64, state 128), equal to transformers 5.25's NemotronHConfig defaults, which add n_groups 8, conv 4,
    # chunk 128 and the vocabulary 131072
    "nemotron-h-8b": ModelDims("nemotron-h-8b", 32, 8, 128, 4096, 21504, 52, 131072, model_type="nemotron_h",
                               layer_types=_nemotron_pattern("M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"),
                               mixer=MixerDims("mamba2", 128, 8, 64, state_size=128, conv_kernel=4, chunk_size=128)),
    # Qwen/Qwen3.5-27B (dense): 64 layers (full_attention_interval 4), hidden 5120, intermediate 17408, 24 heads / KV 4
    # of 256, vocabulary 248320 (the model card; a GPTQ card's architecture table, hugingapi.com/TevunahAi/
    # Qwen3.5-27B-TevunahAi-GPTQ); its gated delta net: 48 value heads on 16 key heads (three value heads a key head),
    # dims 128, conv 4 (a third-party write-up of the Qwen3.6-27B config.json, which shares the architecture; not
    # checked against the checkpoint's config.json: plan with its path to be sure); untied as the 9B
    "qwen3.5-27b": ModelDims("qwen3.5-27b", 24, 4, 256, 5120, 17408, 64, 248320, qk_norm=True,
                             model_type="qwen3_5_text", layer_types=_every_fourth_attention(64),
                             mixer=MixerDims("gated_delta", 48, 16, 128, key_head_dim=128, conv_kernel=4)),
}  # fmt: skip
#: not a preset: Granite-4.0-H-Small (an MoE Mamba-2 hybrid)

PRESETS = {
    "llama3-8b": ModelDims("llama3-8b", 32, 8, 128, 4096, 14336, 32, 128256),
    "qwen3-32b": ModelDims("qwen3-32b", 64, 8, 128, 5120, 25600, 64, 151936, qk_norm=True, model_type="qwen3"),
    # Qwen/Qwen3-30B-A3B config.json: 128 experts of moe_intermediate_size 768, top-8, every layer sparse
    "qwen3-30b-a3b": ModelDims(
        "qwen3-30b-a3b",
        32,
        4,
        128,
        2048,
        768,
        48,
        151936,
        qk_norm=True,
        model_type="qwen3_moe",
        num_experts=128,
        experts_per_token=8,
    ),
    # openai/gpt-oss-20b config.json: 32 experts of 2,880, top-4, q/k/v/o and expert biases, sinks,
    # sliding_window 128 on every other layer (planned as full causal: an upper bound)
    "gpt-oss-20b": ModelDims(
        "gpt-oss-20b",
        64,
        8,
        64,
        2880,
        2880,
        24,
        201088,
        attention_bias=True,
        model_type="gpt_oss",
        num_experts=32,
        experts_per_token=4,
        output_bias=True,
        expert_bias=True,
        attention_sinks=True,
        sliding_window=128,
    ),
}
#: each preset's GPUs (the paper's: Llama3-8B on 8 x 80 GB, Qwen3-32B on 16; the MoE presets by their
#: ZeRO-3 model states: Qwen3-30B-A3B 30.5B params -> 16, GPT-OSS-20B 20.9B -> 8)
PRESET_GPUS = {"llama3-8b": 8, "qwen3-32b": 16, "qwen3-30b-a3b": 16, "gpt-oss-20b": 8}
PRESETS.update(HYBRID_PRESETS)
PRESET_GPUS.update(dict.fromkeys(HYBRID_PRESETS, 8))  # the hybrids as Llama3-8B: 8 x 80 GB


def model_dims(name_or_path: str) -> ModelDims:
    """A preset name (see PRESETS) or the path of a transformers config.json."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"model {name_or_path!r}: not a preset ({sorted(PRESETS)}) nor a config.json file")
    return ModelDims.from_file(path)
