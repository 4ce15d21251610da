"""The UPipe stage loop as one autograd Function.

Forward runs the stage plan: per round, gather the round's KV heads once; per stage, gather u query
heads per rank over the full sequence, attend, send the output back and write it at the heads' own
indices. Only sequence-sharded tensors are saved (the inputs, the output, per-stage lse and kernel aux),
so no gathered full-sequence tensor outlives its stage; the one exception is K/V a caller exchanged
before the call for several layers (``ExchangedKeyValue``: KV-shared layers, ``ds_upipe.exchanged_kv``).
Backward replays each stage's all-to-alls and returns dK/dV as ``RoundKeyValueGrads`` decides: per stage
into the source's own gradients when those can be the accumulator, else summed in float32 over the round
and sent back once.

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
    heads_send_buffer,
    put_heads,
    scatter_buffer,
    scatter_segments,
    select_heads,
    start_heads_exchange,
    start_scatter,
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


#: the registered StageCounters (see StageCounter).  Process-level on purpose: a counter is an observer
#: its owner registers to see every UPipe stage the process runs (a Trainer or accelerate script
#: counts the stages of models it never holds), and only the owner reads it.  Nothing that computes
#: reads this list, so a second model or group cannot be affected by it; per-model counts live on
#: each runtime (``UPipeRuntime.stage_runs``).
_ACTIVE_COUNTERS: list[StageCounter] = []


@dataclass(frozen=True)
class Slot:
    """What a ``StageSource`` call is about: the ``kind`` of heads ("query" or "key_value") of
    stage ``stage`` of round ``round`` (a key/value slot with ``stage`` None: the round's K/V, or
    their gradient summed over the round; with a stage: that stage's dK/dV), whose global head
    indices, concatenated over destination ranks (may repeat where KV heads are replicated), are
    ``heads``."""

    kind: str  # "query" | "key_value"
    round: int
    stage: int | None
    heads: Tensor

    @property
    def key(self) -> tuple[str, int, int | None]:
        """(kind, round, stage): the slot's identity."""
        return self.kind, self.round, self.stage


@dataclass(frozen=True)
class Piece:
    """Which heads of a ``Slot`` a gradient covers: ``heads[start : start + count]``, the heads that
    rank ``source_rank`` attended over (None: every rank's, the whole slot at once)."""

    source_rank: int | None
    start: int
    count: int

    def heads(self, slot: Slot) -> Tensor:
        return slot.heads.narrow(0, self.start, self.count)


class StageSource(Protocol):
    """Writes a stage's local heads (this rank's sequence shard) into the exchange's send buffer and
    takes their gradients back.  The contract is explicit, never inferred from the order of calls:
    every call names its ``Slot`` (kind, round, stage, heads) and every gradient its ``Piece``
    (source rank and head slice).

    - ``local_shape`` (b, s, head_dim), ``dtype``, ``device``: of the chunks the source writes;
      ``value_head_dim``: the head dim of V and so of the output (head_dim except in latent attention,
      whose values are narrower than its queries and keys): the one number every V, output, dV and
      dout buffer of the loop is sized by.
    - ``query(slot, out)``: write a stage's query heads into ``out``, a strided [b, s, C, n, d] view
      of the send buffer (head ``slot.heads[c * n + i]`` at [:, :, c, i]: ``comm.select_heads``);
      ``key_value(slot, out_key, out_value)``: a round's K and V (a "key_value" slot, ``stage``
      None).  With overlap_comm the next stage's query is asked for before this stage's gradients
      come back.
    - ``add_query_grad(slot, piece, grad)``: the gradient of ``piece.heads(slot)`` of a query slot.
    - ``add_key_value_grad(slot, piece, grad_key, grad_value)``: dK/dV of ``piece.heads(slot)`` of
      round ``slot.round``: one stage's (a key/value slot with ``stage`` set) or the round's sum
      (``stage`` None).
    - ``finish(slot)`` (backward): every gradient of the slot has been handed over: a stage's query
      slot after its dQ, a stage's key/value slot after its dK/dV (per-stage mode), a round's
      key/value slot after the round (its summed dK/dV in per-round mode; nothing more per stage).

    Two choices the source makes:

    - ``grads_per_source_rank``: gradients come as one piece per source rank (contiguous
      [b, s, n, d] views of the received buffer: no copy; the source sums each piece, e.g. by
      index_add), else once per slot (``Piece(None, 0, heads.numel())``) as a [b, s, C, n, d] view
      of the received buffer (source rank major: ``flatten(2, 3)`` gives the slot's heads in order;
      the source's first op on it may read it strided instead of copying it).
    - ``key_value_grads_per_stage``: the source sums dK/dV handed over per stage (the pipeline then
      needs no round-sized accumulator when the gradients are in the accumulation dtype), else
      dK/dV come once per round, summed by the pipeline."""

    local_shape: tuple[int, int, int]
    value_head_dim: int
    dtype: torch.dtype
    device: torch.device
    grads_per_source_rank: bool
    key_value_grads_per_stage: bool

    def query(self, slot: Slot, out: Tensor) -> None: ...

    def key_value(self, slot: Slot, out_key: Tensor, out_value: Tensor) -> None: ...

    def add_query_grad(self, slot: Slot, piece: Piece, grad: Tensor) -> None: ...

    def add_key_value_grad(self, slot: Slot, piece: Piece, grad_key: Tensor, grad_value: Tensor) -> None: ...

    def finish(self, slot: Slot) -> None: ...


class LocalTensorSource:
    """Stage inputs taken from already computed local q, k, v ([b, s, h, d] views)."""

    #: gradients are summed into grad_q/grad_k/grad_v by index_add, piece by piece, stage by stage
    grads_per_source_rank = True
    key_value_grads_per_stage = True

    def __init__(self, query: Tensor, key: Tensor, value: Tensor) -> None:
        self.q, self.k, self.v = query, key, value
        self.local_shape = (query.shape[0], query.shape[1], query.shape[3])
        self.value_head_dim = value.shape[3]
        self.dtype, self.device = query.dtype, query.device
        self.grad_q: Tensor | None = None
        self.grad_k: Tensor | None = None
        self.grad_v: Tensor | None = None

    def query(self, slot: Slot, out: Tensor) -> None:
        select_heads(self.q, slot.heads, out)

    def key_value(self, slot: Slot, out_key: Tensor, out_value: Tensor) -> None:
        select_heads(self.k, slot.heads, out_key)
        select_heads(self.v, slot.heads, out_value)

    def add_query_grad(self, slot: Slot, piece: Piece, grad: Tensor) -> None:
        if self.grad_q is None:
            self.grad_q = torch.zeros(self.q.shape, dtype=self.q.dtype, device=self.q.device)
        self.grad_q.index_add_(2, piece.heads(slot), grad)

    def add_key_value_grad(self, slot: Slot, piece: Piece, grad_key: Tensor, grad_value: Tensor) -> None:
        heads = piece.heads(slot)
        if self.grad_k is None:
            self.grad_k = torch.zeros(self.k.shape, dtype=self.k.dtype, device=self.k.device)
            self.grad_v = torch.zeros(self.v.shape, dtype=self.v.dtype, device=self.v.device)
        # index_add, not copy: with fewer KV heads than ranks one local head has several replicas.
        self.grad_k.index_add_(2, heads, grad_key.to(self.k.dtype))
        self.grad_v.index_add_(2, heads, grad_value.to(self.v.dtype))

    def finish(self, slot: Slot) -> None:
        pass


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
    recompute_attention_output: bool = False

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

    def start_gather(
        self,
        source: StageSource,
        write: Callable[[list[Tensor]], None],
        heads: Sequence[int],
        values: int = 0,
        *,
        prefetch: bool = True,
    ) -> PendingExchange:
        """All-to-all the local [b, s, C*n_j, d_j] tensors that ``write(views)`` writes into the send
        buffer's [b, s, C, n_j, d_j] views (``heads[j]`` = C*n_j, dtype the source's; the last ``values``
        tensors are of the source's ``value_head_dim``, the others of its q/k head dim) in one packed exchange,
        asynchronously when ``prefetch`` and overlap_comm; the handle's ``wait()`` gives
        [b, n_j, S, d_j] each."""
        c = self.plan.group_size
        d, dv = source.local_shape[2], source.value_head_dim
        dims = [d] * (len(heads) - values) + [dv] * values
        send, layout = heads_send_buffer(write, heads, source.local_shape, source.dtype, source.device, c, dims)
        strided = self.attention.reads_strided_inputs
        return start_heads_exchange(send, layout, c, self.group, self.overlap_comm and prefetch, not strided)

    def gather_key_value(self, source: StageSource, slot: Slot) -> tuple[Tensor, ...]:
        """A round's K and V ([b, n, S, d] each), in one exchange, finished at once."""
        n = slot.heads.numel()
        return self.start_gather(source, lambda out: source.key_value(slot, *out), (n, n), 1, prefetch=False).wait()

    def round_key_value(
        self, source: StageSource, slot: Slot, exchanged: ExchangedKeyValue | None
    ) -> tuple[Tensor, ...]:
        """A round's K and V ([b, n, S, d] each): exchanged now, or taken from the call's ``exchanged``."""
        return self.gather_key_value(source, slot) if exchanged is None else exchanged.round(slot.round)

    def every_round_slot(self) -> Slot:
        """One key/value slot of the KV heads of every round (``ExchangedKeyValue``): per destination rank
        its heads round after round, so rank p receives [b, rounds * n, S, d], round r at heads r * n ..."""
        c = self.plan.group_size
        heads = torch.cat([kv.view(c, -1) for kv in self.indices.kv], dim=1).flatten()
        return Slot("key_value", 0, None, heads)

    def prefetched(
        self, items: Sequence[Slot], start: Callable[[Slot], PendingExchange]
    ) -> Iterator[tuple[Slot, tuple[Tensor, ...]]]:
        """Yield (slot, gathered inputs) per stage; with overlap_comm the next stage's exchange is
        issued before the current stage is handed out, otherwise after it is done."""
        pending = start(items[0]) if items else None
        for i, item in enumerate(items):
            assert pending is not None
            gathered = [pending.wait()]
            has_next = i + 1 < len(items)
            pending = start(items[i + 1]) if self.overlap_comm and has_next else None
            # pop: this frame keeps no reference, so the consumer's `del` frees the stage's buffers
            yield item, gathered.pop()
            if not self.overlap_comm and has_next:
                pending = start(items[i + 1])

    def start_scatter(self, parts: list[Tensor], dtype: torch.dtype, *, overlap: bool = False) -> PendingExchange:
        """Pop every [b, n_j, S, d_j] tensor of ``parts`` and all-to-all them in ``dtype``, packed in one
        exchange (asynchronously when ``overlap`` and overlap_comm); the handle's ``wait()`` gives
        [C, b, s, n_j, d_j] each: this rank's sequence chunk, per source rank.  Popping hands over the
        last references, so each is freed as soon as it is written into the send buffer."""
        heads = [(t.shape[1], t.shape[3]) for t in parts]

        def taken() -> Iterator[Tensor]:
            while parts:
                yield parts.pop(0).to(dtype)

        send, shapes = scatter_buffer(taken(), heads, self.plan.group_size)
        async_op = overlap and self.overlap_comm
        return start_scatter(send, shapes, self.plan.group_size, self.group, async_op)

    def scatter(self, parts: list[Tensor], dtype: torch.dtype) -> tuple[Tensor, ...]:
        """``start_scatter`` finished at once."""
        return self.start_scatter(parts, dtype).wait()

    def count_stage(self) -> None:
        for counter in _ACTIVE_COUNTERS:
            counter.count += 1
        if self.stage_counter is not None:
            self.stage_counter[0] += 1


def _stage_slots(ctx: PipelineContext, round_idx: int) -> list[Slot]:
    return [Slot("query", round_idx, i, idx) for i, idx in enumerate(ctx.indices.query[round_idx])]


def pipeline_forward(
    ctx: PipelineContext, source: StageSource, out: Tensor, exchanged: ExchangedKeyValue | None = None
) -> list[Tensor | None]:
    """Run all stages, writing into ``out`` ([b, s, H, d_v] view, d_v the source's ``value_head_dim``).  Returns,
    stage after stage, the kernel's lse followed by its aux (tensors or None, for ``save_for_backward``).
    ``exchanged``: every round's K/V, exchanged before the call (none exchanged here)."""
    saved: list[Tensor | None] = []
    for round_idx, kv_idx in enumerate(ctx.indices.kv):
        k_full, v_full = ctx.round_key_value(source, Slot("key_value", round_idx, None, kv_idx), exchanged)

        def start(slot: Slot) -> PendingExchange:
            return ctx.start_gather(source, lambda out: source.query(slot, out[0]), (slot.heads.numel(),))

        later: list[Callable[[], None]] = []  # overlap_comm: the previous stage's output write
        for slot, (q_full,) in ctx.prefetched(_stage_slots(ctx, round_idx), start):
            o_full, lse, aux = ctx.stage_attention(slot.heads).forward(q_full, k_full, v_full)
            saved += (lse, *aux)
            del q_full
            _run(later)  # the previous stage's output arrived while this stage computed
            owner = [o_full]  # the only reference: the scatter frees it once it is copied to send
            del o_full
            pending = ctx.start_scatter(owner, out.dtype, overlap=True)
            later.append(functools.partial(_write_stage_output, out, slot, pending))
            del pending
            if not ctx.overlap_comm:
                _run(later)
            ctx.count_stage()
        _run(later)
        del k_full, v_full
    return saved


def _run(later: list[Callable[[], None]]) -> None:
    """Run (and drop) the deferred hand-overs."""
    while later:
        later.pop(0)()


def _write_stage_output(out: Tensor, slot: Slot, pending: PendingExchange) -> None:
    (o_local,) = pending.wait()
    # every source rank's heads in one op, read from the [C, b, s, n, d] receive buffer as it is
    put_heads(out, slot.heads, o_local.permute(1, 2, 0, 3, 4))


@dataclass
class RecomputedOutput:
    """Stands for the output in ``pipeline_backward`` when the forward saved neither it nor the stages'
    lse: each stage's attention forward is run again on its gathered q/k/v, and the stage's output,
    sent back to the local layout, is handed to ``take(slot, o_local)`` ([C, b, s, n, d]: [src] is this
    rank's sequence chunk of the heads rank src attended over, ``slot.heads[src * n : (src + 1) * n]``).
    Fused mode uses it to compute o_proj's weight gradient stage by stage instead of keeping the whole
    attention output (one hidden state) from forward to backward."""

    dtype: torch.dtype
    take: Callable[[Slot, Tensor], None]


def pipeline_backward(
    ctx: PipelineContext,
    source: StageSource,
    out: Tensor | RecomputedOutput,
    grad_out: Tensor | Callable[[Slot, Tensor], None],
    saved: Sequence[Tensor | None],
    exchanged: ExchangedKeyValue | None = None,
) -> None:
    """Replay every stage and hand q/k/v gradients (local layout) to ``source``; ``saved`` is what
    ``pipeline_forward`` returned (empty with a ``RecomputedOutput``).  With ``exchanged`` (the K/V the
    forward was given) no K/V is exchanged: dK/dV are summed into its gradients (full-sequence layout).

    ``grad_out`` is the output gradient ([b, s, H, d_v] view) or a function ``grad_out(slot, out)``
    writing the gradient of the stage's heads into ``out`` ([b, s, C, n, d], as ``query``): a caller that fuses the
    output projection computes each stage's slice on demand instead of materializing the full
    gradient.

    Per stage one packed exchange brings q, dout and (for an lse-based kernel backward) the output;
    one sends dq back, one more the stage's dK/dV when they go back per stage (``RoundKeyValueGrads``)."""
    recomputed = out if isinstance(out, RecomputedOutput) else None
    dtype = out.dtype
    stage_number = 0
    per_stage = 0 if recomputed else len(saved) // ctx.plan.num_stages  # lse + the kernel's aux, per stage
    # an lse-based backward needs the stage output; a recompute (CallableKernel) does not
    needs_output = ctx.attention.needs_output_in_backward and recomputed is None
    for round_idx, kv_idx in enumerate(ctx.indices.kv):
        kv_slot = Slot("key_value", round_idx, None, kv_idx)
        k_full, v_full = ctx.round_key_value(source, kv_slot, exchanged)
        if exchanged is None:
            kv_grads = RoundKeyValueGrads(ctx, source, kv_slot, k_full, dtype)
        else:
            kv_grads = ExchangedKeyValueGrads(ctx, source, kv_slot, exchanged.round_grads(round_idx), dtype)

        def start_stage(slot: Slot) -> PendingExchange:
            def write(views: list[Tensor]) -> None:
                source.query(slot, views[0])
                if callable(grad_out):
                    grad_out(slot, views[1])
                else:
                    select_heads(grad_out, slot.heads, views[1])
                if needs_output:
                    select_heads(out, slot.heads, views[2])

            # q, then dout (and out) of the value head dim
            values = 2 if needs_output else 1
            return ctx.start_gather(source, write, (slot.heads.numel(),) * (1 + values), values)

        for slot, (q_full, dout_full, *o_full) in ctx.prefetched(_stage_slots(ctx, round_idx), start_stage):
            attention = ctx.stage_attention(slot.heads)
            if recomputed is not None:
                o_stage, lse, aux = attention.forward(q_full, k_full, v_full)
                # before the kernel's backward, whose gradients would otherwise sit beside these buffers
                (o_local,) = ctx.scatter([o_stage], dtype)
                recomputed.take(slot, o_local)
                del o_local
            else:
                lse, *aux = saved[stage_number * per_stage : (stage_number + 1) * per_stage]
                o_stage = o_full.pop() if o_full else None
            # [dq, dk, dv], the only references: each is freed as soon as it is on its way back
            grads = list(attention.backward(dout_full, q_full, k_full, v_full, o_stage, lse, tuple(aux)))
            del o_full, o_stage, lse, aux
            del q_full, dout_full  # free the stage's inputs before its gradients travel
            kv_grads.add_and_send(slot, grads)
            stage_number += 1
            ctx.count_stage()
        del k_full, v_full
        kv_grads.finish()


class RoundKeyValueGrads:
    """Where a stage's dQ and the dK/dV of one round (the stages sharing its KV heads) go.

    Per stage, when the source sums partial gradients and its gradients are in the accumulation dtype
    (float32/float64): each stage's dK/dV is sent back after its dQ, in one packed exchange, and summed
    into the source's own gradient buffers (for UPipeDistributedAttention, the layer's dk/dv), which
    are the accumulator.  No round-sized accumulator is alive while the kernel runs.  The sum is the
    same, in the same order (0 + dK_1 + dK_2 + ...), except that KV heads replicated over ranks
    (Hkv < C) interleave their replicas' terms.

    Per round otherwise (half precision, whose stage gradients are summed in float32 before one
    rounding; or a source taking one gradient per round): dK/dV go into an
    accumulator in float32 (float64 for float64; the half dtype itself with
    ``ctx.accumulate_in_input_dtype``), K and V allocated as the two segments of one packed send
    buffer and summed into through [b, n, S, d] views, so they are sent once at the end, together and
    without a layout copy.

    The kernels' backward ops return new dK/dV (none of torch's has an ``out=`` form), so a kernel's
    output cannot land in the accumulator itself."""

    def __init__(self, ctx: PipelineContext, source: StageSource, kv_slot: Slot, k_full: Tensor, dtype: torch.dtype):
        self.ctx, self.source, self.kv_slot, self.dtype = ctx, source, kv_slot, dtype
        self.by_rank = source.grads_per_source_rank
        acc_dtype = ctx.accumulate_dtype(k_full.dtype)
        #: overlap_comm: the hand-overs of the last stage's asynchronous gradient exchanges
        self.later: list[Callable[[], None]] = []
        self.acc: Tensor | None = None  # [C, X]: the K and V segments of one send buffer
        self.acc_views: tuple[Tensor, ...] = ()
        if not (source.key_value_grads_per_stage and k_full.dtype == acc_dtype == dtype):  # per round
            b, n, seq, d = k_full.shape
            c = ctx.plan.group_size
            self.shapes = [(b, seq // c, n, d), (b, seq // c, n, source.value_head_dim)]
            size = b * seq * n * (d + source.value_head_dim) // c
            self.acc = torch.zeros((c, size), dtype=acc_dtype, device=k_full.device)
            self.acc_views = tuple(scatter_segments(self.acc, self.shapes))

    def add_and_send(self, slot: Slot, grads: list[Tensor]) -> None:
        """One stage's [dQ, dK, dV] ([b, n, S, d]), taken out of ``grads``: dQ sent back and handed to
        the source, then dK/dV too (per stage, in one packed exchange) or into the round's accumulator.

        dQ travels alone, and the source finishes the query slot before dK/dV arrive: a packed
        dQ+dK+dV exchange (one collective fewer per stage) holds the whole received buffer, and a
        fused source's pending dx terms, while dQ is taken back through the projections, which raised
        the fused block's peak (MemTracker, tests/test_hf_memory.py: 6.73 and 6.45 units against 6.38).

        With overlap_comm the exchanges are asynchronous and handed over after the next stage's
        kernel backward (or at the round's end): their buffers stay alive meanwhile."""
        _run(self.later)  # the previous stage's gradients, received while this stage's kernel ran
        dq = self.ctx.start_scatter([grads.pop(0)], self.dtype, overlap=True)
        self._then(functools.partial(self._hand_over_query, slot, dq))
        del dq
        self._add_key_value(Slot("key_value", self.kv_slot.round, slot.stage, self.kv_slot.heads), grads)

    def _then(self, hand_over: Callable[[], None]) -> None:
        """Hand an exchange's result over now, or (overlap_comm: it is asynchronous) after the next stage's kernel."""
        if self.ctx.overlap_comm:
            self.later.append(hand_over)
        else:
            hand_over()

    def _add_key_value(self, stage_kv: Slot, grads: list[Tensor]) -> None:
        """A stage's [dK, dV] ([b, n, S, d], taken out of ``grads``): sent back now or into the round's accumulator."""
        if self.acc is None:
            dkdv = self.ctx.start_scatter(grads, self.dtype, overlap=True)
            self._then(functools.partial(self._hand_over_key_value, stage_kv, dkdv))
            del dkdv
        for acc in self.acc_views:
            acc += to_send_layout(grads.pop(0), self.ctx.plan.group_size)

    def _hand_over_query(self, slot: Slot, pending: PendingExchange) -> None:
        (dq_local,) = pending.wait()
        del pending
        _hand_over(self.source.add_query_grad, slot, (dq_local,), self.by_rank)
        del dq_local
        self.source.finish(slot)

    def _hand_over_key_value(self, slot: Slot, pending: PendingExchange) -> None:
        local = pending.wait()
        del pending
        _hand_over(self.source.add_key_value_grad, slot, local, self.by_rank)
        del local
        self.source.finish(slot)

    def finish(self) -> None:
        """After the round's last stage: send the round's accumulated dK/dV back (per-round mode),
        and finish the round's key/value slot."""
        _run(self.later)
        if self.acc is not None:
            acc, self.acc, self.acc_views = self.acc, None, ()
            send = acc if acc.dtype == self.dtype else acc.to(self.dtype)
            del acc
            pending = start_scatter(send, self.shapes, self.ctx.plan.group_size, self.ctx.group)
            del send
            self._hand_over_key_value(self.kv_slot, pending)
            return
        self.source.finish(self.kv_slot)


class ExchangedKeyValueGrads(RoundKeyValueGrads):
    """``RoundKeyValueGrads`` of a round whose K/V were exchanged before the call (``ExchangedKeyValue``): dQ
    goes back per stage as usual; each stage's dK/dV is summed into ``grads`` (the round's [b, n, S, d] views of
    the call's full-sequence dK/dV), which the exchange's own backward sends back, once for every layer that
    attended with them (``ds_upipe.exchanged_kv``)."""

    def __init__(
        self, ctx: PipelineContext, source: StageSource, kv_slot: Slot, grads: tuple[Tensor, Tensor], dtype: torch.dtype
    ):
        self.ctx, self.source, self.kv_slot, self.dtype = ctx, source, kv_slot, dtype
        self.by_rank = source.grads_per_source_rank
        self.later: list[Callable[[], None]] = []
        self.acc, self.acc_views = None, ()
        self.grads = grads

    def _add_key_value(self, stage_kv: Slot, grads: list[Tensor]) -> None:
        for acc in self.grads:
            acc += grads.pop(0)


@dataclass
class ExchangedKeyValue:
    """The KV heads of every round of a plan that this rank attends with, over the whole sequence, exchanged
    once before an attention call (``ds_upipe.exchanged_kv``): ``key`` [b, rounds * n, S, d], ``value``
    [b, rounds * n, S, d_v], round r at heads [r * n, (r + 1) * n) (``PipelineContext.every_round_slot``);
    in backward ``grads`` (dK, dV) of the same shapes, in the accumulation dtype."""

    key: Tensor
    value: Tensor
    num_rounds: int
    grads: tuple[Tensor, Tensor] | None = None

    def _heads(self, round_idx: int) -> tuple[int, int]:
        n = self.key.shape[1] // self.num_rounds
        return round_idx * n, n

    def round(self, round_idx: int) -> tuple[Tensor, Tensor]:
        start, n = self._heads(round_idx)
        return self.key.narrow(1, start, n), self.value.narrow(1, start, n)

    def round_grads(self, round_idx: int) -> tuple[Tensor, Tensor]:
        assert self.grads is not None
        start, n = self._heads(round_idx)
        return self.grads[0].narrow(1, start, n), self.grads[1].narrow(1, start, n)


def _hand_over(add: Callable[..., Any], slot: Slot, by_rank_tensors: tuple[Tensor, ...], by_rank: bool) -> None:
    """``add(slot, piece, *tensors)`` from ``scatter`` results ([C, b, s, n, d] each): once per
    source rank with contiguous [b, s, n, d] views when ``by_rank``, else once with all ranks' heads
    as a [b, s, C, n, d] view each (no copy).  A function of its own, so that no loop variable keeps
    a piece (and with it the whole received buffer) alive after the hand-over."""
    if not by_rank:
        add(slot, Piece(None, 0, slot.heads.numel()), *(t.permute(1, 2, 0, 3, 4) for t in by_rank_tensors))
        return
    n = by_rank_tensors[0].shape[3]
    for src in range(by_rank_tensors[0].shape[0]):
        add(slot, Piece(src, src * n, n), *(t[src] for t in by_rank_tensors))


def _as_bshd(t: Tensor, batch_dim_idx: int) -> Tensor:
    """View a [b, s, h, d] or [s, b, h, d] tensor as [b, s, h, d]."""
    return t.transpose(0, 1) if batch_dim_idx == 1 else t


@torch.compiler.disable
def apply_eagerly(function: type[torch.autograd.Function], *args: Any) -> Any:
    """``function.apply(*args)``, run eagerly under ``torch.compile``: the graph breaks before and after
    the node, which autograd links like any other (its backward runs eagerly too).

    Why not traced: a stage loop's exchanges are process-group calls with async work handles and
    gloo use-count waits, its plan is Python data, and its views are written in place through ``out=``;
    dynamo cannot put them in a graph.  Left to itself it breaks inside the node's forward and then
    compiles the loop's helpers frame by frame: slow, and the unfused path failed there
    (``comm.select_heads``' ``aten.index.Tensor_out`` into a strided view under symbolic shapes).
    An in-place collective that dynamo does trace inside an autograd Function is what lost q/k/v
    gradients in DeepSpeed #8491; eager nodes keep eager numerics and memory (tests/test_compile.py)."""
    return function.apply(*args)


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
        # the query's heads of the value's head dim (latent attention: narrower than q/k's)
        out = torch.empty((*query.shape[:-1], value.shape[-1]), dtype=query.dtype, device=query.device)
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
