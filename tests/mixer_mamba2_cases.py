"""Rank-side bodies of tests/test_mixer_mamba2.py: Mamba-2 hybrids (Nemotron-H, Granite 4 hybrid, Bamba) patched by
``apply_upipe`` on sequence shards == the unpatched model on the whole sequence (float64 logits, loss, every
parameter gradient summed over the ranks), packed rows == every document alone, and the refusal of a bad U."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

import hf_patches
from hf_patches.mixers import mamba2
from tests import mixer_bf16
from tests.hf_cases import (
    compare,
    float64_internals,
    make_batch,
    packed_batch,
    per_document_reference,
    reference_step,
    sharded_step,
)

COMMON = dict(vocab_size=101, initializer_range=0.1, use_cache=False, num_attention_heads=4, num_key_value_heads=2)

#: family -> (config class, config fields, causal LM class); chunk_size 4: a shard spans several chunks.
#: SSM heads / groups: Nemotron-H 8 / 1 (fewer groups than ranks), Bamba 8 / 2, Granite 12 / 4 (at C=2, U=4 a
#: rank's two heads straddle two groups: a group per head)
FAMILIES = {
    "nemotron_h": (
        "NemotronHConfig",
        dict(
            hidden_size=32,
            layers_block_type=["mamba", "attention", "mlp", "mamba"],
            head_dim=8,
            intermediate_size=48,
            mamba_num_heads=8,
            mamba_head_dim=4,
            n_groups=1,
            ssm_state_size=4,
            chunk_size=4,
            use_bias=True,  # in_proj rows with a bias
        ),
        "NemotronHForCausalLM",
    ),
    "granitemoehybrid": (
        "GraniteMoeHybridConfig",
        dict(
            hidden_size=48,
            num_hidden_layers=2,
            layer_types=["linear_attention", "full_attention"],
            intermediate_size=32,
            shared_intermediate_size=32,
            num_local_experts=0,  # dense (grouped_mm experts refuse float64)
            mamba_n_heads=12,
            mamba_n_groups=4,
            mamba_d_state=4,
            mamba_d_head=8,
            mamba_chunk_size=4,
        ),
        "GraniteMoeHybridForCausalLM",
    ),
    "bamba": (
        "BambaConfig",
        dict(
            hidden_size=32,
            num_hidden_layers=2,
            attn_layer_indices=[1],
            intermediate_size=48,
            mamba_n_heads=8,
            mamba_n_groups=2,
            mamba_d_state=4,
            mamba_chunk_size=4,
        ),
        "BambaForCausalLM",
    ),
}


def build(family: str, seed: int = 0) -> torch.nn.Module:
    """A tiny float64 model; the mixers' per-head and per-channel parameters perturbed so that no two heads
    (A_log, dt_bias, D) or channels (conv, norm) are alike: a head or channel read from the wrong place shows."""
    import transformers

    config_cls, fields, model_cls = FAMILIES[family]
    config = getattr(transformers, config_cls)(**{**COMMON, **fields})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).to(torch.float64)
    with torch.no_grad():
        for mixer in mixers(model):
            for p in (mixer.A_log, mixer.dt_bias, mixer.D, mixer.norm.weight, mixer.conv1d.bias):
                p.add_(0.3 * torch.randn_like(p))
    return model


def mixers(model: torch.nn.Module) -> list[torch.nn.Module]:
    names = hf_patches.mixers.MIXER_KINDS["mamba2"].classes
    return [m for m in model.modules() if type(m).__name__ in names]


def num_heads(family: str) -> int:
    fields = FAMILIES[family][1]
    return fields.get("mamba_num_heads") or fields["mamba_n_heads"]


def parity(family: str, u: int | None, world: int, seq: int = 24, checkpointing: bool = False) -> dict[str, float]:
    group = dist.group.WORLD
    data = make_batch(1, 2, seq)
    model = build(family)
    ref_model = copy.deepcopy(model)
    hf_patches.apply_upipe(model, group, mixer_head_chunk_size=u)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return compare(reference_step(ref_model, data), sharded_step(model, data, group), seq)


def packed(family: str, u: int | None, world: int, seq: int = 24) -> dict[str, float]:
    """A packed row (positions restarting at each document) == every document alone through the unpatched model."""
    group = dist.group.WORLD
    batch, cus = packed_batch(3, seq, world)
    model = build(family, seed=1)
    ref_model = copy.deepcopy(model)
    hf_patches.apply_upipe(model, group, mixer_head_chunk_size=u)
    return compare(per_document_reference(ref_model, batch, cus), sharded_step(model, batch, group), seq)


def _per_segment(fn, seq_idx_of_call, calls):
    """A stand-in for a mamba_ssm / causal-conv1d kernel on CPU: transformers' torch function run on each run of
    equal ``seq_idx`` alone (how the kernels restart at a change of seq_idx); counts the calls given a seq_idx."""

    def kernel(*args, seq_idx=None, **kwargs):
        if seq_idx is None:
            return fn(*args, **kwargs)
        calls.append(tuple(seq_idx.shape))
        time_dim, tensors = seq_idx_of_call(args)
        rows = []
        for b, idx in enumerate(seq_idx.tolist()):
            cuts = [0, *(t for t in range(1, len(idx)) if idx[t] != idx[t - 1]), len(idx)]
            parts = [
                fn(
                    *(a[b : b + 1].narrow(time_dim, s, e - s) if i in tensors else a for i, a in enumerate(args)),
                    **kwargs,
                )
                for s, e in zip(cuts, cuts[1:])
            ]
            rows.append(torch.cat(parts, dim=time_dim))
        return torch.cat(rows)

    return kernel


def kernel_path(world: int) -> dict[str, float]:
    """The kernel route on a packed row (Bamba, float32, as the kernels take): ``kernel_runs`` answers yes, each
    kernel call's arguments pass the kernel's contract (checked by the sharded forward) and carry ``seq_idx``, and
    stand-ins honouring seq_idx as the kernels do give every document alone through the unpatched model."""
    import sys

    group = dist.group.WORLD
    batch, cus = packed_batch(3, 24, world)
    model = build("bamba", seed=2).float()
    ref = per_document_reference(copy.deepcopy(model), batch, cus)
    hf_patches.apply_upipe(model, group)
    namespace = vars(sys.modules[type(mixers(model)[0]).__module__])
    originals = {name: namespace[name] for name in ("causal_conv1d_fn", "mamba2_chunk_scan")}
    calls: list = []
    namespace["causal_conv1d_fn"] = _per_segment(originals["causal_conv1d_fn"], lambda a: (2, {0}), calls)
    namespace["mamba2_chunk_scan"] = _per_segment(originals["mamba2_chunk_scan"], lambda a: (1, {0, 1, 3, 4}), calls)
    users = (hf_patches.mixers.common, hf_patches.mixers.mamba2)  # the modules that ask whether a kernel runs
    kernel_runs = hf_patches.mixers.common.kernel_runs
    for user in users:
        user.kernel_runs = lambda package, device: True
    try:
        errors = compare(ref, sharded_step(model, batch, group), 24)
    finally:
        namespace.update(originals)
        for user in users:
            user.kernel_runs = kernel_runs
    # each mixer's conv and scan in each of its H / C stages (U = C), in forward and the checkpointed recompute
    expected = len(mixers(model)) * 2 * (num_heads("bamba") // world) * 2
    errors["seq_idx_calls"] = float(len(calls) != expected or set(calls) != {(1, 24)})
    return errors


def refusal(world: int) -> str:
    """apply_upipe's message for a U that is not a multiple of C (raised before any collective)."""
    try:
        hf_patches.apply_upipe(build("bamba"), dist.group.WORLD, mixer_head_chunk_size=world + 1)
    except ValueError as e:
        return str(e)
    return "not refused"


def bf16_case() -> dict[str, dict[str, float]]:
    """Nemotron-H's first Mamba-2 mixer in bf16 under SP (U=C and U=all heads) against the unpatched layer and
    its own spread (tests/mixer_bf16.py)."""
    layer = mixers(build("nemotron_h").to(torch.bfloat16))[0]
    return mixer_bf16.bf16_spread(layer, mamba2.sharded_forward, {"u=C": None, "u=H": num_heads("nemotron_h")}, seq=32)


def matrix(rank: int, world: int) -> dict:
    """Every family at U = C and U = all heads and on a packed row, HF gradient checkpointing, Granite's
    group-per-head stage (C=2, U=4), all in float64 internals (``float64_internals``: tolerance 1e-10); Nemotron-H
    with transformers' float32 internals as they are (float32 tolerance); the refusal's message."""
    cases = {}
    with float64_internals():
        for family in FAMILIES:
            heads = num_heads(family)
            cases[f"{family}_u=C"] = parity(family, None, world)
            cases[f"{family}_u=H"] = parity(family, heads, world)
            cases[f"{family}_packed"] = packed(family, None if family == "bamba" else heads, world)
        cases["nemotron_h_checkpointing"] = parity("nemotron_h", None, world, checkpointing=True)
        if world == 2:
            cases["granitemoehybrid_u=4"] = parity("granitemoehybrid", 4, world)
    return {
        "bf16": bf16_case() if world == 2 else None,
        "float64": cases,
        "float32_internals": parity("nemotron_h", None, world),
        "kernel_path": kernel_path(world),
        "refusal": refusal(world),
    }
