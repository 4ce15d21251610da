"""Checkpoint pairs (``upipe.checkpoint_pairs: N``): two decoder layers on one saved layer input.

Activation checkpointing keeps one layer input per layer until backward; with ``cpu_checkpointing``
they sit in host memory, and at millions of tokens that is what binds a node (Llama3-8B at 8M tokens
on 8 ranks: 31 x 8 GiB per rank, 1,984 GiB of a 2 TB node).  A pair (A, B) of consecutive layers keeps
only A's input x.  B's input y = A(x) is not kept: B's backward

1. brings x back and runs A without grad to get y, then drops x;
2. replays B from y with grad and runs B's backward (dy);
3. brings x back again, replays A with grad and runs A's backward (dx),

with the RNG state of each layer's first forward restored for every replay.  One extra forward of A
per pair and step, one hidden state fewer per pair; at most one layer input is on the device at a
time, as with plain checkpointing.  The lowest ``2N`` layers form the pairs (0, 1), (2, 3), ...; the
others stay on DeepSpeed's checkpoint.

Why not DeepSpeed's checkpoint twice: its offload engine restores a saved tensor once
(``restore_input`` consumes it) and keeps the newest one on the device (``keep_last_count``), so the
pair keeps its own copy (``PairInputStore``): in exact-size pinned host buffers on CUDA when
checkpoints are offloaded, else the tensor itself.

transformers' ``GradientCheckpointingLayer`` calls ``self._gradient_checkpointing_func(partial(forward,
self, **kwargs), *args)`` when training with grad, so the pair is two per-instance functions: A's
runs A without grad and hands its output over (``LowerLayer``, the graph's link to A); B's checks
that it got exactly that output and runs ``UpperLayer``.  Per-forward data (x, the RNG states) lives
on the autograd context, so a second forward before this one's backward cannot change it.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .checkpointing import register_pinned, unregister_pinned, without_recomputed_outputs

RngState = tuple[Tensor, Tensor | None]


def rng_state() -> RngState:
    """The CPU generator's state and, where CUDA is initialized, the current device's."""
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


@contextlib.contextmanager
def replaying(state: RngState) -> Iterator[None]:
    """Run with the generators at ``state``; afterwards they are as they were (``fork_rng``)."""
    cpu, cuda = state
    devices = [torch.cuda.current_device()] if cuda is not None else []
    with torch.random.fork_rng(devices=devices):
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda)
        yield


class PairInputStore:
    """Where a pair keeps its lower layer's input between forward and backward.

    ``offload``: copy it into a host buffer of exactly its size (on CUDA registered with
    ``cudaHostRegister``, page-locked in place, and copied asynchronously on the current stream),
    taken from this pair's pool and given back when the backward is done with it (or its graph is
    dropped): one buffer per pair, reused step after step, and a second forward before a backward gets
    a buffer of its own.  Otherwise the tensor itself is kept (on a CPU accelerator activations already
    live in host memory)."""

    def __init__(self, offload: bool) -> None:
        self.offload = offload
        self._free: list[Tensor] = []
        self._pinned: list[Tensor] = []  # every registered buffer, unregistered when the store goes
        self.allocated_bytes = 0
        weakref.finalize(self, unregister_pinned, self._pinned)

    def keep(self, x: Tensor) -> SavedInput:
        if not self.offload:
            return SavedInput(self, x.detach(), None)
        host = self._take(x)
        host.copy_(x.detach(), non_blocking=True)
        return SavedInput(self, host, x.device)

    def _take(self, x: Tensor) -> Tensor:
        for i, buffer in enumerate(self._free):
            if buffer.shape == x.shape and buffer.dtype == x.dtype:
                return self._free.pop(i)
        host = torch.empty(tuple(x.shape), dtype=x.dtype, device="cpu")
        self.allocated_bytes += host.numel() * host.element_size()
        if x.is_cuda and register_pinned(host):
            self._pinned.append(host)
        return host

    def give_back(self, host: Tensor) -> None:
        self._free.append(host)


class SavedInput:
    """One forward's saved lower-layer input; ``restore()`` may be called any number of times."""

    def __init__(self, store: PairInputStore, tensor: Tensor, device: torch.device | None) -> None:
        self.tensor, self.device = tensor, device
        # the buffer goes back to the pool when this forward is done with it, backward or not
        self._release = weakref.finalize(self, store.give_back, tensor) if device is not None else None

    def restore(self) -> Tensor:
        if self.device is None:
            return self.tensor
        return self.tensor.to(self.device, non_blocking=True)

    def release(self) -> None:
        if self._release is not None:
            self._release()
        self.tensor = None  # type: ignore[assignment]


def _same_tensor(a: Tensor, b: Tensor) -> bool:
    """``a`` is ``b`` or an alias of all of it: ZeRO-3's module hooks hand a layer's output and the
    next layer's input on as ``detach()`` aliases (parameter_offload.py, PreBackwardFunctionForModule,
    PostBackwardFunctionModule).  ``b`` is alive, so no other tensor can hold its storage."""
    if a is b:
        return True
    return (
        a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        and a.storage_offset() == b.storage_offset()
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
    )


def _single_tensor(value: Any, layer: str) -> Tensor:
    if not isinstance(value, Tensor):
        raise TypeError(
            f"upipe.checkpoint_pairs: decoder layer {layer} returned {type(value).__name__}; checkpoint pairs "
            "need layers that return the hidden state as one tensor (transformers 5 decoder layers do); set "
            "upipe.checkpoint_pairs to 0 for this model"
        )
    return value


@dataclass
class LowerForward:
    """One forward of a pair's lower layer A: what both halves of the pair's backward need."""

    run: Callable[[Tensor], Any]
    rng: RngState
    saved: SavedInput
    pair: CheckpointPair

    def output(self) -> Tensor:
        """A's output recomputed from the saved input, without grad (B's input)."""
        with replaying(self.rng), torch.no_grad():
            return _single_tensor(self.run(self.saved.restore()), self.pair.lower)


class LowerLayer(torch.autograd.Function):
    """A's half: forward returns a stand-in of A's output y (no storage: y itself went to B without a
    graph); backward gets dy from ``UpperLayer``'s backward, replays A from the saved input and returns dx.
    Two Functions, not one, so that autograd frees B's output gradient before A's backward runs."""

    @staticmethod
    def forward(ctx, x: Tensor, lower: LowerForward, y: Tensor) -> Tensor:
        ctx.lower = lower
        return y.new_empty(()).expand(y.shape)

    @staticmethod
    def backward(ctx, dy: Tensor):
        lower = ctx.lower
        x = lower.saved.restore().detach().requires_grad_(True)
        with replaying(lower.rng), torch.enable_grad():
            out = without_recomputed_outputs(lower.run, x)
        torch.autograd.backward(out, dy)
        lower.saved.release()
        lower.pair.backward_runs += 1
        return x.grad, None, None


class UpperLayer(torch.autograd.Function):
    """B's half: z = B(y); backward recomputes y from A's saved input, replays B and returns dy to
    ``LowerLayer`` through the stand-in ``link``."""

    @staticmethod
    def forward(ctx, link: Tensor, y: Tensor, lower: LowerForward, run_b: Callable[[Tensor], Any], layer: str):
        ctx.lower, ctx.run_b = lower, run_b
        ctx.rng = rng_state()
        return _single_tensor(run_b(y), layer)

    @staticmethod
    def backward(ctx, dz: Tensor):
        y = ctx.lower.output().detach().requires_grad_(True)
        with replaying(ctx.rng), torch.enable_grad():
            z = without_recomputed_outputs(ctx.run_b, y)
        torch.autograd.backward(z, dz)
        return y.grad, None, None, None, None


@dataclass
class Handoff:
    """From A's call to B's: A's output as the model received it, and the graph's link to A."""

    output: Tensor
    link: Tensor
    lower: LowerForward


class CheckpointPair:
    """Layers ``lower`` and ``lower + 1`` checkpointed on the lower one's input."""

    def __init__(self, lower_index: int, store: PairInputStore) -> None:
        self.lower, self.upper = str(lower_index), str(lower_index + 1)
        self.store = store
        self.backward_runs = 0  # the pair's backwards so far (observability: the pair ran)
        self._handoff: Handoff | None = None

    def lower_checkpoint(self, run_a: Callable[..., Any], *args: Any) -> Tensor:
        x = self._only_input(args, self.lower)
        if not x.requires_grad:
            raise ValueError(
                f"upipe.checkpoint_pairs: the input of decoder layer {self.lower} does not require grad, so its "
                "backward would never run; call model.enable_input_require_grads() (ds_upipe does when it "
                "installs checkpointing) or set upipe.checkpoint_pairs to 0"
            )
        rng = rng_state()
        lower = LowerForward(run_a, rng, self.store.keep(x), self)
        with torch.no_grad():
            y = _single_tensor(run_a(x), self.lower)
        self._handoff = Handoff(y, LowerLayer.apply(x, lower, y), lower)
        return y

    def upper_checkpoint(self, run_b: Callable[..., Any], *args: Any) -> Tensor:
        y = self._only_input(args, self.upper)
        handoff, self._handoff = self._handoff, None
        if handoff is None or not _same_tensor(y, handoff.output):
            raise RuntimeError(
                f"upipe.checkpoint_pairs: decoder layer {self.upper} was called with an input that is not decoder "
                f"layer {self.lower}'s output of this forward; a checkpoint pair needs the two layers called one "
                "after the other on the hidden state; set upipe.checkpoint_pairs to 0 for this model"
            )
        return UpperLayer.apply(handoff.link, y, handoff.lower, run_b, self.upper)

    @staticmethod
    def _only_input(args: tuple[Any, ...], layer: str) -> Tensor:
        if len(args) != 1 or not isinstance(args[0], Tensor):
            raise TypeError(
                f"upipe.checkpoint_pairs: decoder layer {layer} got {len(args)} positional arguments; checkpoint "
                "pairs need the hidden state as the only positional argument (the others as keywords), as "
                "transformers' decoders call their layers; set upipe.checkpoint_pairs to 0 for this model"
            )
        return args[0]


def checkpointed_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's checkpointable layers (transformers' ``GradientCheckpointingLayer``: a decoder's
    layers), in module order."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def check_pairs_fit(model: torch.nn.Module, pairs: int) -> list[torch.nn.Module]:
    """The model's checkpointable layers; ValueError unless the lowest ``2 * pairs`` of them can be paired."""
    if not pairs:
        return []
    found = checkpointed_layers(model) if getattr(model, "supports_gradient_checkpointing", False) else []
    layers = len(found)
    if 2 * pairs > layers:
        raise ValueError(
            f"invalid ds_config: upipe.checkpoint_pairs: got {pairs} for a model with {layers} checkpointable "
            f"decoder layers; allowed: 0 to {layers // 2} (each pair is two consecutive layers)"
        )
    for index, layer in enumerate(found[: 2 * pairs]):
        # the lower layer's replays call forward, not the module: ZeRO-3's hooks of the layer module itself
        # (which gather its own parameters) would not run for them; its submodules' hooks do
        own = [name for name, _ in layer.named_parameters(recurse=False)]
        if own:
            raise ValueError(
                f"invalid ds_config: upipe.checkpoint_pairs: got {pairs}, but decoder layer {index} "
                f"({type(layer).__name__}) has parameters of its own ({', '.join(own)}), outside its submodules; "
                "checkpoint pairs need layers whose parameters all live in submodules; set upipe.checkpoint_pairs to 0"
            )
    return found


def install_checkpoint_pairs(model: torch.nn.Module, pairs: int, offload: bool) -> list[CheckpointPair]:
    """Checkpoint the lowest ``2 * pairs`` layers of ``model`` in pairs (after transformers'
    ``_set_gradient_checkpointing`` gave every layer the plain checkpoint).  The pairs, with their
    input stores, live on the model (``model.upipe_checkpoint_pairs``); ``offload``: keep the saved
    inputs in host memory (``PairInputStore``)."""
    layers = check_pairs_fit(model, pairs)
    installed = []
    for i in range(pairs):
        pair = CheckpointPair(2 * i, PairInputStore(offload))
        layers[2 * i]._gradient_checkpointing_func = pair.lower_checkpoint
        layers[2 * i + 1]._gradient_checkpointing_func = pair.upper_checkpoint
        installed.append(pair)
    model.upipe_checkpoint_pairs = installed
    return installed
