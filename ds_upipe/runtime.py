"""``UPipeRuntime``: the one UPipe runtime object, built one way by every route.

The core layer (``UPipeDistributedAttention``), ``hf_patches.apply_upipe`` and the Trainer /
accelerate registration (``ds_upipe.integration.hf_integration``) each own one per layer or per
model, made by ``UPipeRuntime.build`` (``hf_patches.UPipeState`` is this class with the HF model's
extra facts).  It owns what every UPipe attention call of its owner shares:

- the groups (the Ulysses group of C_u ranks, the ring group of R ranks or None) and their sizes;
- the stage plans, one per head counts (H, Hkv): built and validated where they are known (the HF routes:
  every layer's, from the model config), else per call (the core layer, from its inputs): ``plan_for``;
- the local kernel and its wrapping for one call (``attention``): sliding window, ring, sinks,
  packed documents, in that order, or the window and bidirectional spans (``ds_upipe.spans``) alone;
- the one record of settings every rank must share (``settings``, compared by
  ``ds_upipe.validation.check_settings``), and the per-layout input-check cache (``checked_inputs``);
- the pipeline context of one call (``context``), which the autograd node keeps until its backward.

Per-forward data (packed boundaries, window, sinks, spans) is passed to ``attention``/``context`` per call
and kept by the call's context only; nothing here is read back by a later call.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .heads import per_head_counts
from .kernel_choice import make_kernel
from .kernels import AttentionKernel, CallableKernel, with_softmax_scale
from .layout import SequenceLayout
from .options import UPipeOptions
from .packing import DocumentBoundaries, DocumentKernel
from .pipeline import PipelineContext, plan_indices
from .ring import RingAttentionKernel
from .schedule import StagePlan, build_plan
from .sinks import SinkKernel, sinks_shape_code
from .spans import BidirectionalSpans, SpanKernel
from .validation import CheckedInputs, RuntimeSettings, resolve_ulysses_head_chunk_size
from .windows import windowed


@dataclass(kw_only=True)
class UPipeRuntime:
    """One UPipe runtime (module docstring).  Build it with ``UPipeRuntime.build``; its plain fields
    marked settable may be changed afterwards (every call reads them then)."""

    #: the Ulysses group (the whole sequence-parallel group without a ring) and its size C_u
    group: dist.ProcessGroup | None
    group_size: int
    #: the local attention: an ``AttentionKernel``, or (core layer) a generic callable with
    #: DistributedAttention's contract, run as a ``CallableKernel``
    kernel: AttentionKernel | Callable[..., Tensor]
    #: the settings the runtime was built with, as requested (``ds_upipe.options``); the fields below
    #: are what runs (U resolved by the plan, fused projections after the model's fallback)
    options: UPipeOptions = field(default_factory=UPipeOptions)
    #: U as configured (None: U = C); the plan's U where the plan is known (``plan``)
    head_chunk_size: int | None = None
    #: the stage plan of the first layer's heads, where known at build (None: per call, ``plan_for``)
    plan: StagePlan | None = None
    #: every stage plan by (H, Hkv): the model's layers' at build, the core layer's added per call (``plan_for``)
    plans: dict[tuple[int, int], StagePlan] = field(default_factory=dict)
    #: UPipe x Ring: the ring group (None: no ring) and its size R; the sequence-parallel group is
    #: then C_u x R ranks, each holding its zigzag shard (``ds_upipe.ring.zigzag_positions``)
    ring_group: dist.ProcessGroup | None = None
    ring_size: int = 1
    #: prefetch the next stage's all-to-alls while the current one computes (settable)
    overlap_comm: bool = False
    #: the ring's K/V exchange overlaps compute (None: follows ``overlap_comm``)
    ring_overlap: bool | None = None
    #: sum half-precision gradients over the stages in the input dtype instead of float32 (settable)
    accumulate_in_input_dtype: bool = False
    #: HF models: q/k/v projected per stage from the layer input, as it runs (False where the model
    #: falls back to its own projections, and in the core layer)
    fused_projections: bool = False
    #: backward recomputes each stage's attention output instead of keeping it: what runs (fused
    #: HF mode only; ``build`` sets it False where the projections run unfused) (settable)
    recompute_attention_output: bool = False
    #: stages run by this runtime's attention calls (forward + backward), for tests and launch checks
    stage_runs: list[int] = field(default_factory=lambda: [0])
    #: the core layer's input exchange, cached per input layout (``validation.CheckedInputs``)
    checked_inputs: CheckedInputs = field(default_factory=CheckedInputs)
    #: ring attention around the kernel, per (window, overlap, scale): one object per setting, so its
    #: counters (``RingAttentionKernel.work``) add up over the runtime's calls
    ring_kernels: dict[tuple[int | None, bool, float | None], RingAttentionKernel] = field(
        default_factory=dict, repr=False
    )

    @classmethod
    def build(
        cls,
        options: UPipeOptions,
        *,
        group: dist.ProcessGroup | None,
        kernel: AttentionKernel | Callable[..., Tensor] | None = None,
        num_heads: int | None = None,
        num_kv_heads: int | None = None,
        layer_heads: Mapping[tuple[int, int], int] | None = None,
        softmax_scale: float | None = None,
        ring_group: dist.ProcessGroup | None = None,
        ring_overlap: bool | None = None,
        fused_projections: bool = False,
        **extra: Any,
    ) -> Any:
        """The runtime of one layer or model from its ``options``, the same way for every route.

        ``kernel``: the core layer's local attention (an ``AttentionKernel`` or a callable) in place of
        ``options.kernel``, which is built by name otherwise (causal, ``softmax_scale``).
        ``num_heads``/``num_kv_heads`` (where known) build and validate the plan now (ValueError naming
        the valid U; with a ring, saying that C_u, not C_u x R, splits the heads).  ``layer_heads``: the
        model's distinct head counts -> the first layer with them (``heads.head_counts``, in place of
        ``num_heads``/``num_kv_heads``): each one's plan built now at the one U, the error naming the layer.
        ``fused_projections``: whether HF fused projections run (``options.fused_projections`` unless the
        model falls back; ``recompute_attention_output`` acts only then).
        ``extra``: the fields of a subclass (``hf_patches.UPipeState``)."""
        initialized = dist.is_initialized()
        group_size = dist.get_world_size(group) if initialized else 1
        ring_size = dist.get_world_size(ring_group) if ring_group is not None and initialized else 1
        if kernel is None:
            kernel = make_kernel(options.kernel, causal=True, softmax_scale=softmax_scale)
        head_chunk_size = options.head_chunk_size
        if layer_heads is None and num_heads is not None and num_kv_heads is not None:
            layer_heads = {(num_heads, num_kv_heads): 0}
        plans = per_head_counts(
            layer_heads or {}, lambda h, kv: _ring_aware_plan(h, kv, group_size, ring_size, head_chunk_size)
        )
        plan = next(iter(plans.values()), None)
        if plan is not None:
            head_chunk_size = plan.head_chunk_size  # U as resolved (C for None): one U for every plan
        return cls(
            options=options,
            group=group,
            group_size=group_size,
            kernel=kernel,
            head_chunk_size=head_chunk_size,
            plan=plan,
            plans=plans,
            ring_group=ring_group if ring_size > 1 else None,
            ring_size=ring_size,
            overlap_comm=options.overlap_comm,
            ring_overlap=ring_overlap,
            accumulate_in_input_dtype=options.accumulate_in_input_dtype,
            fused_projections=fused_projections,
            # unfused, the model's o_proj keeps the attention output anyway: nothing to recompute
            recompute_attention_output=options.as_run(fused_projections).recompute_attention_output,
            **extra,
        )

    def __deepcopy__(self, memo: dict[int, Any]) -> UPipeRuntime:
        """A copy of a patched model (reference model, EMA) joins the same sequence-parallel group:
        a process group cannot be copied, and the copy must run its collectives with the same ranks."""
        for group in (self.group, self.ring_group):
            memo.setdefault(id(group), group)
        clone = object.__new__(type(self))
        memo[id(self)] = clone
        for f in fields(self):
            setattr(clone, f.name, copy.deepcopy(getattr(self, f.name), memo))
        return clone

    @property
    def layout(self) -> SequenceLayout:
        return SequenceLayout(self.group_size, self.ring_size)

    @property
    def uses_kernel(self) -> bool:
        """The local attention is an AttentionKernel with an lse (a CallableKernel passed in directly
        counts as the callable it wraps: no lse, recomputed per stage)."""
        return isinstance(self.kernel, AttentionKernel) and not isinstance(self.kernel, CallableKernel)

    @property
    def overlaps_ring(self) -> bool:
        """Whether the ring's K/V exchange overlaps compute (moot without a ring)."""
        return self.ring_size > 1 and (self.overlap_comm if self.ring_overlap is None else self.ring_overlap)

    def plan_for(self, num_heads: int, num_kv_heads: int) -> StagePlan:
        """The stage plan for these head counts: the one place a call finds its plan (a model's layers: built
        and validated by ``build``; the core layer's inputs: built at their first call)."""
        key = (num_heads, num_kv_heads)
        if key not in self.plans:
            self.plans[key] = build_plan(num_heads, num_kv_heads, self.group_size, self.head_chunk_size)
        return self.plans[key]

    def settings(self, window: int | None = None, sinks: Tensor | None = None, scatter_idx: int = 2) -> RuntimeSettings:
        """What every rank must agree on for a call with this window and these sinks."""
        kernel = self.kernel if self.uses_kernel else None
        return RuntimeSettings(
            head_chunk_size=self.head_chunk_size,
            scatter_idx=scatter_idx,
            overlap_comm=self.overlap_comm,
            uses_kernel=kernel is not None,
            causal=None if kernel is None else bool(kernel.causal),
            softmax_scale=None if kernel is None else kernel.softmax_scale,
            ring_size=self.ring_size,
            ring_overlap=self.overlaps_ring,
            accumulate_in_input_dtype=self.accumulate_in_input_dtype,
            fused_projections=self.fused_projections,
            recompute_attention_output=self.recompute_attention_output,
            share_exchanged_kv=self.options.share_exchanged_kv,
            num_heads=None if self.plan is None else self.plan.num_heads,
            num_kv_heads=None if self.plan is None else self.plan.num_kv_heads,
            window=window,
            sinks=sinks_shape_code(sinks),
        )

    def attention(
        self,
        documents: DocumentBoundaries | None = None,
        window: int | None = None,
        sinks: Tensor | None = None,
        *,
        spans: BidirectionalSpans | None = None,
        scale: float | None = None,
        batch_dim_idx: int = 0,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> AttentionKernel:
        """What each stage of one call runs.  A generic callable runs as a ``CallableKernel`` with this
        call's layout and extra arguments (windows, sinks, documents and rings need a kernel: refused
        by the input checks).  A kernel is restricted to ``window`` (``ds_upipe.windows``), run as ring
        attention over the ring group (``overlap_comm`` / ``ring_overlap`` as set now; not with packed
        rows: refused by the input checks), given the call's ``sinks`` (``ds_upipe.sinks``, on the
        ring's merged lse) and run per document of ``documents`` (this forward's packed boundaries,
        ``DocumentKernel``); ``spans``: this forward's bidirectional spans (Gemma 3's and 4's images, ``SpanKernel``
        around the windowed kernel; not with documents, sinks or a ring).  ``scale``: the call's softmax scale
        (None: the kernel's; ``kernels.with_softmax_scale``: a model's own scale, Gemma's query_pre_attn_scalar,
        Granite's attention_multiplier, reaches the kernel's ops exactly)."""
        if not isinstance(self.kernel, AttentionKernel):
            return CallableKernel(self.kernel, batch_dim_idx, args, kwargs)
        causal = with_softmax_scale(self.kernel, scale)
        kernel = windowed(causal, window)
        spans = None if spans is None else spans.for_window(window)  # Gemma 4's: sliding layers only
        if spans is not None:
            _check_spans_alone(documents, sinks, self.ring_size)
            return SpanKernel(kernel, causal, spans)
        if documents is None and self.ring_size > 1:
            key = (window, self.overlaps_ring, scale)
            if key not in self.ring_kernels:
                self.ring_kernels[key] = RingAttentionKernel(kernel, self.ring_group, overlap=self.overlaps_ring)
            kernel = self.ring_kernels[key]
        if sinks is not None:
            kernel = SinkKernel(kernel, sinks)
        if documents is not None and not documents.is_trivial:
            kernel = DocumentKernel(kernel, documents)
        return kernel

    def context(
        self,
        device: torch.device,
        documents: DocumentBoundaries | None = None,
        window: int | None = None,
        sinks: Tensor | None = None,
        *,
        spans: BidirectionalSpans | None = None,
        scale: float | None = None,
        plan: StagePlan | None = None,
        attention: AttentionKernel | None = None,
    ) -> PipelineContext:
        """One attention call's pipeline context (the autograd node keeps it, so its backward sees the
        same documents, window, sinks and spans).  ``plan``: the call's (default the built one);
        ``attention``: the call's kernel (default ``self.attention(documents, window, sinks, spans=spans,
        scale=scale)``)."""
        plan = self.plan if plan is None else plan
        if plan is None:
            raise ValueError("UPipeRuntime.context: no plan (pass plan=runtime.plan_for(num_heads, num_kv_heads))")
        return PipelineContext(
            plan=plan,
            indices=plan_indices(plan, device),
            group=self.group,
            attention=self.attention(documents, window, sinks, spans=spans, scale=scale)
            if attention is None
            else attention,
            stage_counter=self.stage_runs,
            overlap_comm=self.overlap_comm,
            accumulate_in_input_dtype=self.accumulate_in_input_dtype,
            recompute_attention_output=self.recompute_attention_output,
        )


def _check_spans_alone(documents: DocumentBoundaries | None, sinks: Tensor | None, ring_size: int) -> None:
    """Bidirectional spans run on the plain (or windowed) kernel only: ValueError naming what else the call has."""
    others = {
        "packed documents": documents is not None and not documents.is_trivial,
        "attention sinks": sinks is not None,
        "a ring group": ring_size > 1,
    }
    given = [name for name, on in others.items() if on]
    if given:
        raise ValueError(
            f"bidirectional spans (Gemma 3's image tokens, ds_upipe.spans) with {' and '.join(given)}: not supported; "
            "run one sample a row, without a ring"
        )


def _ring_aware_plan(
    num_heads: int, num_kv_heads: int, group_size: int, ring_size: int, head_chunk_size: int | None
) -> StagePlan:
    """The stage plan over the Ulysses group; with a ring, the error says that C_u, not C_u x R, splits
    the heads (``validation.resolve_ulysses_head_chunk_size``: one rule for every route)."""
    if ring_size > 1:
        head_chunk_size = resolve_ulysses_head_chunk_size(
            num_heads, num_kv_heads, group_size, ring_size, head_chunk_size
        )
    return build_plan(num_heads, num_kv_heads, group_size, head_chunk_size)
