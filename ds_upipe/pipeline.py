"""The UPipe stage loop as one autograd Function.

Forward runs the stage plan: per round, gather the round's KV heads once; per stage, gather u query
heads per rank over the full sequence, attend, send the output back and write it at the heads' own
indices.  Only sequence-sharded tensors are saved (the inputs, the output, per-stage lse and kernel
aux), so no gathered full-sequence tensor outlives its stage.  Backward replays each stage's all-to-alls,
accumulates dK/dV of a round in float32 and sends them back once per round.

Where the stage inputs come from is abstracted by ``StageSource``: plain local q/k/v tensors here,
per-stage projections of the layer input in hf_patches' fused mode.  The loop itself never changes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from .comm import PendingExchange, heads_to_sequence, sequence_to_heads, start_heads_to_sequence
from .kernels import AttentionKernel
from .schedule import StagePlan

#: process-wide count of UPipe stages run (forward + backward), so a launch can prove UPipe ran
STAGE_RUNS: list[int] = [0]


class StageSource(Protocol):
    """Supplies a stage's local heads ([b, s, n, d] views of this rank's sequence shard) and takes
    their gradients back.  ``heads`` is a 1-D index tensor of global head indices (may repeat)."""

    def query(self, heads: Tensor) -> Tensor: ...

    def key_value(self, heads: Tensor) -> tuple[Tensor, Tensor]: ...

    def add_query_grad(self, heads: Tensor, grad: Tensor) -> None: ...

    def add_key_value_grad(self, heads: Tensor, grad_key: Tensor, grad_value: Tensor) -> None: ...


class LocalTensorSource:
    """Stage inputs taken from already computed local q, k, v ([b, s, h, d] views)."""

    def __init__(self, query: Tensor, key: Tensor, value: Tensor) -> None:
        self.q, self.k, self.v = query, key, value
        self.grad_q: Tensor | None = None
        self.grad_k: Tensor | None = None
        self.grad_v: Tensor | None = None

    def query(self, heads: Tensor) -> Tensor:
        return self.q.index_select(2, heads)

    def key_value(self, heads: Tensor) -> tuple[Tensor, Tensor]:
        return self.k.index_select(2, heads), self.v.index_select(2, heads)

    def add_query_grad(self, heads: Tensor, grad: Tensor) -> None:
        if self.grad_q is None:
            self.grad_q = torch.zeros(self.q.shape, dtype=self.q.dtype, device=self.q.device)
        self.grad_q.index_add_(2, heads, grad)

    def add_key_value_grad(self, heads: Tensor, grad_key: Tensor, grad_value: Tensor) -> None:
        if self.grad_k is None:
            self.grad_k = torch.zeros(self.k.shape, dtype=self.k.dtype, device=self.k.device)
            self.grad_v = torch.zeros(self.v.shape, dtype=self.v.dtype, device=self.v.device)
        # index_add, not copy: with fewer KV heads than ranks one local head has several replicas.
        self.grad_k.index_add_(2, heads, grad_key.to(self.k.dtype))
        self.grad_v.index_add_(2, heads, grad_value.to(self.v.dtype))


@dataclass
class PlanIndices:
    """The plan's head lists as device index tensors, concatenated over destination ranks."""

    kv: list[Tensor]  # per round
    query: list[list[Tensor]]  # per round, per stage

    @staticmethod
    def build(plan: StagePlan, device: torch.device) -> PlanIndices:
        def flat(per_rank: tuple[tuple[int, ...], ...]) -> Tensor:
            return torch.tensor([h for heads in per_rank for h in heads], dtype=torch.long, device=device)

        return PlanIndices(
            kv=[flat(r.kv_heads) for r in plan.rounds],
            query=[[flat(s.query_heads) for s in r.stages] for r in plan.rounds],
        )


@dataclass
class PipelineContext:
    """Everything the stage loop needs besides the tensors."""

    plan: StagePlan
    indices: PlanIndices
    group: dist.ProcessGroup | None
    attention: AttentionKernel | Callable[..., Tensor]
    #: for a generic callable: its layout ([b, S, h, d] when 0, [S, b, h, d] when 1) and extra args
    batch_dim_idx: int = 0
    call_args: tuple[Any, ...] = ()
    call_kwargs: dict[str, Any] | None = None
    #: per-owner count of stage runs (forward and backward); read by tests and launch checks
    stage_counter: list[int] | None = None
    #: issue the next stage's input all-to-alls before computing the current stage (two stages'
    #: input buffers alive instead of one)
    overlap_comm: bool = False

    @property
    def uses_kernel(self) -> bool:
        return isinstance(self.attention, AttentionKernel)

    def gather(self, local_heads: Tensor) -> Tensor:
        return heads_to_sequence(local_heads, self.plan.group_size, self.group)

    def start_gather(self, local_heads: Tensor) -> PendingExchange:
        return start_heads_to_sequence(local_heads, self.plan.group_size, self.group, async_op=self.overlap_comm)

    def prefetched(
        self, items: Sequence[Tensor], start: Callable[[Tensor], tuple[PendingExchange, ...]]
    ) -> Iterator[tuple[Tensor, tuple[Tensor, ...]]]:
        """Yield (item, gathered inputs) per stage; with overlap_comm the next stage's exchanges are
        issued before the current stage is handed out, otherwise after it is done."""
        pending = start(items[0]) if items else ()
        for i, item in enumerate(items):
            gathered = [tuple(p.wait() for p in pending)]
            has_next = i + 1 < len(items)
            pending = start(items[i + 1]) if self.overlap_comm and has_next else ()
            # pop: this frame keeps no reference, so the consumer's `del` frees the stage's buffers
            yield item, gathered.pop()
            if not self.overlap_comm and has_next:
                pending = start(items[i + 1])

    def scatter(self, full_heads: Tensor) -> Tensor:
        return sequence_to_heads(full_heads, self.plan.group_size, self.group)

    def count_stage(self) -> None:
        STAGE_RUNS[0] += 1
        if self.stage_counter is not None:
            self.stage_counter[0] += 1

    # -- generic callables get DeepSpeed's layout and are differentiated by autograd -------------
    def _to_callable_layout(self, t: Tensor) -> Tensor:
        t = t.transpose(1, 2)  # [b, S, n, d]
        return (t.transpose(0, 1) if self.batch_dim_idx == 1 else t).contiguous()

    def _from_callable_layout(self, t: Tensor) -> Tensor:
        t = t.transpose(0, 1) if self.batch_dim_idx == 1 else t
        return t.transpose(1, 2)  # [b, n, S, d]

    def call_generic(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        out = self.attention(
            self._to_callable_layout(q),
            self._to_callable_layout(k),
            self._to_callable_layout(v),
            *self.call_args,
            **(self.call_kwargs or {}),
        )
        return self._from_callable_layout(out)


def pipeline_forward(ctx: PipelineContext, source: StageSource, out: Tensor) -> list[Tensor | None]:
    """Run all stages, writing into ``out`` ([b, s, H, d] view).  In kernel mode returns, stage after
    stage, the kernel's lse followed by its aux (tensors or None, for ``save_for_backward``)."""
    saved: list[Tensor | None] = []
    for round_idx, kv_idx in enumerate(ctx.indices.kv):
        key, value = source.key_value(kv_idx)
        k_full, v_full = ctx.gather(key), ctx.gather(value)
        del key, value
        stages = ctx.indices.query[round_idx]
        for q_idx, (q_full,) in ctx.prefetched(stages, lambda idx: (ctx.start_gather(source.query(idx)),)):
            if ctx.uses_kernel:
                o_full, lse, aux = ctx.attention.forward(q_full, k_full, v_full)
                saved += (lse, *aux)
            else:
                o_full = ctx.call_generic(q_full, k_full, v_full)
            del q_full
            out.index_copy_(2, q_idx, ctx.scatter(o_full).to(out.dtype))
            del o_full
            ctx.count_stage()
        del k_full, v_full
    return saved


def pipeline_backward(
    ctx: PipelineContext,
    source: StageSource,
    out: Tensor,
    grad_out: Tensor | Callable[[Tensor], Tensor],
    saved: Sequence[Tensor | None],
) -> None:
    """Replay every stage and hand q/k/v gradients (local layout) to ``source``; ``saved`` is what
    ``pipeline_forward`` returned.

    ``grad_out`` is the output gradient ([b, s, H, d] view) or a function returning the gradient of
    the given heads ([b, s, n, d]): a caller that fuses the output projection computes each stage's
    slice on demand instead of materializing the full gradient."""
    dtype = out.dtype
    stage_number = 0
    per_stage = len(saved) // ctx.plan.num_stages  # lse + the kernel's aux, the same for every stage
    for round_idx, kv_idx in enumerate(ctx.indices.kv):
        key, value = source.key_value(kv_idx)
        k_full, v_full = ctx.gather(key), ctx.gather(value)
        del key, value
        # accumulate in (at least) float32 across the stages that share these KV heads
        acc_dtype = torch.float64 if k_full.dtype == torch.float64 else torch.float32
        grad_k_acc = torch.zeros(k_full.shape, dtype=acc_dtype, device=k_full.device)
        grad_v_acc = torch.zeros(v_full.shape, dtype=acc_dtype, device=v_full.device)

        def start_stage(idx: Tensor) -> tuple[PendingExchange, ...]:
            exchanges = [
                ctx.start_gather(source.query(idx)),
                ctx.start_gather(grad_out(idx) if callable(grad_out) else grad_out.index_select(2, idx)),
            ]
            if ctx.uses_kernel:  # lse-based backward needs the stage output; a recompute does not
                exchanges.append(ctx.start_gather(out.index_select(2, idx)))
            return tuple(exchanges)

        for q_idx, (q_full, dout_full, *o_full) in ctx.prefetched(ctx.indices.query[round_idx], start_stage):
            if ctx.uses_kernel:
                lse, *aux = saved[stage_number * per_stage : (stage_number + 1) * per_stage]
                dq, dk, dv = ctx.attention.backward(dout_full, q_full, k_full, v_full, o_full[0], lse, tuple(aux))
                del o_full
            else:
                dq, dk, dv = _generic_backward(ctx, q_full, k_full, v_full, dout_full)
            del q_full, dout_full
            grad_k_acc += dk
            grad_v_acc += dv
            del dk, dv
            dq_local = ctx.scatter(dq.to(dtype))
            del dq  # free the stage's buffers before the source turns dq into its own gradients
            source.add_query_grad(q_idx, dq_local)
            del dq_local
            stage_number += 1
            ctx.count_stage()
        del k_full, v_full
        source.add_key_value_grad(kv_idx, ctx.scatter(grad_k_acc.to(dtype)), ctx.scatter(grad_v_acc.to(dtype)))
        del grad_k_acc, grad_v_acc


def _generic_backward(
    ctx: PipelineContext, q: Tensor, k: Tensor, v: Tensor, dout: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Recompute one stage of a generic callable under autograd and differentiate it."""
    with torch.enable_grad():
        q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
        out = ctx.call_generic(q, k, v)
        return torch.autograd.grad(out, (q, k, v), dout)


def _as_bshd(t: Tensor, batch_dim_idx: int) -> Tensor:
    """View a [b, s, h, d] or [s, b, h, d] tensor as [b, s, h, d]."""
    return t.transpose(0, 1) if batch_dim_idx == 1 else t


class UPipeAttentionFunction(torch.autograd.Function):
    """Autograd node for the unfused pipeline: inputs are local q, k, v in DeepSpeed's layout."""

    @staticmethod
    def forward(fctx, query: Tensor, key: Tensor, value: Tensor, pctx: PipelineContext) -> Tensor:
        b_dim = pctx.batch_dim_idx
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        source = LocalTensorSource(_as_bshd(query, b_dim), _as_bshd(key, b_dim), _as_bshd(value, b_dim))
        with torch.no_grad():
            saved = pipeline_forward(pctx, source, _as_bshd(out, b_dim))
        fctx.pctx = pctx
        fctx.save_for_backward(query, key, value, out, *saved)
        return out

    @staticmethod
    def backward(fctx, grad_out: Tensor):
        query, key, value, out, *saved = fctx.saved_tensors
        pctx: PipelineContext = fctx.pctx
        b_dim = pctx.batch_dim_idx
        source = LocalTensorSource(_as_bshd(query, b_dim), _as_bshd(key, b_dim), _as_bshd(value, b_dim))
        with torch.no_grad():
            pipeline_backward(pctx, source, _as_bshd(out, b_dim), _as_bshd(grad_out, b_dim), saved)

        def to_layout(g: Tensor | None) -> Tensor | None:
            return None if g is None else _as_bshd(g, b_dim)  # the transpose is its own inverse

        return (
            to_layout(source.grad_q),
            to_layout(source.grad_k),
            to_layout(source.grad_v),
            None,
        )
