"""``UPipeDistributedAttention``: DeepSpeed-Ulysses' DistributedAttention with head-chunk pipelining."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from deepspeed.sequence.layer import DistributedAttention, apply_rotary_pos_emb
from torch import Tensor

from .cuda_env import warn_if_record_streams
from .kernels import AttentionKernel
from .options import UPipeOptions
from .packing import DocumentBoundaries
from .pipeline import UPipeAttentionFunction, apply_eagerly
from .ring import SequenceLayout, zigzag_positions
from .runtime import UPipeRuntime
from .sinks import check_sinks
from .validation import CheckedInputs, check_packing_supported, check_window_and_sinks
from .windows import check_window


def _runtime_field(name: str) -> property:
    """A layer attribute that is its runtime's field of the same name."""
    return property(
        lambda self: getattr(self.runtime, name),
        lambda self, value: setattr(self.runtime, name, value),
        doc=f"``self.runtime.{name}``",
    )


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

    ``validate_inputs`` exchanges every rank's shapes, dtypes and settings (the runtime's
    ``RuntimeSettings``: head_chunk_size, overlap_comm, scatter_idx, the kernel's causal and
    softmax_scale, ...) in one tiny all_gather the first time the layer sees an input layout, so a bad
    input, or ranks configured differently, raise the same ValueError on all ranks instead of hanging
    some of them.  The exchange runs every call (so every rank issues the same collectives); a layout
    every rank has checked is then compared on the device, without a host read
    (``validation.CheckedInputs`` says why the exchange itself is not skipped).  It must itself be the
    same on every rank.

    Everything the layer runs with is its ``runtime`` (``ds_upipe.runtime.UPipeRuntime``), built as
    ``hf_patches.apply_upipe`` builds a model's; ``head_chunk_size``, ``overlap_comm``,
    ``ring_overlap`` and ``accumulate_in_input_dtype`` are its fields (settable).
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
        #: this layer's UPipe runtime (``ds_upipe.runtime``): groups, kernel and its wrapping, plans, the
        #: cross-rank settings and the per-layout input-check cache; built as the HF routes build theirs
        self.runtime = UPipeRuntime.build(
            UPipeOptions(
                head_chunk_size=head_chunk_size,
                fused_projections=False,  # the core layer gets q, k, v projected
                overlap_comm=overlap_comm,
                accumulate_in_input_dtype=accumulate_in_input_dtype,
            ),
            group=sequence_process_group,
            kernel=local_attention,
            ring_group=ring_group,
            ring_overlap=ring_overlap,
        )
        self.validate_inputs = validate_inputs
        if dist.is_initialized() and sequence_process_group is not None:
            warn_if_record_streams(dist.get_backend(sequence_process_group))  # torch < 2.8 + NCCL
        del sp_stream  # accepted for DistributedAttention's signature; UPipe's async collectives need no stream
        #: sliding window of every call (``forward(window=...)`` overrides it): ``ds_upipe.windows``
        self.window = check_window(window)
        if sinks is not None:
            check_sinks(sinks)
        #: attention sinks of every call (``forward(sinks=...)`` overrides): one logit per query head
        self.sinks = sinks

    # the runtime's settings under the constructor's names (settable: every call reads them)
    head_chunk_size = _runtime_field("head_chunk_size")
    overlap_comm = _runtime_field("overlap_comm")
    ring_overlap = _runtime_field("ring_overlap")
    accumulate_in_input_dtype = _runtime_field("accumulate_in_input_dtype")

    @property
    def ring_group(self) -> dist.ProcessGroup | None:
        return self.runtime.ring_group

    @property
    def stage_runs(self) -> list[int]:
        """Number of stages this module has run (forward + backward), in a one-element list."""
        return self.runtime.stage_runs

    @property
    def checked_inputs(self) -> CheckedInputs:
        return self.runtime.checked_inputs

    @property
    def group_size(self) -> int:
        """C_u: ranks of the Ulysses group (the sequence-parallel group without a ring)."""
        return self.runtime.group_size

    @property
    def ring_size(self) -> int:
        return self.runtime.ring_size

    @property
    def layout(self) -> SequenceLayout:
        return self.runtime.layout

    def attention_kernel(
        self,
        batch_dim_idx: int = 0,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        window: int | None = None,
    ) -> AttentionKernel:
        """What each stage runs without packing or sinks (``UPipeRuntime.attention``)."""
        return self.runtime.attention(None, window, batch_dim_idx=batch_dim_idx, args=args, kwargs=kwargs)

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
        runtime = self.runtime
        documents = None if cu_seqlens is None else DocumentBoundaries.of(cu_seqlens)
        window = self.window if window is None else check_window(window)
        sinks = self.sinks if sinks is None else sinks
        settings = runtime.settings(window, sinks, self.scatter_idx)
        if self.validate_inputs:
            # one tiny exchange per call; a host read only for a layout not yet checked (validation.CheckedInputs)
            num_heads, num_kv_heads, _ = runtime.checked_inputs(
                query,
                key,
                value,
                batch_dim_idx,
                settings,
                self.spg,
                ring_group=runtime.ring_group,
                documents=None if documents is None else documents.fingerprint(),
                ulysses_size=runtime.group_size,
            )
        else:
            num_heads, num_kv_heads = query.shape[2], key.shape[2]
        # local checks again for validate_inputs=False (the exchange raised them on every rank already)
        check_window_and_sinks(settings, num_heads)
        if documents is not None:
            # the same boundaries on every rank (checked above), so the same error everywhere
            seq_dim = 1 - batch_dim_idx
            documents.check(query.shape[batch_dim_idx], query.shape[seq_dim] * runtime.layout.sp_size)
            # the input exchange's check again, for validate_inputs=False (local settings only)
            check_packing_supported(settings.uses_kernel, runtime.ring_size)
        attention = runtime.attention(documents, window, sinks, batch_dim_idx=batch_dim_idx, args=args, kwargs=kwargs)
        if rotary_pos_emb is not None:
            query, key = self._apply_local_rotary(query, key, batch_dim_idx, rotary_pos_emb)
        pctx = runtime.context(query.device, plan=runtime.plan_for(num_heads, num_kv_heads), attention=attention)
        if sinks is None:
            return apply_eagerly(UPipeAttentionFunction, query, key, value, pctx, batch_dim_idx)
        return apply_eagerly(UPipeAttentionFunction, query, key, value, pctx, batch_dim_idx, sinks)

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
