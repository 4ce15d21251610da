"""Rank-side bodies of tests/test_compile.py: UPipe under ``torch.compile`` == UPipe eager.

Each case runs a model (or the core layer) eagerly, then the same module compiled (each decoder layer, as
torchtitan-style users compile, or the whole model) and compares outputs and every gradient; the unpatched
model's own compiled-vs-eager difference on the whole sequence is measured alongside, as the bar for what
the compiler itself changes outside the UPipe nodes (which run eagerly: ``ds_upipe.pipeline.apply_eagerly``).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

import hf_patches
from ds_upipe import TorchSDPAKernel, UPipeDistributedAttention
from tests import core_cases, hf_cases, mixer_gated_delta_cases, mixer_mamba2_cases, mixer_short_conv_cases

#: float32: the dtype users compile in; float64 would hide the compiler's reassociations
DTYPE = torch.float32
SEQ = 8

Step = Callable[[nn.Module], tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]]


def _compile(model: nn.Module, backend: str, whole: bool) -> None:
    """Compile ``model`` in place: the whole model, or each decoder layer (torchtitan's per-block compile)."""
    if whole:
        model.compile(backend=backend)
        return
    for layer in model.model.layers:
        layer.compile(backend=backend)


def lost_gradients(model: nn.Module) -> list[str]:
    """Parameters whose gradient on this rank is missing or all zero (a node that dropped its inputs'
    gradients, as DeepSpeed #8491's compiled all-to-all did)."""
    return [n for n, p in model.named_parameters() if p.requires_grad and (p.grad is None or not p.grad.any())]


def errors(ref: tuple, got: tuple) -> dict[str, float]:
    """Relative errors of (outputs, loss, gradients by name) ``got`` against ``ref``; a gradient name on
    one side only is an infinite error."""
    (r_out, r_loss, r_grads), (g_out, g_loss, g_grads) = ref, got
    errs = {"out": hf_cases.relative_error(g_out, r_out), "loss": hf_cases.relative_error(g_loss, r_loss)}
    for name in set(r_grads) | set(g_grads):
        both = name in r_grads and name in g_grads
        errs[name] = hf_cases.relative_error(g_grads[name], r_grads[name]) if both else float("inf")
    return errs


def compiled_vs_eager(model: nn.Module, step: Step, backend: str, whole: bool = False) -> dict:
    """{"errors": compiled vs eager, "lost": gradients lost under compile, "seconds": the compiled step's}."""
    eager = step(model)
    _compile(model, backend, whole)
    start = time.perf_counter()
    compiled = step(model)
    seconds = time.perf_counter() - start
    num_parameters = sum(p.requires_grad for p in model.parameters())
    return {"errors": errors(eager, compiled), "lost": lost_gradients(model), "num_parameters": num_parameters} | {
        "seconds": seconds
    }


def _whole_sequence_step(data: dict) -> Step:
    return lambda model: hf_cases.reference_step(model, data)


def _sharded_step(data: dict, group: dist.ProcessGroup) -> Step:
    return lambda model: hf_cases.sharded_step(model, data, group)


def hf_cases_for(backend: str, fused_options: tuple[bool, ...], whole: bool) -> dict[str, dict]:
    """A tiny Llama (GQA 8:2, two layers) patched fused and unfused, compiled, against itself eager; and
    the unpatched model compiled against itself eager on the whole sequence (key "unpatched")."""
    group, data = dist.group.WORLD, hf_cases.make_batch(0, 1, SEQ)
    base = hf_cases.build_model("llama", DTYPE)
    out = {"unpatched": compiled_vs_eager(copy.deepcopy(base), _whole_sequence_step(data), backend, whole)}
    for fused in fused_options:
        model = copy.deepcopy(base)
        hf_cases.patch_model(model, group, None, fused, False, False)
        out["fused" if fused else "unfused"] = compiled_vs_eager(model, _sharded_step(data, group), backend, whole)
    return out


def core_case(backend: str) -> dict:
    """``UPipeDistributedAttention`` (GQA 8:2, U = C) compiled: output and q/k/v gradients (the "grads")."""
    q, k, v, dout = core_cases.make_inputs(0, 1, SEQ, 8, 2, 8, DTYPE)
    rank, world = dist.get_rank(), dist.get_world_size()
    shards = [core_cases.local_shard(t, rank, world, 0).to(DTYPE) for t in (q, k, v, dout)]
    attn = UPipeDistributedAttention(TorchSDPAKernel(causal=True), dist.group.WORLD)

    def step(module: nn.Module) -> tuple:
        leaves = [t.clone().requires_grad_(True) for t in shards[:3]]
        out = module(*leaves, 0)
        out.backward(shards[3])
        return out.detach(), out.detach().sum(), {name: t.grad for name, t in zip("qkv", leaves) if t.grad is not None}

    eager = step(attn)
    start = time.perf_counter()
    compiled = step(torch.compile(attn, backend=backend))
    lost = [name for name in "qkv" if name not in compiled[2] or not compiled[2][name].any()]
    return {"errors": errors(eager, compiled), "lost": lost, "seconds": time.perf_counter() - start}


#: the hybrid models of ``mixer_case``: name -> builder of a tiny float64 model (one mixer kind each: gated delta
#: net, Mamba-2, short conv; each with a softmax attention layer)
HYBRIDS = {
    "qwen3_5": lambda: mixer_gated_delta_cases.build_model("qwen3_5"),
    "bamba": lambda: mixer_mamba2_cases.build("bamba"),
    "lfm2": lambda: mixer_short_conv_cases.build_model(False),
}


def mixer_case(backend: str, hybrid: str) -> dict:
    """A tiny hybrid model (mixer layers head-sharded in stages, or a short conv's halo exchange, plus
    softmax attention layers), compiled per decoder layer, against itself eager; the unpatched model's own
    difference alongside."""
    group, data = dist.group.WORLD, hf_cases.make_batch(0, 1, 16)
    base = HYBRIDS[hybrid]().to(DTYPE)
    out = {"unpatched": compiled_vs_eager(copy.deepcopy(base), _whole_sequence_step(data), backend)}
    model = copy.deepcopy(base)
    hf_patches.apply_upipe(model, group)
    out["patched"] = compiled_vs_eager(model, _sharded_step(data, group), backend)
    return out


#: every case of tests/test_compile.py: name -> the case (the whole-model compile runs the unfused path only:
#: the fused path's whole-model compile costs 24 s more for what the per-layer cases already cover)
CASES = {
    "per_layer_aot_eager": lambda: hf_cases_for("aot_eager", (True, False), whole=False),
    "per_layer_inductor": lambda: hf_cases_for("inductor", (True, False), whole=False),
    "whole_model_aot_eager": lambda: hf_cases_for("aot_eager", (False,), whole=True),
    "core_aot_eager": lambda: core_case("aot_eager"),
    "core_inductor": lambda: core_case("inductor"),
    "hybrid_lfm2_aot_eager": lambda: mixer_case("aot_eager", "lfm2"),
    "hybrid_qwen3_5_aot_eager": lambda: mixer_case("aot_eager", "qwen3_5"),
    "hybrid_bamba_aot_eager": lambda: mixer_case("aot_eager", "bamba"),
}


def spawn_body(rank: int, world: int, names: tuple[str, ...] = tuple(CASES)) -> dict:
    """The cases ``names`` (default: all) in one spawn; each case resets dynamo's caches first."""
    results = {}
    for name in names:
        torch._dynamo.reset()
        start = time.perf_counter()
        results[name] = CASES[name]()
        results[name + "_seconds"] = time.perf_counter() - start
    return results
