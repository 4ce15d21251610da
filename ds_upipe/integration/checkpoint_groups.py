"""Checkpoint groups (``upipe.checkpoint_groups: N`` of ``checkpoint_group_size: k`` layers; ``checkpoint_pairs:
N`` is N groups of 2): k consecutive decoder layers on one saved layer input.

Activation checkpointing keeps one layer input per layer until backward; with ``cpu_checkpointing``
they sit in host memory, and at millions of tokens that is what binds a node (Llama3-8B at 8M tokens
on 8 ranks: 31 x 8 GiB per rank, 1,984 GiB of a 2 TB node).  A group of layers 0..k-1 (numbered within
the group) keeps only layer 0's input x_0.  Its backward

1. (the top layer's backward) brings x_0 back and runs layers 0..k-2 once without grad, each with its
   forward's RNG state, to get x_1..x_k-1; it keeps x_1..x_k-2 (the inner inputs) where the group keeps
   x_0 (host or device), and replays layer k-1 from x_k-1 with grad and runs its backward;
2. (each lower layer j's backward, j = k-2 .. 0) brings x_j back, replays layer j with grad (its forward's
   RNG state again), runs its backward and lets x_j go.

So recompute-all-once-and-hold: k-1 more layer forwards per group and step (whatever k), and per rank N
saved inputs plus, during one group's backward, k-2 inner inputs (one shared pool: groups run their
backward one after the other) -- N + k - 2 hidden states where plain checkpointing keeps N x k.  On the
device at most the current layer's input and output while recomputing, one layer input while
replaying, as with plain checkpointing.  k = 2 holds no inner input (the top layer's input is used as it
is made): the pairs as they were.  The lowest ``N x k`` layers form the groups; the others stay on
DeepSpeed's checkpoint.

Why not DeepSpeed's checkpoint twice: its offload engine restores a saved tensor once
(``restore_input`` consumes it) and keeps the newest one on the device (``keep_last_count``), so the
group keeps its own copies (``GroupInputStore``): in exact-size pinned host buffers on CUDA when
checkpoints are offloaded, else the tensors themselves.

transformers' ``GradientCheckpointingLayer`` calls ``self._gradient_checkpointing_func(partial(forward,
self, **kwargs), *args)`` when training with grad, so a group is k per-instance functions: layer 0's runs
it without grad and hands its output over (``GroupBottom``, the graph's link to it), each middle layer's
checks that it got exactly the previous output and extends the link (``GroupMiddle``), the top layer's
runs ``GroupTop``.  One autograd Function per layer, so that autograd frees each layer's output gradient
before the next lower layer's backward runs.  Per-forward data (x_0, the run functions, the RNG states,
the inner inputs) lives on the autograd context (``GroupForward``), so a second forward before this
one's backward cannot change it.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from .checkpointing import register_pinned, unregister_pinned, without_recomputed_outputs

RngState = tuple[Tensor, Tensor | None]
KEY = "upipe.checkpoint_groups"


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


class GroupInputStore:
    """Where groups keep layer inputs between forward and backward (a group's saved inputs, or every
    group's inner inputs: one store each).

    ``offload``: copy each into a host buffer of exactly its size (on CUDA registered with
    ``cudaHostRegister``, page-locked in place, and copied asynchronously on the current stream),
    taken from this store's pool and given back when the backward is done with it (or its graph is
    dropped): buffers reused step after step, and a second forward before a backward gets buffers of
    its own.  ``allocated_bytes``: what the pool holds (pins, on CUDA).  Otherwise the tensor itself is
    kept (on a CPU accelerator activations already live in host memory)."""

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
    """One saved layer input; ``restore()`` may be called any number of times."""

    def __init__(self, store: GroupInputStore, tensor: Tensor, device: torch.device | None) -> None:
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
            f"{KEY}: decoder layer {layer} returned {type(value).__name__}; checkpoint groups need layers that "
            "return the hidden state as one tensor (transformers 5 decoder layers do); set upipe.checkpoint_groups "
            "(and checkpoint_pairs) to 0 for this model"
        )
    return value


@dataclass
class GroupForward:
    """One forward of a group: what its layers' backwards need.  ``runs[j]`` / ``rngs[j]``: layer j's
    run function and the RNG state its forward started from; ``saved``: layer 0's input; ``inner[j]``:
    layer j's input (1 <= j <= k-2) from the top layer's backward until layer j's backward."""

    group: CheckpointGroup
    saved: SavedInput
    runs: list[Callable[[Tensor], Any]] = field(default_factory=list)
    rngs: list[RngState] = field(default_factory=list)
    inner: dict[int, SavedInput] = field(default_factory=dict)

    def run(self, j: int, x: Tensor) -> Tensor:
        """Layer j on ``x`` with its forward's RNG state (grad as the caller has it)."""
        with replaying(self.rngs[j]):
            return _single_tensor(without_recomputed_outputs(self.runs[j], x), self.group.layers[j])

    def top_input(self) -> Tensor:
        """Layers 0..k-2 once without grad from the saved input; their inputs x_1..x_k-2 kept (the group's
        inner store), the top layer's input returned."""
        x = self.saved.restore()
        with torch.no_grad():
            for j in range(len(self.runs) - 1):
                if j:
                    self.inner[j] = self.group.inner_store.keep(x)
                x = self.run(j, x)
        return x

    def input_of(self, j: int) -> Tensor:
        return self.saved.restore() if j == 0 else self.inner[j].restore()

    def release(self, j: int) -> None:
        """Layer j's backward is done with its input."""
        (self.saved if j == 0 else self.inner.pop(j)).release()


def _replay_backward(forward: GroupForward, j: int, x: Tensor, dy: Tensor) -> Tensor:
    """Replay layer j from ``x`` with grad, run its backward with ``dy``; the input's gradient."""
    x = x.detach().requires_grad_(True)
    with torch.enable_grad():
        out = forward.run(j, x)
    torch.autograd.backward(out, dy)
    return x.grad


class GroupBottom(torch.autograd.Function):
    """Layer 0's half: forward returns a stand-in of its output y (no storage: y itself went to layer 1
    without a graph); backward gets dy from layer 1's Function, replays layer 0 from the saved input and
    returns dx."""

    @staticmethod
    def forward(ctx, x: Tensor, forward: GroupForward, y: Tensor) -> Tensor:
        ctx.forward = forward
        return y.new_empty(()).expand(y.shape)

    @staticmethod
    def backward(ctx, dy: Tensor):
        forward = ctx.forward
        dx = _replay_backward(forward, 0, forward.input_of(0), dy)
        forward.release(0)
        forward.group.backward_runs += 1
        return dx, None, None


class GroupMiddle(torch.autograd.Function):
    """Layer j's link (0 < j < k-1): forward a stand-in of its output; backward replays it from its inner
    input (kept by the top layer's backward) and returns the gradient of its input to layer j-1."""

    @staticmethod
    def forward(ctx, link: Tensor, forward: GroupForward, j: int, y: Tensor) -> Tensor:
        ctx.forward, ctx.j = forward, j
        return y.new_empty(()).expand(y.shape)

    @staticmethod
    def backward(ctx, dy: Tensor):
        forward, j = ctx.forward, ctx.j
        dx = _replay_backward(forward, j, forward.input_of(j), dy)
        forward.release(j)
        return dx, None, None, None


class GroupTop(torch.autograd.Function):
    """The top layer: z = layer(y); backward recomputes the group's layer inputs from the saved one
    (``GroupForward.top_input``), replays the top layer and returns dy to layer k-2 through ``link``."""

    @staticmethod
    def forward(ctx, link: Tensor, y: Tensor, forward: GroupForward) -> Tensor:
        ctx.forward = forward
        return _single_tensor(forward.runs[-1](y), forward.group.layers[-1])  # the forward's own RNG draws

    @staticmethod
    def backward(ctx, dz: Tensor):
        forward = ctx.forward
        dy = _replay_backward(forward, len(forward.runs) - 1, forward.top_input(), dz)
        return dy, None, None


@dataclass
class Handoff:
    """From one layer's call to the next one's: the output as the model received it, and the graph's link."""

    output: Tensor
    link: Tensor
    forward: GroupForward


class CheckpointGroup:
    """Layers ``bottom`` .. ``bottom + size - 1`` checkpointed on the bottom one's input; ``store``: the
    group's saved inputs, ``inner_store``: the inner inputs (shared by the model's groups)."""

    def __init__(self, bottom: int, size: int, store: GroupInputStore, inner_store: GroupInputStore) -> None:
        self.layers = [str(bottom + j) for j in range(size)]
        self.store, self.inner_store = store, inner_store
        self.backward_runs = 0  # the group's backwards so far (observability: the group ran)
        self._handoff: Handoff | None = None

    def checkpoint_function(self, j: int) -> Callable[..., Tensor]:
        """Layer j's ``_gradient_checkpointing_func``."""
        return lambda run, *args: self._call(j, run, *args)

    def _call(self, j: int, run: Callable[..., Any], *args: Any) -> Tensor:
        x = self._only_input(args, self.layers[j])
        if j == 0:
            if not x.requires_grad:
                raise ValueError(
                    f"{KEY}: the input of decoder layer {self.layers[0]} does not require grad, so its backward "
                    "would never run; call model.enable_input_require_grads() (ds_upipe does when it installs "
                    "checkpointing) or set upipe.checkpoint_groups (and checkpoint_pairs) to 0"
                )
            forward = GroupForward(self, self.store.keep(x))
            link = x
        else:
            handoff, self._handoff = self._handoff, None
            if handoff is None or not _same_tensor(x, handoff.output):
                raise RuntimeError(
                    f"{KEY}: decoder layer {self.layers[j]} was called with an input that is not decoder layer "
                    f"{self.layers[j - 1]}'s output of this forward; a checkpoint group needs its layers called one "
                    "after the other on the hidden state; set upipe.checkpoint_groups (and checkpoint_pairs) to 0 "
                    "for this model"
                )
            forward, link = handoff.forward, handoff.link
        forward.runs.append(run)
        forward.rngs.append(rng_state())
        if j == len(self.layers) - 1:
            return GroupTop.apply(link, x, forward)
        with torch.no_grad():
            y = _single_tensor(run(x), self.layers[j])
        link = GroupBottom.apply(x, forward, y) if j == 0 else GroupMiddle.apply(link, forward, j, y)
        self._handoff = Handoff(y, link, forward)
        return y

    @staticmethod
    def _only_input(args: tuple[Any, ...], layer: str) -> Tensor:
        if len(args) != 1 or not isinstance(args[0], Tensor):
            raise TypeError(
                f"{KEY}: decoder layer {layer} got {len(args)} positional arguments; checkpoint groups need the "
                "hidden state as the only positional argument (the others as keywords), as transformers' decoders "
                "call their layers; set upipe.checkpoint_groups (and checkpoint_pairs) to 0 for this model"
            )
        return args[0]


def checkpointed_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's checkpointable layers (transformers' ``GradientCheckpointingLayer``: a decoder's
    layers), in module order."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def check_groups_fit(model: torch.nn.Module, groups: int, size: int) -> list[torch.nn.Module]:
    """The model's checkpointable layers; ValueError unless the lowest ``groups * size`` of them can be grouped
    (``groups``, ``size``: ``UPipeConfig.checkpoint_grouping``)."""
    if not groups:
        return []
    found = checkpointed_layers(model) if getattr(model, "supports_gradient_checkpointing", False) else []
    layers = len(found)
    if groups * size > layers:
        raise ValueError(
            f"invalid ds_config: {KEY}: got {groups} groups of {size} layers for a model with {layers} "
            f"checkpointable decoder layers; allowed: 0 to {layers // size} groups of {size} (each group is "
            f"{size} consecutive layers)"
        )
    for index, layer in enumerate(found[: groups * size]):
        # replays call forward, not the module: ZeRO-3's hooks of the layer module itself (which gather its
        # own parameters) would not run for them; its submodules' hooks do
        own = [name for name, _ in layer.named_parameters(recurse=False)]
        if own:
            raise ValueError(
                f"invalid ds_config: {KEY}: got {groups} groups of {size}, but decoder layer {index} "
                f"({type(layer).__name__}) has parameters of its own ({', '.join(own)}), outside its submodules; "
                "checkpoint groups need layers whose parameters all live in submodules; set upipe.checkpoint_groups "
                "(and checkpoint_pairs) to 0"
            )
    return found


def install_checkpoint_groups(model: torch.nn.Module, groups: int, size: int, offload: bool) -> list[CheckpointGroup]:
    """Checkpoint the lowest ``groups * size`` layers of ``model`` in groups of ``size`` (after transformers'
    ``_set_gradient_checkpointing`` gave every layer the plain checkpoint).  The groups, with their input
    stores, live on the model (``model.upipe_checkpoint_groups``); ``offload``: keep the saved and inner
    inputs in host memory (``GroupInputStore``)."""
    layers = check_groups_fit(model, groups, size)
    inner = GroupInputStore(offload)  # one for all groups: their backwards run one after the other
    installed = []
    for i in range(groups):
        group = CheckpointGroup(i * size, size, GroupInputStore(offload), inner)
        for j in range(size):
            layers[i * size + j]._gradient_checkpointing_func = group.checkpoint_function(j)
        installed.append(group)
    model.upipe_checkpoint_groups = installed
    return installed
