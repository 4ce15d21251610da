"""Gradient error of ``upipe.accumulate_dtype`` ("fp32" vs "input") in bf16, against float64.

A Llama model (bf16 weights) runs patched by ``hf_patches.apply_upipe`` on C gloo ranks (fused
projections, U = C: the most stages) with each setting; the reference is the same weights, unpatched,
in float64 on the whole sequence; "plain bf16" is that unpatched model in bf16 in one process (the
error bf16 training has anyway).  Printed per setting: the relative error ||g - g_ref|| / ||g_ref||
of every parameter gradient, max and median over the parameters, max over the q/k/v projections
(the gradients the option touches), the embedding (which every layer's dx reaches), and the loss.

    PYTHONPATH=. DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 python benchmarks/accumulate_dtype.py [--world 4]
"""

from __future__ import annotations

import argparse
import copy
import statistics

import torch
import torch.distributed as dist

from ds_upipe.tools.ranks import run_ranks

SHAPE = dict(
    num_attention_heads=32, num_key_value_heads=8, hidden_size=512, head_dim=16, intermediate_size=512, vocab_size=256
)


def _model(layers: int, seed: int):
    import transformers

    from ds_upipe.tools.models import tiny_config

    config = tiny_config("llama", num_hidden_layers=layers, initializer_range=0.02, use_cache=False, **SHAPE)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).to(torch.bfloat16)


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().double().clone() for n, p in model.named_parameters() if p.grad is not None}


def _full_step(model, batch) -> tuple[float, dict[str, torch.Tensor]]:
    from tests.hf_cases import reference_loss

    out = model(input_ids=batch["input_ids"])
    loss = reference_loss(out.logits, batch["labels"])
    loss.backward()
    return loss.item(), _grads(model)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def _summary(grads, ref) -> dict[str, float]:
    errs = {n: _rel(grads[n], ref[n]) for n in ref}
    attn = [e for n, e in errs.items() if ".self_attn." in n and "o_proj" not in n]
    return {
        "max": max(errs.values()),
        "median": statistics.median(errs.values()),
        "qkv_max": max(attn),
        "embed": errs["model.embed_tokens.weight"],  # every layer's dx flows into it
    }


def measure(rank: int, world: int, layers: int, seq: int, seed: int) -> dict[str, dict[str, float]]:
    import hf_patches
    from tests.hf_cases import make_batch, sharded_step

    batch = make_batch(seed, 1, seq, vocab=SHAPE["vocab_size"])
    base = _model(layers, seed)
    ref_loss, ref = _full_step(copy.deepcopy(base).double(), batch)
    bf16_loss, bf16 = _full_step(copy.deepcopy(base), batch)
    rows = {"plain bf16 (1 process)": {**_summary(bf16, ref), "loss_err": abs(bf16_loss - ref_loss) / ref_loss}}
    for setting in ("fp32", "input"):
        model = copy.deepcopy(base)
        hf_patches.apply_upipe(model, dist.group.WORLD, accumulate_in_input_dtype=setting == "input")
        _, loss, grads = sharded_step(model, batch, dist.group.WORLD)
        grads = {n: g.double() for n, g in grads.items()}
        rows[f"upipe accumulate_dtype={setting}"] = {
            **_summary(grads, ref),
            "loss_err": abs(loss.item() - ref_loss) / ref_loss,
        }
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--seeds", type=int, default=2)
    args = parser.parse_args()
    print(f"C={args.world}, {args.layers} layers, {args.seq} tokens, {SHAPE}, U=C (fused)")
    print(f"{'setting':34s} {'max':>9s} {'median':>9s} {'qkv max':>9s} {'embed':>9s} {'loss':>9s}")
    for seed in range(args.seeds):
        rows = run_ranks(measure, args.world, args.layers, args.seq, seed)[0]
        for name, r in rows.items():
            print(
                f"seed {seed} {name:27s} {r['max']:9.2e} {r['median']:9.2e} {r['qkv_max']:9.2e} "
                f"{r['embed']:9.2e} {r['loss_err']:9.2e}"
            )


if __name__ == "__main__":
    main()
