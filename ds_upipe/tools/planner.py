"""``ds-upipe plan``: per-GPU peak memory of a sequence-parallel training step, from the real code.

A step's peak on one GPU is

    model states (ZeRO-partitioned)  +  ZeRO working buffers  +  reserve
    +  max over the phases {a decoder layer's recompute + backward, the loss} of
       (activation checkpoints on the GPU  +  that phase's peak, measured on fake tensors)

The phase peaks are not modelled: ``ds_upipe.integration.fake_run`` runs the real forward and
backward (a transformers decoder layer with UPipe or DeepSpeed ALST, the long-context stack when
configured; the final norm + lm_head + loss) as rank 0 of C on fake tensors under MemTracker.
What fake execution cannot see stays analytic, each term with its source:

- model states: bf16 weights, gradients and Adam's fp32 master, m, v (2 + 2 + 12 bytes per
  parameter; fp32: 4 + 4 + 8), partitioned as the ZeRO stage says (ZeRO paper, Rajbhandari et
  al. 2020, section 5; DeepSpeed's ``estimate_zero3_model_states_mem_needs``);
- ZeRO buffers: the reduce bucket (``reduce_bucket_size``, DeepSpeed's default 5e8 elements) and at
  stage 3 the gathered 16-bit weights of the current module (a layer, or the lm_head at the loss)
  and ``zero_prefetch_layers`` prefetched layers (``stage3_prefetch_bucket_size``);
- activation checkpoints: one layer input (b x S/C x hidden) per layer below the one in backward
  (``deepspeed.checkpointing`` / HF gradient checkpointing keep exactly the layer inputs); with CPU
  offload only the one being brought back; without checkpointing every layer's saved tensors
  (measured: ``Peak.after_forward`` of the fake run);
- the CUDA attention kernel's backward workspace (flash-attn 2's float32 dq accumulator and GQA
  dK/dV expansion, flash-attn 3's float32 accumulators): ``fake_run.kernel_workspace_bytes``,
  added inside the fake run while the backward op runs;
- a reserve for the CUDA context, NCCL buffers and allocator fragmentation.

The forward phase of a checkpointed layer is not a phase of its own: it runs without grad and with
the same checkpoints resident as the layer's backward, whose recompute + backward holds more.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hf_patches.families import MOE_TYPES, PLANNER_LAYERS

from ..heads import HeadLayout
from ..layout import SequenceLayout
from ..schedule import valid_head_chunk_sizes

if TYPE_CHECKING:
    from ..integration.config import SPSettings

GiB = 2**30
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
#: the paper's sequence lengths (tokens); 1K = 1024
PAPER_STEPS = [128 * 2**10, 256 * 2**10, 512 * 2**10, 2**20, 2 * 2**20, 3 * 2**20, 4 * 2**20, 5 * 2**20]


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
        from ..integration.fake_run import ModelShape

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


# -- the run being planned -----------------------------------------------------------------------


@dataclass(frozen=True)
class AttentionScheme:
    """``ulysses`` is DeepSpeed ALST's UlyssesSPAttentionHF; ``upipe`` is ours at head chunk U."""

    kind: str  # "ulysses" | "upipe"
    head_chunk_size: int | None = None
    fused: bool = True
    overlap_comm: bool = False  # the pipeline's prefetch of the next stage (two stages' inputs alive)
    #: upipe.accumulate_dtype = "input": bf16/fp16 gradients summed over the stages in that dtype
    accumulate_in_input_dtype: bool = False
    #: upipe.recompute_attention_output: fused backward recomputes each stage's attention output
    recompute_attention_output: bool = False

    @property
    def label(self) -> str:
        if self.kind == "ulysses":
            return "ulysses (ALST)"
        extra = (
            ("" if self.fused else "-unfused")
            + ("+overlap" if self.overlap_comm else "")
            + ("+input-acc" if self.accumulate_in_input_dtype else "")
            + ("+recompute" if self.recompute_attention_output else "")
        )
        return f"upipe{extra} U={self.head_chunk_size}"


KERNELS = ("none", "fa2", "fa3")


@dataclass(frozen=True)
class TrainSetup:
    """One sequence-parallel training run (sequence-parallel degree = ``gpus``).

    Defaults: ZeRO-3, activation checkpointing with the checkpoints offloaded to CPU, the
    long-context stack (tiled loss, tiled RMSNorms, tiled MLP; hf_patches'
    ``apply_long_context_stack`` with its default tile sizes), bf16, micro-batch 1."""

    gpus: int = 8
    gpu_memory_gib: float = 79.6  # an "80 GB" H100/A100 reports 81559 MiB
    zero_stage: int = 3
    checkpointing: bool = True
    offload_checkpoints: bool = True
    tiled_mlp: bool = True
    tiled_loss: bool = True
    tiled_norm: bool = True
    loss_tile_tokens: int | None = None
    norm_tile_tokens: int | None = None
    mlp_tile_tokens: int | None = None
    dtype: str = "bf16"
    batch: int = 1
    #: the attention kernel's backward workspace (fake_run.kernel_workspace_bytes): "fa2" (torch SDPA's
    #: CUDA flash = flash-attn 2), "fa3", "none" (CPU: MemTracker sees everything)
    kernel: str = "fa2"
    #: CUDA context, NCCL communicators and buffers, allocator fragmentation (``RESERVE_BASIS``)
    reserve_gib: float = 4.0
    #: whose async all-to-all buffer lifetime the fake run reproduces: "nccl" (released at wait) or
    #: "gloo" (held until the handle dies: what the CPU measurements see)
    comm_backend: str = "nccl"
    #: False: one forward + backward without optimizer states, from gradients set to None (what
    #: benchmarks/whole_step.py measures): the model states are the weights, and each gradient counts
    #: from its creation on (the fake runs count the phase's own; a layer's backward comes after the
    #: loss phase's lm_head / final-norm gradients)
    optimizer: bool = True
    zero_prefetch_layers: int = 1  # ZeRO-3: layers gathered ahead of the current one
    zero_reduce_bucket: int = 500_000_000  # ZeRO: reduce_bucket_size (elements), DeepSpeed's default
    #: UPipe x Ring (upipe.ring_size): the ``gpus`` sequence-parallel ranks are Ulysses degree C_u = gpus /
    #: ring_size x ring_size; 1 is no ring
    ring_size: int = 1
    #: host (CPU) memory of one node, GiB; the node runs ``min(gpus, gpus_per_node)`` ranks
    host_memory_gib: float = 2048.0
    gpus_per_node: int = 8
    #: zero_optimization.offload_optimizer.device == "cpu": fp32 master, Adam m and v and the fp32
    #: gradient partition live in host memory (DeepSpeed's CPU Adam steps them there)
    offload_optimizer: bool = False
    #: zero_optimization.offload_param.device == "cpu" (ZeRO-3 only): the 16-bit weight partition in host memory
    offload_param: bool = False
    #: pin_memory of the offloaded optimizer / parameters (DeepSpeed's default False: pageable)
    offload_pin_memory: bool = False
    #: how offloaded checkpoints are pinned: "pow2" (DeepSpeed 0.19.8's _ActivationOffloadEngine:
    #: ``torch.empty`` + ``pin_memory``, and torch's CachingHostAllocator rounds every block up to a
    #: power of two) or "exact" (``ds_upipe.integration.checkpointing.ExactPinnedPool``: one block per
    #: checkpoint of exactly its bytes)
    checkpoint_pinning: str = "pow2"
    #: upipe.checkpoint_pairs: the lowest 2N layers checkpointed in pairs on one saved input
    #: (``ds_upipe.integration.checkpoint_pairs``): N layer inputs fewer kept, N more layer forwards
    checkpoint_pairs: int = 0
    #: host memory per node outside the tensors above (``HOST_BASIS``)
    host_os_gib: float = 32.0
    host_per_rank_gib: float = 8.0

    def __post_init__(self) -> None:
        if self.checkpoint_pinning not in ("pow2", "exact"):
            raise ValueError(f"checkpoint_pinning={self.checkpoint_pinning!r}: choose 'pow2' or 'exact'")
        if self.host_memory_gib <= 0:
            raise ValueError(f"host_memory_gib={self.host_memory_gib} must be positive")
        if self.gpus_per_node < 1:
            raise ValueError(f"gpus_per_node={self.gpus_per_node} must be >= 1")
        if self.offload_param and self.zero_stage != 3:
            raise ValueError(
                f"offload_param with zero_stage={self.zero_stage}: DeepSpeed offloads parameters only at ZeRO stage 3"
            )
        if self.offload_optimizer and self.zero_stage == 0:
            raise ValueError("offload_optimizer with zero_stage=0: DeepSpeed offloads the optimizer at ZeRO stages 1-3")
        if self.gpus < 1:
            raise ValueError(f"gpus={self.gpus} must be >= 1")
        if self.ring_size < 1 or self.gpus % self.ring_size:
            raise ValueError(
                f"ring_size={self.ring_size} must be a positive divisor of gpus={self.gpus} "
                "(the sequence-parallel ranks are Ulysses degree x ring size)"
            )
        if self.gpu_memory_gib <= 0:
            raise ValueError(f"gpu_memory_gib={self.gpu_memory_gib} must be positive")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage={self.zero_stage}: must be 0, 1, 2 or 3")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype={self.dtype!r}: choose one of {sorted(DTYPE_BYTES)}")
        if self.kernel not in KERNELS:
            raise ValueError(f"kernel={self.kernel!r}: choose one of {list(KERNELS)}")
        if self.batch < 1:
            raise ValueError(f"batch={self.batch} must be >= 1")
        if self.checkpoint_pairs < 0 or (self.checkpoint_pairs and not self.checkpointing):
            raise ValueError(f"checkpoint_pairs={self.checkpoint_pairs} needs checkpointing=True and must be >= 0")
        if self.offload_checkpoints and not self.checkpointing:
            raise ValueError("offload_checkpoints=True needs checkpointing=True (only checkpoints are offloaded)")

    @property
    def act_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def ulysses_size(self) -> int:
        """C_u: the ranks UPipe's head-chunked all-to-alls span (all ``gpus`` without a ring)."""
        return self.gpus // self.ring_size

    @property
    def seq_multiple(self) -> int:
        """Sequence lengths must be multiples of this: the GPUs, and with a ring two zigzag chunks per ring
        rank, each split over the Ulysses ranks (``ds_upipe.ring.zigzag_positions``)."""
        return SequenceLayout(self.ulysses_size, self.ring_size).sequence_multiple

    @property
    def stack_label(self) -> str:
        parts = [n for n, on in (("loss", self.tiled_loss), ("norm", self.tiled_norm), ("MLP", self.tiled_mlp)) if on]
        return "tiled " + "/".join(parts) if parts else "no long-context stack"


#: torch dtype names (what the bench and the CPU measurements take) -> the planner's names
PLANNER_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def measured_scheme(
    kind: str,
    head_chunk_size: int | None = None,
    fused: bool = True,
    overlap_comm: bool = False,
    recompute_attention_output: bool = False,
) -> AttentionScheme:
    """The scheme of a measured method: the bench's ``"alst"`` is the planner's ``"ulysses"``."""
    if kind == "alst":
        return AttentionScheme("ulysses")
    return AttentionScheme(
        "upipe", head_chunk_size, fused, overlap_comm, recompute_attention_output=recompute_attention_output
    )


def measured_layer_setup(
    gpus: int, dtype: str, tiled_mlp: bool, checkpointing: bool = False, hidden_size: int | None = None
) -> TrainSetup:
    """The setup of one decoder layer measured with MemTracker on CPU gloo ranks (the bench, the
    planner's calibration): torch ``dtype`` name, no tiled norm or loss, no CUDA kernel workspace,
    gloo's buffer lifetimes, checkpoints kept on the device; ``checkpointing`` plans the checkpoint's
    replay in backward instead of a plain forward + backward.  ``hidden_size``: the MLP tile of the
    measured layer, which applies TiledMLP as ALST documents it (ceil(s / hidden) shards, i.e.
    hidden_size tokens per tile), not the stack's default rule."""
    return TrainSetup(
        mlp_tile_tokens=hidden_size,
        gpus=gpus,
        dtype=PLANNER_DTYPES[dtype],
        tiled_mlp=tiled_mlp,
        tiled_norm=False,
        tiled_loss=False,
        kernel="none",
        comm_backend="gloo",
        checkpointing=checkpointing,
        offload_checkpoints=False,
    )


def methods_for(
    dims: ModelDims, gpus: int, fused: bool = True, overlap_comm: bool = False, ring_size: int = 1
) -> list[AttentionScheme]:
    """Ulysses, then UPipe at every valid U (smallest first).  With a ring (``ring_size`` > 1) UPipe x Ring
    at every U valid for C_u = gpus / ring_size; U = H is Ulysses x Ring (DeepSpeed ALST has no ring)."""
    us = valid_head_chunk_sizes(dims.num_heads, dims.num_kv_heads, gpus // ring_size)
    upipe = [AttentionScheme("upipe", u, fused, overlap_comm) for u in us]
    return upipe if ring_size > 1 else [AttentionScheme("ulysses"), *upipe]


# -- a ds_config ------------------------------------------------------------------------------------


def from_ds_config(
    config: dict[str, Any] | SPSettings, base: TrainSetup | None = None
) -> tuple[TrainSetup, AttentionScheme, int | None]:
    """(setup, the attention scheme it runs, upipe.seq_length) of a ds_config: what the run does.

    Reads the validated settings the runtime reads (``ds_upipe.integration.config.parse_config``,
    given a ds_config dict, or its ``SPSettings``): the same rules, the same errors (an unknown
    ``upipe`` key is refused, as ``ds_upipe.initialize`` refuses it), the tile sizes as configured."""
    from ..integration.config import parse_config, tiled

    settings = parse_config(config) if isinstance(config, dict) else config
    upipe = settings.upipe
    (loss, loss_tiles), (norm, norm_tiles), (mlp, mlp_tiles) = (
        tiled(v) for v in (upipe.tiled_loss, upipe.tiled_norm, upipe.tiled_mlp)
    )
    zero = settings.zero_optimization
    base = base or TrainSetup()
    opt_offload, opt_pin = _offload_setting(zero, "offload_optimizer")
    param_offload, param_pin = _offload_setting(zero, "offload_param")
    setup = replace(
        base,
        offload_optimizer=opt_offload,
        offload_param=param_offload,
        # a ds_config runs through ds_upipe.initialize / the HF integration, which install the
        # exact-size pinned checkpoint pool (integration.checkpointing.install_exact_pinned_pool)
        checkpoint_pinning="exact" if settings.offload_checkpoints else base.checkpoint_pinning,
        offload_pin_memory=opt_pin or param_pin,
        gpus=settings.sequence_parallel_size,
        zero_stage=settings.zero_stage,
        checkpointing=settings.checkpointing,
        offload_checkpoints=settings.offload_checkpoints,
        dtype=settings.dtype,
        batch=settings.micro_batch_size or 1,
        tiled_loss=loss,
        tiled_norm=norm,
        tiled_mlp=mlp,
        loss_tile_tokens=loss_tiles,
        norm_tile_tokens=norm_tiles,
        mlp_tile_tokens=mlp_tiles,
        zero_reduce_bucket=int(zero.get("reduce_bucket_size", base.zero_reduce_bucket)),
        ring_size=settings.ring_size,
        checkpoint_pairs=upipe.checkpoint_pairs,
    )
    if upipe.enabled:
        u = upipe.head_chunk_size
        scheme = AttentionScheme(
            "upipe",
            None if u == "auto" else u,  # "auto": auto_head_chunk_size, once the setup is final (cli)
            upipe.fused_projections,
            upipe.overlap_comm,
            upipe.accumulate_dtype == "input",
            upipe.recompute_attention_output,
        )
    else:
        scheme = AttentionScheme("ulysses")
    return setup, scheme, upipe.seq_length


def auto_head_chunk_size(dims: ModelDims, setup: TrainSetup, scheme: AttentionScheme, upipe: Any) -> int:
    """The U that ``upipe.head_chunk_size: "auto"`` picks for this model and setup: the runtime's rule and
    measurement (``integration.auto_chunk.choose_head_chunk_size`` on the model's attention layer, at
    ``upipe.seq_length`` with ``upipe.memory_budget_gib``), with the scheme's settings (flags given on
    the command line override the block's, as they do for the plan)."""
    from ..integration.auto_chunk import choose_head_chunk_size

    block = upipe.model_copy(
        update=dict(
            fused_projections=scheme.fused,
            overlap_comm=scheme.overlap_comm,
            accumulate_dtype="input" if scheme.accumulate_in_input_dtype else "fp32",
            recompute_attention_output=scheme.recompute_attention_output,
            ring_size=setup.ring_size,
        )
    )
    return choose_head_chunk_size(
        block,
        num_heads=dims.num_heads,
        num_kv_heads=dims.num_kv_heads,
        head_dim=dims.head_dim,
        group_size=setup.ulysses_size,
        micro_batch_size=setup.batch,
        dtype_bytes=setup.act_bytes,
        model_config=dims.shape().config(1),
    )


_OFFLOAD_KEYS = {"device", "pin_memory", "buffer_count", "buffer_size", "max_in_cpu", "nvme_path", "fast_init",
                 "pipeline_read", "pipeline_write", "ratio"}  # fmt: skip


def _offload_setting(zero: dict[str, Any], key: str) -> tuple[bool, bool]:
    """(offloaded to CPU, pinned) of ``zero_optimization.<key>``; refused by name: a device other
    than "cpu" / "none" (NVMe is not planned), unknown keys, a non-object."""
    block = zero.get(key)
    if block is None:
        return False, False
    if not isinstance(block, dict):
        raise ValueError(f'zero_optimization.{key}={block!r}: must be an object like {{"device": "cpu"}}')
    unknown = sorted(set(block) - _OFFLOAD_KEYS)
    if unknown:
        raise ValueError(f"zero_optimization.{key}: unknown keys {unknown}; DeepSpeed's are {sorted(_OFFLOAD_KEYS)}")
    device = block.get("device", "none")
    if device not in ("cpu", "none", None):
        raise ValueError(
            f"zero_optimization.{key}.device={device!r}: the planner models 'cpu' and 'none' "
            "(NVMe offload is not planned)"
        )
    return device == "cpu", bool(block.get("pin_memory", False))


# -- the analytic terms ---------------------------------------------------------------------------


def model_state_bytes(dims: ModelDims, setup: TrainSetup) -> int:
    """Weights, gradients and Adam states on one GPU after ZeRO partitioning over the GPUs:
    bf16 2 + 2 + 12 (fp32 master, m, v) bytes per parameter; fp32 4 + 4 + 8.  offload_optimizer:
    the optimizer states leave the GPU (``host_terms``); offload_param: the weight partition too."""
    p = dims.total_params
    w, g, o = (4, 4, 8) if setup.dtype == "fp32" else (2, 2, 12)
    n = setup.gpus
    if not setup.optimizer:  # weights only: the step's gradients are counted where they are made
        g = o = 0
    if setup.offload_optimizer:
        o = 0
    if setup.offload_param:
        w = 0
    if setup.zero_stage >= 3:
        return math.ceil(p * (w + g + o) / n)
    if setup.zero_stage == 2:
        return p * w + math.ceil(p * (g + o) / n)
    if setup.zero_stage == 1:
        return p * (w + g) + math.ceil(p * o / n)
    return p * (w + g + o)


def zero_buffer_bytes(dims: ModelDims, setup: TrainSetup) -> int:
    """ZeRO working buffers: the reduce bucket (stages 2-3) and, at stage 3, the gathered 16-bit
    weights in flight -- the current module (a layer, or the LM head at the loss) and the
    prefetched layers.  (At stages 0-2 the weights are part of the model states.)"""
    pe = DTYPE_BYTES[setup.dtype]
    bucket = pe * min(setup.zero_reduce_bucket, dims.total_params) if setup.zero_stage >= 2 else 0
    if setup.zero_stage < 3:
        return bucket
    current = max(dims.params_per_layer, dims.embedding_params)
    return bucket + pe * (current + setup.zero_prefetch_layers * dims.params_per_layer)


def hidden_state_bytes(dims: ModelDims, setup: TrainSetup, seq_len: int) -> int:
    """One layer input of this rank: b x S/C x hidden (a checkpoint)."""
    return setup.batch * (seq_len // setup.gpus) * dims.hidden_size * setup.act_bytes


#: what ``TrainSetup.reserve_gib`` stands for (not measured here: no GPU in the test environment)
RESERVE_BASIS = (
    "CUDA context + cuBLAS/cuDNN workspaces ~1 GiB, one NCCL communicator per process group (data, "
    "sequence, ZeRO) ~0.3-0.5 GiB each, NVLS buffers on NVSwitch nodes ~1 GiB, allocator fragmentation; "
    "4 GiB assumed (3-6 GiB is typical)"
)
#: what ``host_os_gib`` and ``host_per_rank_gib`` stand for (assumed, not measured)
HOST_BASIS = (
    "OS, page cache floor and services per node; per rank: the CUDA driver's host mappings, torch / "
    "DeepSpeed / Python libraries, the data loader, DeepSpeed's host staging"
)


def pinned_block_bytes(nbytes: int, pinning: str) -> int:
    """Host bytes one pinned checkpoint of ``nbytes`` takes: torch's CachingHostAllocator (what
    ``tensor.pin_memory()`` / DeepSpeed's offload engine use) rounds a block up to a power of two
    (c10's ``llvm::PowerOf2Ceil`` in CachingHostAllocator.h, torch 2.x); the exact pool does not."""
    if pinning == "exact" or nbytes <= 0:
        return max(0, nbytes)
    return 1 << (nbytes - 1).bit_length()


def ranks_per_node(setup: TrainSetup) -> int:
    return min(setup.gpus, setup.gpus_per_node)


def kept_checkpoints(dims: ModelDims, setup: TrainSetup) -> tuple[int, int]:
    """(layer inputs DeepSpeed's offload engine pins on the host, inputs the checkpoint pairs keep)
    per rank.  DeepSpeed checkpoints the ``layers - 2N`` layers above the pairs and keeps the newest
    input on the GPU (``keep_last_count=1``); each of the N pairs keeps one input (its own exact-size
    buffer, ``integration.checkpoint_pairs.PairInputStore``)."""
    pairs = setup.checkpoint_pairs
    if 2 * pairs > dims.num_layers:
        raise ValueError(
            f"checkpoint_pairs={pairs}: {dims.name} has {dims.num_layers} layers, so at most {dims.num_layers // 2}"
        )
    return max(0, dims.num_layers - 2 * pairs - 1), pairs


def pair_recompute_fraction(dims: ModelDims, setup: TrainSetup) -> float:
    """The checkpoint pairs' extra compute as a fraction of a checkpointed step's layer compute: N more
    layer forwards over L x (forward + recompute + backward ~ 2 forwards) = 4L forwards (backward ~ 2
    forwards: the usual 2:1 FLOP rule; an estimate, not a measurement)."""
    return setup.checkpoint_pairs / (4 * dims.num_layers)


def host_terms(dims: ModelDims, setup: TrainSetup, seq_len: int) -> dict[str, int]:
    """Host memory of one node by term (bytes).  Offloaded checkpoints: DeepSpeed's offload engine
    keeps the newest layer input on the GPU (``keep_last_count=1``), so each rank pins ``layers - 1``
    layer inputs, each rounded as ``setup.checkpoint_pinning`` says.  offload_optimizer: the fp32
    master, m, v and fp32 gradient partitions (16 bytes per parameter / GPUs; fp32 training: the
    master is the weights, 12); offload_param: the 16-bit weight partition.  Pinned optimizer /
    parameter buffers (``pin_memory``) are rounded like the checkpoints (one flat buffer each)."""
    ranks = ranks_per_node(setup)
    terms: dict[str, int] = {}
    if setup.offload_checkpoints:
        x = hidden_state_bytes(dims, setup, seq_len)
        engine, pairs = kept_checkpoints(dims, setup)
        per_rank = engine * pinned_block_bytes(x, setup.checkpoint_pinning)
        terms[f"checkpoints ({engine} layer inputs/rank, {setup.checkpoint_pinning} pinned)"] = ranks * per_rank
        if pairs:
            terms[f"checkpoint pairs ({pairs} layer inputs/rank, exact pinned)"] = ranks * pairs * x
    rounding = "pow2" if setup.offload_pin_memory else "exact"
    part = math.ceil(dims.total_params / setup.gpus)
    if setup.offload_optimizer and setup.optimizer:
        buffers = (4, 4, 4) if setup.dtype == "fp32" else (4, 4, 4, 4)  # (master,) m, v, fp32 grads
        terms["optimizer states (offload_optimizer)"] = ranks * sum(
            pinned_block_bytes(b * part, rounding) for b in buffers
        )
    if setup.offload_param:
        terms["weights (offload_param)"] = ranks * pinned_block_bytes(DTYPE_BYTES[setup.dtype] * part, rounding)
    terms["OS and processes (assumed)"] = int((setup.host_os_gib + ranks * setup.host_per_rank_gib) * GiB)
    return terms


# -- the fake-tensor phases -------------------------------------------------------------------------


def step_spec(dims: ModelDims, setup: TrainSetup, scheme: AttentionScheme, seq_len: int) -> Any:
    from ..integration.fake_run import StepSpec

    if seq_len < setup.gpus or seq_len % setup.gpus:
        raise ValueError(f"seq_len={seq_len} is not a positive multiple of gpus={setup.gpus}")
    if scheme.kind == "upipe" and scheme.head_chunk_size is not None:
        valid = valid_head_chunk_sizes(dims.num_heads, dims.num_kv_heads, setup.ulysses_size)
        if scheme.head_chunk_size not in valid:
            raise ValueError(f"head_chunk_size={scheme.head_chunk_size} is not valid here; valid: {valid}")
    return StepSpec(
        model=dims.shape(),
        attention="alst" if scheme.kind == "ulysses" else "upipe",
        sp_size=setup.gpus,
        seq_len=seq_len,
        head_chunk_size=scheme.head_chunk_size,
        fused=scheme.fused,
        overlap_comm=scheme.overlap_comm,
        accumulate_in_input_dtype=scheme.accumulate_in_input_dtype,
        recompute_attention_output=scheme.recompute_attention_output,
        batch=setup.batch,
        dtype=setup.dtype,
        tiled_norm=setup.tiled_norm,
        tiled_mlp=setup.tiled_mlp,
        tiled_loss=setup.tiled_loss,
        norm_tile_tokens=setup.norm_tile_tokens,
        mlp_tile_tokens=setup.mlp_tile_tokens,
        loss_tile_tokens=setup.loss_tile_tokens,
        kernel=setup.kernel,
        comm_backend=setup.comm_backend,
        ring_size=setup.ring_size,
        checkpointed=setup.checkpointing,
    )


def layer_peak(dims: ModelDims, setup: TrainSetup, scheme: AttentionScheme, seq_len: int, live: bool = False):
    """The fake run of one decoder layer's forward + backward (``fake_run.Peak``): what one layer saves
    without checkpointing, and the per-layer calibration against MemTracker."""
    from ..integration import fake_run

    return fake_run.layer_step(step_spec(dims, setup, scheme, seq_len), live)


def step_peak(dims: ModelDims, setup: TrainSetup, scheme: AttentionScheme, seq_len: int, live: bool = False):
    """The fake run of a whole step of a two-layer model (``fake_run.model_step``: both layers, the
    final norm and the loss, forward and backward, measured together; ``Peak.phases`` per phase)."""
    from ..integration import fake_run

    return fake_run.model_step(step_spec(dims, setup, scheme, seq_len), keep_gradients=not setup.optimizer, live=live)


# -- a whole training step on one GPU ------------------------------------------------------------


@dataclass
class Prediction:
    """Predicted peak of one GPU for one training step (GiB), its parts, and what sets it."""

    method: str
    seq_len: int
    total_gib: float
    fits: bool
    model_states_gib: float
    zero_buffers_gib: float
    reserve_gib: float
    #: the phase of the step at the peak (``fake_run.STEP_PHASES``: forward, loss, top layer, bottom layer)
    peak_phase: str
    #: what the model's other ``layers - 2`` layers add on the GPU in that phase (analytic, ``other_layers``)
    other_layers_gib: float
    other_layers_basis: str
    phase_gib: float  # the two-layer step's fake-run peak in that phase without the weights (workspace included)
    workspace_gib: float  # of which the analytic kernel workspace
    peak_at: str  # the allocation that set the two-layer step's peak
    phases_gib: dict[str, float] = field(default_factory=dict)  # other layers + fake-run peak, per phase
    live_at_peak: list[tuple[str, float]] = field(default_factory=list)  # GiB by origin (with ``live``)
    host_gib: float = 0.0  # host memory of one node
    host_fits: bool = True
    host_terms_gib: dict[str, float] = field(default_factory=dict)
    gpu_fits: bool = True
    #: what stops a longer context: "GPU", "host", "both" or "" (fits)
    binding: str = ""


def other_layers(dims: ModelDims, setup: TrainSetup, seq_len: int, saved_per_layer: int) -> dict[str, tuple[int, str]]:
    """Per phase of the two-layer step, what the other ``layers - 2`` layers of the model add on the GPU
    (bytes, basis).  They sit below the two measured layers: in the forward, the loss phase and the top
    layer's backward each keeps its checkpoint (the layer input DeepSpeed saves; a pair keeps one for
    two layers), or without checkpointing what its forward saved for backward; with the checkpoints
    offloaded none stays (the newest and the one coming back are the measured layers' own).  In the bottom
    layer's backward their backward is done: without an optimizer (gradients kept from their creation
    on) their weight gradients are alive; with one, ZeRO has moved them into its buckets."""
    extra = max(0, dims.num_layers - 2)
    if setup.checkpointing:
        kept = max(0, extra - setup.checkpoint_pairs)
        below = (
            (0, "checkpoints of the layers below: offloaded to the host")
            if setup.offload_checkpoints
            else (
                kept * hidden_state_bytes(dims, setup, seq_len),
                f"{kept} more layer inputs kept as checkpoints (DeepSpeed keeps each checkpointed layer's input"
                + (f"; {setup.checkpoint_pairs} pairs keep one for two layers)" if setup.checkpoint_pairs else ")"),
            )
        )
    else:
        below = (extra * saved_per_layer, f"{extra} more layers' saved activations (one layer's, measured, each)")
    if setup.optimizer:
        above = (0, "weight gradients of the layers above: in ZeRO's buckets (model states, ZeRO buffers)")
    else:
        grads = extra * dims.params_per_layer * setup.act_bytes
        above = (grads, f"{extra} more layers' weight gradients (kept from their creation on: no optimizer)")
    return {"forward": below, "loss": below, "top layer": below, "bottom layer": above}


def predict(
    dims: ModelDims, setup: TrainSetup, method: AttentionScheme, seq_len: int, live: bool = False
) -> Prediction:
    """Peak memory of one GPU for one training step at ``seq_len`` tokens (the whole sequence, split
    over ``setup.gpus`` sequence-parallel ranks).  ``live``: also the largest allocations at the peak.

    The step of a two-layer model is measured whole (``step_peak``), phase by phase; each phase gets
    what the other layers add there (``other_layers``), and the largest sum, with the model states,
    ZeRO buffers and the reserve, is the prediction."""
    kept_checkpoints(dims, setup)  # checkpoint_pairs within the model's layers
    step = step_peak(dims, setup, method, seq_len, live)
    saved = 0
    if not setup.checkpointing:  # what one layer keeps from its forward to its backward, its input among them
        layer = layer_peak(dims, setup, method, seq_len)
        x = hidden_state_bytes(dims, setup, seq_len)
        rope = 2 * setup.batch * (seq_len // setup.gpus) * dims.head_dim * setup.act_bytes
        saved = max(0, layer.after_forward - layer.weights - x - rope - 8 * setup.batch * (seq_len // setup.gpus))
    others = other_layers(dims, setup, seq_len, saved)
    phases = {k: others[k][0] + v - step.weights for k, v in step.phases.items()}
    phase = max(phases, key=lambda k: phases[k])
    states, zero, reserve = model_state_bytes(dims, setup), zero_buffer_bytes(dims, setup), setup.reserve_gib * GiB
    total = states + zero + reserve + phases[phase]
    host = host_terms(dims, setup, seq_len)
    host_total = sum(host.values())
    gpu_fits = total <= setup.gpu_memory_gib * GiB
    host_fits = host_total <= setup.host_memory_gib * GiB
    binding = (
        "" if gpu_fits and host_fits else "both" if not (gpu_fits or host_fits) else "GPU" if host_fits else "host"
    )
    at_peak = phase == max(step.phases, key=lambda k: step.phases[k])
    return Prediction(
        method=method.label,
        seq_len=seq_len,
        total_gib=total / GiB,
        fits=gpu_fits and host_fits,
        host_gib=host_total / GiB,
        host_fits=host_fits,
        host_terms_gib={k: v / GiB for k, v in host.items()},
        gpu_fits=gpu_fits,
        binding=binding,
        model_states_gib=states / GiB,
        zero_buffers_gib=zero / GiB,
        reserve_gib=setup.reserve_gib,
        peak_phase=phase,
        other_layers_gib=others[phase][0] / GiB,
        other_layers_basis=others[phase][1],
        phase_gib=(step.phases[phase] - step.weights) / GiB,
        workspace_gib=step.workspace / GiB if at_peak else 0.0,
        peak_at=step.at if at_peak else f"the {phase} phase's peak (the step's own peak is in another phase)",
        phases_gib={k: v / GiB for k, v in phases.items()},
        live_at_peak=[(label, b / GiB) for label, b in step.live] if at_peak else [],
    )


# -- searches and reports --------------------------------------------------------------------------


def max_context(
    dims: ModelDims, setup: TrainSetup, method: AttentionScheme, granularity: int = 2**14, limit: int = 2**27
) -> int:
    """The largest sequence length, a multiple of ``granularity`` (and of the GPU count), that fits
    BOTH the GPU (``predict``) and the node's host memory (``host_terms``); 0 when not even one step
    fits (``nothing_fits`` says why).  Every candidate is a fake run; the memory is nearly affine in
    the length, so secant guesses land next to the answer, each checked with its neighbour, and
    what remains of the bracket is closed by bisection."""
    step = math.lcm(granularity, setup.seq_multiple)
    top = max(1, limit // step)
    # the host memory is analytic and grows with the length: cap the search where it stops fitting
    host_budget = setup.host_memory_gib * GiB
    if sum(host_terms(dims, setup, step).values()) > host_budget:
        return 0
    lo_h, hi_h = 1, top
    if sum(host_terms(dims, setup, top * step).values()) > host_budget:
        while hi_h - lo_h > 1:
            mid = (lo_h + hi_h) // 2
            lo_h, hi_h = (
                (mid, hi_h) if sum(host_terms(dims, setup, mid * step).values()) <= host_budget else (lo_h, mid)
            )
        top = lo_h
    budget = setup.gpu_memory_gib
    totals: dict[int, float] = {}

    def fits(k: int) -> bool:
        if k not in totals:
            totals[k] = predict(dims, setup, method, k * step).total_gib
        return totals[k] <= budget

    if not fits(1):
        return 0
    lo, hi = 1, None  # fits(lo); not fits(hi)
    points = [1, min(top, max(2, 2**20 // step))]  # 1 and ~1M tokens: two runs for the first secant
    for _ in range(4):
        for k in points:
            if fits(k):
                lo = max(lo, k)
            else:
                hi = k if hi is None else min(hi, k)
        if lo == top or (hi is not None and hi - lo <= 1):
            break
        (a, b) = sorted(totals)[-2:] if hi is None else (lo, hi)
        slope = (totals[b] - totals[a]) / (b - a)
        guess = top if slope <= 0 else int(a + (budget - totals[a]) / slope)
        guess = min(max(guess, lo + 1), top if hi is None else hi - 1)
        points = [guess, guess + 1] if guess < top else [guess]
    while hi is not None and hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo * step


def context_step(setup: TrainSetup, granularity: int = 2**14) -> int:
    return math.lcm(granularity, setup.seq_multiple)


def binding_limit(dims: ModelDims, setup: TrainSetup, method: AttentionScheme, max_len: int) -> str:
    """What stops the next length after ``max_len``: "GPU", "host" or "both"."""
    nxt = max_len + context_step(setup)
    gpu_over = predict(dims, setup, method, nxt).total_gib > setup.gpu_memory_gib
    host_over = sum(host_terms(dims, setup, nxt).values()) > setup.host_memory_gib * GiB
    return "both" if gpu_over and host_over else "host" if host_over else "GPU"


def nothing_fits(dims: ModelDims, setup: TrainSetup, method: AttentionScheme) -> str:
    """Why not even the smallest length fits: the binding memory and its largest terms."""
    n = context_step(setup)
    p = predict(dims, setup, method, n)
    parts = []
    if not p.gpu_fits:
        gpu = {
            "model states": p.model_states_gib,
            "ZeRO buffers": p.zero_buffers_gib,
            "reserve": p.reserve_gib,
            "the other layers": p.other_layers_gib,
            f"{p.peak_phase} phase": p.phase_gib,
        }
        top = max(gpu, key=lambda k: gpu[k])
        parts.append(
            f"GPU: {p.total_gib:.1f} GiB > --gpu-memory {setup.gpu_memory_gib:g} GiB at {fmt_tokens(n)} tokens, "
            f"largest term {top} {gpu[top]:.1f} GiB"
        )
    if not p.host_fits:
        top = max(p.host_terms_gib, key=lambda k: p.host_terms_gib[k])
        parts.append(
            f"host: {p.host_gib:.1f} GiB > --host-memory {setup.host_memory_gib:g} GiB per node at "
            f"{fmt_tokens(n)} tokens, largest term {top} {p.host_terms_gib[top]:.1f} GiB"
        )
    return f"{p.method}: nothing fits; " + "; ".join(parts)


def which_head_chunk_report(
    dims: ModelDims, setup: TrainSetup, seq_len: int, methods: Sequence[AttentionScheme] | None = None
) -> str:
    """Answer "which U do I need for N tokens": every method at N (``methods``, as the plan table runs
    them; default ``methods_for``), then the recommendation (the largest U that fits: fewest stages,
    closest to Ulysses' speed)."""
    methods = list(methods) if methods is not None else methods_for(dims, setup.gpus, ring_size=setup.ring_size)
    preds = [predict(dims, setup, m, seq_len) for m in methods]
    ring = f" (Ulysses {setup.ulysses_size} x ring {setup.ring_size})" if setup.ring_size > 1 else ""
    lines = [f"at {fmt_tokens(seq_len)} tokens on {setup.gpus} x {setup.gpu_memory_gib:g} GiB{ring}:"]
    for p in preds:
        lines.append(f"  {p.method:<22}{p.total_gib:>8.1f} GiB  {'fits' if p.fits else 'does not fit'}")
    upipe_fit = [(p, m) for p, m in zip(preds, methods) if m.kind == "upipe" and p.fits]
    if methods[0].kind == "ulysses" and preds[0].fits:
        lines.append("-> Ulysses (ALST) already fits; UPipe is not needed at this length.")
    elif upipe_fit:
        best = max(upipe_fit, key=lambda pm: pm[1].head_chunk_size or 0)[0]
        lines.append(f"-> use {best.method}: the largest head chunk that fits (fewest stages).")
    else:
        lines.append("-> nothing fits at this length. Add GPUs, offload more, or shorten the sequence.")
    return "\n".join(lines)


def fmt_tokens(n: int) -> str:
    """Tokens with the paper's K = 1024, M = 1024K."""
    if n >= 2**20:
        return f"{n / 2**20:.2f}".rstrip("0").rstrip(".") + "M"
    if n >= 2**10:
        return f"{n / 2**10:.0f}K"
    return str(n)


def paper_step(n: int) -> str:
    """The largest of the paper's lengths not above ``n`` (what its grid would report)."""
    fitting = [s for s in PAPER_STEPS if s <= n]
    return fmt_tokens(fitting[-1]) if fitting else "<128K"


def moe_basis(dims: ModelDims) -> str:
    """How an MoE model (and a windowed one) is planned, for the reports ("" for a dense full-causal one)."""
    notes = []
    if dims.num_experts:
        notes.append(
            f"MoE: {dims.num_experts} experts of {dims.intermediate_size}, top-{dims.experts_per_token}; all experts "
            "in the model states and ZeRO-3's gathered layer; the fake run's MLP is a dense stand-in of width "
            f"{dims.mlp_stand_in_intermediate} (top-k x (expert intermediate + 3/4 hidden): one token's activations "
            "in its experts)"
        )
    if dims.sliding_window:
        notes.append(f"sliding-window layers ({dims.sliding_window} tokens) planned as full causal (an upper bound)")
    if dims.attention_sinks:
        notes.append("attention sinks: one logit per head, no activation term")
    return "; ".join(notes)


def describe(dims: ModelDims, setup: TrainSetup) -> str:
    moe = (
        f", {dims.num_experts} experts top-{dims.experts_per_token}, {dims.active_params_per_token / 1e9:.2f}B active"
        if dims.num_experts
        else ""
    )
    basis = moe_basis(dims)
    return (
        f"{dims.name}: H={dims.num_heads} KV={dims.num_kv_heads} d={dims.head_dim} hidden={dims.hidden_size} "
        f"intermediate={dims.intermediate_size} layers={dims.num_layers} vocab={dims.vocab_size} "
        f"({dims.total_params / 1e9:.2f}B params{moe})\n"
        + (f"{basis}\n" if basis else "")
        + f"{setup.gpus} GPUs x {setup.gpu_memory_gib:g} GiB"
        + (f" (Ulysses {setup.ulysses_size} x ring {setup.ring_size})" if setup.ring_size > 1 else "")
        + f", ZeRO-{setup.zero_stage}, {setup.dtype}, "
        f"checkpointing={setup.checkpointing} (CPU offload={setup.offload_checkpoints}"
        + (f", {setup.checkpoint_pairs} checkpoint pairs" if setup.checkpoint_pairs else "")
        + f"), {setup.stack_label}, "
        f"kernel workspace={setup.kernel}, micro-batch={setup.batch}, reserve={setup.reserve_gib:g} GiB\n"
        f"host {setup.host_memory_gib:g} GiB per node, offload_optimizer={setup.offload_optimizer}, "
        f"offload_param={setup.offload_param}, checkpoint pinning={setup.checkpoint_pinning}"
    )


def plan_table(dims: ModelDims, setup: TrainSetup, seq_lens: Iterable[int], methods: list[AttentionScheme]) -> str:
    """Predicted peak GiB per method and length (* = does not fit) and each method's max context."""
    seq_lens = list(seq_lens)
    head = (
        f"{'method':<22}"
        + "".join(f"{fmt_tokens(s):>9}" for s in seq_lens)
        + f"{'max context':>13}{'grid':>7}{'binds':>7}"
    )
    lines = [
        describe(dims, setup),
        "predicted peak GiB per GPU (* = does not fit the GPU; + = does not fit the host)",
        head,
        "-" * len(head),
    ]
    for m in methods:
        cells = []
        for s in seq_lens:
            p = predict(dims, setup, m, s)
            cells.append(f"{p.total_gib:>8.1f}{'+' if not p.host_fits else ' ' if p.gpu_fits else '*'}")
        mc = max_context(dims, setup, m)
        binds = binding_limit(dims, setup, m, mc) if mc else "-"
        lines.append(f"{m.label:<22}" + "".join(cells) + f"{fmt_tokens(mc):>13}{paper_step(mc):>7}{binds:>7}")
    host_row = [sum(host_terms(dims, setup, s).values()) / GiB for s in seq_lens]
    lines.append(f"{'host GiB per node':<22}" + "".join(f"{h:>8.0f} " for h in host_row))
    states = model_state_bytes(dims, setup) / GiB
    zero = zero_buffer_bytes(dims, setup) / GiB
    lines.append(
        f"fixed per GPU: model states {states:.1f} GiB, ZeRO buffers {zero:.1f} GiB, "
        f"reserve {setup.reserve_gib:g} GiB; 'grid' = the largest of the paper's lengths (128K ... 5M) that fits; "
        f"host: {setup.host_memory_gib:g} GiB per node of {ranks_per_node(setup)} ranks, 'binds' = what stops "
        "the next length"
    )
    return "\n".join(lines)


def breakdown_report(dims: ModelDims, setup: TrainSetup, method: AttentionScheme, seq_len: int) -> str:
    """The components of the predicted peak at ``seq_len`` and the allocation that sets it."""
    p = predict(dims, setup, method, seq_len, live=True)
    lines = [
        f"breakdown: {p.method} at {fmt_tokens(seq_len)} tokens ({p.total_gib:.2f} GiB of "
        f"{setup.gpu_memory_gib:g}, {'fits' if p.fits else 'does not fit'})",
        *([f"  model basis: {moe_basis(dims)}"] if moe_basis(dims) else []),
        f"  model states (ZeRO-{setup.zero_stage}, analytic)        {p.model_states_gib:8.2f} GiB",
        f"  ZeRO buffers (analytic)                  {p.zero_buffers_gib:8.2f} GiB",
        f"  reserve (assumed: {RESERVE_BASIS})",
        f"                                           {p.reserve_gib:8.2f} GiB",
        f"  {p.peak_phase} phase of a two-layer step, fake-tensor run   {p.phase_gib:8.2f} GiB"
        + (f"  (of which kernel workspace {p.workspace_gib:.2f}, analytic)" if p.workspace_gib else ""),
        f"  the other {max(0, dims.num_layers - 2)} layers in that phase (analytic)   {p.other_layers_gib:8.2f} GiB"
        f"  ({p.other_layers_basis})",
        "  phases (two-layer run + other layers): " + ", ".join(f"{k} {v:.2f} GiB" for k, v in p.phases_gib.items()),
        f"  peak set by: {p.peak_at}",
        "  alive at the peak (by the operation that allocated it):",
    ]
    lines += [f"    {gib:8.2f} GiB  {label}" for label, gib in p.live_at_peak]
    lines.append(
        f"  host memory per node ({ranks_per_node(setup)} ranks): {p.host_gib:.1f} GiB of "
        f"{setup.host_memory_gib:g}, {'fits' if p.host_fits else 'does not fit'}"
    )
    lines += [f"    {gib:8.1f} GiB  {label}" for label, gib in p.host_terms_gib.items()]
    lines.append(f"    (OS and processes: {setup.host_os_gib:g} + {setup.host_per_rank_gib:g}/rank GiB; {HOST_BASIS})")
    if setup.checkpoint_pairs:
        lines.append(
            f"  checkpoint pairs: {setup.checkpoint_pairs} (layers 0-{2 * setup.checkpoint_pairs - 1}): "
            f"{setup.checkpoint_pairs} layer inputs/rank fewer kept, {setup.checkpoint_pairs} more layer forwards per "
            f"step, about +{100 * pair_recompute_fraction(dims, setup):.1f}% of the layers' compute (estimate: "
            "backward = 2 forwards)"
        )
    return "\n".join(lines)


def to_json(dims: ModelDims, setup: TrainSetup, seq_lens: Iterable[int], methods: list[AttentionScheme]) -> dict:
    out: dict = {"model": asdict(dims), "setup": asdict(setup), "predictions": [], "max_context": {}}
    for m in methods:
        out["max_context"][m.label] = max_context(dims, setup, m)
        out["predictions"].extend(asdict(predict(dims, setup, m, s)) for s in seq_lens)
    return out
