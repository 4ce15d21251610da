"""The measurements: one rank's step of a decoder layer, the loss, a whole model, the core layer, and the
attention's intermediate peak that "auto" compares with the budget."""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from ...options import UPipeOptions
from ..checkpointing import releasing, without_recomputed_outputs
from ..prepare import prepare_model
from .fla import on_gated_delta_mixers
from .models import HFModelConfig, ModelShape
from .tracker import KERNELS, Peak, track
from .world import _backend_retention, _deepspeed_comm_on_fake_world, _release_deepspeed_sp_groups, fake_world

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}


@dataclass(frozen=True)
class StepSpec:
    """One rank's step of one decoder layer (or the loss): the run's attention scheme and stack."""

    model: ModelShape | HFModelConfig
    attention: str  # "alst" (DeepSpeed's UlyssesSPAttentionHF around transformers' sdpa) or "upipe"
    sp_size: int  # C: the whole sequence-parallel group, C_u x ring_size (fake_run uses no other group size)
    seq_len: int  # global tokens S (each rank holds S / C)
    #: UPipe's settings (``attention="upipe"``), as the run passes them to ``apply_upipe``
    options: UPipeOptions = UPipeOptions()
    batch: int = 1
    dtype: str = "bf16"
    tiled_norm: bool = False
    tiled_mlp: bool = False
    tiled_loss: bool = False
    norm_tile_tokens: int | None = None
    mlp_tile_tokens: int | None = None
    loss_tile_tokens: int | None = None
    #: the analytic CUDA workspace: "none" (CPU), "fa2", "fa3"; a CUDA one also runs gated delta nets as FLA's chunk
    #: kernel (``fla``'s stand-in), "none" as transformers' torch fallback
    kernel: str = "none"
    comm_backend: str = "nccl"  # whose async-Work buffer lifetime to reproduce: "nccl" or "gloo"
    #: UPipe x Ring: sp_size = C_u x ring_size; rank 0 runs UPipe over its C_u Ulysses ranks and the real
    #: RingAttentionKernel over a fake ring group of ring_size ranks (its K/V and dK/dV blocks in flight)
    ring_size: int = 1
    #: the layer runs as a checkpointed layer's replay in backward (``integration.checkpointing``)
    checkpointed: bool = False

    def __post_init__(self) -> None:
        if self.comm_backend not in ("nccl", "gloo"):
            raise ValueError(f"comm_backend={self.comm_backend!r}: choose 'nccl' or 'gloo'")
        if self.attention not in ("alst", "upipe"):
            raise ValueError(f"attention={self.attention!r}: choose 'alst' or 'upipe'")
        if self.seq_len < self.sp_size or self.seq_len % self.sp_size:
            raise ValueError(
                f"seq_len={self.seq_len} is not a positive multiple of the sequence-parallel size {self.sp_size}"
            )
        if self.ring_size != 1:
            from ...layout import sequence_layout

            if self.attention != "upipe":
                raise ValueError(
                    f"ring_size={self.ring_size}: DeepSpeed ALST has no ring; plan UPipe x Ring instead "
                    "(head_chunk_size = num_heads is Ulysses x Ring)"
                )
            layout = sequence_layout(self.sp_size, self.ring_size)
            multiple = layout.sequence_multiple  # two zigzag chunks per ring rank
            if self.seq_len % multiple:
                raise ValueError(
                    f"seq_len={self.seq_len}: with Ulysses degree {layout.ulysses_size} x ring size "
                    f"{self.ring_size} the sequence must be a multiple of {multiple}"
                )
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r}: choose one of {sorted(DTYPES)}")
        if self.kernel not in KERNELS:
            raise ValueError(f"kernel={self.kernel!r}: choose one of {list(KERNELS)}")

    @property
    def stack(self) -> dict[str, Any]:
        """The long-context stack's keywords (``prepare.prepare_model``)."""
        return dict(
            tiled_loss=self.tiled_loss,
            tiled_norm=self.tiled_norm,
            tiled_mlp=self.tiled_mlp,
            loss_tile_tokens=self.loss_tile_tokens,
            norm_tile_tokens=self.norm_tile_tokens,
            mlp_tile_tokens=self.mlp_tile_tokens,
        )

    @property
    def local_tokens(self) -> int:
        return self.seq_len // self.sp_size


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


@contextlib.contextmanager
def _fake_model(spec: StepSpec, layers: int = 1) -> Iterator[tuple[torch.nn.Module, dist.ProcessGroup]]:
    """(the spec's patched model (``_patched_model``), the fake group) on fake tensors, as rank 0 of a
    fake group of the spec's size, with the real backend's buffer retention: the setting every
    model-level fake run uses."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with (
        fake_world(spec.sp_size) as group,
        FakeTensorMode(),
        _patched_model(spec, group, layers=layers) as model,
        _backend_retention(spec.comm_backend),
        _recurrence_kernel(spec, model),
    ):
        yield model, group


@contextlib.contextmanager
def _patched_model(spec: StepSpec, group: dist.ProcessGroup, layers: int = 1) -> Iterator[torch.nn.Module]:
    """A ``*ForCausalLM`` of ``layers`` decoder layers (fake weights) set up as the run sets it up; ALST's
    override of transformers' attention registry is undone afterwards."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    with _default_dtype(DTYPES[spec.dtype]):
        model = AutoModelForCausalLM.from_config(spec.model.config(layers))
    original = ALL_ATTENTION_FUNCTIONS["sdpa"]
    try:
        ulysses, ring = None, None
        if spec.attention == "alst":
            from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

            _deepspeed_comm_on_fake_world()
            UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", spec.sp_size, spec.batch)
        else:
            ulysses, ring = _sequence_groups(spec, group)
        # as the run prepares it (the engine route's mode of the tiled loss: the whole sequence's loss)
        prepare_model(
            model,
            upipe=spec.options if spec.attention == "upipe" else None,
            group=ulysses,
            ring_group=ring,
            stack=spec.stack,
            forward_loss="sequence_parallel",
            loss_group=group,
        )
        yield model.train()
    finally:
        ALL_ATTENTION_FUNCTIONS["sdpa"] = original
        _release_deepspeed_sp_groups()


@contextlib.contextmanager
def _recurrence_kernel(spec: StepSpec, model: torch.nn.Module) -> Iterator[None]:
    """A GPU target's (``spec.kernel`` a CUDA one) gated delta nets run FLA's chunk kernel, whose memory the fake
    run models with ``fla``'s stand-in; a CPU run's (``kernel="none"``) run transformers' torch fallback, as the
    fake run executes it (what the CPU measurements compare against)."""
    if spec.kernel == "none":
        yield
        return
    with on_gated_delta_mixers(model):
        yield


def _sequence_groups(spec: StepSpec, group: dist.ProcessGroup) -> tuple[dist.ProcessGroup, dist.ProcessGroup | None]:
    """(Ulysses group, ring group or None) of rank 0 in the fake world of ``spec.sp_size`` ranks: the
    groups ``ds_upipe.ring.build_sequence_groups`` makes in a real run (new_group works on the fake backend)."""
    if spec.ring_size == 1:
        return group, None
    from ...ring import build_sequence_groups

    return build_sequence_groups(spec.sp_size, spec.ring_size)


def _names(model: torch.nn.Module) -> dict[int, str]:
    return {id(m): name or type(m).__name__ for name, m in model.named_modules()}


def _rotary(model: torch.nn.Module, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(cos, sin) of the model's rotary embedding, () for a model without one (Nemotron-H: no position encoding)."""
    rotary = getattr(model.model, "rotary_emb", None)
    if rotary is None:
        return ()
    with torch.no_grad():
        return tuple(rotary(x, pos))


def _final_norm(model: torch.nn.Module) -> torch.nn.Module:
    """The model's final norm (Nemotron-H names it ``norm_f``)."""
    base = model.model
    return base.norm if hasattr(base, "norm") else base.norm_f


def _layer_kwargs(cos_sin: tuple[torch.Tensor, ...], pos: torch.Tensor) -> dict[str, Any]:
    """A decoder layer's keywords: Nemotron-H's blocks take no position embeddings (hybrid layers without attention
    take them and ignore them)."""
    kwargs: dict[str, Any] = {"position_ids": pos}
    if cos_sin:
        kwargs["position_embeddings"] = cos_sin
    return kwargs


@functools.lru_cache(maxsize=512)
def layer_step(spec: StepSpec, live: bool = False) -> Peak:
    """Rank 0's peak over one decoder layer's forward (with grad) and backward: the layer's weights,
    its input x, the incoming gradient dy, cos/sin and the position ids are alive throughout, the
    weight gradients from their creation on (what a checkpointed layer's recompute + backward holds
    besides the other layers' checkpoints: the reentrant checkpoint holds x and dy through the
    layer's backward; ``spec.checkpointed`` runs the layer as its replay does, through
    ``checkpointing.without_recomputed_outputs``, whose output stand-in frees the layer output).
    ``after_forward``: x, the output and what the layer saved for backward (what each layer keeps
    without checkpointing)."""

    dtype = DTYPES[spec.dtype]
    s, hidden = spec.local_tokens, spec.model.hidden_size
    with _fake_model(spec) as (model, _):
        layer = model.model.layers[0]
        x = torch.empty(spec.batch, s, hidden, dtype=dtype).requires_grad_(True)
        dy = torch.empty(spec.batch, s, hidden, dtype=dtype)
        pos = torch.arange(s).expand(spec.batch, s)
        cos_sin = _rotary(model, x, pos)

        call = functools.partial(layer, **_layer_kwargs(cos_sin, pos))

        def forward() -> torch.Tensor:
            # checkpointed: what the checkpoint's replay in backward runs (its output a stand-in)
            return without_recomputed_outputs(call, x) if spec.checkpointed else call(x)

        def backward(y: torch.Tensor) -> None:
            y.backward(dy)

        external = {"layer input x": [x], "incoming gradient dy": [dy], "cos/sin, position ids": [*cos_sin, pos]}
        return track(
            backward,
            external,
            list(layer.parameters()),
            kernel=spec.kernel,
            names=_names(model),
            forward=forward,
            live=live,
        )


@functools.lru_cache(maxsize=512)
def loss_step(spec: StepSpec, live: bool = False) -> Peak:
    """Rank 0's peak over the loss phase: the final norm, the lm_head and the sequence-parallel
    cross-entropy, forward and backward, from the last hidden state h (alive throughout, with its
    gradient).  ``spec.tiled_loss``: hf_patches' tiled loss (no full logits); else the full logits
    and ``hf_patches.sequence_parallel_loss``.  The attention scheme plays no part."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    import hf_patches

    dtype = DTYPES[spec.dtype]
    s, hidden = spec.local_tokens, spec.model.hidden_size
    with fake_world(spec.sp_size) as group, FakeTensorMode(), _patched_model(spec, group) as model:
        h = torch.empty(spec.batch, s, hidden, dtype=dtype).requires_grad_(True)
        labels = torch.zeros(spec.batch, s, dtype=torch.long)

        def forward() -> torch.Tensor:
            hidden_states = _final_norm(model)(h)
            if spec.tiled_loss:
                return hf_patches.tiled_sequence_parallel_loss(
                    model, hidden_states, labels, group, tile_tokens=spec.loss_tile_tokens
                )
            return hf_patches.sequence_parallel_loss(model.lm_head(hidden_states), labels, group)

        def backward(loss: torch.Tensor) -> None:
            loss.backward()

        weights = list(_final_norm(model).parameters()) + list(model.lm_head.parameters())
        external = {"last hidden state h": [h], "labels": [labels]}
        return track(backward, external, weights, kernel=spec.kernel, names=_names(model), forward=forward, live=live)


#: the phases of ``model_step``, in the order a step runs them
STEP_PHASES = ("forward", "loss", "top layer", "bottom layer")


@functools.lru_cache(maxsize=512)
def model_step(spec: StepSpec, keep_gradients: bool = False, live: bool = False, layers: int = 2) -> Peak:
    """Rank 0's peak over one whole training step of a two-layer model: both decoder layers' forward,
    the final norm and the loss, and the backward through all of them, measured together, so what the
    loss phase keeps is seen beside the layers' backward (and the other way round).  ``Peak.phases``
    holds each phase's peak (``STEP_PHASES``: the forward; the loss phase, from the start of backward to
    the top layer's; the top layer's backward, a checkpoint's replay included; the bottom layer's).
    The planner adds, per phase, what the other ``layers - 2`` layers of a real model keep
    (``planner.predict``); the embedding is outside (its output, the bottom layer's input, is alive
    throughout, as the checkpoint DeepSpeed keeps of it).

    ``spec.checkpointed``: the layers run under DeepSpeed's reentrant checkpoint with the recomputed
    outputs released (``checkpointing.releasing``), as ``sp_setup.configure_activation_checkpointing``
    installs it; on this fake CPU device every checkpoint stays where it is (what a GPU run keeps without
    offload; with offload, the newest stays, and DeepSpeed's engine also keeps the one below it on the device,
    ds_upipe's engine does not: ``planner.offloaded_below_top``).
    ``keep_gradients``: each parameter's gradient lives from its creation to the end (one forward +
    backward from gradients set to None, what the CPU whole-step benchmark measures); otherwise it is
    dropped once accumulated, as ZeRO moves it into its reduce bucket (counted by the planner)."""
    from deepspeed.runtime.activation_checkpointing import checkpointing as ds_checkpointing

    import hf_patches

    dtype = DTYPES[spec.dtype]
    s, hidden = spec.local_tokens, spec.model.hidden_size
    phase = ["forward"]
    with _fake_model(spec, layers=layers) as (model, group):
        base = model.model
        if spec.checkpointed:
            model._set_gradient_checkpointing(
                enable=True, gradient_checkpointing_func=releasing(ds_checkpointing.checkpoint)
            )
        if not keep_gradients:
            for p in model.parameters():
                p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
        x = torch.empty(spec.batch, s, hidden, dtype=dtype).requires_grad_(True)
        pos = torch.arange(s).expand(spec.batch, s)
        labels = torch.zeros(spec.batch, s, dtype=torch.long)
        cos_sin = _rotary(model, x, pos)

        def enters(name: str) -> Callable[[torch.Tensor], None]:
            return lambda grad: phase.__setitem__(0, name)

        def forward() -> torch.Tensor:
            h = x
            names = ["bottom layer", *(f"layer {i}" for i in range(1, layers - 1)), "top layer"]
            for layer, name in zip(base.layers, names, strict=True):
                h = layer(h, **_layer_kwargs(cos_sin, pos))
                h.register_hook(enters(name))  # the layer's backward starts when its output's gradient is there
            h = _final_norm(model)(h)
            if spec.tiled_loss:
                return hf_patches.tiled_sequence_parallel_loss(
                    model, h, labels, group, tile_tokens=spec.loss_tile_tokens
                )
            return hf_patches.sequence_parallel_loss(model.lm_head(h), labels, group)

        def backward(loss: torch.Tensor) -> None:
            phase[0] = "loss"
            loss.backward()

        external = {"bottom layer's input x": [x], "cos/sin, position ids": [*cos_sin, pos], "labels": [labels]}
        return track(
            backward,
            external,
            list(model.parameters()),
            kernel=spec.kernel,
            names=_names(model),
            forward=forward,
            live=live,
            phase=lambda: phase[0],
        )


@functools.lru_cache(maxsize=512)
def core_step(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    sp_size: int,
    head_chunk_size: int,
    seq_len: int,
    batch: int = 1,
    dtype: str = "bf16",
    kernel: str = "none",
    ring_size: int = 1,
    accumulate_in_input_dtype: bool = False,
    overlap_comm: bool = False,
) -> Peak:
    """Rank 0's peak over ``UPipeDistributedAttention`` (TorchSDPAKernel) forward+backward on
    [b, S/C, H, d] q and [b, S/C, Hkv, d] k, v, with the output gradient materialized; with
    ``ring_size`` R > 1 UPipe runs over C_u = sp_size / R ranks and ring attention over R (fake groups).  ``weights``
    holds the bytes of q, k, v, out, dout, dq, dk, dv (the inputs, output and their gradients), so
    ``activations`` is the stage buffers: ``intermediate``, the "intermediate" of docs/benchmarks.md."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ...kernels import TorchSDPAKernel
    from ...layer import UPipeDistributedAttention
    from ...ring import build_sequence_groups

    t = DTYPES[dtype]
    s = seq_len // sp_size
    with fake_world(sp_size) as world, FakeTensorMode():
        group, ring = (world, None) if ring_size == 1 else build_sequence_groups(sp_size, ring_size)
        # validate_inputs=False: the documented trusted-inputs switch; the check's one all_gather of
        # a few int64 per rank ends in .tolist(), which fake tensors cannot run
        attn = UPipeDistributedAttention(
            TorchSDPAKernel(causal=True),
            group,
            head_chunk_size=head_chunk_size,
            validate_inputs=False,
            ring_group=ring,
            accumulate_in_input_dtype=accumulate_in_input_dtype,
            overlap_comm=overlap_comm,
        )
        q = torch.empty(batch, s, num_heads, head_dim, dtype=t).requires_grad_(True)
        k = torch.empty(batch, s, num_kv_heads, head_dim, dtype=t).requires_grad_(True)
        v = torch.empty(batch, s, num_kv_heads, head_dim, dtype=t).requires_grad_(True)
        dout = torch.empty(batch, s, num_heads, head_dim, dtype=t)

        def forward() -> torch.Tensor:
            return attn(q, k, v, batch_dim_idx=0)

        def backward(out: torch.Tensor) -> None:
            out.backward(dout)

        peak = track(backward, {"q, k, v": [q, k, v], "dout": [dout]}, [], kernel=kernel, forward=forward)
    io = 2 * (2 * q.numel() + k.numel() + v.numel()) * q.element_size()  # q k v out dout dq dk dv
    return intermediate(peak, io)


# -- what "auto" compares with upipe.memory_budget_gib: the one definition ---------------------------------


def intermediate(peak: Peak, io_bytes: int) -> Peak:
    """``peak`` with ``weights`` set to ``io_bytes``, so that ``activations`` is the attention's
    intermediate peak: what ``upipe.head_chunk_size: "auto"`` compares with ``upipe.memory_budget_gib``
    (docs/config.md).  The peak of the attention's forward + backward minus its inputs, its output,
    their gradients and its parameters and their gradients (what the rest of the step has anyway and
    ``ds-upipe plan`` counts elsewhere): the stage buffers, the all-to-all buffers in flight, the
    accumulators, the per-stage projections and what the attention saves from forward to backward."""
    peak.weights = io_bytes
    return peak


@functools.lru_cache(maxsize=512)
def attention_step(spec: StepSpec, packed: bool = False) -> Peak:
    """Rank 0's peak over the attention module of the first decoder layer of ``spec.model`` (one per
    kind of layer: ``HFModelConfig.layer_kinds``), forward + backward, run as the model runs it: built
    from ``spec.model`` (the real model's config on ``"auto"``'s routes), patched by
    ``hf_patches.apply_upipe`` with the spec's options (apply_upipe's own fallback of fused projections
    for that architecture) and ring, and called as the decoder layer calls it (hidden states, cos/sin,
    position ids, this forward's documents).  ``packed``: the row is packed as two documents, one token and the rest, so
    the kernel runs per document (``ds_upipe.packing.DocumentKernel``) with a segment of nearly the
    whole row beside the row's buffers (the most that per-document path holds).  ``activations``:
    ``intermediate``."""

    from hf_patches.architectures import SHARED_KV_KWARG, find_decoder, takes_shared_kv
    from hf_patches.state import DOCUMENTS_KWARG

    from ...packing import DocumentBoundaries

    dtype = DTYPES[spec.dtype]
    s, hidden = spec.local_tokens, spec.model.hidden_size
    with _fake_model(spec) as (model, _):
        attn = find_decoder(model).attentions[0]
        h = torch.empty(spec.batch, s, hidden, dtype=dtype).requires_grad_(True)
        dout = torch.empty(spec.batch, s, hidden, dtype=dtype)
        pos = torch.arange(s).expand(spec.batch, s)
        rotary = getattr(model.model, "rotary_emb", None)
        # per layer type where the rotary embedding takes it (Gemma 3 / 4: sliding and full layers rotate differently)
        by_type = rotary is not None and "layer_type" in inspect.signature(type(rotary).forward).parameters
        with torch.no_grad():
            cos_sin = None if rotary is None else rotary(h, pos, **({"layer_type": attn.layer_type} if by_type else {}))
        kwargs: dict[str, Any] = {"position_ids": pos}
        if takes_shared_kv(attn):  # Gemma 3n / 4: where a producing layer leaves its keys and values
            kwargs[SHARED_KV_KWARG] = {}
        if packed:
            kwargs[DOCUMENTS_KWARG] = DocumentBoundaries(((0, 1, spec.seq_len),))

        def forward() -> torch.Tensor:
            return attn(hidden_states=h, position_embeddings=cos_sin, attention_mask=None, **kwargs)[0]

        def backward(out: torch.Tensor) -> None:
            out.backward(dout)

        side = [pos, *(cos_sin or ())]
        weights = list(attn.parameters())
        peak = track(backward, {"hidden states h": [h], "dout": [dout], "cos/sin, position ids": side}, weights,
                     forward=forward)  # fmt: skip
    params = sum(w.untyped_storage().nbytes() for w in {id(w): w for w in weights}.values())
    io = 4 * h.untyped_storage().nbytes() + sum(t.untyped_storage().nbytes() for t in side)  # h dh out dout
    return intermediate(peak, 2 * params + io)


def attention_activations(
    head_chunk_sizes: list[int], *, model: str | None, options: dict[str, Any], **kwargs: Any
) -> dict[str, int]:
    """The intermediate peak (``intermediate``) of every U, in one process (``"auto"``: one child process
    for all U).  ``model``: the JSON of the real model's config (``HFModelConfig``), measured with
    ``attention_step`` on a layer of each kind the model has (``HFModelConfig.layer_kinds``: sliding and
    full attention layers), unpacked and packed rows (without a ring; rings refuse packing): the
    largest counts, since every layer runs at the chosen U and whether a batch is packed is known only
    per forward.  None (the core layer's route, no HF model): ``core_step`` of
    ``UPipeDistributedAttention``.  ``options``: the run's ``UPipeOptions`` as a dict (JSON to a child
    process); ``kwargs``: sp_size, seq_len, batch, dtype, ring_size (``StepSpec``'s fields), and without a
    model the head counts and head_dim."""
    base = UPipeOptions(**options)
    if model is None:
        return {
            str(u): core_step(
                head_chunk_size=u,
                accumulate_in_input_dtype=base.accumulate_in_input_dtype,
                overlap_comm=base.overlap_comm,
                **kwargs,
            ).activations
            for u in head_chunk_sizes
        }
    kinds = HFModelConfig(model).layer_kinds()  # the JSON of HFModelConfig.of, one per kind of layer
    out = {}
    for u in head_chunk_sizes:
        specs = [StepSpec(kind, "upipe", options=replace(base, head_chunk_size=u), **kwargs) for kind in kinds]
        packings = (False, True) if specs[0].ring_size == 1 else (False,)
        out[str(u)] = max(attention_step(spec, packed).activations for spec in specs for packed in packings)
    return out


@functools.lru_cache(maxsize=512)
def mixer_step(spec: StepSpec, packed: bool = False) -> Peak:
    """Rank 0's peak over the first sequence mixer (``hf_patches.mixers``: gated delta net, Mamba-2) of
    ``spec.model``, forward + backward, run as the model runs it: patched by ``hf_patches.apply_upipe`` with
    ``spec.options`` (its ``mixer_head_chunk_size``), called with the decoder layer's hidden states (and this
    forward's documents: ``packed``, two documents, one token and the rest, which the torch fallbacks run one at a
    time).  ``activations``: ``intermediate`` (the stages' projections, exchanges, conv and recurrence buffers and
    what the checkpointed stages keep: the mixer's share of the budget)."""
    from hf_patches.architectures import find_decoder
    from hf_patches.state import DOCUMENTS_KWARG

    from ...packing import DocumentBoundaries

    dtype = DTYPES[spec.dtype]
    s, hidden = spec.local_tokens, spec.model.hidden_size
    with _fake_model(spec) as (model, _):
        mixers = find_decoder(model).mixers
        if not mixers:
            raise ValueError(f"{json.loads(spec.model.json_text)['model_type']}: the first layer holds no mixer")
        mixer = mixers[0][1]
        h = torch.empty(spec.batch, s, hidden, dtype=dtype).requires_grad_(True)
        dout = torch.empty(spec.batch, s, hidden, dtype=dtype)
        kwargs = {DOCUMENTS_KWARG: DocumentBoundaries(((0, 1, spec.seq_len),))} if packed else {}

        def forward() -> torch.Tensor:
            return mixer(h, **kwargs)

        def backward(out: torch.Tensor) -> None:
            out.backward(dout)

        weights = list(mixer.parameters())
        peak = track(backward, {"hidden states h": [h], "dout": [dout]}, weights, forward=forward)
    params = sum(w.untyped_storage().nbytes() for w in {id(w): w for w in weights}.values())
    return intermediate(peak, 2 * params + 4 * h.untyped_storage().nbytes())  # h dh out dout


def mixer_activations(*, model: str, options: dict[str, Any], **kwargs: Any) -> dict[str, int]:
    """``mixer_head_chunk_size: "auto"``'s measurement: the intermediate peak (``intermediate``) of the model's
    mixer layer (``HFModelConfig.layer_kinds``: the kind whose first layer holds a mixer) at every U its mixers
    run with (``hf_patches.mixers.mixer_head_chunk_sizes``), on unpacked and packed rows (the larger counts), in
    one process.  ``model``: the JSON of the model's ``HFModelConfig``; ``options``: the run's ``UPipeOptions``
    as a dict; ``kwargs``: sp_size, seq_len, batch, dtype (``StepSpec``'s fields).  {} for a model without mixers
    of a kind with heads."""
    from transformers import AutoModelForCausalLM

    from hf_patches.architectures import find_decoder
    from hf_patches.mixers import mixer_head_chunk_sizes

    base = UPipeOptions(**options)
    for kind in HFModelConfig(model).layer_kinds():
        with torch.device("meta"):
            mixers = find_decoder(AutoModelForCausalLM.from_config(kind.config(1))).mixers
        if mixers:
            break
    else:
        return {}
    us = mixer_head_chunk_sizes(mixers, kwargs["sp_size"])
    specs = {u: StepSpec(kind, "upipe", options=replace(base, mixer_head_chunk_size=u), **kwargs) for u in us}
    return {str(u): max(mixer_step(spec, packed).activations for packed in (False, True)) for u, spec in specs.items()}
