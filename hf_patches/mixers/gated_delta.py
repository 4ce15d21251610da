"""Gated delta net layers (Qwen3.5, Qwen3.5-MoE, Qwen3-Next, OLMo hybrid) run head-sharded under UPipe.

Per stage of U value heads (U/C a rank): every rank projects its local tokens to the q/k/v/b/a rows of
every destination rank's heads of the stage, one all-to-all gives each rank the whole sequence of its
heads, the depthwise causal conv (on the [q, k, v] channels of those heads) and the module's own
chunked gated-delta recurrence run there, and the result goes back to the token owners.  The gated
RMSNorm (with z) and the output projection then run on the local tokens, as the module does.

Value head j reads key head j // (H_v / H_k).  A rank whose stage heads need part of a key head gets
that key head's q/k channels replicated (autograd sums the replicas' gradients back into the weights).

The families differ only in where each head's rows lie in their input projections (``_layout``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from ds_upipe.packing import DocumentBoundaries

from .common import (
    causal_conv,
    check_head_chunk_size,
    checkpointed_stage,
    model_function,
    per_document,
    refusal,
)
from .exchange import heads_to_sequence, sequence_to_heads

#: the module-level recurrence each family's modeling file defines (dispatching to FLA when installed)
_RECURRENCE_NAMES = ("torch_chunk_gated_delta_rule", "chunk_gated_delta_rule")

#: (first row, row count) of one head in a projection's weight
RowsOf = Callable[[int], tuple[int, int]]


@dataclass(frozen=True)
class _Part:
    """Where one input of the recurrence comes from: the projection and the rows of a (key or value) head."""

    proj: nn.Linear
    rows: RowsOf


@dataclass(frozen=True)
class _Layout:
    """A family's projections: q, k per key head; v, z, b, a per value head; its gated norm and output."""

    parts: dict[str, _Part]
    norm: nn.Module
    out_proj: nn.Linear
    beta_scale: float


def _layout(module: nn.Module) -> _Layout:
    """The family's projection layout, from the module's own submodules (the three layouts of transformers)."""
    dk, dv, hk, hv = module.head_k_dim, module.head_v_dim, module.num_k_heads, module.num_v_heads
    key_dim, r = dk * hk, hv // hk
    if hasattr(module, "in_proj_qkvz"):  # Qwen3-Next: interleaved per key head [q, k, v (r heads), z (r heads)]
        qkvz, ba, block = module.in_proj_qkvz, module.in_proj_ba, 2 * dk + 2 * r * dv
        parts = {
            "q": _Part(qkvz, lambda g: (g * block, dk)),
            "k": _Part(qkvz, lambda g: (g * block + dk, dk)),
            "v": _Part(qkvz, lambda h: ((h // r) * block + 2 * dk + (h % r) * dv, dv)),
            "z": _Part(qkvz, lambda h: ((h // r) * block + 2 * dk + (r + h % r) * dv, dv)),
            "b": _Part(ba, lambda h: ((h // r) * 2 * r + h % r, 1)),
            "a": _Part(ba, lambda h: ((h // r) * 2 * r + r + h % r, 1)),
        }
        return _Layout(parts, module.norm, module.out_proj, 1.0)
    if hasattr(module, "in_proj_qkv"):  # Qwen3.5 (dense and MoE): [q | k | v] then separate z, b, a
        qkv = module.in_proj_qkv
        parts = {
            "q": _Part(qkv, lambda g: (g * dk, dk)),
            "k": _Part(qkv, lambda g: (key_dim + g * dk, dk)),
            "v": _Part(qkv, lambda h: (2 * key_dim + h * dv, dv)),
            "z": _Part(module.in_proj_z, lambda h: (h * dv, dv)),
            "b": _Part(module.in_proj_b, lambda h: (h, 1)),
            "a": _Part(module.in_proj_a, lambda h: (h, 1)),
        }
        return _Layout(parts, module.norm, module.out_proj, 1.0)
    # OLMo hybrid: one projection an input; beta in [0, 2] when negative eigenvalues are allowed
    parts = {
        "q": _Part(module.q_proj, lambda g: (g * dk, dk)),
        "k": _Part(module.k_proj, lambda g: (g * dk, dk)),
        "v": _Part(module.v_proj, lambda h: (h * dv, dv)),
        "z": _Part(module.g_proj, lambda h: (h * dv, dv)),
        "b": _Part(module.b_proj, lambda h: (h, 1)),
        "a": _Part(module.a_proj, lambda h: (h, 1)),
    }
    return _Layout(parts, module.o_norm, module.o_proj, 2.0 if module.allow_neg_eigval else 1.0)


def _rows(part: _Part, heads: list[int], device: torch.device) -> Tensor:
    """The weight rows of ``heads`` in ``part``'s projection, in head order."""
    spans = [part.rows(h) for h in heads]
    return torch.cat([torch.arange(first, first + n, device=device) for first, n in spans])


def _z_is_whole(layout: _Layout, module: nn.Module) -> bool:
    """z is its own projection (Qwen3.5, OLMo): call it as is; Qwen3-Next's z rows are sliced from qkvz."""
    return layout.parts["z"].proj.out_features == module.value_dim


# ---- what this layer can run ----------------------------------------------------------------------


def check(layer: int, module: nn.Module, group_size: int, head_chunk_size: int | None) -> None:
    """U must be a multiple of C dividing the value heads; the value heads a multiple of the key heads."""
    hv, hk = module.num_v_heads, module.num_k_heads
    if hv % hk:
        raise refusal(layer, module, f"{hv} value heads are not a multiple of its {hk} key heads")
    check_head_chunk_size(layer, module, "linear_num_value_heads", hv, group_size, head_chunk_size)


def head_count(module: nn.Module) -> int:
    """What U counts: the value heads."""
    return module.num_v_heads


def zero3_params(module: nn.Module) -> list[nn.Parameter]:
    """The projections read by rows and the conv read by channels (z's projection too when sliced)."""
    layout = _layout(module)
    names = ("q", "k", "v", "b", "a") if _z_is_whole(layout, module) else ("q", "k", "v", "z", "b", "a")
    params: list[nn.Parameter] = []
    for proj in (layout.parts[n].proj for n in names):
        for p in (proj.weight, proj.bias):
            if p is not None and all(p is not q for q in params):
                params.append(p)
    params.append(module.conv1d.weight)
    if module.conv1d.bias is not None:
        params.append(module.conv1d.bias)
    return params


# ---- FLA's contract --------------------------------------------------------------------------------


def check_fla_arguments(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, cu_seqlens: Tensor | None) -> None:
    """What FLA's ``chunk_gated_delta_rule`` requires (fla/ops/gated_delta_rule/chunk.py): token-first
    q, k [B, T, H, K] of equal shape, v [B, T, HV, V] with HV a multiple of H (grouped value attention),
    g and beta [B, T, HV], contiguous; ``cu_seqlens`` (varlen) int32 [N + 1] from 0 to T with B == 1.
    The torch fallback accepts more; checking here keeps the CPU-tested calls valid for the kernel."""
    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(f"FLA gated delta rule: q {tuple(q.shape)} and k {tuple(k.shape)} must be equal [B, T, H, K]")
    b, t, h = q.shape[:3]
    if v.dim() != 4 or v.shape[:2] != (b, t) or v.shape[2] % h:
        raise ValueError(f"FLA gated delta rule: v {tuple(v.shape)} must be [B, T, HV, V], HV a multiple of H={h}")
    for name, x in (("g", g), ("beta", beta)):
        if x.shape != v.shape[:3]:
            raise ValueError(f"FLA gated delta rule: {name} {tuple(x.shape)} must be [B, T, HV] = {tuple(v.shape[:3])}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"FLA gated delta rule: q/k/v dtypes {q.dtype}, {k.dtype}, {v.dtype} differ")
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not x.is_contiguous():
            raise ValueError(f"FLA gated delta rule: {name} must be contiguous (token-first [B, T, ...])")
    if cu_seqlens is None:
        return
    if cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1:
        raise ValueError(
            f"FLA gated delta rule: cu_seqlens must be 1-D int32, got {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}"
        )
    if b != 1:
        raise ValueError(f"FLA gated delta rule: batch {b} with cu_seqlens: flatten the rows to B == 1")
    if int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != t:
        raise ValueError(f"FLA gated delta rule: cu_seqlens must run from 0 to T={t}, got {cu_seqlens.tolist()}")


# ---- the sharded forward ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _StageHeads:
    """A stage's heads per rank: value heads, and the key heads they read (replicated where needed)."""

    values: list[list[int]]  # [rank] -> u value heads
    keys: list[list[int]]  # [rank] -> the key heads, local value head i reads key i // (u / len)


def _stage_heads(module: nn.Module, stage: int, u_rank: int, group_size: int) -> _StageHeads:
    r = module.num_v_heads // module.num_k_heads
    values, keys = [], []
    for j in range(group_size):
        first = (stage * group_size + j) * u_rank
        heads = list(range(first, first + u_rank))
        if u_rank % r == 0:  # whole groups: each key head once
            key = [h // r for h in heads[::r]]
        elif r % u_rank == 0:  # part of one group: that key head replicated to this rank
            key = [first // r]
        else:  # groups straddle ranks unevenly: one key copy a value head
            key = [h // r for h in heads]
        values.append(heads)
        keys.append(key)
    return _StageHeads(values, keys)


def _stage_projection(layout: _Layout, heads: _StageHeads, device: torch.device) -> tuple[Tensor, Tensor | None]:
    """The stage's input projection: for each rank j in turn, the rows of its q, k (its key heads) and
    v, b, a (its value heads), so that one matmul and one all-to-all serve the whole stage."""
    weights, biases = [], []
    for keys, values in zip(heads.keys, heads.values):
        for name, hs in (("q", keys), ("k", keys), ("v", values), ("b", values), ("a", values)):
            proj = layout.parts[name].proj
            rows = _rows(layout.parts[name], hs, device)
            weights.append(proj.weight[rows])
            biases.append(proj.weight.new_zeros(len(rows)) if proj.bias is None else proj.bias[rows])
    has_bias = any(layout.parts[n].proj.bias is not None for n in ("q", "k", "v", "b", "a"))
    return torch.cat(weights), torch.cat(biases) if has_bias else None


def _conv_channels(module: nn.Module, keys: list[int], values: list[int]) -> Tensor:
    """The conv channels (layout [q | k | v] of all heads) of these key heads' q and k and value heads' v."""
    dk, dv, key_dim = module.head_k_dim, module.head_v_dim, module.key_dim
    spans = [(g * dk, dk) for g in keys] + [(key_dim + g * dk, dk) for g in keys]
    spans += [(2 * key_dim + h * dv, dv) for h in values]
    return torch.cat([torch.arange(first, first + n) for first, n in spans])


def _stage(
    module: nn.Module,
    layout: _Layout,
    heads: _StageHeads,
    rank: int,
    group: dist.ProcessGroup | None,
    documents: DocumentBoundaries | None,
    hidden_states: Tensor,
) -> Tensor:
    """One stage on this rank: [B, s, D] local tokens -> [B, s, U, dv] this stage's heads of these tokens."""
    dk, dv, c = module.head_k_dim, module.head_v_dim, len(heads.values)
    kl, u = len(heads.keys[0]), len(heads.values[0])
    device = hidden_states.device
    send = F.linear(hidden_states, *_stage_projection(layout, heads, device))
    mixed = sequence_to_heads(send.unflatten(-1, (c, -1)), group)  # [B, S, 2 kl dk + u dv + 2u]
    qkv, b, a = mixed.split([2 * kl * dk + u * dv, u, u], dim=-1)

    mine_k, mine_v = heads.keys[rank], heads.values[rank]
    channels = _conv_channels(module, mine_k, mine_v).to(device)
    conv = module.conv1d
    weight = conv.weight[channels].squeeze(1)
    conv_bias = None if conv.bias is None else conv.bias[channels]
    qkv = causal_conv(module, qkv, weight, conv_bias, module.activation, documents)
    query, key, value = qkv.split([kl * dk, kl * dk, u * dv], dim=-1)
    batch, seq = query.shape[:2]
    query, key = (x.reshape(batch, seq, kl, dk).contiguous() for x in (query, key))
    value = value.reshape(batch, seq, u, dv).contiguous()

    # as the module computes them, on this rank's heads (the .float() guards A_log's exp in half precision)
    beta = b.sigmoid()
    if layout.beta_scale != 1.0:
        beta = beta * layout.beta_scale
    index = torch.tensor(mine_v, device=device)
    g = -module.A_log[index].float().exp() * F.softplus(a.float() + module.dt_bias[index])
    recurrence = model_function(module, *_RECURRENCE_NAMES)

    def run(q: Tensor, k: Tensor, v: Tensor, g_: Tensor, beta_: Tensor) -> Tensor:
        q, k, v, g_, beta_ = (x.contiguous() for x in (q, k, v, g_, beta_))
        check_fla_arguments(q, k, v, g_, beta_, None)
        out, _ = recurrence(
            q, k, v, g=g_, beta=beta_, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=True
        )
        return out

    out = per_document(run, documents, query, key, value, g, beta)  # [B, S, u, dv]
    local = heads_to_sequence(out, group, c)  # [B, s, C, u, dv]
    return local.flatten(2, 3)


def sharded_forward(
    module: nn.Module,
    hidden_states: Tensor,
    *,
    group: dist.ProcessGroup | None,
    head_chunk_size: int | None,
    documents: DocumentBoundaries | None,
) -> Tensor:
    """The module's output on this rank's shard [B, s, D]: stages of U value heads, then norm and out_proj."""
    c = dist.get_world_size(group)
    rank = dist.get_rank(group)
    u = c if head_chunk_size is None else head_chunk_size
    layout = _layout(module)
    batch, local = hidden_states.shape[:2]
    outs = []
    for stage in range(module.num_v_heads // u):
        heads = _stage_heads(module, stage, u // c, c)
        outs.append(checkpointed_stage(_stage, module, layout, heads, rank, group, documents, hidden_states))
    core = torch.cat(outs, dim=2)  # [B, s, H_v, dv]
    if _z_is_whole(layout, module):
        z = layout.parts["z"].proj(hidden_states)
    else:
        part = layout.parts["z"]
        rows = _rows(part, list(range(module.num_v_heads)), hidden_states.device)
        z = F.linear(hidden_states, part.proj.weight[rows], None if part.proj.bias is None else part.proj.bias[rows])
    dv = module.head_v_dim
    normed = layout.norm(core.reshape(-1, dv), z.reshape(-1, dv))
    return layout.out_proj(normed.reshape(batch, local, -1))
