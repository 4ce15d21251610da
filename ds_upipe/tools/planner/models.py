"""The model catalogue: a model's dimensions (``ModelDims``), the presets and a config.json reader."""

from __future__ import annotations

import json
from dataclasses import dataclass
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

    def __post_init__(self) -> None:
        for name in ("num_heads", "num_kv_heads", "head_dim", "hidden_size", "intermediate_size", "num_layers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"model_type={self.model_type!r}: the planner runs {', '.join(MODEL_TYPES)}")
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
        return self.experts_per_token * (self.intermediate_size + 3 * self.hidden_size // 4)

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
        return sum(self.layer_param_counts().values())

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def total_params(self) -> int:
        lm_head = 0 if self.tie_word_embeddings else self.embedding_params
        return self.embedding_params + lm_head + self.num_layers * self.params_per_layer + self.hidden_size

    def shape(self) -> Any:
        """The fake run's ModelShape (transformers builds the layer from it)."""
        from ...integration.fake_run import ModelShape

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
        """From a transformers config dict (config.json of a Llama/Mistral/Qwen2/Qwen3 model, or of the
        sparse MoE Qwen3-MoE / Mixtral / GPT-OSS)."""
        cfg = config.get("text_config", config)
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
