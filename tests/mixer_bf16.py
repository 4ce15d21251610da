"""bf16 exactness of one sequence-mixer layer under SP, against that layer's own run-to-run spread without SP
(rank side; the callers are tests/mixer_*_cases.py).

The reference is the unpatched layer on a batch of two rows: output, input gradient and parameter gradients
for a random output gradient.  The spread is what the unpatched layer itself gives on mathematically
equivalent runs of the same data: the batch's rows in the other order, and the two rows run one at a time
(parameter gradients accumulated row after row in bf16, as gradient accumulation over micro-batches does).
SP splits the same sums: a parameter gradient is each rank's sum over its tokens, then summed over the ranks;
the projections and the recurrence run on a subset of the heads (other matmul shapes).

The rule (``beyond_bounds``): the output is bit for bit the reference's; each gradient's difference from the
reference is within the larger of that spread and the reference's own bf16 rounding error (its difference
from the same layer computed in float64 from the same bf16 weights and data).  The input gradient needs the
second yardstick: splitting rows cannot move it (each row's is computed alone), while the sharded forward
projects a stage's q/k/v/b/a (x/B/C/dt) rows in one matmul, so their input gradients are summed in float32
inside it and rounded once, where the module's separate projections round each to bf16 and autograd adds
them in bf16: one bf16 ulp apart (docs/config.md, "Hybrid models (sequence mixers): ZeRO-3 and bf16")."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn

import hf_patches
from tests.hf_cases import float64_internals

#: row orders / splits of the unpatched layer: the reference, then the spread's runs
REFERENCE = [[0, 1]]
SPREAD_RUNS = {"rows_swapped": [[1, 0]], "rows_one_at_a_time": [[0], [1]]}


def _unpatched(module: nn.Module, x: Tensor, dout: Tensor, runs: list[list[int]]) -> dict[str, Tensor]:
    """The layer on ``x`` split into ``runs`` (lists of rows), gradients accumulated over the runs."""
    module = copy.deepcopy(module)
    out, dx = torch.empty_like(dout), torch.empty_like(x)
    for rows in runs:
        xi = x[rows].detach().requires_grad_()
        yi = module(xi)
        yi.backward(dout[rows])
        out[rows], dx[rows] = yi.detach(), xi.grad
    return {"out": out, "dx": dx, **{n: p.grad for n, p in module.named_parameters()}}


def _sharded(
    module: nn.Module, x: Tensor, dout: Tensor, sharded_forward: Callable[..., Tensor], u: int | None
) -> dict[str, Tensor]:
    """The kind's sharded forward on this rank's contiguous shard; output and input gradient gathered, parameter
    gradients summed over the ranks (in float32, then rounded once to bf16: the exact sum of two bf16 values)."""
    group = dist.group.WORLD
    module = copy.deepcopy(module)
    c, rank = dist.get_world_size(), dist.get_rank()
    local = x.shape[1] // c
    xs = x[:, rank * local : (rank + 1) * local].detach().requires_grad_()
    out = sharded_forward(module, xs, group=group, head_chunk_size=u, documents=None)
    out.backward(dout[:, rank * local : (rank + 1) * local])
    grads = {}
    for n, p in module.named_parameters():
        g = p.grad.float()
        dist.all_reduce(g)
        grads[n] = g.to(p.grad.dtype)
    gathered = {"out": out.detach(), "dx": xs.grad}
    return {k: hf_patches.gather_sequence(v, group) for k, v in gathered.items()} | grads


def _max_diff(a: dict[str, Tensor], b: dict[str, Tensor]) -> dict[str, float]:
    return {k: (a[k].double() - b[k].double()).abs().max().item() for k in b}


def bf16_spread(
    module: nn.Module, sharded_forward: Callable[..., Tensor], us: dict[str, int | None], seq: int, seed: int = 0
) -> dict[str, dict[str, float]]:
    """Per quantity (out, dx, each parameter's gradient): the largest difference from the reference of each SP
    run (key ``sp_<name>`` for each U of ``us``) and of each spread run (``spread_<name>``), and its scale
    (``scale``: the reference's largest value).  ``module`` is an unpatched bf16 mixer."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, seq, module.hidden_size, generator=gen)
    x, dout = x.bfloat16(), torch.randn(x.shape, generator=gen).bfloat16()
    ref = _unpatched(module, x, dout, REFERENCE)
    with float64_internals():  # the same bf16 weights and data, computed in float64 throughout
        truth = _unpatched(copy.deepcopy(module).double(), x.double(), dout.double(), REFERENCE)
    result = {"scale": {k: v.abs().max().item() for k, v in ref.items()}, "error_reference": _max_diff(ref, truth)}
    for name, runs in SPREAD_RUNS.items():
        result[f"spread_{name}"] = _max_diff(_unpatched(module, x, dout, runs), ref)
    for name, u in us.items():
        sp = _sharded(module, x, dout, sharded_forward, u)
        result[f"sp_{name}"] = _max_diff(sp, ref)
        result[f"error_sp_{name}"] = _max_diff(sp, truth)
    return result


def beyond_bounds(result: dict[str, dict[str, float]]) -> dict[str, dict[str, tuple[float, float]]]:
    """Per SP run, what breaks the rule: an output that is not bit for bit the reference's, or a gradient whose
    difference from the reference exceeds both yardsticks of the unpatched layer's own variation, the spread
    of its equivalent runs and its bf16 rounding error (its difference from float64): {run: {quantity: (SP
    difference, bound)}}."""
    spreads = [v for name, v in result.items() if name.startswith("spread_")]
    bound = {k: max(*(v[k] for v in spreads), result["error_reference"][k]) for k in result["scale"]}
    bound["out"] = 0.0
    return {
        name: {k: (d, bound[k]) for k, d in diffs.items() if d > bound[k]}
        for name, diffs in result.items()
        if name.startswith("sp_")
    }
