"""Mamba-2 mixers (Nemotron-H ``NemotronHMamba2Mixer``, Granite 4 hybrid ``GraniteMoeHybridMambaLayer``, Bamba
``BambaMixer``) run head-sharded: the whole sequence of a few SSM heads a rank, in stages.

The module computes ``in_proj`` -> [z (d_inner) | xBC (conv_dim = d_inner + 2 G N) | dt (H)], a depthwise causal
conv (and activation) over the xBC channels, the SSD scan (``mamba2_chunk_scan``: x [B, T, H, P], dt [B, T, H],
A = -exp(A_log), B/C [B, T, G, N], head h reading group h // (H / G), D skip, dt_bias + softplus, dt_limit), then
the gated grouped RMSNorm ``norm(y, z)`` and ``out_proj``.  Heads are independent given the whole sequence of their
x, dt and their group's B/C, so a stage projects, for every rank of the group, the rows of that rank's heads (and of
the groups they read, replicated to every rank that needs them), exchanges them to the head layout, runs the conv
and the scan the module's own module-level functions run (``causal_conv1d_fn``, ``mamba2_chunk_scan``: mamba_ssm /
causal-conv1d kernels where installed and on CUDA, transformers' torch code otherwise), and exchanges the scan's
output back.  The gate z, the norm (over groups of channels: exact on all heads of the local tokens) and
``out_proj`` then run on the local tokens, as the module does.

Falcon-H1's ``FalconH1Mixer`` is not covered: its layers run attention and the mixer side by side ("hybrid" layer
type, refused by ``find_decoder``) and it scales the projections by muP multipliers.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from ds_upipe.packing import DocumentBoundaries

from .common import (
    causal_conv,
    check_head_chunk_size,
    checkpointed_stage,
    kernel_runs,
    model_function,
    per_document,
    refusal,
    seq_idx_of,
)
from .exchange import heads_to_sequence, sequence_to_heads

#: the SSM attributes the sharded forward reads from the module (all three classes define them)
_ATTRIBUTES = (
    "num_heads",
    "head_dim",
    "n_groups",
    "ssm_state_size",
    "intermediate_size",
    "conv_dim",
    "chunk_size",
    "time_step_limit",
    "activation",
    "in_proj",
    "conv1d",
    "norm",
    "out_proj",
    "A_log",
    "dt_bias",
    "D",
)


def check(layer: int, module: nn.Module, group_size: int, head_chunk_size: int | None) -> None:
    """The mixer has the Mamba-2 layout the sharded forward slices, and U is a multiple of C dividing the heads."""
    missing = [a for a in _ATTRIBUTES if not hasattr(module, a)]
    if missing:
        raise refusal(layer, module, f"a Mamba-2 mixer without {', '.join(missing)}: not the computation UPipe shards")
    heads, width = module.num_heads, module.in_proj.out_features
    if (
        module.intermediate_size != heads * module.head_dim
        or width != 2 * module.intermediate_size + 2 * (module.n_groups * module.ssm_state_size) + heads
    ):
        raise refusal(
            layer,
            module,
            f"in_proj gives {width} channels, not [z | x | B | C | dt] of {heads} heads x {module.head_dim}, "
            f"{module.n_groups} groups x {module.ssm_state_size}: not the Mamba-2 layout UPipe shards",
        )
    if heads % module.n_groups:
        raise refusal(layer, module, f"n_groups={module.n_groups} does not divide num_heads={heads}")
    check_head_chunk_size(layer, module, "num_heads", heads, group_size, head_chunk_size)


def head_count(module: nn.Module) -> int:
    """What U counts: the SSM heads."""
    return module.num_heads


def zero3_params(module: nn.Module) -> list[nn.Parameter]:
    """in_proj and conv1d are read by slices, outside their own forwards (norm and out_proj run as modules; A_log,
    dt_bias and D are the mixer's own)."""
    return [p for sub in (module.in_proj, module.conv1d) for p in sub.parameters(recurse=False)]


@dataclass(frozen=True)
class _StagePlan:
    """What one stage projects, convolves and scans (index tensors built once per module, sizes and rank)."""

    #: in_proj rows of every rank's block, in rank order: [x of its heads | B, C of its groups | dt of its heads]
    rows: Tensor
    #: this rank's conv1d channels (in xBC order: x of its heads, then B, then C of its groups)
    channels: Tensor
    #: this rank's heads
    heads: Tensor
    #: heads a rank, B/C groups a rank (head i of a rank reads its group i // (heads / groups))
    num_heads: int
    num_groups: int


def _rank_groups(first: int, count: int, heads_per_group: int) -> list[int]:
    """The groups (one index a local group, repeated where needed) the ``count`` heads from ``first`` read, laid
    out so that local head i reads local group i // (count / len(groups)), as the scan assumes."""
    if heads_per_group % count == 0:  # the rank's heads are in one group
        return [first // heads_per_group]
    if count % heads_per_group == 0:  # whole groups (aligned: first is a multiple of count)
        return [first // heads_per_group + i for i in range(count // heads_per_group)]
    return [(first + i) // heads_per_group for i in range(count)]  # a group per head, replicated


@cache
def _plan(
    heads: int, head_dim: int, groups: int, state: int, d_inner: int, u: int, size: int, rank: int, stage: int
) -> _StagePlan:
    per_rank, per_group = u // size, heads // groups
    conv_dim = d_inner + 2 * groups * state
    blocks, mine = [], None
    for j in range(size):
        first = stage * u + j * per_rank
        rank_heads = torch.arange(first, first + per_rank)
        group_list = torch.tensor(_rank_groups(first, per_rank, per_group))
        x = (rank_heads[:, None] * head_dim + torch.arange(head_dim)).flatten()
        state_rows = (group_list[:, None] * state + torch.arange(state)).flatten()
        channels = torch.cat([x, d_inner + state_rows, d_inner + groups * state + state_rows])
        blocks.append(torch.cat([d_inner + channels, d_inner + conv_dim + rank_heads]))
        if j == rank:
            mine = (channels, rank_heads, len(group_list))
    channels, rank_heads, num_groups = mine
    return _StagePlan(torch.cat(blocks), channels, rank_heads, per_rank, num_groups)


def _require(ok: bool, message: object) -> None:
    if not ok:
        raise ValueError(f"mamba_chunk_scan_combined: {message}")


def check_mamba_ssm_arguments(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None,
    dt_bias: Tensor | None,
    seq_idx: Tensor | None,
) -> None:
    """What mamba_ssm's ``mamba_chunk_scan_combined`` (ops/triton/ssd_combined.py) requires: x [B, T, H, P] with
    stride(-1) == 1 or stride(1) == 1, dt [B, T, H], A [H], B and C [B, T, G, N] with G dividing H, D [H] or
    [H, P], dt_bias [H], seq_idx int32 [B, T] contiguous (int32 as causal-conv1d and mamba_ssm's Mamba2 pass it)."""
    _require(x.dim() == 4, f"x must be [B, T, H, P], got {tuple(x.shape)}")
    batch, seq, heads, head_dim = x.shape
    _require(x.stride(-1) == 1 or x.stride(1) == 1, f"x strides {x.stride()}")
    _require(tuple(dt.shape) == (batch, seq, heads), f"dt {tuple(dt.shape)} != {(batch, seq, heads)}")
    _require(tuple(A.shape) == (heads,), f"A {tuple(A.shape)} != {(heads,)}")
    _require(B.dim() == 4 and tuple(B.shape[:2]) == (batch, seq), f"B {tuple(B.shape)} is not [B, T, G, N]")
    _require(tuple(C.shape) == tuple(B.shape), f"C {tuple(C.shape)} != B {tuple(B.shape)}")
    _require(heads % B.shape[2] == 0, f"{B.shape[2]} groups do not divide {heads} heads")
    if D is not None:
        _require(tuple(D.shape) in ((heads,), (heads, head_dim)), f"D {tuple(D.shape)}")
    if dt_bias is not None:
        _require(tuple(dt_bias.shape) == (heads,), f"dt_bias {tuple(dt_bias.shape)}")
    if seq_idx is not None:
        _require(
            seq_idx.dtype == torch.int32 and seq_idx.is_contiguous(),
            f"seq_idx {seq_idx.dtype}, strides {seq_idx.stride()}: must be contiguous int32",
        )
        _require(tuple(seq_idx.shape) == (batch, seq), f"seq_idx {tuple(seq_idx.shape)} != {(batch, seq)}")


def _scan(
    module: nn.Module,
    plan: _StagePlan,
    x: Tensor,
    dt: Tensor,
    bc: tuple[Tensor, Tensor],
    documents: DocumentBoundaries | None,
) -> Tensor:
    """The module's SSD scan (as its ``mamba2_scan_forward`` calls ``mamba2_chunk_scan`` without a cache) on this
    rank's heads of the whole sequence, restarting at each document start."""
    heads = plan.heads.to(x.device)
    A = -torch.exp(module.A_log[heads].float())
    D, dt_bias = module.D[heads], module.dt_bias[heads]
    kernel = kernel_runs("mamba_ssm", x.device)

    def run(x: Tensor, dt: Tensor, b: Tensor, c: Tensor, seq_idx: Tensor | None = None) -> Tensor:
        check_mamba_ssm_arguments(x, dt, A, b, c, D, dt_bias, seq_idx)  # on every device: CPU runs pin the contract
        extra = {} if seq_idx is None else {"seq_idx": seq_idx}
        return model_function(module, "mamba2_chunk_scan")(
            x,
            dt,
            A,
            b,
            c,
            chunk_size=module.chunk_size,
            D=D,
            z=None,
            dt_bias=dt_bias,
            dt_softplus=True,
            dt_limit=module.time_step_limit,
            **extra,
        )

    if kernel and documents is not None and not documents.is_trivial:
        return run(x, dt, *bc, seq_idx_of(documents, x.shape[0], x.shape[1], x.device))
    return per_document(run, documents, x, dt, *bc)


def _stage(
    module: nn.Module,
    plan: _StagePlan,
    hidden_states: Tensor,
    group: dist.ProcessGroup | None,
    size: int,
    documents: DocumentBoundaries | None,
) -> Tensor:
    """One stage: [B, s, D_model] local tokens -> [B, s, U * P] scan output of the stage's heads, in head order."""
    batch, local = hidden_states.shape[:2]
    rows = plan.rows.to(hidden_states.device)
    proj = module.in_proj
    bias = proj.bias[rows] if proj.bias is not None else None
    projected = F.linear(hidden_states, proj.weight[rows], bias).view(batch, local, size, -1)
    full = sequence_to_heads(projected, group)  # [B, S, width]: the whole sequence of this rank's heads
    x_dim, bc_dim = plan.num_heads * module.head_dim, plan.num_groups * module.ssm_state_size
    xbc, dt = full.split([x_dim + 2 * bc_dim, plan.num_heads], dim=-1)
    channels = plan.channels.to(xbc.device)
    weight = module.conv1d.weight[channels, 0]
    bias = module.conv1d.bias[channels] if module.conv1d.bias is not None else None
    xbc = causal_conv(module, xbc, weight, bias, module.activation, documents)
    x, b, c = xbc.split([x_dim, bc_dim, bc_dim], dim=-1)
    seq = x.shape[1]
    x = x.reshape(batch, seq, plan.num_heads, module.head_dim)
    bc = (b.reshape(batch, seq, plan.num_groups, -1), c.reshape(batch, seq, plan.num_groups, -1))
    y = _scan(module, plan, x, dt, bc, documents)
    back = heads_to_sequence(y.reshape(batch, seq, x_dim), group, size)  # [B, s, C, heads x P]
    return back.reshape(batch, local, -1)


def sharded_forward(
    module: nn.Module,
    hidden_states: Tensor,
    *,
    group: dist.ProcessGroup | None,
    head_chunk_size: int | None,
    documents: DocumentBoundaries | None,
) -> Tensor:
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    u = size if head_chunk_size is None else head_chunk_size
    sizes = (module.num_heads, module.head_dim, module.n_groups, module.ssm_state_size, module.intermediate_size)
    outputs = []
    for stage in range(module.num_heads // u):
        # not cached under a fake-tensor mode (the planner's fake runs): its index tensors would be fake ones
        plan_of = _plan.__wrapped__ if torch._guards.detect_fake_mode() is not None else _plan
        plan = plan_of(*sizes, u, size, rank, stage)
        outputs.append(checkpointed_stage(_stage, module, plan, hidden_states, group, size, documents))
    scan_output = torch.cat(outputs, dim=-1)  # [B, s, d_inner], heads in order
    proj = module.in_proj
    d_inner = module.intermediate_size
    gate = F.linear(hidden_states, proj.weight[:d_inner], proj.bias[:d_inner] if proj.bias is not None else None)
    return module.out_proj(module.norm(scan_output, gate).to(hidden_states.dtype))
