"""Exchanged elements of multi-head latent attention under UPipe: unfused (as it runs) against the fused-latent
design of docs/hf_patches.md ("Multi-head latent attention"), per local token per layer per training step.

Measured: the tiny DeepSeek-V3 of tests/family_cases.py, patched unfused, one forward + backward on C gloo ranks,
every ``all_to_all_single`` send buffer counted (the self block included: what leaves a rank is (C-1)/C of it),
against ``unfused_elements`` of its dims.  Printed for DeepSeek-V3's real dims: ``unfused_elements`` and
``latent_elements`` scaled to what leaves a rank, at C = 2 to 32.

    PYTHONPATH=. DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 python benchmarks/mla_exchanges.py
"""

from __future__ import annotations

import torch.distributed as dist

from ds_upipe.tools.ranks import run_ranks

#: DeepSeek-V3 (transformers' DeepseekV3Config defaults)
DEEPSEEK_V3 = dict(heads=128, qk=128 + 64, v=128, latent=512 + 64, q_latent=1536)


def unfused_elements(heads: int, qk: int, v: int) -> int:
    """All-to-all send elements per local token per layer per step (core.md's exchange table, H_kv = H): forward
    K+V, q, out; backward K+V again, q + dout + out, dq, dK+dV."""
    forward = heads * (qk + v) + heads * qk + heads * v
    return forward + heads * (qk + v) + heads * (qk + 2 * v) + heads * qk + heads * (qk + v)


def latent_elements(heads: int, qk: int, v: int, latent: int, q_latent: int, group: int, gather_q: bool) -> float:
    """Elements leaving a rank per local token per layer per step, fused latent: the latent all-gathered in forward
    and backward and its gradient reduce-scattered (latent x (C-1) each); q in forward and backward and dq (or,
    ``gather_q``, q's latent gathered and reduce-scattered like the latent), out, dout + out as all-to-alls
    ((C-1)/C of the send)."""
    share = (group - 1) / group
    q = 3 * q_latent * (group - 1) if gather_q else 3 * heads * qk * share
    return 3 * latent * (group - 1) + q + 3 * heads * v * share


def count_unfused(rank: int, world: int, seq: int) -> dict[str, float]:
    """The tiny DeepSeek-V3's measured send elements per local token per layer, and ``unfused_elements``."""
    import hf_patches
    from tests import family_cases, hf_cases

    model = family_cases.build_family("deepseek_v3")
    cfg = model.config
    hf_patches.apply_upipe(model, dist.group.WORLD, fused_projections=False)
    sent = []
    all_to_all = dist.all_to_all_single

    def counted(out, inp, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202 - all_to_all_single's own
        sent.append(inp.numel())
        return all_to_all(out, inp, *args, **kwargs)

    dist.all_to_all_single = counted  # a count around the real collective, restored below
    try:
        hf_cases.sharded_step(model, hf_cases.make_batch(0, 1, seq), dist.group.WORLD)
    finally:
        dist.all_to_all_single = all_to_all
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    return {
        "measured": sum(sent) / (seq // world) / cfg.num_hidden_layers,
        "formula": unfused_elements(cfg.num_attention_heads, qk, cfg.v_head_dim),
    }


def main() -> None:
    for world in (2, 4):
        print(f"tiny DeepSeek-V3, C={world}: {run_ranks(count_unfused, world, 16)[0]}")
    d = DEEPSEEK_V3
    for group in (2, 4, 8, 16, 32):
        unfused = unfused_elements(d["heads"], d["qk"], d["v"]) * (group - 1) / group
        latent = latent_elements(**d, group=group, gather_q=False)
        both = latent_elements(**d, group=group, gather_q=True)
        ratios = f"latent {latent:.0f} ({latent / unfused:.3f}), q's latent too {both:.0f} ({both / unfused:.3f})"
        print(f"DeepSeek-V3, C={group}: unfused {unfused:.0f}, {ratios}")


if __name__ == "__main__":
    main()
