"""The activation checkpoint's recompute without the recomputed layer output.

A reentrant checkpoint (DeepSpeed's ``CheckpointFunction``, what ``ds_upipe.initialize`` and the HF
integration install) replays a layer in backward and then runs ``torch.autograd.backward(outputs,
grads)`` while holding the replayed ``outputs``: one hidden state per layer output that nothing
reads (the layer's last op, the residual add, does not save its result), alive through the layer's
whole backward -- at the attention's backward, where a long-context step peaks.  ``releasing``
wraps the checkpoint's ``run_function`` so that in the replay each output is handed back as
``RecomputedOutput``: a zero-stride stand-in of the same shape (one element of storage) whose
gradient goes unchanged to the real output's graph.  The real output is then freed as soon as
the layer returns, unless its own graph saved it (then it stays, and the result is the same).
The first forward (without grad: the outputs are the next layer's input) is untouched.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor


class RecomputedOutput(torch.autograd.Function):
    """Identity for gradients; the forward value is a stand-in that holds no memory."""

    @staticmethod
    def forward(ctx, output: Tensor) -> Tensor:
        return output.new_empty(()).expand(output.shape)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return grad


def _stand_in(value: Any) -> Any:
    if isinstance(value, Tensor) and value.requires_grad and value.is_floating_point():
        return RecomputedOutput.apply(value)
    if isinstance(value, tuple | list):
        return type(value)(_stand_in(v) for v in value)
    return value


def without_recomputed_outputs(run_function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``run_function(*args, **kwargs)``; when it runs with grad (the checkpoint's replay in backward,
    whose outputs only root the layer's backward) its differentiable outputs become stand-ins."""
    outputs = run_function(*args, **kwargs)
    return _stand_in(outputs) if torch.is_grad_enabled() else outputs


def releasing(checkpoint: Callable[..., Any]) -> Callable[..., Any]:
    """A ``gradient_checkpointing_func`` (``checkpoint(run_function, *args)``) whose replay releases
    the replayed outputs (module docstring)."""

    @functools.wraps(checkpoint)
    def run(run_function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return checkpoint(functools.partial(without_recomputed_outputs, run_function), *args, **kwargs)

    return run
