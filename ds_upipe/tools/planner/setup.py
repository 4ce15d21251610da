"""The run being planned (``TrainSetup``, ``AttentionScheme``), read from a ds_config or measured settings."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from ...integration.fake_run import KERNELS
from ...layout import SequenceLayout
from ...options import UPipeOptions
from ...schedule import valid_head_chunk_sizes
from .models import ModelDims
from .units import DTYPE_BYTES

if TYPE_CHECKING:
    from ...integration.config import SPSettings

# -- the run being planned -----------------------------------------------------------------------


@dataclass(frozen=True)
class AttentionScheme:
    """``ulysses`` is DeepSpeed ALST's UlyssesSPAttentionHF; ``upipe`` is ours with ``options`` (U =
    ``options.head_chunk_size``; ignored for ``ulysses``)."""

    kind: str  # "ulysses" | "upipe"
    options: UPipeOptions = UPipeOptions()

    @classmethod
    def upipe(cls, head_chunk_size: int | None = None, **settings: Any) -> AttentionScheme:
        """UPipe at U = ``head_chunk_size`` with ``settings`` (``UPipeOptions`` fields)."""
        return cls("upipe", UPipeOptions(head_chunk_size=head_chunk_size, **settings))

    def with_options(self, **settings: Any) -> AttentionScheme:
        """This scheme with ``settings`` (``UPipeOptions`` fields) replaced."""
        return replace(self, options=UPipeOptions.of(self.options, **settings))

    @property
    def label(self) -> str:
        if self.kind == "ulysses":
            return "ulysses (ALST)"
        mixer = self.options.mixer_head_chunk_size
        return f"upipe{self.options.label} U={self.options.head_chunk_size}" + (f" mixer U={mixer}" if mixer else "")


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
    #: CUDA flash = flash-attn 2), "fa3", "none" (CPU: MemTracker sees everything); a CUDA one also plans gated delta
    #: nets as FLA's chunk kernel (``fake_run.fla``), "none" as transformers' torch fallback
    kernel: str = "fa2"
    #: CUDA context, NCCL communicators and buffers, allocator fragmentation (``RESERVE_BASIS``)
    reserve_gib: float = 8.0
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
    #: upipe.checkpoint_groups / checkpoint_group_size (checkpoint_pairs N = N groups of 2): the lowest N x k
    #: layers checkpointed in groups of k on one saved input (``ds_upipe.integration.checkpoint_groups``):
    #: N (k - 1) layer inputs fewer kept, k - 2 held while a group's backward runs, N (k - 1) more layer forwards
    checkpoint_groups: int = 0
    checkpoint_group_size: int = 2
    #: host memory per node outside the tensors above (``HOST_BASIS``): ``host_os_gib`` per node
    #: (``--host-reserve``), ``host_per_rank_gib`` per rank
    host_os_gib: float = 64.0
    host_per_rank_gib: float = 8.0
    #: a vision-language model (``ModelDims.vision_model_type``): images and vision tokens (after the tower's
    #: merger: the placeholder tokens of its images) per sample, and the activations its vision tower and
    #: projector save for backward per image (bytes, measured by the user: ``vlm_cases.tower_memory`` shows how;
    #: 0: not planned).  The vision tokens are sequence tokens: a planned length includes them
    images: int = 0
    vision_tokens: int = 0
    tower_bytes_per_image: int = 0

    def __post_init__(self) -> None:
        for name in ("images", "vision_tokens", "tower_bytes_per_image"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0")
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
        if self.checkpoint_groups < 0 or (self.checkpoint_groups and not self.checkpointing):
            raise ValueError(f"checkpoint_groups={self.checkpoint_groups} needs checkpointing=True and must be >= 0")
        if self.checkpoint_group_size < 2:
            raise ValueError(f"checkpoint_group_size={self.checkpoint_group_size} must be >= 2")
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


def measured_scheme(kind: str, options: UPipeOptions | None = None) -> AttentionScheme:
    """The scheme of a measured method: the bench's ``"alst"`` is the planner's ``"ulysses"``."""
    if kind == "alst":
        return AttentionScheme("ulysses")
    return AttentionScheme("upipe", options or UPipeOptions())


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
    """Ulysses, then UPipe at every valid U (smallest first); a hybrid: UPipe at U = C with mixer U = C, then
    mixer U = all its heads (one stage), then attention U = H too (Ulysses without stages: Megatron's, VeOmni's).
    With a ring (``ring_size`` > 1) UPipe x Ring
    at every U valid for C_u = gpus / ring_size; U = H is Ulysses x Ring (DeepSpeed ALST has no ring)."""
    if dims.mixer is not None:  # a hybrid: UPipe's mixer stages against all mixer heads at once (ALST refuses it)
        both = dict(fused_projections=fused, overlap_comm=overlap_comm)
        c, h, mh = gpus, dims.num_heads, dims.mixer.num_heads
        return [AttentionScheme.upipe(u, mixer_head_chunk_size=mu, **both) for u, mu in ((c, c), (c, mh), (h, mh))]
    us = valid_head_chunk_sizes(dims.num_heads, dims.num_kv_heads, gpus // ring_size)
    upipe = [AttentionScheme.upipe(u, fused_projections=fused, overlap_comm=overlap_comm) for u in us]
    return upipe if ring_size > 1 else [AttentionScheme("ulysses"), *upipe]


# -- a ds_config ------------------------------------------------------------------------------------


def from_ds_config(
    config: dict[str, Any] | SPSettings, base: TrainSetup | None = None
) -> tuple[TrainSetup, AttentionScheme, int | None]:
    """(setup, the attention scheme it runs, upipe.seq_length) of a ds_config: what the run does.

    Reads the validated settings the runtime reads (``ds_upipe.integration.config.parse_config``,
    given a ds_config dict, or its ``SPSettings``): the same rules, the same errors (an unknown
    ``upipe`` key is refused, as ``ds_upipe.initialize`` refuses it), the tile sizes as configured."""
    from ...integration.config import parse_config, tiled

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
        checkpoint_groups=upipe.checkpoint_grouping[0],
        checkpoint_group_size=upipe.checkpoint_grouping[1],
    )
    if upipe.enabled:
        u = upipe.head_chunk_size
        # "auto": auto_head_chunk_size, once the setup is final (cli)
        scheme = AttentionScheme("upipe", upipe.options(None if u == "auto" else u))
    else:
        scheme = AttentionScheme("ulysses")
    return setup, scheme, upipe.seq_length


def auto_head_chunk_size(dims: ModelDims, setup: TrainSetup, scheme: AttentionScheme, upipe: Any) -> int:
    """The U that ``upipe.head_chunk_size: "auto"`` picks for this model and setup: the runtime's rule and
    measurement (``integration.auto_chunk.choose_head_chunk_size`` on the model's attention layer, at
    ``upipe.seq_length`` with ``upipe.memory_budget_gib``), with the scheme's settings (flags given on
    the command line override the block's, as they do for the plan)."""
    from ...integration.auto_chunk import choose_head_chunk_size

    return choose_head_chunk_size(
        upipe.model_copy(update=dict(ring_size=setup.ring_size)),
        num_heads=dims.num_heads,
        num_kv_heads=dims.num_kv_heads,
        head_dim=dims.head_dim,
        group_size=setup.ulysses_size,
        micro_batch_size=setup.batch,
        dtype_bytes=setup.act_bytes,
        model_config=dims.shape().config(1),
        options=scheme.options,
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
