"""Per-rank memory of the real code, run on fake tensors: what ``ds-upipe plan`` and ``"auto"`` use.

Nothing here models an allocation by hand (one CUDA kernel's stand-in aside, below). Each measurement builds
the real modules (a transformers decoder layer patched by ``hf_patches.apply_upipe`` or wrapped by DeepSpeed
ALST's ``UlyssesSPAttentionHF``, the long-context stack when asked, the final norm + lm_head + loss, or
ds_upipe's ``UPipeDistributedAttention``) and runs their forward and backward as rank 0 of a group of C under

- torch's ``FakeTensorMode``: every tensor has its real shape, dtype and storage size, no data,
  so a Llama3-8B layer at millions of tokens runs in about half a second on a CPU;
- the ``fake`` process group (``init_process_group("fake", rank=0, world_size=C)``): collectives
  keep shapes and move nothing;
- torch's ``MemTracker``: the live bytes of every storage the code allocates, the peak, and (our
  subclass) the operation that set it and the largest tensors alive then.

What fake execution cannot see is added analytically, here only one term: the CUDA attention kernel's backward
workspace (``kernel_workspace_bytes``), added while the backward op runs. One CUDA kernel is stood in for: on
a GPU target (``StepSpec.kernel`` a CUDA one) the gated delta nets' recurrence runs ``fla``'s stand-in for
FLA's chunk kernel (its allocations and saved tensors, pinned against FLA's source), since the torch fallback
fake execution would run is not what the GPU runs (and loops over S / 64 chunks: minutes at a million tokens).
The terms of a whole GPU step (model states, ZeRO buffers, checkpoints) are ds_upipe.tools.planner's.

Data-dependent calls (``.item()``, ``.tolist()``) cannot run on fake tensors; the measured code has none: the
layer and the loss are called directly, so hf_patches' model-level input check (all_gathers of the inputs'
shapes and positions, ``.tolist()``) is not in the measured region (it runs once per step on a few numbers per
rank; its tensors are [2, b, S] integers).

A process that already has a default process group (a training job choosing ``"auto"``) cannot open the fake
one; ``isolated`` then runs the measurement in a child Python process.

One module a job: ``tracker`` (MemTracker's peak, the kernel workspace term), ``fla`` (FLA's chunk gated delta
rule as memory), ``world`` (the fake process group), ``models`` (what a step builds), ``steps`` (the
measurements), ``isolation`` (a child process where this one has a process group).
"""

from __future__ import annotations

from .isolation import _child, isolated
from .models import HFModelConfig, ModelShape
from .steps import (
    DTYPES,
    STEP_PHASES,
    StepSpec,
    attention_activations,
    attention_step,
    core_step,
    intermediate,
    layer_step,
    loss_step,
    mixer_activations,
    mixer_step,
    model_step,
)
from .tracker import KERNELS, NoModuleTracking, Peak, PeakTracker, kernel_workspace_bytes, track
from .world import _release_deepspeed_sp_groups, fake_world

__all__ = [
    "DTYPES",
    "KERNELS",
    "STEP_PHASES",
    "HFModelConfig",
    "ModelShape",
    "NoModuleTracking",
    "Peak",
    "PeakTracker",
    "StepSpec",
    "_child",
    "_release_deepspeed_sp_groups",
    "attention_activations",
    "attention_step",
    "core_step",
    "fake_world",
    "intermediate",
    "isolated",
    "kernel_workspace_bytes",
    "layer_step",
    "loss_step",
    "mixer_activations",
    "mixer_step",
    "model_step",
    "track",
]
