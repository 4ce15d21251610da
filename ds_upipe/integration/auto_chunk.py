"""``"head_chunk_size": "auto"`` and ``"mixer_head_chunk_size": "auto"``: the largest U whose stage memory
(the attention's; the sequence mixers'), measured on fake tensors, fits the budget (``largest_fitting``, the one
rule of both).  Apart from ``config`` (whose rules are pure) because it measures: one fake-tensor run in a
child process (``fake_run.isolated``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

from hf_patches import fused_fallback

from ..heads import HeadLayout, head_counts, per_head_counts
from ..layout import SequenceLayout
from ..options import UPipeOptions
from ..schedule import resolve_head_chunk_size, valid_head_chunk_sizes
from . import fake_run
from .config import SPSettings, UPipeConfig

logger = logging.getLogger("ds_upipe")


def attention_stage_bytes(head_chunk_size: int, **kwargs: Any) -> int:
    """``attention_stage_bytes_by_u`` of one U."""
    return attention_stage_bytes_by_u([head_chunk_size], **kwargs)[head_chunk_size]


def attention_stage_bytes_by_u(
    head_chunk_sizes: list[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    group_size: int,
    seq_length: int,
    micro_batch_size: int,
    dtype_bytes: int,
    ring_size: int = 1,
    model_config: Any = None,
    options: UPipeOptions | None = None,
    **settings: Any,
) -> dict[int, int]:
    """Per-rank attention memory of UPipe at each head chunk size, in bytes: the attention's
    intermediate peak (``fake_run.intermediate``: the peak of its forward + backward minus its inputs,
    output, their gradients, parameters and parameter gradients), measured by running it on fake
    tensors as rank 0 of the group, every U in one run (in a process that already has a process
    group: one child process), with the run's ``options`` as it runs them (``UPipeOptions.of(options,
    **settings)``; its head_chunk_size is each U in turn: accumulation, ``overlap_comm`` (two stages'
    buffers in flight), fused projections or not, ``recompute_attention_output``) and ring.

    ``model_config`` (the model's transformers config, where the route has the model): the attention
    module of a decoder layer of each kind it has (``layer_types``; the largest) patched by
    ``hf_patches.apply_upipe`` as the model will run it, on unpacked and packed rows (the
    larger counts; ``fake_run.attention_step``).  None (no HF model: the core layer): the core
    ``UPipeDistributedAttention`` on q, k, v (``fake_run.core_step``).  Kernel-internal CUDA workspaces
    are not included; the SDPA kernel runs whatever ``upipe.kernel`` is (fake tensors run on the CPU)."""
    dtype = {2: "bf16", 4: "fp32", 8: "fp64"}[dtype_bytes]
    # with a ring the real RingAttentionKernel runs too, over a fake ring group (rank 0 of C_u x R): a stage
    # attends over its ring block, with the K/V block in flight and the travelling dK/dV counted as allocated
    multiple = SequenceLayout(group_size, ring_size).sequence_multiple
    seq = max(multiple, seq_length - seq_length % multiple)
    common: dict[str, Any] = dict(
        sp_size=group_size * ring_size,
        seq_len=seq,
        batch=micro_batch_size,
        dtype=dtype,
        ring_size=ring_size,
        options=asdict(UPipeOptions.of(options, **settings)),
    )
    built = None if model_config is None else fake_run.HFModelConfig.of(model_config)
    if model_config is not None and built is None:
        logger.warning(
            '"head_chunk_size": "auto": transformers cannot build model type %r from its name (remote code); '
            "measuring the core attention layer instead of the model's (leave headroom in memory_budget_gib)",
            getattr(model_config, "model_type", None),
        )
    if built is None:
        common.update(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)
        model = None
    else:
        model = built.json_text
    peaks = fake_run.isolated("attention_activations", head_chunk_sizes=list(head_chunk_sizes), model=model, **common)
    return {int(u): int(b) for u, b in peaks.items()}


def choose_head_chunk_size(
    upipe: UPipeConfig,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    group_size: int,
    micro_batch_size: int,
    dtype_bytes: int,
    model_config: Any = None,
    options: UPipeOptions | None = None,
    layer_heads: Mapping[tuple[int, int], int] | None = None,
) -> int:
    """The head chunk size U to use: the configured int (validated against every layer's heads), C for null,
    and for "auto" the largest U valid for every layer's heads whose measured attention memory
    (``attention_stage_bytes_by_u``) fits ``memory_budget_gib`` (C when none fits).  ``group_size`` is the
    Ulysses degree C_u (the sequence-parallel size over ``upipe.ring_size``).  ``model_config``: the model's
    transformers config where the route has one (its attention layer is measured; else the core layer);
    ``options``: the settings as the model runs them (None: the block's, ``upipe.options``; the routes
    pass them with fused projections off where apply_upipe falls back for that model, e.g. PEFT LoRA
    projections; the planner its scheme's).  ``layer_heads``: the model's head counts where its layers differ
    (``heads.head_counts``; None: ``num_heads``/``num_kv_heads`` in every layer): one U runs each layer's plan."""
    value = upipe.head_chunk_size
    counts = {(num_heads, num_kv_heads): 0} if layer_heads is None else layer_heads
    if value != "auto":
        try:
            resolved = per_head_counts(counts, lambda h, kv: resolve_head_chunk_size(h, kv, group_size, value))
            return next(iter(resolved.values()))  # the one U (C for null)
        except ValueError as err:
            ring = upipe.ring_size
            where = "" if ring == 1 else f" (with upipe.ring_size={ring} the heads are split over the Ulysses degree)"
            raise ValueError(f"invalid ds_config: upipe.head_chunk_size: {err}{where}") from None
    budget = upipe.memory_budget_gib * 2**30
    options = upipe.options(None) if options is None else options
    # every valid U measured in one fake run, with every setting the model runs with; the same choice
    # on every rank (the same measurement of the same config, checked equal across ranks: the settings
    # exchange before registration and the runtime's check of U at each forward)
    valid = per_head_counts(counts, lambda h, kv: set(valid_head_chunk_sizes(h, kv, group_size)))
    need = attention_stage_bytes_by_u(
        sorted(set.intersection(*valid.values())),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        group_size=group_size,
        seq_length=upipe.seq_length,
        micro_batch_size=micro_batch_size,
        dtype_bytes=dtype_bytes,
        ring_size=upipe.ring_size,
        model_config=model_config,
        options=options,
    )
    return largest_fitting(need, budget, group_size)


def largest_fitting(need: dict[int, int], budget: float, fallback: int) -> int:
    """The rule of every "auto": the largest U whose measured bytes ``need[U]`` fit ``budget`` (bytes), else
    ``fallback`` (C: the least memory, which runs even where the budget is too small)."""
    fits = [u for u, size in need.items() if size <= budget]
    return max(fits) if fits else fallback


def mixer_stage_bytes_by_u(
    *,
    model_config: Any,
    group_size: int,
    seq_length: int,
    micro_batch_size: int,
    dtype_bytes: int,
    options: UPipeOptions | None = None,
) -> dict[int, int]:
    """Per-rank memory of the model's sequence mixer layer at each U its mixers run with, in bytes: the
    intermediate peak of its forward + backward (``fake_run.mixer_activations``: the mixer module patched by
    ``hf_patches.apply_upipe`` with ``options``, on unpacked and packed rows), measured on fake tensors as rank 0
    of the group, every U in one run (a child process where this one has a process group).  {} for a model
    without mixers that have heads (short convolutions take no U)."""
    built = fake_run.HFModelConfig.of(model_config)
    if built is None:
        raise ValueError(
            f'upipe.mixer_head_chunk_size="auto": transformers cannot build model type '
            f"{getattr(model_config, 'model_type', None)!r} from its name (remote code); give an int"
        )
    seq = max(group_size, seq_length - seq_length % group_size)
    dtype = {2: "bf16", 4: "fp32", 8: "fp64"}[dtype_bytes]
    peaks = fake_run.isolated(
        "mixer_activations",
        model=built.json_text,
        options=asdict(options or UPipeOptions()),
        sp_size=group_size,
        seq_len=seq,
        batch=micro_batch_size,
        dtype=dtype,
    )
    return {int(u): int(b) for u, b in peaks.items()}


def choose_mixer_head_chunk_size(
    upipe: UPipeConfig, *, model_config: Any, group_size: int, micro_batch_size: int, dtype_bytes: int
) -> int | None:
    """The mixers' U: the configured int or None (validated where the mixers are known: ``check_mixer_settings``),
    and for "auto" the largest U whose measured mixer memory (``mixer_stage_bytes_by_u``) fits
    ``memory_budget_gib`` (C when none fits; None for a model whose mixers take no U), by attention's rule
    (``largest_fitting``).  The budget is the same per-layer figure as attention's: a layer is either kind."""
    if upipe.mixer_head_chunk_size != "auto":
        return upipe.mixer_head_chunk_size
    need = mixer_stage_bytes_by_u(
        model_config=model_config,
        group_size=group_size,
        seq_length=upipe.seq_length,
        micro_batch_size=micro_batch_size,
        dtype_bytes=dtype_bytes,
        options=upipe.options(None),
    )
    return largest_fitting(need, upipe.memory_budget_gib * 2**30, group_size) if need else None


def run_mixer_head_chunk_size(settings: SPSettings, model: Any, micro_batch_size: int) -> int | None:
    """The mixers' U a run uses for a model (``choose_mixer_head_chunk_size`` with the run's settings and the
    model's text config; the one call, ``sp_setup.prepare_for_run``)."""
    config = model.config if hasattr(model, "config") else model
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return choose_mixer_head_chunk_size(
        settings.upipe,
        model_config=text,
        group_size=settings.ulysses_size,
        micro_batch_size=micro_batch_size,
        dtype_bytes=settings.dtype_bytes,
    )


def run_head_chunk_size(settings: SPSettings, model: Any, micro_batch_size: int) -> int:
    """The U a run uses for a model: ``choose_head_chunk_size`` with the run's settings and the model's
    heads (the one call of the engine route and of the Trainer / accelerate registration).  ``model``: the
    model object (its fused projections as ``prepare_model`` will run them: ``runs_fused``) or, where a
    registration has only a name or path, its config."""
    config = model.config if hasattr(model, "config") else model
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    fused = runs_fused(model, settings.upipe) if hasattr(model, "config") else settings.upipe.fused_projections
    return choose_head_chunk_size(
        settings.upipe,
        **asdict(HeadLayout.from_config(text)),
        group_size=settings.ulysses_size,
        micro_batch_size=micro_batch_size,
        dtype_bytes=settings.dtype_bytes,
        model_config=text,
        options=settings.upipe.options(None).as_run(fused),
        layer_heads=head_counts(text),
    )


def runs_fused(model: Any, upipe: UPipeConfig) -> bool:
    """Whether ``prepare_model`` will run ``model``'s attention with fused projections:
    ``upipe.fused_projections`` and no fallback for this model (``hf_patches.fused_fallback``: PEFT
    LoRA or quantized projections, attention classes fused mode does not know)."""
    if not upipe.fused_projections or upipe.head_chunk_size != "auto":
        return upipe.fused_projections  # only "auto" reads it: no model inspection otherwise
    return fused_fallback(model) is None
