"""``UPipeDistributedAttention``: DeepSpeed-Ulysses' DistributedAttention with head-chunk pipelining."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from deepspeed.sequence.layer import DistributedAttention, apply_rotary_pos_emb
from torch import Tensor

from .cuda_env import warn_if_record_streams
from .kernels import AttentionKernel, CallableKernel
from .packing import DocumentBoundaries, DocumentKernel
from .pipeline import PipelineContext, UPipeAttentionFunction, plan_indices
from .ring import RingAttentionKernel, SequenceLayout, zigzag_positions
from .schedule import StagePlan, build_plan
from .sinks import SinkKernel, check_sinks, sinks_shape_code
from .validation import CheckedInputs, LayerSettings, check_packing_supported, check_window_and_sinks
from .windows import check_window, windowed


class UPipeDistributedAttention(DistributedAttention):
    """Drop-in for ``deepspeed.sequence.layer.DistributedAttention`` that runs heads in stages.

    Arguments are DistributedAttention's, plus ``head_chunk_size`` (U): query heads per stage across
    the sequence-parallel group.  None means U = C (the group size, least memory); U = H is plain
    Ulysses in one stage.  Key and value may have fewer heads than query (GQA/MQA), including fewer
    than C (then KV replicas are sent and their gradients summed back).

    ``local_attention`` is either an ``AttentionKernel`` (forward returns the lse, backward needs no
    recompute) or any callable with DistributedAttention's contract ``f(q, k, v, *args, **kwargs)``
    on [b, S, h, d] (batch_dim_idx=0) or [S, b, h, d] (batch_dim_idx=1) tensors; such a callable runs
    as a ``CallableKernel`` (recomputed per stage in backward).

    ``overlap_comm=True`` issues the next stage's input all-to-alls asynchronously before the current
    stage computes (two stages' input buffers alive instead of one).  DeepSpeed's ``sp_stream`` is
    accepted for signature compatibility; the asynchronous collectives use the backend's own stream.

    ``ring_group`` (None: no ring) makes it UPipe x Ring: ``sequence_process_group`` is then the
    Ulysses group (C_u ranks, within a node) and each stage attends over the whole sequence by ring
    attention over ``ring_group`` (R ranks, across nodes; ``ds_upipe.ring.RingAttentionKernel``), so
    ``local_attention`` must be an ``AttentionKernel``.  Each rank holds its zigzag shard
    (``ds_upipe.ring.zigzag_shard``), and both groups come from ``ds_upipe.ring.build_sequence_groups``.
    ``ring_overlap`` (None: follow ``overlap_comm``) sends the next K/V block while the current one
    computes.

    Packed sequences: ``forward(..., cu_seqlens=...)`` gives the document boundaries of the global
    sequence (cumulative lengths ``(0, l1, l1 + l2, ..., S)``, flash-attn's ``cu_seqlens``; one row
    shared by the batch, or one per row; ``ds_upipe.packing.documents_from_positions`` derives them
    from global position_ids).  Every stage then attends within each document only
    (``ds_upipe.packing.DocumentKernel`` around the local kernel), the same on every rank; it needs
    an ``AttentionKernel`` and no ring.

    Sliding windows and sinks: ``window`` (constructor, or ``forward(..., window=...)`` per call) restricts
    every stage to causal attention over the last W tokens, itself included (transformers'
    ``sliding_window``; ``ds_upipe.windows.windowed`` around the kernel: flash-attn's own window, banded
    tiles otherwise; inside each document, and over the ring's zigzag chunks); ``sinks`` (a [H] tensor, one
    logit per query head, e.g. GPT-OSS's ``module.sinks``; constructor or per call) adds attention sinks
    (``ds_upipe.sinks.SinkKernel``), each stage with its own heads' sinks, the gradient returned to the
    tensor through autograd.  Both need an ``AttentionKernel`` (a window a causal one).

    ``validate_inputs`` exchanges every rank's shapes, dtypes and settings (head_chunk_size,
    overlap_comm, scatter_idx, the kernel's causal and softmax_scale) once per forward (one tiny
    all_gather) so a bad input, or ranks configured differently, raise the same ValueError on all
    ranks instead of hanging some of them.  It must itself be the same on every rank.
    """

    def __init__(
        self,
        local_attention: AttentionKernel | Callable[..., Tensor],
        sequence_process_group: dist.ProcessGroup | None,
        scatter_idx: int = 2,
        gather_idx: int = 0,
        sp_stream: Any = None,
        num_kv_heads: int | None = None,
        *,
        head_chunk_size: int | None = None,
        overlap_comm: bool = False,
        validate_inputs: bool = True,
        ring_group: dist.ProcessGroup | None = None,
        ring_overlap: bool | None = None,
        accumulate_in_input_dtype: bool = False,
        window: int | None = None,
        sinks: Tensor | None = None,
    ) -> None:
        # DeepSpeed's overlap handles belong to its own forward; UPipe runs its own loop.
        super().__init__(local_attention, sequence_process_group, scatter_idx, gather_idx, None, num_kv_heads)
        if head_chunk_size is not None and (
            isinstance(head_chunk_size, bool) or not isinstance(head_chunk_size, int) or head_chunk_size < 1
        ):
            raise ValueError(f"head_chunk_size must be a positive int or None, got {head_chunk_size!r}")
        self.head_chunk_size = head_chunk_size
        self.overlap_comm = overlap_comm
        #: bf16/fp16 dK/dV summed over a round's stages in their own dtype (sent per stage) instead of float32
        self.accumulate_in_input_dtype = bool(accumulate_in_input_dtype)
        self.validate_inputs = validate_inputs
        self.checked_inputs = CheckedInputs()
        if dist.is_initialized() and sequence_process_group is not None:
            warn_if_record_streams(dist.get_backend(sequence_process_group))  # torch < 2.8 + NCCL
        del sp_stream  # accepted for DistributedAttention's signature; UPipe's async collectives need no stream
        self.ring_group = ring_group
        self.ring_overlap = overlap_comm if ring_overlap is None else ring_overlap
        self._ring_kernels: dict[int | None, RingAttentionKernel] = {}
        #: sliding window of every call (``forward(window=...)`` overrides it): ``ds_upipe.windows``
        self.window = check_window(window)
        if sinks is not None:
            check_sinks(sinks)
        #: attention sinks of every call (``forward(sinks=...)`` overrides): one logit per query head
        self.sinks = sinks
        #: number of stages this module has run (forward + backward)
        self.stage_runs = [0]

    @property
    def group_size(self) -> int:
        return dist.get_world_size(self.spg) if dist.is_initialized() else 1

    @property
    def ring_size(self) -> int:
        return dist.get_world_size(self.ring_group) if self.ring_group is not None and dist.is_initialized() else 1

    @property
    def layout(self) -> SequenceLayout:
        return SequenceLayout(self.group_size, self.ring_size)

    def attention_kernel(
        self,
        batch_dim_idx: int = 0,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        window: int | None = None,
    ) -> AttentionKernel:
        """What each stage runs: the local attention kernel (restricted to ``window``), or ring attention
        around it when there is a ring.  A plain local-attention function runs as a ``CallableKernel``
        with this call's layout and extra arguments (and cannot be windowed)."""
        if not isinstance(self.local_attn, AttentionKernel):
            return CallableKernel(self.local_attn, batch_dim_idx, args, kwargs)
        local = windowed(self.local_attn, window)
        if self.ring_size == 1:
            return local
        if window not in self._ring_kernels:
            self._ring_kernels[window] = RingAttentionKernel(local, self.ring_group, overlap=self.ring_overlap)
        return self._ring_kernels[window]

    def layer_settings(self, window: int | None = None, sinks: Tensor | None = None) -> LayerSettings:
        """What the ranks of the group must agree on (checked in the input exchange)."""
        # a CallableKernel passed in directly counts as the callable it wraps: no lse, recompute
        is_kernel = isinstance(self.local_attn, AttentionKernel) and not isinstance(self.local_attn, CallableKernel)
        kernel = self.local_attn if is_kernel else None
        return LayerSettings(
            head_chunk_size=self.head_chunk_size,
            scatter_idx=self.scatter_idx,
            overlap_comm=self.overlap_comm,
            uses_kernel=kernel is not None,
            causal=None if kernel is None else bool(kernel.causal),
            softmax_scale=None if kernel is None else kernel.softmax_scale,
            ring_size=self.ring_size,
            ring_overlap=self.ring_overlap and self.ring_size > 1,  # moot without a ring
            accumulate_in_input_dtype=self.accumulate_in_input_dtype,
            window=window,
            sinks=sinks_shape_code(sinks),
        )

    def plan_for(self, num_heads: int, num_kv_heads: int) -> StagePlan:
        return build_plan(num_heads, num_kv_heads, self.group_size, self.head_chunk_size)

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        batch_dim_idx: int,
        rotary_pos_emb: tuple[Tensor, Tensor] | None = None,
        *args: Any,
        cu_seqlens: DocumentBoundaries | Tensor | list[int] | list[list[int]] | None = None,
        window: int | None = None,
        sinks: Tensor | None = None,
        **kwargs: Any,
    ) -> Tensor:
        documents = None if cu_seqlens is None else DocumentBoundaries.of(cu_seqlens)
        window = self.window if window is None else check_window(window)
        sinks = self.sinks if sinks is None else sinks
        if self.validate_inputs:
            # one host read per new layout per module, not per call (validation.CheckedInputs)
            num_heads, num_kv_heads, _ = self.checked_inputs(
                query,
                key,
                value,
                batch_dim_idx,
                self.layer_settings(window, sinks),
                self.spg,
                ring_group=self.ring_group,
                documents=None if documents is None else documents.fingerprint(),
                ulysses_size=self.group_size,
            )
        else:
            num_heads, num_kv_heads = query.shape[2], key.shape[2]
        # local checks again for validate_inputs=False (the exchange raised them on every rank already)
        check_window_and_sinks(self.layer_settings(window, sinks), num_heads)
        attention = self.attention_kernel(batch_dim_idx, args, kwargs, window)
        if sinks is not None:
            attention = SinkKernel(attention, sinks)
        if documents is not None:
            # the same boundaries on every rank (checked above), so the same error everywhere
            seq_dim = 1 - batch_dim_idx
            documents.check(query.shape[batch_dim_idx], query.shape[seq_dim] * self.layout.sp_size)
            # the input exchange's check again, for validate_inputs=False (local settings only)
            check_packing_supported(not isinstance(attention, CallableKernel), self.ring_size)
            if not documents.is_trivial:
                attention = DocumentKernel(attention, documents)
        plan = self.plan_for(num_heads, num_kv_heads)
        if rotary_pos_emb is not None:
            query, key = self._apply_local_rotary(query, key, batch_dim_idx, rotary_pos_emb)
        pctx = PipelineContext(
            plan=plan,
            indices=plan_indices(plan, query.device),
            group=self.spg,
            attention=attention,
            stage_counter=self.stage_runs,
            overlap_comm=self.overlap_comm,
            accumulate_in_input_dtype=self.accumulate_in_input_dtype,
        )
        if sinks is None:
            return UPipeAttentionFunction.apply(query, key, value, pctx, batch_dim_idx)
        return UPipeAttentionFunction.apply(query, key, value, pctx, batch_dim_idx, sinks)

    def _apply_local_rotary(
        self, query: Tensor, key: Tensor, batch_dim_idx: int, rotary_pos_emb: tuple[Tensor, Tensor]
    ) -> tuple[Tensor, Tensor]:
        """RoPE is position-wise, so it commutes with the all-to-all: apply this rank's slice of the
        full-sequence frequencies to the local shard (DeepSpeed applies them after gathering)."""
        seq_dim = 1 - batch_dim_idx  # sequence dim of the gathered layout
        local_len = query.shape[seq_dim]
        full_len = local_len * self.layout.sp_size
        positions = None
        sliced = []
        for freqs in rotary_pos_emb:
            freqs = freqs.permute(1, 0, 2, 3)  # the same permute DeepSpeed applies
            if freqs.shape[seq_dim] != 1:
                if freqs.shape[seq_dim] != full_len:
                    raise ValueError(
                        f"rotary_pos_emb covers {freqs.shape[seq_dim]} positions; expected the full sequence "
                        f"{full_len} (or 1 to broadcast)"
                    )
                if self.ring_size == 1:
                    freqs = freqs.narrow(seq_dim, self._sp_rank() * local_len, local_len)
                else:  # the zigzag positions this rank holds
                    if positions is None:
                        positions = zigzag_positions(full_len, self.layout, self._sp_rank()).to(freqs.device)
                    freqs = freqs.index_select(seq_dim, positions)
            sliced.append(freqs)
        return apply_rotary_pos_emb(query, *sliced), apply_rotary_pos_emb(key, *sliced)

    def _sp_rank(self) -> int:
        """This rank's index in the sequence-parallel group: ring index * C_u + Ulysses index."""
        if not dist.is_initialized():
            return 0
        ring_index = dist.get_rank(self.ring_group) if self.ring_group is not None else 0
        return self.layout.sp_rank(ring_index, dist.get_rank(self.spg))
