"""The one sequence-parallel setup behind ``ds_upipe.initialize`` (engine.py) and the HF Trainer /
accelerate path (hf_integration.py).

- the mpu: DeepSpeed's ``parallel_state_sp`` groups (contiguous ranks), as ALST builds them;
- a HuggingFace model prepared for the run (``prepare_for_run``: ``prepare.prepare_model`` with the
  ``"upipe"`` block's options at the U ``auto_chunk.run_head_chunk_size`` chose) or DeepSpeed ALST's
  Ulysses (``register_alst``);
- the long-context stack of the ``"upipe"`` block (``tiled_loss``, ``tiled_norm``, ``tiled_mlp``:
  ``hf_patches.apply_long_context_stack``), with UPipe, ALST or no sequence parallelism;
- the ds_config's ``activation_checkpointing`` section applied to the model's layers;
- the ZeRO / BF16_Optimizer gradient-average correction (DeepSpeed issue #5248).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from deepspeed.accelerator import get_accelerator

from hf_patches import check_long_context_stack, check_mixer_settings
from hf_patches.mixers import mixer_kind_of
from hf_patches.packing import per_document_attention

from ..heads import HeadLayout
from .auto_chunk import run_mixer_head_chunk_size
from .checkpoint_groups import check_groups_fit, install_checkpoint_groups
from .checkpointing import install_exact_pinned_pool, releasing
from .config import SPSettings, UPipeConfig, tiled
from .prepare import prepare_model

#: attention functions ALST replaced in transformers' registry, to restore them.  Process-level because
#: what it undoes is: transformers' ``ALL_ATTENTION_FUNCTIONS`` is one registry per process by design,
#: and ALST's ``register_with_transformers`` replaces the function under the model's implementation
#: name for every model of the process (ds_upipe's own UPipe attention is registered under its own
#: name, "upipe", and reads all its settings from the calling module's runtime).
REPLACED_ATTENTION: dict[str, Callable[..., Any]] = {}


def model_head_layout(model: torch.nn.Module) -> HeadLayout:
    """The head layout of a HuggingFace model; ValueError for anything else."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "get_text_config"):
        raise ValueError(
            f"sequence_parallel_size > 1 needs a HuggingFace transformers model (with .config); "
            f"got {type(model).__name__}. For other models use ds_upipe.UPipeDistributedAttention directly."
        )
    return HeadLayout.from_config(config)


#: the sequence-parallel group -> its (ring_size -> this rank's (Ulysses group, ring group)): the
#: subgroups live as long as the group they divide (weak keys: a destroyed group's entry goes with it,
#: and a new group never meets an old group's subgroups, as an id() key could once the id is reused)
_RING_GROUPS: weakref.WeakKeyDictionary[Any, dict[int, tuple[Any, Any]]] = weakref.WeakKeyDictionary()


def upipe_groups(sequence_group: Any, settings: SPSettings) -> tuple[Any, Any]:
    """(the group UPipe's all-to-alls run over, the ring group or None).

    Without a ring that is the mpu's sequence-parallel group.  With ``upipe.ring_size`` R the mpu's
    group (C_u x R contiguous ranks) stays DeepSpeed's sequence-parallel group (data, gradient
    averaging, loss), and UPipe runs over its Ulysses and ring subgroups
    (``ds_upipe.ring.build_sequence_groups``: C_u consecutive ranks, within a node; rings across
    nodes).  Every rank must call this (group creation is collective)."""
    if settings.ring_size == 1:
        return sequence_group, None
    from ..ring import build_sequence_groups

    by_ring = _RING_GROUPS.setdefault(sequence_group, {})
    if settings.ring_size not in by_ring:
        by_ring[settings.ring_size] = build_sequence_groups(settings.sequence_parallel_size, settings.ring_size)
    return by_ring[settings.ring_size]


def restore_attention_functions() -> None:
    """Undo ``register_alst``'s change to transformers' attention registry."""
    if REPLACED_ATTENTION:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        for name, fn in REPLACED_ATTENTION.items():
            ALL_ATTENTION_FUNCTIONS[name] = fn
        REPLACED_ATTENTION.clear()


def sequence_parallel_mpu(sp: int) -> Any:
    """DeepSpeed's parallel_state_sp with groups of size ``sp`` (reused if they already exist)."""
    from deepspeed.runtime.sequence_parallel import parallel_state_sp

    if parallel_state_sp._SEQUENCE_PARALLEL_GROUP is not None:
        if parallel_state_sp.get_sequence_parallel_world_size() == sp:
            return parallel_state_sp
        parallel_state_sp._release_sequence_parallel_groups()
    parallel_state_sp.initialize_sequence_parallel(sequence_parallel_size=sp)
    return parallel_state_sp


def register_alst(model: torch.nn.Module, sp: int, mb: int) -> Any:
    """DeepSpeed ALST's Ulysses on this model; returns its mpu (parallel_state_sp)."""
    from deepspeed.runtime.sequence_parallel import parallel_state_sp
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    impl = model.config._attn_implementation
    if parallel_state_sp._SEQUENCE_PARALLEL_GROUP is not None:
        parallel_state_sp._release_sequence_parallel_groups()  # register_with_transformers creates them
    original = ALL_ATTENTION_FUNCTIONS.get(impl)
    packed_rows_per_document(impl)
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model,
        core_attn_implementation=impl,
        sequence_parallel_size=sp,
        micro_batch_size=mb,
        seq_length_is_variable=True,
    )
    if original is not None:
        REPLACED_ATTENTION[impl] = original
    return mpu


def packed_rows_per_document(impl: str) -> None:
    """Before ALST's registration wraps the core attention function ``impl``: with transformers'
    ``sdpa``, which ignores ``position_ids``, make it run per document on packed rows (ALST drops the
    mask, so the documents of a packed row would attend to each other; ``hf_patches.packing``).
    flash-attention functions already read the gathered positions (varlen); others are left as they are."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    core = ALL_ATTENTION_FUNCTIONS.get(impl)
    if impl == "sdpa" and core is not None and not getattr(core, "upipe_per_document", False):
        ALL_ATTENTION_FUNCTIONS[impl] = per_document_attention(core)


def prepare_for_run(
    model: torch.nn.Module,
    settings: SPSettings,
    *,
    sequence_group: Any,
    head_chunk_size: int | None,
    forward_loss: str,
    loss_group: Any,
    long_context: bool = True,
) -> None:
    """``prepare.prepare_model`` with a ds_config's settings: UPipe with the block's options at U =
    ``head_chunk_size`` over ``sequence_group`` (the whole sequence-parallel group, split here into its
    Ulysses and ring groups; None: no UPipe patching, i.e. no sequence parallelism or ALST's registration),
    then the block's long-context stack (``long_context``; ``forward_loss``: ``prepare_model``'s)."""
    upipe = settings.upipe
    ulysses_group, ring_group, options = None, None, None
    if sequence_group is not None:
        ulysses_group, ring_group = upipe_groups(sequence_group, settings)
        # "auto" measures this model's mixer layer (the micro-batch as given, else 1 row)
        mixer_u = run_mixer_head_chunk_size(settings, model, settings.micro_batch_size or 1)
        options = upipe.options(head_chunk_size, mixer_u)
    prepare_model(
        model,
        upipe=options,
        group=ulysses_group,
        ring_group=ring_group,
        stack=long_context_options(upipe) if long_context and upipe.long_context else None,
        forward_loss=forward_loss,
        loss_group=loss_group,
    )


def long_context_options(upipe: UPipeConfig) -> dict[str, Any]:
    """``apply_long_context_stack`` keyword arguments of the block's ``tiled_*`` keys."""
    options: dict[str, Any] = {}
    for part in ("loss", "norm", "mlp"):
        on, tile_tokens = tiled(getattr(upipe, f"tiled_{part}"))
        options[f"tiled_{part}"] = on
        options[f"{part}_tile_tokens"] = tile_tokens
    return options


def refuse_unexchanged_mixers(model: torch.nn.Module, upipe: bool) -> None:
    """Under ALST (``upipe`` False) refuse a model holding a sequence mixer of a kind ``hf_patches.mixers``
    runs (linear attention, state space, short conv): ALST shards only softmax attention, so each rank would
    run its mixers on its own shard from a zero state (wrong outputs and gradients, no error).  Under UPipe
    the mixers run head-sharded (``hf_patches.apply_upipe``, which refuses the kinds it cannot run)."""

    if upipe:
        return
    found = sorted({type(m).__name__ for m in model.modules() if mixer_kind_of(type(m).__name__) is not None})
    if found:
        raise ValueError(
            f"invalid ds_config: upipe.enabled: got false for {type(model).__name__}, which holds sequence mixers "
            f"({', '.join(found)}) that DeepSpeed ALST does not exchange across the sequence ranks: each rank would "
            'start their state from zero. Allowed: "upipe": {"enabled": true} (UPipe runs them head-sharded)'
        )


def check_model_settings(model: torch.nn.Module, settings: SPSettings) -> None:
    """Refuse settings the model cannot take: a stack part it lacks (e.g. ``tiled_loss`` on a model
    without an lm_head), more checkpoint groups than it has layers for; with sequence parallelism, a hybrid
    model under ALST (``refuse_unexchanged_mixers``), and what its mixers cannot run under UPipe (a ring, a
    ``mixer_head_chunk_size``: ``hf_patches.check_mixer_settings``).

    Reads only the model's structure and the config, so every rank raises the same ValueError; the
    callers run it before their first collective."""
    upipe = settings.upipe
    check_groups_fit(model, *upipe.checkpoint_grouping)
    if settings.sequence_parallel_size > 1 and isinstance(model, torch.nn.Module):
        refuse_unexchanged_mixers(model, upipe.enabled)
        if upipe.enabled:
            _check_mixer_settings(model, settings)
    if not upipe.long_context:
        return

    try:
        check_long_context_stack(model, **long_context_options(upipe))
    except ValueError as err:
        raise ValueError(f"invalid ds_config: upipe.tiled_loss/tiled_norm/tiled_mlp: {err}") from None


def _check_mixer_settings(model: torch.nn.Module, settings: SPSettings) -> None:
    """apply_upipe's mixer refusals (a ring, a ``mixer_head_chunk_size`` a kind cannot run), named by the
    ds_config key that causes them."""

    upipe = settings.upipe
    key = "ring_size" if upipe.ring_size > 1 else "mixer_head_chunk_size"
    u = None if upipe.mixer_head_chunk_size == "auto" else upipe.mixer_head_chunk_size  # "auto": C must run
    try:
        check_mixer_settings(model, settings.ulysses_size, u, upipe.ring_size > 1)
    except ValueError as err:
        raise ValueError(f"invalid ds_config: upipe.{key}={getattr(upipe, key)}: {err}") from None


def configure_activation_checkpointing(
    model: torch.nn.Module, ds_config: dict[str, Any], settings: SPSettings, mpu: Any
) -> str | None:
    """Make the ds_config's activation_checkpointing section (or upipe.offload_checkpoints) apply.

    Every HF decoder layer is then checkpointed through DeepSpeed's activation checkpointing, which
    keeps only the layer's input (sequence-sharded under SP) and, with ``cpu_checkpointing`` or
    ``upipe.offload_checkpoints``, keeps it in host memory until backward (asynchronously copied on
    CUDA), so one layer's activations at a time are on the device.  Partitioning checkpoints across
    the sequence group is refused in ds_upipe.integration.config.  Without either setting a model's
    own HF gradient checkpointing (``gradient_checkpointing_enable``) is left as the user set it.

    Returns "reentrant" (None: unchanged).  DeepSpeed's reentrant ``checkpoint``, not its
    ``non_reentrant_checkpoint`` (docs/config.md, measured): the non-reentrant one would free the
    recomputed layer output in backward (one hidden state less), but it keeps the first forward's
    autograd graph, and DeepSpeed's ``SequenceTiledCompute`` (``upipe.tiled_norm``) holds its input on
    the autograd context, outside the saved-tensor hooks a non-reentrant checkpoint replaces: two
    hidden states per layer would stay on the device for every layer (hf_patches' own tiled norm now
    saves its input with save_for_backward).  The replayed layer output that the reentrant backward
    would hold is released (``checkpointing.releasing``).  Under ZeRO-3 it also fails:
    the weights it saved while recomputing are released (emptied) by ZeRO-3 before the backward uses
    them.  The reentrant checkpoint runs the first forward without a graph."""
    offload = settings.upipe.offload_checkpoints
    if not settings.checkpointing:
        return None
    from deepspeed.runtime.activation_checkpointing import checkpointing as ds_checkpointing

    in_cpu = True if offload else None
    if get_accelerator().device_name() == "cpu":
        # Activations already live in host memory, and DeepSpeed's cpu_checkpointing path breaks
        # there: its copy to "cpu" returns the input itself, which it then empties (checkpointing.py,
        # get_cpu_activations_for_backward), so backward replays the layer on an empty tensor.
        in_cpu = False
    ds_checkpointing.configure(mpu, deepspeed_config=ds_config, checkpoint_in_cpu=in_cpu)
    # offloaded checkpoints in exact-size pinned buffers, not torch's power-of-two pinned blocks
    install_exact_pinned_pool()
    if not (getattr(model, "supports_gradient_checkpointing", False) and hasattr(model, "_set_gradient_checkpointing")):
        return None  # (checkpoint groups on such a model: refused before, by check_model_settings)
    # releasing: the replay in backward frees the replayed layer output (one hidden state) at once
    model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=releasing(ds_checkpointing.checkpoint))
    # DeepSpeed's checkpoint is reentrant: backward reaches a layer only if its input requires grad
    model.enable_input_require_grads()
    # the lowest N x k layers in groups on one saved input, kept where DeepSpeed would keep it (host or device)
    offload_groups = bool(ds_checkpointing.CPU_CHECKPOINT) and not get_accelerator().is_synchronized_device()
    install_checkpoint_groups(model, *settings.upipe.checkpoint_grouping, offload=offload_groups)
    return "reentrant"


def average_gradients_over_all_ranks(engine: Any) -> None:
    """Make DeepSpeed divide the summed gradients by the world size, and measure their norm right.

    With the full-sequence loss on every rank (module docstring), a sequence group's gradients sum
    to sp times the sample's gradient, and the average that gives the non-SP gradient is
    sum / world_size.  ZeRO-3's default reduce-scatter
    (stage3.py ``__avg_scatter_grads`` via ``reduce_scatter_coalesced``) divides by the world size.
    ZeRO-1/2 divide by ``world_size / sequence_parallel_size`` instead (stage_1_and_2.py:
    ``gradient_reduction_w_predivide``, ``average_tensor``, ``allreduce_bucket``), as do ZeRO-3's
    contiguous all-reduce paths (``__avg_scatter_contiguous_grads``, ``allreduce_bucket``): sp times
    too large, DeepSpeed issue #5248.  That divisor is the optimizer's ``sequence_parallel_size``
    attribute; the only other reader is a switch that forces float32 communication in ZeRO-1/2's
    non-reduce-scatter all-reduce (which then uses the configured communication dtype).  Setting it
    to 1 fixes the average at every ZeRO stage, in one place.

    DeepSpeed's ``BF16_Optimizer`` (ZeRO-1 with bf16 and ``data_types.grad_accum_dtype: fp32``) is
    not a ZeRO optimizer: see ``_fix_bf16_optimizer``."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    optimizer = engine.optimizer
    if isinstance(optimizer, BF16_Optimizer):
        _fix_bf16_optimizer(engine, optimizer)
    elif hasattr(optimizer, "sequence_parallel_size"):
        optimizer.sequence_parallel_size = 1


def _fix_bf16_optimizer(engine: Any, optimizer: Any) -> None:
    """Gradient scale and norm of DeepSpeed's BF16_Optimizer under the sequence-parallel mpu.

    Scale: its gradients are all-reduced by the engine (``_reduce_non_expert_gradients``), which
    divides by ``world_size / engine.sequence_parallel_size``, the same sp-times error as ZeRO-1/2;
    after initialize that division is the attribute's only reader (engine.py), so it is set to 1.

    Norm: every rank then holds the whole averaged float32 gradient.  The optimizer counts a
    gradient only on "tensor-model-parallel rank 0" and sums over the "model-parallel group"
    (``get_grads_for_norm``, ``get_global_norm_of_tensors``), and parallel_state_sp reports the
    sequence-parallel rank and group as those: ranks 1.. of a group count nothing (an empty stack
    raises there).  Without an mpu each rank takes the norm of its own full, identical gradient,
    which is the non-SP norm; the mpu is read nowhere else in the optimizer except Muon's check at
    construction."""
    engine.sequence_parallel_size = 1
    optimizer.mpu = None
