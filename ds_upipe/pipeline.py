"""The UPipe stage loop as one autograd Function.

Forward runs the stage plan: per round, gather the round's KV heads once; per stage, gather u query
heads per rank over the full sequence, attend, send the output back and write it at the heads' own
indices.  Only sequence-sharded tensors are saved (the inputs, the output, per-stage lse and kernel
aux), so no gathered full-sequence tensor outlives its stage.  Backward replays each stage's all-to-alls
and returns dK/dV as ``RoundKeyValueGrads`` decides: per stage into the source's own gradients when
those can be the accumulator, else summed in float32 over the round and sent back once.

Where the stage inputs come from is abstracted by ``StageSource``: plain local q/k/v tensors here,
per-stage projections of the layer input in hf_patches' fused mode.  The loop itself never changes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from .comm import (
    PendingExchange,
    exchange_send_layout,
    from_ranks,
    heads_send_buffer,
    start_heads_exchange,
    to_send_layout,
)
from .kernels import AttentionKernel
from .schedule import StagePlan
from .sinks import find_sink_kernel


class StageCounter:
    """Counts the UPipe stages run (forward + backward) by every UPipe layer of the process while it
    is registered, so a launch or a test can prove that UPipe (not ALST) ran::

        with StageCounter() as stages:
            train()
        print(stages.count)

    An explicit counter object rather than a module-global number: each user counts only what ran
    while its counter was registered.  (Per model, ``hf_patches.upipe_state(model).stage_runs``.)"""

    def __init__(self) -> None:
        self.count = 0

    def start(self) -> StageCounter:
        """Register: count from now on (also ``with StageCounter() as c:``)."""
        _ACTIVE_COUNTERS.append(self)
        return self

    def stop(self) -> None:
        _ACTIVE_COUNTERS.remove(self)

    def __enter__(self) -> StageCounter:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


#: the registered StageCounters (see StageCounter)
_ACTIVE_COUNTERS: list[StageCounter] = []


class StageSource(Protocol):
    """Supplies a stage's local heads ([b, s, n, d] views of this rank's sequence shard) and takes
    their gradients back.  ``heads`` is a 1-D index tensor of global head indices (may repeat).

    A source may set ``accepts_partial_grads = True``: its ``add_*_grad`` then sum whatever part of a
    gradient they are given, any number of times (per source rank, per stage), so the pipeline hands
    gradients over without copying them into one piece and may return dK/dV per stage.  Without it,
    each ``query``/``key_value`` call gets exactly one matching ``add_*_grad`` call, in order."""

    def query(self, heads: Tensor) -> Tensor: ...

    def key_value(self, heads: Tensor) -> tuple[Tensor, Tensor]: ...

    def add_query_grad(self, heads: Tensor, grad: Tensor) -> None: ...

    def add_key_value_grad(self, heads: Tensor, grad_key: Tensor, grad_value: Tensor) -> None: ...


class LocalTensorSource:
    """Stage inputs taken from already computed local q, k, v ([b, s, h, d] views)."""

    #: gradients are summed into grad_q/grad_k/grad_v by index_add, piece by piece
    accepts_partial_grads = True

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


def plan_indices(plan: StagePlan, device: torch.device) -> PlanIndices:
    """The plan's ``PlanIndices`` on ``device``: built once per process (shared by every layer and
    model) and reused.

    Not cached under a fake-tensor mode (the planner's fake runs, ``integration.fake_run``): indices
    built there are fake tensors, which a real run must never get, nor a fake run real ones."""
    if torch._guards.detect_fake_mode() is not None:
        return PlanIndices.build(plan, device)
    return _cached_plan_indices(plan, torch.device(device))


@functools.lru_cache(maxsize=64)
def _cached_plan_indices(plan: StagePlan, device: torch.device) -> PlanIndices:
    # normal tensors even when first asked for under inference mode: later training runs index with them
    with torch.inference_mode(False):
        return PlanIndices.build(plan, device)


@dataclass
class PipelineContext:
    """Everything the stage loop needs besides the tensors."""

    plan: StagePlan
    indices: PlanIndices
    group: dist.ProcessGroup | None
    #: what each stage runs (a plain local-attention function comes wrapped in ``CallableKernel``)
    attention: AttentionKernel
    #: per-owner count of stage runs (forward and backward); read by tests and launch checks
    stage_counter: list[int] | None = None
    #: issue the next stage's input all-to-alls before computing the current stage (two stages'
    #: input buffers alive instead of one)
    overlap_comm: bool = False
    #: sum half-precision gradients over stages in their own dtype (as the UPipe paper does) instead
    #: of float32: the round's dK/dV accumulator (and a fused source's dx / weight-gradient ones) are
    #: half the size, at the cost of one rounding per stage
    accumulate_in_input_dtype: bool = False
    #: fused mode (hf_patches): save no attention output; backward recomputes each stage's attention
    #: forward (``RecomputedOutput``).  One hidden state less per layer, one more kernel forward per stage
    recompute_output: bool = False

    def stage_attention(self, q_idx: Tensor) -> AttentionKernel:
        """The kernel of the stage whose query heads are ``q_idx`` (every rank's, concatenated as the plan
        lists them): a kernel with per-head state (attention sinks, ``ds_upipe.sinks``) bound to the
        heads this rank attends in the stage."""
        if not self.attention.per_head:
            return self.attention
        rank = dist.get_rank(self.group) if self.plan.group_size > 1 else 0
        return self.attention.for_heads(q_idx.view(self.plan.group_size, -1)[rank])

    def accumulate_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype gradients of ``dtype`` are summed in over the stages."""
        if dtype == torch.float64 or (self.accumulate_in_input_dtype and dtype in (torch.float16, torch.bfloat16)):
            return dtype
        return torch.float32

    # The exchanges take their input out of a list (``owner``) that holds its only reference, so the
    # input is freed as soon as its send-layout copy exists, before the receive buffer is allocated.
    def gather(self, owner: list[Tensor]) -> Tensor:
        """Pop the first [b, s, C*n, d] local heads of ``owner``; return them gathered, [b, n, S, d]."""
        return self._start_gather(owner, async_op=False).wait()

    def start_gather(self, owner: list[Tensor]) -> PendingExchange:
        """``gather`` issued asynchronously with overlap_comm (the handle's ``wait()`` finishes it)."""
        return self._start_gather(owner, async_op=self.overlap_comm)

    def _start_gather(self, owner: list[Tensor], async_op: bool) -> PendingExchange:
        send = heads_send_buffer(owner.pop(0), self.plan.group_size)
        return start_heads_exchange(send, self.plan.group_size, self.group, async_op=async_op)

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

    def scatter_by_rank(self, owner: list[Tensor], dtype: torch.dtype) -> Tensor:
        """Pop the first tensor of ``owner`` ([b, n, S, d], or a buffer already in the [C, b, s, n, d]
        send layout) and all-to-all it in ``dtype`` to [C, b, s, n, d]: this rank's sequence chunk, per
        source rank.  Popping hands over the last reference, so the tensor is freed as soon as its
        send-layout copy exists, before the receive buffer is allocated."""
        full = owner.pop(0)
        send = (full if full.dim() == 5 else to_send_layout(full, self.plan.group_size)).to(dtype).contiguous()
        del full
        return exchange_send_layout(send, self.plan.group_size, self.group)

    def count_stage(self) -> None:
        for counter in _ACTIVE_COUNTERS:
            counter.count += 1
        if self.stage_counter is not None:
            self.stage_counter[0] += 1


def pipeline_forward(ctx: PipelineContext, source: StageSource, out: Tensor) -> list[Tensor | None]:
    """Run all stages, writing into ``out`` ([b, s, H, d] view).  Returns, stage after stage, the
    kernel's lse followed by its aux (tensors or None, for ``save_for_backward``)."""
    saved: list[Tensor | None] = []
    for round_idx, kv_idx in enumerate(ctx.indices.kv):
        key_value = list(source.key_value(kv_idx))
        k_full, v_full = ctx.gather(key_value), ctx.gather(key_value)
        stages = ctx.indices.query[round_idx]
        for q_idx, (q_full,) in ctx.prefetched(stages, lambda idx: (ctx.start_gather([source.query(idx)]),)):
            o_full, lse, aux = ctx.stage_attention(q_idx).forward(q_full, k_full, v_full)
            saved += (lse, *aux)
            del q_full
            owner = [o_full]  # the only reference: scatter_by_rank frees it once it is copied to send
            del o_full
            o_local = ctx.scatter_by_rank(owner, out.dtype)
            _hand_over(lambda heads, o: out.index_copy_(2, heads, o.to(out.dtype)), q_idx, (o_local,), True)
            del o_local
            ctx.count_stage()
        del k_full, v_full
    return saved


@dataclass
class RecomputedOutput:
    """Stands for the output in ``pipeline_backward`` when the forward saved neither it nor the stages'
    lse: each stage's attention forward is run again on its gathered q/k/v, and the stage's output,
    sent back to the local layout, is handed to ``take(heads, o_local)`` (per source rank, [b, s, n, d]).
    Fused mode uses it to compute o_proj's weight gradient stage by stage instead of keeping the whole
    attention output (one hidden state) from forward to backward."""

    dtype: torch.dtype
    take: Callable[[Tensor, Tensor], None]


def pipeline_backward(
    ctx: PipelineContext,
    source: StageSource,
    out: Tensor | RecomputedOutput,
    grad_out: Tensor | Callable[[Tensor], Tensor],
    saved: Sequence[Tensor | None],
) -> None:
    """Replay every stage and hand q/k/v gradients (local layout) to ``source``; ``saved`` is what
    ``pipeline_forward`` returned (empty with a ``RecomputedOutput``).

    ``grad_out`` is the output gradient ([b, s, H, d] view) or a function returning the gradient of
    the given heads ([b, s, n, d]): a caller that fuses the output projection computes each stage's
    slice on demand instead of materializing the full gradient."""
    recomputed = out if isinstance(out, RecomputedOutput) else None
    dtype = out.dtype
    by_rank = getattr(source, "accepts_partial_grads", False)
    stage_number = 0
    per_stage = 0 if recomputed else len(saved) // ctx.plan.num_stages  # lse + the kernel's aux, per stage
    # an lse-based backward needs the stage output; a recompute (CallableKernel) does not
    needs_output = ctx.attention.needs_output_in_backward and recomputed is None
    for round_idx, kv_idx in enumerate(ctx.indices.kv):
        key_value = list(source.key_value(kv_idx))
        k_full, v_full = ctx.gather(key_value), ctx.gather(key_value)
        kv_grads = RoundKeyValueGrads(ctx, source, kv_idx, k_full, dtype)

        def start_stage(idx: Tensor) -> tuple[PendingExchange, ...]:
            exchanges = [
                ctx.start_gather([source.query(idx)]),
                ctx.start_gather([grad_out(idx) if callable(grad_out) else grad_out.index_select(2, idx)]),
            ]
            if needs_output:
                exchanges.append(ctx.start_gather([out.index_select(2, idx)]))
            return tuple(exchanges)

        for q_idx, (q_full, dout_full, *o_full) in ctx.prefetched(ctx.indices.query[round_idx], start_stage):
            # [dq, dk, dv], the only references: each is freed as soon as it is on its way back
            attention = ctx.stage_attention(q_idx)
            if recomputed is not None:
                o_stage, lse, aux = attention.forward(q_full, k_full, v_full)
                # before the kernel's backward, whose gradients would otherwise sit beside these buffers
                o_local = ctx.scatter_by_rank([o_stage], dtype)
                _hand_over(recomputed.take, q_idx, (o_local,), True)
                del o_local
            else:
                lse, *aux = saved[stage_number * per_stage : (stage_number + 1) * per_stage]
                o_stage = o_full.pop() if o_full else None
            grads = list(attention.backward(dout_full, q_full, k_full, v_full, o_stage, lse, tuple(aux)))
            del o_full, o_stage, lse, aux
            del q_full, dout_full  # free the stage's inputs before its gradients travel
            dq_local = ctx.scatter_by_rank(grads, dtype)
            _hand_over(source.add_query_grad, q_idx, (dq_local,), by_rank)
            del dq_local
            kv_grads.add(grads)
            stage_number += 1
            ctx.count_stage()
        del k_full, v_full
        kv_grads.finish()


class RoundKeyValueGrads:
    """Where the dK/dV of one round (the stages sharing its KV heads) go.

    Per stage, when the source sums partial gradients and its gradients are in the accumulation dtype
    (float32/float64): each stage's dK/dV is sent back at once and summed into the source's own
    gradient buffers (for UPipeDistributedAttention, the layer's dk/dv), which are the accumulator.
    No round-sized accumulator is alive while the kernel runs, at the price of one dK/dV all-to-all per
    stage.  The sum is the same, in the same order (0 + dK_1 + dK_2 + ...), except that KV heads
    replicated over ranks (Hkv < C) interleave their replicas' terms.

    Per round otherwise (half precision, whose stage gradients are summed in float32 before one
    rounding; or a source taking one gradient per round): an accumulator in float32 (float64 for
    float64; the half dtype itself with ``ctx.accumulate_in_input_dtype``), allocated in the
    all-to-all's send layout and summed into through a [b, n, S, d] view, so it is sent once at the
    end without a layout copy.

    The kernels' backward ops return new dK/dV (none of torch's has an ``out=`` form), so a kernel's
    output cannot land in the accumulator itself."""

    def __init__(self, ctx: PipelineContext, source: StageSource, kv_idx: Tensor, k_full: Tensor, dtype: torch.dtype):
        self.ctx, self.source, self.kv_idx, self.dtype = ctx, source, kv_idx, dtype
        self.by_rank = getattr(source, "accepts_partial_grads", False)
        acc_dtype = ctx.accumulate_dtype(k_full.dtype)
        self.acc: tuple[Tensor, ...] | None = None
        if not (self.by_rank and k_full.dtype == acc_dtype == dtype):  # per round
            b, n, seq, d = k_full.shape
            c = ctx.plan.group_size
            self.acc = tuple(
                torch.zeros((c, b, seq // c, n, d), dtype=acc_dtype, device=k_full.device) for _ in range(2)
            )

    def add(self, grads: list[Tensor]) -> None:
        """One stage's [dK, dV] ([b, n, S, d], this rank's KV heads of the round), taken out of ``grads``."""
        if self.acc is None:
            self._send(grads)
            return
        for acc in self.acc:
            acc += to_send_layout(grads.pop(0), self.ctx.plan.group_size)

    def finish(self) -> None:
        """After the round's last stage: send the round's accumulated dK/dV back (per-round mode)."""
        if self.acc is not None:
            acc, self.acc = list(self.acc), None
            self._send(acc)

    def _send(self, grads: list[Tensor]) -> None:
        """All-to-all [dK, dV] back to sequence layout (emptying ``grads``, so each goes once sent) and
        hand them to the source.  Each is a stage's [b, n, S, d] gradient or a round's accumulator,
        already in the [C, b, s, n, d] send layout."""
        local = [self.ctx.scatter_by_rank(grads, self.dtype) for _ in range(2)]
        _hand_over(self.source.add_key_value_grad, self.kv_idx, tuple(local), self.by_rank)


def _hand_over(add: Callable[..., Any], heads: Tensor, by_rank_tensors: tuple[Tensor, ...], by_rank: bool) -> None:
    """``add(heads, *tensors)`` from ``scatter_by_rank`` results ([C, b, s, n, d] each): once
    per source rank with contiguous [b, s, n, d] views when ``by_rank``, else once with all ranks'
    heads as one [b, s, C*n, d] copy each.  A function of its own, so that no loop variable keeps a
    piece (and with it the whole received buffer) alive after the hand-over."""
    if not by_rank:
        add(heads, *(from_ranks(t) for t in by_rank_tensors))
        return
    n = by_rank_tensors[0].shape[3]
    for src in range(by_rank_tensors[0].shape[0]):
        add(heads.narrow(0, src * n, n), *(t[src] for t in by_rank_tensors))


def _as_bshd(t: Tensor, batch_dim_idx: int) -> Tensor:
    """View a [b, s, h, d] or [s, b, h, d] tensor as [b, s, h, d]."""
    return t.transpose(0, 1) if batch_dim_idx == 1 else t


class UPipeAttentionFunction(torch.autograd.Function):
    """Autograd node for the unfused pipeline: inputs are local q, k, v in DeepSpeed's layout
    ([b, s, h, d] for ``batch_dim_idx`` 0, [s, b, h, d] for 1)."""

    @staticmethod
    def forward(
        fctx,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        pctx: PipelineContext,
        batch_dim_idx: int = 0,
        sinks: Tensor | None = None,
    ) -> Tensor:
        # ``sinks`` ([H]) is the input whose values pctx.attention's SinkKernel holds: an input here so
        # that its gradient (summed by the kernel over the stages) reaches the parameter through autograd
        b_dim = batch_dim_idx
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        source = LocalTensorSource(_as_bshd(query, b_dim), _as_bshd(key, b_dim), _as_bshd(value, b_dim))
        with torch.no_grad():
            saved = pipeline_forward(pctx, source, _as_bshd(out, b_dim))
        fctx.pctx, fctx.batch_dim_idx = pctx, batch_dim_idx
        fctx.save_for_backward(query, key, value, out, *saved)
        return out

    @staticmethod
    def backward(fctx, grad_out: Tensor):
        query, key, value, out, *saved = fctx.saved_tensors
        pctx: PipelineContext = fctx.pctx
        b_dim = fctx.batch_dim_idx
        source = LocalTensorSource(_as_bshd(query, b_dim), _as_bshd(key, b_dim), _as_bshd(value, b_dim))
        with torch.no_grad():
            pipeline_backward(pctx, source, _as_bshd(out, b_dim), _as_bshd(grad_out, b_dim), saved)

        def to_layout(g: Tensor | None) -> Tensor | None:
            return None if g is None else _as_bshd(g, b_dim)  # the transpose is its own inverse

        sink_kernel = find_sink_kernel(pctx.attention)
        return (
            to_layout(source.grad_q),
            to_layout(source.grad_k),
            to_layout(source.grad_v),
            None,
            None,
            None if sink_kernel is None else sink_kernel.grad,
        )
