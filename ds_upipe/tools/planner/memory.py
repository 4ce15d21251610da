"""The arithmetic: the analytic terms, the fake-tensor phases and one whole training step on one GPU (``predict``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from ...schedule import valid_head_chunk_sizes
from .models import MIXER_LAYER, ModelDims
from .setup import AttentionScheme, TrainSetup
from .units import DTYPE_BYTES, GiB

if TYPE_CHECKING:
    pass

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


#: what ``TrainSetup.reserve_gib`` (``--gpu-reserve``) stands for (not measured here: no GPU in the test environment)
RESERVE_BASIS = (
    "CUDA context + cuBLAS/cuDNN workspaces ~1 GiB; NCCL: a ZeRO-3 SP run has at least 3 communicators (world, "
    "sequence, data) and on NVSwitch nodes with NVLS on one takes ~1.6 GB, >= 3 ~6 GB (NVIDIA/nccl#864; "
    "NCCL_NVLS_ENABLE=0: ~0.5-0.7 GB each, nccl#964), ~4 GiB assumed; caching-allocator fragmentation ~3 GiB "
    "(with expandable_segments); 8 GiB assumed"
)
#: what ``host_os_gib`` (``--host-reserve``) and ``host_per_rank_gib`` stand for (assumed, not measured)
HOST_BASIS = (
    "per node: the OS, daemons (monitoring, container runtime, filesystem clients) and the page cache the "
    "data set and checkpoints keep (64 GiB assumed); per rank: the CUDA driver's host mappings, torch / "
    "DeepSpeed / Python libraries, the data loader, DeepSpeed's host staging (8 GiB)"
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


def kept_checkpoints(dims: ModelDims, setup: TrainSetup) -> tuple[int, int, int]:
    """(layer inputs DeepSpeed's offload engine pins on the host, inputs the checkpoint groups keep, inner
    inputs a group's backward holds) per rank.  DeepSpeed checkpoints the ``layers - N k`` layers above the
    groups and keeps the newest input on the GPU (``keep_last_count=1``); each of the N groups keeps one
    input (its own exact-size buffer, ``integration.checkpoint_groups.GroupInputStore``) and the group whose
    backward runs holds its k - 2 inner inputs (one pool for all groups)."""
    groups, k = setup.checkpoint_groups, setup.checkpoint_group_size
    if groups * k > dims.num_layers:
        raise ValueError(
            f"checkpoint_groups={groups} of {k}: {dims.name} has {dims.num_layers} layers, so at most "
            f"{dims.num_layers // k}"
        )
    return max(0, dims.num_layers - groups * k - 1), groups, (k - 2 if groups else 0)


def group_recompute_fraction(dims: ModelDims, setup: TrainSetup) -> float:
    """The checkpoint groups' extra compute as a fraction of a checkpointed step's layer compute: N (k - 1)
    more layer forwards (each group's top backward recomputes its layers' inputs once) over L x (forward +
    recompute + backward ~ 2 forwards) = 4L forwards (backward ~ 2 forwards: the usual 2:1 FLOP rule; an
    estimate, not a measurement)."""
    return setup.checkpoint_groups * (setup.checkpoint_group_size - 1) / (4 * dims.num_layers)


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
        engine, groups, inner = kept_checkpoints(dims, setup)
        per_rank = engine * pinned_block_bytes(x, setup.checkpoint_pinning)
        terms[f"checkpoints ({engine} layer inputs/rank, {setup.checkpoint_pinning} pinned)"] = ranks * per_rank
        if groups:
            label = f"checkpoint groups of {setup.checkpoint_group_size} ({groups} saved + {inner} inner layer inputs"
            terms[f"{label}/rank, exact pinned)"] = ranks * (groups + inner) * x
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


def step_spec(dims: ModelDims, setup: TrainSetup, scheme: AttentionScheme, seq_len: int, kind: str = "") -> Any:
    """The fake run's spec; a hybrid's for its layers of ``kind`` (``ModelDims.layer_counts``)."""
    from ...integration.fake_run import StepSpec

    if seq_len < setup.gpus or seq_len % setup.gpus:
        raise ValueError(f"seq_len={seq_len} is not a positive multiple of gpus={setup.gpus}")
    if dims.is_hybrid:
        check_hybrid_scheme(dims, setup, scheme)
    u = scheme.options.head_chunk_size
    if scheme.kind == "upipe" and u is not None:
        valid = valid_head_chunk_sizes(dims.num_heads, dims.num_kv_heads, setup.ulysses_size)
        if u not in valid:
            raise ValueError(f"head_chunk_size={u} is not valid here; valid: {valid}")
    options = scheme.options
    if kind == MIXER_LAYER:
        # a step of mixer layers holds no softmax attention: its attention U cannot change it, so the schemes that
        # differ only there share one fake run (``fake_run.model_step``'s cache; a gated delta net's torch fallback
        # loops over S / 64 chunks a stage: minutes at a million tokens)
        options = replace(options, head_chunk_size=None)
    return StepSpec(
        model=dims.shape(kind),
        attention="alst" if scheme.kind == "ulysses" else "upipe",
        sp_size=setup.gpus,
        seq_len=seq_len,
        options=options,
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


def check_hybrid_scheme(dims: ModelDims, setup: TrainSetup, scheme: AttentionScheme) -> None:
    """A hybrid runs under UPipe only, its mixer U valid for its heads (hf_patches.mixers' rule); ALST is refused
    as the runtime refuses it (``check_model_settings``: each rank's mixer would start from a zero state)."""
    from hf_patches.mixers.common import valid_head_chunk_sizes as valid_mixer_chunks

    if scheme.kind != "upipe":
        raise ValueError(
            f"{dims.name} is a hybrid: DeepSpeed ALST cannot run its {dims.mixer.kind if dims.mixer else ''} layers "
            "(each rank's recurrence would start from a zero state); plan UPipe (mixer_head_chunk_size = the mixer's "
            "heads is Ulysses without stages)"
        )
    if setup.ring_size != 1:
        raise ValueError(f"ring_size={setup.ring_size}: UPipe x Ring shards attention only, not a hybrid's mixers")
    if dims.mixer is not None:
        u = scheme.options.mixer_head_chunk_size
        valid = valid_mixer_chunks(dims.mixer.num_heads, setup.gpus)
        if (setup.gpus if u is None else u) not in valid:
            raise ValueError(
                f"mixer_head_chunk_size={u} is not valid for {dims.mixer.num_heads} mixer heads on "
                f"{setup.gpus} ranks (a multiple of the ranks dividing the heads); valid: {valid}"
            )


def layer_peak(
    dims: ModelDims, setup: TrainSetup, scheme: AttentionScheme, seq_len: int, live: bool = False, kind: str = ""
):
    """The fake run of one decoder layer's forward + backward (``fake_run.Peak``): what one layer saves
    without checkpointing, and the per-layer calibration against MemTracker (a hybrid: a layer of ``kind``)."""
    from ...integration import fake_run

    return fake_run.layer_step(step_spec(dims, setup, scheme, seq_len, kind), live)


def step_peak(
    dims: ModelDims, setup: TrainSetup, scheme: AttentionScheme, seq_len: int, live: bool = False, kind: str = ""
):
    """The fake run of a whole step of a two-layer model (``fake_run.model_step``: both layers, the
    final norm and the loss, forward and backward, measured together; ``Peak.phases`` per phase); a
    hybrid's: both layers of ``kind``."""
    from ...integration import fake_run

    spec = step_spec(dims, setup, scheme, seq_len, kind)
    return fake_run.model_step(spec, keep_gradients=not setup.optimizer, live=live)


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
    #: a vision-language model's terms (``vision_terms``): "resident" (in every phase above), "merge" (its phase)
    vision_gib: dict[str, float] = field(default_factory=dict)
    #: what of that peak a real run has on the host (``offloaded_below_top``), subtracted
    offloaded_gib: float = 0.0
    offloaded_basis: str = ""


def images_per_rank(setup: TrainSetup) -> int:
    """The most images a rank's tower encodes in a micro-batch (``hf_patches.vlm.image_share``: whole images in
    contiguous shares differing by one; a rank with an empty share encodes one image as a stand-in)."""
    images = setup.images * setup.batch
    return max(1, -(-images // setup.gpus)) if images else 0


def vision_terms(dims: ModelDims, setup: TrainSetup, seq_len: int) -> dict[str, tuple[int, str]]:
    """What a vision-language model (``hf_patches.vlm``) adds on each rank to the text model's step, by term:
    (bytes, basis).  "resident": held through every phase of the text model; "forward": held by the model's
    forward while the text model's forward runs; "merge": the peak of the merge before it (a phase of its own).
    Empty for a text model."""
    if not dims.vision_model_type:
        if setup.images or setup.vision_tokens or setup.tower_bytes_per_image:
            raise ValueError(
                f"images / vision tokens / tower memory given for {dims.name}, a text model: they plan a "
                "vision-language model's config.json (its vision_config)"
            )
        return {}
    if setup.ring_size > 1:
        raise ValueError(f"{dims.name}: a vision-language model with ring_size={setup.ring_size} is not supported")
    row = setup.batch * dims.hidden_size * setup.act_bytes  # one token of a [B, S, hidden] tensor
    vision = min(setup.vision_tokens, seq_len)
    images = images_per_rank(setup)
    tower = images * setup.tower_bytes_per_image
    given = f"{setup.tower_bytes_per_image / 2**20:.1f} MiB each, given" if tower else "not given: 0"
    return {
        "resident": (
            vision * row + tower,
            f"{vision} gathered vision tokens' features (the output's image features) and {images} images' tower "
            f"activations ({given})",
        ),
        "forward": (
            seq_len * row + vision * row,
            "the whole sample's merged embeddings and the features' concatenation, held by the model's forward "
            "(each rank's text model runs on a copy of its shard)",
        ),
        "merge": (
            2 * seq_len * row + 2 * vision * row + tower,
            "the merge: the token embeddings and the merged copy of the whole sample, the gathered features and "
            "their concatenation, the tower's activations",
        ),
    }


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
        groups, k = setup.checkpoint_groups, setup.checkpoint_group_size
        # a group keeps one input for k layers, and its backward holds k - 2 inner ones (counted throughout)
        kept = max(0, extra - groups * (k - 1)) + kept_checkpoints(dims, setup)[2]
        below = (
            (0, "checkpoints of the layers below: offloaded to the host")
            if setup.offload_checkpoints
            else (
                kept * hidden_state_bytes(dims, setup, seq_len),
                f"{kept} more layer inputs kept as checkpoints (DeepSpeed keeps each checkpointed layer's input"
                + (f"; {groups} groups keep one for {k} layers, {k - 2} inner in backward)" if groups else ")"),
            )
        )
    else:
        below = (extra * saved_per_layer, f"{extra} more layers' saved activations (one layer's, measured, each)")
    if setup.optimizer:
        above = (0, "weight gradients of the layers above: in ZeRO's buckets (model states, ZeRO buffers)")
    else:
        grads = extra * dims.params_per_layer * setup.act_bytes
        above = (grads, f"{extra} more layers' weight gradients (kept from their creation on: no optimizer)")
    inner = kept_checkpoints(dims, setup)[2]
    if setup.checkpointing and not setup.offload_checkpoints and inner and not setup.optimizer:
        # the lowest group's top layer replays with its k - 2 inner inputs held while nearly every gradient is
        # alive (no optimizer: measured, tests/test_planner.py's grouped step); with one the top-layer phase,
        # which counts the inner inputs, is the larger
        inner_bytes = inner * hidden_state_bytes(dims, setup, seq_len)
        above = (above[0] + inner_bytes, f"{above[1]}; {inner} inner layer inputs of the lowest group's backward")
    return {"forward": below, "loss": below, "top layer": below, "bottom layer": above}


def offloaded_below_top(dims: ModelDims, setup: TrainSetup, seq_len: int) -> dict[str, tuple[int, str]]:
    """Per phase of the two-layer step, what its measured peak holds that a real run has in host memory
    (bytes, subtracted; basis).  The fake run keeps the bottom layer's input (in a real model layer
    L - 2's, a DeepSpeed checkpoint) on the device throughout.  ds_upipe's offload engine keeps no forward
    stash (``integration.checkpointing.FORWARD_STASH``), so with checkpoints offloaded into its exact pool
    that input's device copy goes once its copy out (started after the top layer's forward) is done, and
    the bottom layer's backward brings it back: it is not on the device in the top layer's backward, where
    the step peaks (counted in the forward and the loss phase, conservatively: the copy may still run).
    DeepSpeed's own engine (``pow2`` pinning) keeps it on the device (``max_fwd_stash_count=2``).  Only
    where both measured layers stand for DeepSpeed's checkpointed layers (checkpoint groups below them)."""
    from ...integration.checkpointing import FORWARD_STASH

    engine_layers = dims.num_layers - setup.checkpoint_groups * setup.checkpoint_group_size
    if not (
        setup.checkpointing
        and setup.offload_checkpoints
        and setup.checkpoint_pinning == "exact"
        and FORWARD_STASH == 0
        and engine_layers >= 2
    ):
        return {}
    x = hidden_state_bytes(dims, setup, seq_len)
    basis = "the bottom layer's input: on the host (ds_upipe's offload engine keeps no forward stash)"
    return {"top layer": (x, basis)}


def predict(
    dims: ModelDims, setup: TrainSetup, method: AttentionScheme, seq_len: int, live: bool = False
) -> Prediction:
    """Peak memory of one GPU for one training step at ``seq_len`` tokens (the whole sequence, split
    over ``setup.gpus`` sequence-parallel ranks).  ``live``: also the largest allocations at the peak.

    The step of a two-layer model is measured whole (``step_peak``), phase by phase; each phase gets
    what the other layers add there (``other_layers``), and the largest sum, with the model states,
    ZeRO buffers and the reserve, is the prediction."""
    kept_checkpoints(dims, setup)  # checkpoint groups within the model's layers
    vision = vision_terms(dims, setup, seq_len)  # refused before any fake run
    saved = 0
    if not setup.checkpointing:  # what one layer keeps from its forward to its backward, its input among them
        x = hidden_state_bytes(dims, setup, seq_len)
        rope = 2 * setup.batch * (seq_len // setup.gpus) * dims.head_dim * setup.act_bytes
        for kind in dims.layer_counts:  # a hybrid: the largest kind's for every layer (an upper bound)
            layer = layer_peak(dims, setup, method, seq_len, kind=kind)
            kept = layer.after_forward - layer.weights - x - rope - 8 * setup.batch * (seq_len // setup.gpus)
            saved = max(saved, kept)
    others = other_layers(dims, setup, seq_len, saved)
    offloaded = offloaded_below_top(dims, setup, seq_len)
    # a hybrid: a two-layer step of each kind of layer; each phase's peak is the largest kind's there
    steps = {kind: step_peak(dims, setup, method, seq_len, live, kind) for kind in dims.layer_counts}
    by_kind = {
        kind: {k: others[k][0] - offloaded.get(k, (0, ""))[0] + v - s.weights for k, v in s.phases.items()}
        for kind, s in steps.items()
    }
    phases = {k: max(p[k] for p in by_kind.values()) for k in next(iter(by_kind.values()))}
    if vision:  # a vision-language model: its merge before the text model, and what it holds through it
        phases = {
            k: v + vision["resident"][0] + (vision["forward"][0] if k == "forward" else 0) for k, v in phases.items()
        }
        phases = {"vision merge": vision["merge"][0], **phases}
    phase = max(phases, key=lambda k: phases[k])
    kind = max(by_kind, key=lambda kd: by_kind[kd].get(phase, 0))
    step = steps[kind]
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
    measured = step.phases.get(phase, step.weights)  # the vision merge runs no decoder layer
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
        other_layers_gib=others.get(phase, (0, ""))[0] / GiB,
        other_layers_basis=others.get(phase, (0, "none: before the decoder layers"))[1],
        offloaded_gib=offloaded.get(phase, (0, ""))[0] / GiB,
        offloaded_basis=offloaded.get(phase, (0, ""))[1],
        phase_gib=(measured - step.weights) / GiB,
        vision_gib={k: b / GiB for k, (b, _) in vision.items()},
        workspace_gib=step.workspace / GiB if at_peak else 0.0,
        peak_at=(f"{kind} layers: " if kind else "")
        + (step.at if at_peak else f"the {phase} phase's peak (the step's own peak is in another phase)")
        + (f"; with the vision-language model's {vision['resident'][1]}" if vision else "")
        + (f" and {vision['forward'][1]}" if vision and phase == "forward" else ""),
        phases_gib={k: v / GiB for k, v in phases.items()},
        live_at_peak=[(label, b / GiB) for label, b in step.live] if at_peak else [],
    )
