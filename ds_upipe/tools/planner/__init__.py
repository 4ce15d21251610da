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

One module a job: ``units``, ``models`` (the catalogue: dimensions and presets), ``setup`` (the run
being planned, read from a ds_config), ``memory`` (the arithmetic: analytic terms, fake-tensor phases,
``predict``), ``reports`` (searches, tables, JSON).  The package's names are its modules' public names.
"""

from __future__ import annotations

from .memory import (
    HOST_BASIS,
    RESERVE_BASIS,
    Prediction,
    group_recompute_fraction,
    hidden_state_bytes,
    host_terms,
    images_per_rank,
    kept_checkpoints,
    layer_peak,
    model_state_bytes,
    offloaded_below_top,
    other_layers,
    pinned_block_bytes,
    predict,
    ranks_per_node,
    step_peak,
    step_spec,
    vision_terms,
    zero_buffer_bytes,
)
from .models import (
    MODEL_TYPES,
    PRESET_GPUS,
    PRESETS,
    VISION_LANGUAGE_TEXT_TYPES,
    ModelDims,
    model_dims,
)
from .reports import (
    binding_limit,
    breakdown_report,
    choose_group_size,
    context_step,
    describe,
    fmt_tokens,
    group_size_report,
    group_size_rows,
    grouped,
    host_max_context,
    max_context,
    moe_basis,
    nothing_fits,
    paper_step,
    plan_table,
    to_json,
    vision_note,
    which_head_chunk_report,
)
from .setup import (
    PLANNER_DTYPES,
    AttentionScheme,
    TrainSetup,
    auto_head_chunk_size,
    from_ds_config,
    measured_layer_setup,
    measured_scheme,
    methods_for,
)
from .units import (
    DTYPE_BYTES,
    PAPER_STEPS,
    GiB,
)

__all__ = [
    "AttentionScheme",
    "DTYPE_BYTES",
    "GiB",
    "HOST_BASIS",
    "MODEL_TYPES",
    "ModelDims",
    "PAPER_STEPS",
    "PLANNER_DTYPES",
    "PRESETS",
    "PRESET_GPUS",
    "Prediction",
    "RESERVE_BASIS",
    "TrainSetup",
    "auto_head_chunk_size",
    "binding_limit",
    "breakdown_report",
    "choose_group_size",
    "group_size_report",
    "group_size_rows",
    "grouped",
    "host_max_context",
    "context_step",
    "describe",
    "fmt_tokens",
    "from_ds_config",
    "hidden_state_bytes",
    "host_terms",
    "images_per_rank",
    "kept_checkpoints",
    "layer_peak",
    "max_context",
    "measured_layer_setup",
    "measured_scheme",
    "methods_for",
    "model_dims",
    "model_state_bytes",
    "moe_basis",
    "nothing_fits",
    "offloaded_below_top",
    "other_layers",
    "group_recompute_fraction",
    "paper_step",
    "pinned_block_bytes",
    "plan_table",
    "predict",
    "ranks_per_node",
    "step_peak",
    "step_spec",
    "to_json",
    "vision_note",
    "vision_terms",
    "VISION_LANGUAGE_TEXT_TYPES",
    "which_head_chunk_report",
    "zero_buffer_bytes",
]
