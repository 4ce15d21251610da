"""``prepare_model``: what every route does to an HF model before it trains or is measured.

The engine route (``ds_upipe.initialize``), the Trainer / accelerate registration (a model object, or one
given by path and applied at ``deepspeed.initialize``), TRL's DPO reference model, and the fake runs of
``"auto"`` and the planner (on fake process groups) all prepare a model here, so what is planned is what
runs: UPipe patched in place with the run's ``UPipeOptions`` (attention and sequence mixers), then the
long-context stack.  Group creation, ALST's registration and activation checkpointing stay with the
routes (each has its own: the engine and the registration configure DeepSpeed's from the ds_config, the
fake runs replay checkpoints themselves).  ``sp_setup.prepare_for_run`` translates a ds_config's settings.
"""

from __future__ import annotations

from typing import Any, Literal

import torch.distributed as dist
from torch import nn

import hf_patches

from ..options import UPipeOptions

#: ``apply_long_context_stack``'s switches
TILED_PARTS = ("tiled_loss", "tiled_norm", "tiled_mlp")


def prepare_model(
    model: nn.Module,
    *,
    upipe: UPipeOptions | None,
    group: dist.ProcessGroup | None = None,
    ring_group: dist.ProcessGroup | None = None,
    stack: dict[str, Any] | None = None,
    forward_loss: Literal["local", "sequence_parallel"] = "local",
    loss_group: dist.ProcessGroup | None = None,
) -> nn.Module:
    """Prepare ``model`` in place; returns it.

    Args:
        upipe: UPipe's options (None: no UPipe patching: no sequence parallelism, or ALST's registration).
        group, ring_group: the Ulysses group and the ring group (None: no ring) UPipe runs over.
        stack: ``hf_patches.apply_long_context_stack``'s keywords (``tiled_*``, ``*_tile_tokens``; None or
            every part off: no stack).
        forward_loss, loss_group: the tiled loss's mode for the model's loss from labels ("local" where the
            caller combines the ranks' losses; ``apply_long_context_stack``); "local" without a tiled loss.
    """
    if upipe is not None:
        hf_patches.apply_upipe(model, group, upipe, ring_group=ring_group)
    if stack and any(stack.get(part) for part in TILED_PARTS):
        if not stack.get("tiled_loss"):
            forward_loss = "local"  # a setting of the tiled loss only
        hf_patches.apply_long_context_stack(model, **stack, forward_loss=forward_loss, loss_group=loss_group)
    return model
