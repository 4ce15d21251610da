"""Per-model UPipe settings shared by the patched attention modules of one model."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, fields
from typing import Any

import torch
import torch.distributed as dist

from ds_upipe.kernels import AttentionKernel, with_softmax_scale
from ds_upipe.packing import DocumentBoundaries, DocumentKernel
from ds_upipe.pipeline import PipelineContext, plan_indices
from ds_upipe.ring import RingAttentionKernel, SequenceLayout
from ds_upipe.schedule import StagePlan
from ds_upipe.sinks import SinkKernel
from ds_upipe.windows import windowed

#: The keyword argument that carries one forward's packed-sequence boundaries (``DocumentBoundaries``,
#: or None) from the model-level input check to every attention module of that forward.  It travels
#: with the forward as transformers threads its own ``cu_seq_lens_*`` kwargs (base model -> decoder
#: layers -> attention), so a checkpointed layer's replay in backward gets the boundaries of the
#: forward it replays, whatever forwards ran in between (never read back from shared state).
DOCUMENTS_KWARG = "upipe_documents"


@dataclass
class UPipeState:
    """What ``apply_upipe`` decided for one model (read it with ``hf_patches.upipe_state``)."""

    #: the Ulysses group (the whole sequence-parallel group without a ring) and its size C_u
    group: dist.ProcessGroup | None
    group_size: int
    plan: StagePlan
    kernel: AttentionKernel
    #: True: projections run per stage (fused); False: HF computes q/k/v, UPipe runs the core
    fused: bool
    #: why fused projections are off although requested (None when fused or not requested)
    fallback_reason: str | None
    architecture: str
    #: prefetch the next stage's all-to-alls while the current one computes (two stages in flight);
    #: settable after apply_upipe, e.g. from a config
    overlap_comm: bool = False
    #: set once fused mode has logged that it runs unfused under torch.autocast
    autocast_warned: bool = False
    #: stages run by this model's attention layers (forward + backward), for tests and launch checks
    stage_runs: list[int] = field(default_factory=lambda: [0])
    #: UPipe x Ring: the ring group (None: no ring) and its size R; the sequence-parallel group is
    #: then C_u x R ranks, each holding its zigzag shard (``ds_upipe.ring.zigzag_positions``)
    ring_group: dist.ProcessGroup | None = None
    ring_size: int = 1
    #: sum half-precision gradients over the stages in the input dtype instead of float32
    #: (``apply_upipe(accumulate_in_input_dtype=...)``; settable after apply_upipe)
    accumulate_in_input_dtype: bool = False
    #: fused mode: keep no attention output from forward to backward; backward recomputes each stage's
    #: attention forward (``apply_upipe(recompute_attention_output=...)``; settable after apply_upipe)
    recompute_attention_output: bool = False
    #: documents per batch row of the last attention call (None: one per row): a report for examples
    #: and tests only; the computation takes each call's boundaries from its forward (DOCUMENTS_KWARG)
    last_documents_per_row: tuple[int, ...] | None = None

    def __deepcopy__(self, memo: dict[int, Any]) -> UPipeState:
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
    def recomputes_attention_output(self) -> bool:
        """Whether backward recomputes the attention output: asked for, and the model runs fused (unfused,
        the model's o_proj keeps the output anyway)."""
        return self.fused and self.recompute_attention_output

    @property
    def head_chunk_size(self) -> int:
        return self.plan.head_chunk_size

    @property
    def layout(self) -> SequenceLayout:
        return SequenceLayout(self.group_size, self.ring_size)

    def attention(
        self,
        documents: DocumentBoundaries | None = None,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
        scale: float | None = None,
    ) -> AttentionKernel:
        """What each stage runs: the kernel, or ring attention around it over the ring group (a new one
        per call, so it follows ``overlap_comm`` as set now; forward and backward share the call's).
        With packed sequences (``documents``: this forward's boundaries, ``DOCUMENTS_KWARG``), the kernel
        runs per document (``DocumentKernel``: one flash-attn varlen call per stage around
        ``flash_attn``, one call per document otherwise; the input check refuses packing with a ring).
        ``window``: the layer's sliding window (``ds_upipe.windows``), inside each document and ring block;
        ``sinks``: the call's attention sinks (``ds_upipe.sinks``), on the ring's merged lse, per document;
        ``scale``: the call's softmax scale (None: the kernel's), ``ds_upipe.kernels.with_softmax_scale``."""
        kernel = windowed(with_softmax_scale(self.kernel, scale), window)
        if documents is None and self.ring_size > 1:
            kernel = RingAttentionKernel(kernel, self.ring_group, overlap=self.overlap_comm)
        if sinks is not None:
            kernel = SinkKernel(kernel, sinks)
        return kernel if documents is None else DocumentKernel(kernel, documents)

    def context(
        self,
        device: torch.device,
        documents: DocumentBoundaries | None = None,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
        scale: float | None = None,
    ) -> PipelineContext:
        """One attention call's pipeline context; ``documents`` are that call's packed-sequence
        boundaries (the autograd node keeps the context, so its backward sees the same ones)."""
        self.last_documents_per_row = None if documents is None else tuple(len(r) - 1 for r in documents.rows)
        return PipelineContext(
            plan=self.plan,
            indices=plan_indices(self.plan, device),
            group=self.group,
            attention=self.attention(documents, window, sinks, scale),
            stage_counter=self.stage_runs,
            overlap_comm=self.overlap_comm,
            accumulate_in_input_dtype=self.accumulate_in_input_dtype,
            recompute_output=self.recomputes_attention_output,
        )
