"""The long-context stack's tiled MLP on sparse mixture-of-experts blocks (hf_patches.moe_tiling):
Qwen3-MoE, Mixtral and GPT-OSS tiny models in float64, in one process.

- module level: the MoE block tiled == untiled (every output, the router logits transformers'
  recorder collects, the input gradient and every parameter gradient incl. the router's);
- model level: the whole stack (tiled loss, norms, MLPs) with ``output_router_logits=True`` ==
  the unpatched model: loss incl. the load-balancing aux loss, aux loss, every layer's router logits,
  every parameter gradient; and without router logits (the aux loss off) likewise;
- refused: Mixtral's router jitter noise, naming the layer;
- ZeRO-3: the MoE blocks are z3 leaf modules after the stack (gathered once per block call).

Mutations that fail these tests: dropping the last tile's router logits in ``tiling.TiledPerToken.forward``
(module and model router_logits, aux loss, router gradients); not backpropagating the router
logits' gradient in ``tiling.TiledPerToken.backward`` (router weight gradients); recording the logits twice.
"""

from __future__ import annotations

import copy

import pytest
import torch

import hf_patches
from hf_patches.moe_tiling import find_router, tiled_moe
from hf_patches.tiling import _forward_function
from tests.hf_cases import TOLERANCE, reference_loss, relative_error
from tests.moe_cases import MOE_FAMILIES, build_moe_model

FAMILIES = list(MOE_FAMILIES)
TOL = TOLERANCE[torch.float64]


def _collecting(model, fn):
    """fn() inside transformers' router-logits collector of ``model`` (as its capturing forward sets
    it up): (fn's result, the collected router logits)."""
    from transformers.utils.output_capturing import _active_collector

    collected = {"router_logits": []}
    token = _active_collector.set(collected)
    try:
        return fn(), collected["router_logits"]
    finally:
        _active_collector.reset(token)


def _block_step(model, block, x, up, up_logits, tile_tokens):
    """Outputs, router logits and gradients of one MoE block (tiled when tile_tokens is set)."""
    router, index = find_router(model.model, "layers.0.mlp", block)
    forward = _forward_function(block)
    x = x.clone().requires_grad_(True)
    if tile_tokens is None:
        out, logits = _collecting(model.model, lambda: block(x))
    else:
        out, logits = _collecting(model.model, lambda: tiled_moe(block, forward, router, index, x, tile_tokens))
    outs = out if isinstance(out, tuple) else (out,)
    assert len(logits) == 1, f"router logits recorded {len(logits)} times"
    loss = (outs[0] * up).sum() + (logits[0] * up_logits).sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in block.named_parameters()}
    return [o.detach() for o in outs], logits[0].detach(), x.grad, grads


@pytest.mark.parametrize("family", FAMILIES)
def test_module_parity(family):
    from transformers.utils.output_capturing import maybe_install_capturing_hooks

    model = build_moe_model(family)
    maybe_install_capturing_hooks(model.model)  # the recorder hooks, before the blocks are copied
    block = model.model.layers[0].mlp
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 9, 32, dtype=torch.float64, generator=gen)
    up = torch.randn(2, 9, 32, dtype=torch.float64, generator=gen)
    experts = model.config.num_local_experts if hasattr(model.config, "num_local_experts") else model.config.num_experts
    up_logits = torch.randn(18, experts, dtype=torch.float64, generator=gen)
    ref = _block_step(model, copy.deepcopy(block), x, up, up_logits, None)
    for tile_tokens in (4, 5, 1):  # uneven tiles, one token per tile
        got = _block_step(model, copy.deepcopy(block), x, up, up_logits, tile_tokens)
        assert len(got[0]) == len(ref[0])
        for o_got, o_ref in zip(got[0], ref[0], strict=True):
            assert o_got.shape == o_ref.shape and relative_error(o_got, o_ref) <= TOL
        assert relative_error(got[1], ref[1]) <= TOL, "router logits"
        assert relative_error(got[2], ref[2]) <= TOL, "input gradient"
        assert sorted(got[3]) == sorted(ref[3])
        for name in ref[3]:
            assert relative_error(got[3][name], ref[3][name]) <= TOL, f"{family} tile {tile_tokens}: {name}"
        assert any("router" in n or n.startswith("gate") for n in ref[3]), ref[3].keys()


def _model_step(model, data, router_logits, reference=False):
    """The loss's parts and gradients.  The reference's cross-entropy in float64 (transformers'
    ForCausalLMLoss upcasts float64 logits to float32), plus its own aux loss term."""
    if reference:
        out = model(input_ids=data["input_ids"], output_router_logits=router_logits)
        out.loss = reference_loss(out.logits, data["labels"])
        if router_logits:
            out.loss = out.loss + model.router_aux_loss_coef * out.aux_loss
    else:
        out = model(**data, output_router_logits=router_logits)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads


@pytest.mark.parametrize("family", FAMILIES)
def test_model_parity(family):
    """The whole stack on an MoE model == the unpatched model (float64), with the aux loss on and off."""
    model = build_moe_model(family)
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 101, (2, 11), generator=gen)
    labels = ids.clone()
    labels[0, :3] = -100
    data = {"input_ids": ids, "labels": labels}
    for router_logits in (True, False):
        ref_out, ref_grads = _model_step(copy.deepcopy(model), data, router_logits, reference=True)
        tiled = copy.deepcopy(model)
        hf_patches.apply_long_context_stack(
            tiled,
            tiled_loss=True,
            tiled_norm=True,
            tiled_mlp=True,
            loss_tile_tokens=5,
            norm_tile_tokens=4,
            mlp_tile_tokens=3,
        )
        assert [n for n in hf_patches.long_context_stack(tiled).patched if n.endswith("mlp")] == [
            f"layers.{i}.mlp" for i in range(model.config.num_hidden_layers)
        ]
        out, grads = _model_step(tiled, data, router_logits)
        assert out.logits is None
        assert relative_error(out.loss, ref_out.loss) <= TOL, (out.loss, ref_out.loss)
        assert sorted(grads) == sorted(ref_grads)
        for name in ref_grads:
            assert relative_error(grads[name], ref_grads[name]) <= TOL, f"{family} aux={router_logits}: {name}"
        if router_logits:
            assert ref_out.aux_loss is not None and relative_error(out.aux_loss, ref_out.aux_loss) <= TOL
            assert len(out.router_logits) == len(ref_out.router_logits) == model.config.num_hidden_layers
            for got, want in zip(out.router_logits, ref_out.router_logits, strict=True):
                assert got.shape == want.shape and relative_error(got, want) <= TOL
        else:
            assert out.aux_loss is None and ref_out.aux_loss is None
    # the aux loss has a gradient in the router weights (so the check above covers it)
    assert any("router" in n or ".gate." in n for n in ref_grads)


def test_refusals_and_zero3_leaf():
    model = build_moe_model("mixtral", router_jitter_noise=0.1)
    with pytest.raises(ValueError) as err:
        hf_patches.apply_long_context_stack(model, tiled_mlp=True)
    for word in ("layers.0.mlp (MixtralSparseMoeBlock)", "jitter noise 0.1", "router_jitter_noise=0.0"):
        assert word in str(err.value), err.value
    assert hf_patches.long_context_stack(model) is None and "forward" not in model.model.layers[0].mlp.__dict__

    for family in FAMILIES:
        model = build_moe_model(family)
        hf_patches.apply_long_context_stack(model, tiled_mlp=True)
        assert all(layer.mlp._z3_leaf for layer in model.model.layers), family
        assert not any(getattr(layer.self_attn, "_z3_leaf", False) for layer in model.model.layers)
