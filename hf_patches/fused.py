"""Fused mode: the whole attention block (q/k/v projections to o_proj) as one autograd node.

The full local Q, K, V of a layer never exist: a stage computes its U query heads (and, at a
round's first stage, its KV heads) from x = the attention input and the matching weight rows,
applies the bias (Qwen2, GPT-OSS), the per-head RMSNorm (Qwen3, Qwen3-MoE; Gemma 3's (1 + w) kind) and
RoPE to that chunk, and hands it to the core stage loop (``ds_upipe.pipeline``); attention sinks
(GPT-OSS) wrap the stage kernel (``ds_upipe.sinks``) and are an input of the node, so their gradient
reaches the module's parameter; o_proj runs once on the assembled output.  The node
saves only x, the attention output (which o_proj needs anyway) and the per-stage lse; with
``recompute_attention_output`` only x, and backward recomputes each stage's output (one more kernel forward per
stage), taking o_proj's weight gradient stage by stage (``pipeline.RecomputedOutput``).  Backward
recomputes each stage's chunk from x and differentiates it back to x and to the weight rows, and
computes each stage's output gradient from the block's output gradient and that stage's o_proj
columns, so neither the full output gradient nor the full local Q, K, V is materialized.  Weight
gradients are accumulated over the stages and returned once, as the gradients of the Function's
weight inputs, so autograd (and ZeRO-3's hooks) see one gradient per weight per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ds_upipe.comm import put_heads
from ds_upipe.pipeline import Piece, PipelineContext, RecomputedOutput, Slot, pipeline_backward, pipeline_forward
from ds_upipe.schedule import StagePlan
from ds_upipe.sinks import find_sink_kernel

from .families import NORM_KINDS
from .tiling import NORM_TILE_BYTES

_LOW_PRECISION = (torch.float16, torch.bfloat16)


#: the largest dx product tile (bytes) the fused backward adds to a float32 accumulator at once
DX_TILE_BYTES = 1 << 25


def _heads_flat(grad: Tensor) -> Tensor:
    """A slot's [b, s, C, n, d] gradient as [b, s, C*n, d] (a copy: it is a view of the received
    buffer), or a [b, s, n, d] one as it is."""
    return grad.flatten(2, 3) if grad.dim() == 5 else grad


@dataclass(frozen=True)
class NormSpec:
    """A per-head q/k RMSNorm of a known kind: ``"rms"`` (Qwen3RMSNorm, Qwen3MoeRMSNorm: ``w * norm(x)``,
    normalized in float32, multiplied in the input dtype) or ``"gemma"`` (Gemma3RMSNorm: ``norm(x) * (1 + w)``
    in float32, then cast to the input dtype), with its epsilon."""

    kind: str
    eps: float

    def __call__(self, x: Tensor, weight: Tensor) -> Tensor:
        return rms_norm(x, weight, self.eps, gemma=self.kind == "gemma")

    def out_dtype(self, x: Tensor, weight: Tensor) -> torch.dtype:
        return x.dtype if self.kind == "gemma" else torch.result_type(weight, x)


def norm_spec(norm: nn.Module) -> NormSpec:
    """The ``NormSpec`` of a q/k norm module of a kind in ``families.NORM_KINDS`` (KeyError otherwise)."""
    kind = NORM_KINDS[type(norm).__name__]
    return NormSpec(kind, float(norm.eps if kind == "gemma" else norm.variance_epsilon))


def rms_norm(x: Tensor, weight: Tensor, eps: float, gemma: bool = False) -> Tensor:
    """Qwen3RMSNorm.forward (or, ``gemma``, Gemma3RMSNorm.forward) as a function of its weight (so backward
    can differentiate a leaf), op for op as transformers computes it."""
    input_dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if gemma:
        return (h * (1.0 + weight.float())).type_as(x)
    return weight * h.to(input_dtype)


#: bytes per float32 copy of a q/k-norm token tile (the norm tiles' default; a module attribute, so a test
#: can make the tiles small)
QK_NORM_TILE_BYTES = NORM_TILE_BYTES


def qk_norm_tile_tokens(chunk: Tensor) -> int:
    """Tokens per tile of the per-head q/k RMSNorm of a [b, s, n, d] chunk.  The norm upcasts to float32
    and its backward keeps several float32 copies: over a stage's whole local chunk they set the peak of
    Qwen3's fused layer at long contexts (``ds-upipe plan --breakdown``), over a tile they do not.  The norm
    is per token, so tiling the tokens changes nothing but the norm weight gradient's summation order."""
    b, _, n, d = chunk.shape
    return max(1, QK_NORM_TILE_BYTES // (4 * b * n * d))


def rms_norm_tiled(x: Tensor, weight: Tensor, spec: NormSpec, tile_tokens: int) -> Tensor:
    """The norm of a [b, s, n, d] chunk without autograd, ``tile_tokens`` tokens (dim 1) at a time."""
    s = x.shape[1]
    if tile_tokens >= s:
        return spec(x, weight)
    out = torch.empty(x.shape, dtype=spec.out_dtype(x, weight), device=x.device)
    for start in range(0, s, tile_tokens):
        n = min(tile_tokens, s - start)
        out.narrow(1, start, n).copy_(spec(x.narrow(1, start, n), weight))
    return out


def rms_norm_backward(
    pre_norm: Tensor, weight: Tensor, spec: NormSpec, grad: Tensor, need_weight: bool, tile_tokens: int
) -> tuple[Tensor, Tensor | None]:
    """(d pre_norm, d weight or None) of the norm given the output gradient, by autograd over
    ``tile_tokens`` tokens (dim 1) at a time: transformers' own norm math per tile, so its float32
    temporaries are a tile's, not the chunk's.  The weight gradient is returned as the tiles' sum in
    float32 (float64 for float64), for the caller's accumulator to round once."""
    s = pre_norm.shape[1]
    weight_leaf = weight.detach().requires_grad_(need_weight)
    grad_input: Tensor | None = None
    grad_weight: Tensor | None = None
    for start in range(0, s, tile_tokens):
        n = min(tile_tokens, s - start)
        leaf = pre_norm.narrow(1, start, n).detach().requires_grad_(True)
        with torch.enable_grad():
            normed = spec(leaf, weight_leaf)
        inputs = (leaf, weight_leaf) if need_weight else (leaf,)
        grads = torch.autograd.grad(normed, inputs, grad.narrow(1, start, n).to(normed.dtype))
        if n == s:  # one tile: the result as it is
            grad_input = grads[0]
        else:
            if grad_input is None:
                grad_input = torch.empty(pre_norm.shape, dtype=grads[0].dtype, device=pre_norm.device)
            grad_input.narrow(1, start, n).copy_(grads[0])
        if need_weight:
            tile_sum = grads[1].to(torch.promote_types(grads[1].dtype, torch.float32))
            grad_weight = tile_sum if grad_weight is None else grad_weight.add_(tile_sum)
        del leaf, normed, grads
    assert grad_input is not None  # s >= 1: at least one tile
    return grad_input, grad_weight


@dataclass
class FusedProjections:
    """References to one attention module's projection modules (and its sinks, GPT-OSS).

    Weights are read from the modules at call time, never cached: under ZeRO-3 they are gathered
    only while the attention module's forward (or backward) runs."""

    q_proj: nn.Linear
    k_proj: nn.Linear
    v_proj: nn.Linear
    o_proj: nn.Linear
    q_norm: nn.Module | None
    k_norm: nn.Module | None
    head_dim: int
    #: the module's attention sinks (GPT-OSS ``sinks``: one logit per query head), None without
    sinks: nn.Parameter | None = None
    #: the q/k norms' kind and epsilon (None without q/k norms)
    norm: NormSpec | None = None

    @staticmethod
    def of(attn: nn.Module) -> FusedProjections:
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        sinks = getattr(attn, "sinks", None)
        return FusedProjections(
            attn.q_proj,
            attn.k_proj,
            attn.v_proj,
            attn.o_proj,
            q_norm,
            k_norm,
            attn.head_dim,
            sinks if isinstance(sinks, Tensor) else None,
            None if q_norm is None else norm_spec(q_norm),
        )

    def params(self) -> tuple[Tensor | None, ...]:
        """(Wq, bq, Wk, bk, Wv, bv, q_norm, k_norm, Wo, bo, sinks): the autograd inputs of the fused Function."""
        return (
            self.q_proj.weight,
            self.q_proj.bias,
            self.k_proj.weight,
            self.k_proj.bias,
            self.v_proj.weight,
            self.v_proj.bias,
            None if self.q_norm is None else self.q_norm.weight,
            None if self.k_norm is None else self.k_norm.weight,
            self.o_proj.weight,
            self.o_proj.bias,
            self.sinks,
        )

    def zero3_params(self) -> list[nn.Parameter]:
        """Parameters read outside their own module's forward (ZeRO-3 must gather them for the
        attention module; see ``deepspeed.zero.register_external_parameter``).  The sinks are the
        attention module's own parameter: ZeRO-3 gathers them for its forward anyway."""
        return [p for p in self.params()[:_SK] if p is not None]


# indices into FusedProjections.params()
_WQ, _BQ, _WK, _BK, _WV, _BV, _QN, _KN, _WO, _BO, _SK = range(11)
NUM_PARAMS = 11


def _dense_like(t: Tensor, other: Tensor) -> Tensor:
    """A contiguous result buffer: inputs arriving as views of an all-to-all buffer would otherwise
    give a strided result, and the linear backward's reshape would copy it."""
    return torch.empty(t.shape, dtype=torch.result_type(t, other), device=t.device)


@dataclass(frozen=True)
class RopeTables:
    """RoPE's cos and the two halves of its sin, already broadcast to a chunk's layout: sliced once per
    source (forward or backward), not again at every stage's RoPE."""

    cos: Tensor
    sin_lo: Tensor
    sin_hi: Tensor

    @staticmethod
    def of(cos: Tensor, sin: Tensor) -> RopeTables:
        h = sin.shape[-1] // 2
        return RopeTables(cos, sin[..., :h], sin[..., h:])


def apply_rope(y: Tensor, cos: Tensor, sin: Tensor, out: Tensor | None = None) -> Tensor:
    """y * cos + rotate_half(y) * sin: transformers' RoPE (Llama, Mistral, Qwen2 and Qwen3 share it),
    computed with one temporary instead of four, into ``out`` when given (e.g. a strided view of an
    all-to-all's send buffer)."""
    return apply_rope_tables(y, RopeTables.of(cos, sin), out)


def apply_rope_tables(y: Tensor, rope: RopeTables, out: Tensor | None = None) -> Tensor:
    """``apply_rope`` with its tables prepared."""
    h = y.shape[-1] // 2
    out = torch.mul(y, rope.cos, out=_dense_like(y, rope.cos) if out is None else out)
    out[..., :h].addcmul_(y[..., h:], rope.sin_lo, value=-1)
    out[..., h:].addcmul_(y[..., :h], rope.sin_hi)
    return out


def rope_backward(grad: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Adjoint of ``apply_rope``: grad * cos - rotate_half(grad * sin), computed in place."""
    return rope_backward_tables(grad, RopeTables.of(cos, sin))


def rope_backward_tables(grad: Tensor, rope: RopeTables) -> Tensor:
    """``rope_backward`` with its tables prepared."""
    h = grad.shape[-1] // 2
    out = torch.mul(grad, rope.cos, out=_dense_like(grad, rope.cos))
    out[..., :h].addcmul_(grad[..., h:], rope.sin_hi)
    out[..., h:].addcmul_(grad[..., :h], rope.sin_lo, value=-1)
    return out


@dataclass(frozen=True)
class KeyValueReplicas:
    """Where a round's gathered KV head list repeats heads (Hkv < C: each KV head goes to several
    ranks): ``unique`` lists each head once, ``slot_to_unique[i]`` is the unique index of slot i."""

    unique: tuple[int, ...]
    slot_to_unique: tuple[int, ...]


def kv_replicas(plan: StagePlan) -> list[KeyValueReplicas | None]:
    """Per round, the replica layout of its KV heads (None where no head repeats).  Derived on the host
    from the plan, not from the index tensors (torch.unique), so it also runs under FakeTensorMode."""
    out: list[KeyValueReplicas | None] = []
    for rnd in plan.rounds:
        heads = [h for per_rank in rnd.kv_heads for h in per_rank]
        unique = tuple(dict.fromkeys(heads))
        out.append(None if len(unique) == len(heads) else KeyValueReplicas(unique, tuple(map(unique.index, heads))))
    return out


class FusedProjectionSource:
    """A ``StageSource`` that computes a stage's heads from x and the weight rows of those heads.

    Backward mode keeps, per slot in flight (keyed by the round and stage the pipeline names), only
    the pre-norm chunk of a q/k norm; a slot's gradient is taken back through RoPE by hand, through
    the norm by autograd, and through the linear part by hand: dW[rows] += g^T x, db[rows] += sum g,
    and dx's terms wait for ``finish(slot)``, which adds them in one product per slot (a stage's
    dQ; a stage's or a round's dK with dV), dx += [g_1 ... g_n] @ [W_1; ...; W_n], in place (no
    x-sized temporary per stage).

    It takes each slot's gradient whole (``grads_per_source_rank`` False), as a [b, s, C, n, d] view
    of the received buffer that RoPE's backward reads strided: one op per slot where per-source-rank
    pieces cost C (the pieces' dx terms were concatenated into one product anyway, the same copy).

    dK/dV come once per round, summed by the pipeline (``key_value_grads_per_stage`` False): one
    product per round through K's and V's projections (weight gradient and dx), where per-stage
    hand-overs cost one per stage (at U = C with Hkv >= C a round has H / Hkv stages, so 4x ALST's
    K/V projection backward for Llama: about a tenth of a short-context layer's FLOPs).  With
    ``accumulate_in_input_dtype`` (``accumulate_dtype: "input"``, the memory-first setting of the
    long-context config) and no k norm they come per stage instead, right after the stage's dQ, summed
    straight into the input-dtype gradients: no round-sized accumulator beside the kernel's backward,
    where the block peaks (docs/benchmarks.md, "dK/dV per round").  Qwen3's k norm computes in float32:
    its backward must see the round's summed dK, as the model's own autograd does (each stage's piece
    rounded to float32 on its own would differ from it by about 1e-7)."""

    def __init__(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        proj: FusedProjections,
        *,
        backward: bool = False,
        needs_grad: tuple[bool, ...] = (),
        accumulate_in_input_dtype: bool = False,
        kv_rounds: Sequence[KeyValueReplicas | None] = (),
    ) -> None:
        self.x = x
        self.x2d = x.reshape(-1, x.shape[-1])
        self.cos, self.sin = cos.unsqueeze(2), sin.unsqueeze(2)  # [b, s, 1, d]: broadcast over heads
        # for [b, s, n, d] chunks and for [b, s, C, n, d] send-buffer views / received gradients
        self._rope4 = RopeTables.of(self.cos, self.sin)
        self._rope5 = RopeTables.of(self.cos.unsqueeze(2), self.sin.unsqueeze(2))
        self.proj = proj
        self.weights = proj.params()
        self.d = proj.head_dim
        self.backward = backward
        # needs_grad: x first, then the params (as in FusedProjections.params())
        self.need_x = bool(needs_grad[0]) if backward else False
        self.need_p = tuple(bool(n) for n in needs_grad[1:]) if backward else (False,) * NUM_PARAMS
        # float32 sums for half-precision x / weights unless asked to sum in their own dtype
        self.accumulate_in_input_dtype = accumulate_in_input_dtype
        #: the StageSource contract: chunks of x's batch and sequence shard; gradients per slot
        #: (whole), dK/dV per round unless summed in the input dtype without a k norm (class docstring)
        self.local_shape = (x.shape[0], x.shape[1], self.d)
        self.value_head_dim = self.d  # fused mode runs only Llama-shaped attention: values of the q/k head dim
        self.dtype, self.device = x.dtype, x.device
        self.grads_per_source_rank = False
        self.key_value_grads_per_stage = accumulate_in_input_dtype and proj.k_norm is None
        self.grad_x: Tensor | None = None
        #: dx terms (g, weight index, heads) of the gradients handed over since the last ``finish``
        self._dx_pending: list[tuple[Tensor, int, Tensor]] = []
        self.grad_p: list[Tensor | None] = [None] * NUM_PARAMS
        #: backward, with a q/k norm: the pre-norm chunk of each slot in flight by ``Slot.key``,
        #: dropped by ``finish``
        self._pre_norm: dict[tuple[str, int, int | None], Tensor] = {}
        # the plan's KV replica layout per round, used where a round's dK/dV come whole (a k norm)
        self._kv_rounds = list(kv_rounds)

    def head_rows(self, param: Tensor, heads: Tensor, dim: int = 0) -> Tensor:
        """The rows (q/k/v weights and biases, ``dim`` 0) or columns (o_proj, ``dim`` 1) of ``param`` that
        belong to ``heads``, in their order: one index_select over ``param`` seen with that dim split
        into [heads, d] (no per-call row-index tensor of n * d entries)."""
        blocks = param.unflatten(dim, (-1, self.d)).index_select(dim, heads)
        return blocks.flatten(dim, dim + 1)

    # -- the projection of one chunk ---------------------------------------------------------
    def _linear(self, heads: Tensor, w_idx: int) -> Tensor:
        """x @ W[rows of heads]^T + b[rows of heads] as [b, s, n, d]."""
        weight, bias = self.weights[w_idx], self.weights[w_idx + 1]
        bias_rows = None if bias is None else self.head_rows(bias, heads)
        y = F.linear(self.x, self.head_rows(weight, heads), bias_rows)
        return y.unflatten(-1, (heads.numel(), self.d))

    def _norm(self, norm_idx: int) -> nn.Module | None:
        return self.proj.q_norm if norm_idx == _QN else self.proj.k_norm

    def _chunk(self, slot: Slot, w_idx: int, norm_idx: int, out: Tensor) -> None:
        """Project, normalize and rotate the slot's heads into ``out`` ([b, s, C, n, d], a view of
        the send buffer)."""
        y = self._linear(slot.heads, w_idx)
        norm = self._norm(norm_idx)
        if norm is not None:
            if self.backward:
                self._pre_norm[slot.key] = y
            y = rms_norm_tiled(y, self.weights[norm_idx], self.proj.norm, qk_norm_tile_tokens(y))
        apply_rope_tables(y.view(out.shape), self._rope5, out=out)

    def _pre_norm_of(self, key: tuple[str, int, int | None], piece: Piece) -> Tensor | None:
        pre_norm = self._pre_norm.get(key)
        return None if pre_norm is None else pre_norm.narrow(2, piece.start, piece.count)

    # -- StageSource -------------------------------------------------------------------------
    def query(self, slot: Slot, out: Tensor) -> None:
        self._chunk(slot, _WQ, _QN, out)

    def key_value(self, slot: Slot, out_key: Tensor, out_value: Tensor) -> None:
        self._chunk(slot, _WK, _KN, out_key)
        out_value.copy_(self._linear(slot.heads, _WV).view(out_value.shape))

    def add_query_grad(self, slot: Slot, piece: Piece, grad: Tensor) -> None:
        pre_norm = self._pre_norm_of(slot.key, piece)
        self._linear_backward(self._chunk_backward(grad, pre_norm, _QN), piece.heads(slot), _WQ)

    def add_key_value_grad(self, slot: Slot, piece: Piece, grad_key: Tensor, grad_value: Tensor) -> None:
        pre_norm = self._pre_norm_of(("key_value", slot.round, None), piece)  # the round's K
        heads = piece.heads(slot)
        # in pieces (per source rank) the replicas' terms simply add up in the weight gradient; a whole
        # round's gradient (a k norm) sums its replicas first
        replicas = self._kv_rounds[slot.round] if piece.source_rank is None and self._kv_rounds else None
        if replicas is not None:
            # Sum the replicas' gradients first, as HF's repeat_kv backward does: a q/k norm computes in
            # float32 inside, so taking each replica through it separately would round differently.
            grad_key, grad_value = (_heads_flat(g) for g in (grad_key, grad_value))
            dev = grad_key.device
            unique = torch.tensor(replicas.unique, dtype=torch.long, device=dev)
            slots = torch.tensor(replicas.slot_to_unique, dtype=torch.long, device=dev)
            first = torch.tensor([replicas.slot_to_unique.index(i) for i in range(len(replicas.unique))], device=dev)
            grad_key, grad_value = (self._sum_replicas(g, slots, unique.numel()) for g in (grad_key, grad_value))
            pre_norm = None if pre_norm is None else pre_norm.index_select(2, first)
            heads = unique
        self._linear_backward(self._chunk_backward(grad_key, pre_norm, _KN), heads, _WK)
        self._linear_backward(grad_value, heads, _WV)

    def finish(self, slot: Slot) -> None:
        """Every gradient of ``slot`` is in: its dx terms as one product, its pre-norm chunk dropped."""
        self._flush_grad_x()
        self._pre_norm.pop(slot.key, None)

    # -- backward helpers --------------------------------------------------------------------
    @staticmethod
    def _sum_replicas(grad: Tensor, slots: Tensor, num_unique: int) -> Tensor:
        """[b, s, slots, d] -> [b, s, unique heads, d]: each head's replicas summed."""
        b, s, _, d = grad.shape
        return torch.zeros((b, s, num_unique, d), dtype=grad.dtype, device=grad.device).index_add_(2, slots, grad)

    def _chunk_backward(self, grad: Tensor, pre_norm: Tensor | None, norm_idx: int) -> Tensor:
        """``grad``: [b, s, n, d] or a slot's whole [b, s, C, n, d] (read strided by RoPE's backward,
        whose contiguous result is flattened to [b, s, C*n, d] without a copy)."""
        if grad.dim() == 5:
            grad = rope_backward_tables(grad, self._rope5).flatten(2, 3)
        else:
            grad = rope_backward_tables(grad, self._rope4)
        if pre_norm is None:
            return grad
        grad_input, grad_weight = rms_norm_backward(
            pre_norm,
            self.weights[norm_idx],
            self.proj.norm,
            grad,
            self.need_p[norm_idx],
            qk_norm_tile_tokens(pre_norm),
        )
        del grad
        if grad_weight is not None:
            self._accumulate(norm_idx, None, grad_weight)
        return grad_input

    def _linear_backward(self, grad: Tensor, heads: Tensor, w_idx: int) -> None:
        g = grad.reshape(-1, heads.numel() * self.d).to(self.x.dtype)
        if self.need_x:
            # dx's term waits for the rest of its chunk (the other source ranks' heads, V beside K):
            # _flush_grad_x makes one GEMM of them
            # (its weight rows are selected at the flush, straight into the one buffer the GEMM reads)
            self._dx_pending.append((g, w_idx, heads))
        if self.need_p[w_idx]:
            self._accumulate(w_idx, heads, g.t() @ self.x2d)
        if self.weights[w_idx + 1] is not None and self.need_p[w_idx + 1]:
            self._accumulate(w_idx + 1, heads, g.sum(0))

    def _flush_grad_x(self) -> None:
        """dx += [g_1 ... g_n] @ [W_1; ...; W_n] over the pending terms of a slot: one GEMM per
        slot (a stage's dQ; a stage's or a round's dK with dV; any pieces it came in) instead of one
        per term, each of which would read and write the whole x-sized accumulator.
        With the accumulator in the input dtype it is one in-place addmm.  With a float32 accumulator
        for 16-bit inputs the GEMM runs in the input dtype (tensor cores, float32 accumulation inside,
        as the model's own q/k/v_proj backward computes dx) over tiles of ``DX_TILE_BYTES`` of
        product, each added to the float32 accumulator: an fp32 GEMM would run without TF32 at a
        tenth of the rate, and an untiled product would be an x-sized temporary at the layer's peak."""
        if not self._dx_pending:
            return
        gs = [g for g, _, _ in self._dx_pending]
        w = self._pending_weight_rows().to(gs[0].dtype)
        self._dx_pending.clear()
        if self.grad_x is None:
            acc_dtype = self._acc_dtype(self.x.dtype)
            self.grad_x = torch.zeros(self.x2d.shape, dtype=acc_dtype, device=self.x.device)
        if self.grad_x.dtype == gs[0].dtype:
            self.grad_x.addmm_(gs[0] if len(gs) == 1 else torch.cat(gs, dim=1), w)
            return
        tokens = max(1, DX_TILE_BYTES // (w.shape[1] * w.element_size()))
        for start in range(0, self.grad_x.shape[0], tokens):
            tile = [g[start : start + tokens] for g in gs]
            self.grad_x[start : start + tokens].add_(torch.mm(tile[0] if len(tile) == 1 else torch.cat(tile, 1), w))

    def _pending_weight_rows(self) -> Tensor:
        """[W_1; ...; W_n]: the pending terms' weight rows, each selected into its block of one buffer
        (no per-term copy concatenated again: K's and V's rows of a round are a weight-sized copy)."""
        terms = [(self.weights[w_idx], heads) for _, w_idx, heads in self._dx_pending]
        if len(terms) == 1:
            return self.head_rows(*terms[0])
        rows = [heads.numel() * self.d for _, heads in terms]
        first = terms[0][0]
        out = torch.empty((sum(rows), first.shape[1]), dtype=first.dtype, device=first.device)
        for (weight, heads), block in zip(terms, out.split(rows)):
            torch.index_select(weight.unflatten(0, (-1, self.d)), 0, heads, out=block.unflatten(0, (-1, self.d)))
        return out

    def _acc_dtype(self, dtype: torch.dtype) -> torch.dtype:
        if dtype in _LOW_PRECISION and not self.accumulate_in_input_dtype:
            return torch.float32
        return dtype

    def _accumulate(self, idx: int, heads: Tensor | None, grad: Tensor) -> None:
        """grad_p[idx] += grad, into the rows of ``heads`` (one [d, ...] block per head) when given."""
        param = self.weights[idx]
        acc = self.grad_p[idx]
        if acc is None:
            acc = self.grad_p[idx] = torch.zeros(param.shape, dtype=self._acc_dtype(param.dtype), device=param.device)
        if heads is None:
            acc += grad
        else:
            # index_add, not copy: KV heads replicated over ranks (Hkv < C) repeat rows.
            acc.unflatten(0, (-1, self.d)).index_add_(0, heads, grad.to(acc.dtype).unflatten(0, (-1, self.d)))

    def results(self) -> tuple[Tensor | None, list[Tensor | None]]:
        """(dx, gradients of the params) in the inputs' dtypes."""
        self._flush_grad_x()
        grad_x = None if self.grad_x is None else self.grad_x.view(self.x.shape).to(self.x.dtype)
        grads = [None if g is None else g.to(self.weights[i].dtype) for i, g in enumerate(self.grad_p)]
        return grad_x, grads


class FusedUPipeAttention(torch.autograd.Function):
    """x [b, s, hidden] -> o_proj(attention(x)) [b, s, hidden], heads in the model's order.

    Inputs: x, cos, sin (RoPE of the local positions, [b, s, d]), the PipelineContext, the
    FusedProjections, then the tensors of ``FusedProjections.params()`` (None where absent), which
    are inputs only so that autograd routes their gradients."""

    @staticmethod
    def forward(fctx, x: Tensor, cos: Tensor, sin: Tensor, pctx: PipelineContext, proj: FusedProjections, *params):
        b, s, _ = x.shape
        source = FusedProjectionSource(x, cos, sin, proj)
        out = torch.empty((b, s, pctx.plan.num_heads, proj.head_dim), dtype=x.dtype, device=x.device)
        with torch.no_grad():
            lses = pipeline_forward(pctx, source, out)
            y = F.linear(out.flatten(2), params[_WO], params[_BO])
        fctx.pctx, fctx.proj = pctx, proj
        if pctx.recompute_attention_output:  # backward recomputes the stages' outputs (pipeline.RecomputedOutput)
            del out, lses
            fctx.save_for_backward(x, cos, sin)
        else:
            fctx.save_for_backward(x, cos, sin, out, *lses)
        return y

    @staticmethod
    def backward(fctx, grad_y: Tensor):
        x, cos, sin, *saved = fctx.saved_tensors
        needs = (fctx.needs_input_grad[0], *fctx.needs_input_grad[5:])
        source = FusedProjectionSource(
            x,
            cos,
            sin,
            fctx.proj,
            backward=True,
            needs_grad=needs,
            accumulate_in_input_dtype=fctx.pctx.accumulate_in_input_dtype,
            kv_rounds=kv_replicas(fctx.pctx.plan),
        )
        dy = grad_y.reshape(-1, grad_y.shape[-1])
        w_o = fctx.proj.o_proj.weight
        recompute = fctx.pctx.recompute_attention_output
        num_heads, d = fctx.pctx.plan.num_heads, fctx.proj.head_dim  # the output's shape

        def grad_out(slot: Slot, out: Tensor) -> None:
            """This stage's slice of d(attention output) = dy @ Wo[:, columns of the heads], into ``out``."""
            out.copy_((dy @ source.head_rows(w_o, slot.heads, dim=1)).view(out.shape))

        with torch.no_grad():
            if recompute:
                # o_proj's weight gradient column block by column block, from each stage's recomputed
                # output: the heads' columns are disjoint, so each is written once (no summation)
                grad_w_o = torch.empty(w_o.shape, dtype=x.dtype, device=x.device) if source.need_p[_WO] else None

                def take_output(slot: Slot, o_local: Tensor) -> None:
                    if grad_w_o is not None:
                        # every source rank's columns in one batched product over the [C, b, s, n, d]
                        # receive buffer as it is (no per-rank loop, no copy of it), written in one op
                        c, n = o_local.shape[0], o_local.shape[3]
                        o_by_rank = o_local.view(c, dy.shape[0], n * d)
                        o_grad = torch.bmm(dy.t().expand(c, -1, -1), o_by_rank)  # [C, hidden, n*d]
                        put_heads(grad_w_o.unflatten(1, (-1, d)), slot.heads, o_grad.view(c, -1, n, d).transpose(0, 1))

                pipeline_backward(fctx.pctx, source, RecomputedOutput(x.dtype, take_output), grad_out, ())
                grad_x, grads = source.results()
                grads[_WO] = grad_w_o
            else:
                out, *lses = saved
                pipeline_backward(fctx.pctx, source, out, grad_out, lses)
                grad_x, grads = source.results()
                if source.need_p[_WO]:
                    grads[_WO] = dy.t() @ out.view(-1, num_heads * d)
            if fctx.proj.o_proj.bias is not None and source.need_p[_BO]:
                grads[_BO] = dy.sum(0)
            sink_kernel = find_sink_kernel(fctx.pctx.attention)
            if sink_kernel is not None and source.need_p[_SK]:
                # summed over the stages by the kernel (this rank's heads and tokens), as for the unfused node
                grads[_SK] = sink_kernel.grad.to(fctx.proj.sinks.dtype)
        return (grad_x, None, None, None, None, *grads)
