"""The mixers' autograd exchanges (hf_patches/mixers/exchange.py) against the same permutation computed on the
whole tensor in one process, values and gradients, over 2 and 4 gloo ranks in one spawn each."""

from __future__ import annotations

import pytest
import torch

from ds_upipe.tools.ranks import run_ranks


def _exchange_rank(rank: int, world: int) -> dict[str, float]:
    import torch.distributed as dist

    from hf_patches.mixers.exchange import heads_to_sequence, previous_tokens, sequence_to_heads

    torch.manual_seed(0)
    b, s, h, d = 2, 3, 2, 5
    full = torch.randn(b, world * s, world * h, d, dtype=torch.float64)  # [B, S, heads, d], same on every rank
    weight = torch.randn_like(full)
    mine = full[:, rank * s : (rank + 1) * s].clone().requires_grad_(True)
    heads = sequence_to_heads(mine.unflatten(2, (world, h)), None)  # [B, S, h, d]
    expect_heads = full[:, :, rank * h : (rank + 1) * h]
    back = heads_to_sequence(heads * 2, None, world).flatten(2, 3)
    (heads * weight[:, :, rank * h : (rank + 1) * h]).sum().backward()
    grad_expect = weight[:, rank * s : (rank + 1) * s]
    errors = {
        "to_heads": (heads - expect_heads).abs().max().item(),
        "to_sequence": (back - 2 * mine).abs().max().item(),
        "grad": (mine.grad - grad_expect).abs().max().item(),
    }
    x = full[:, rank * s : (rank + 1) * s, 0].clone().requires_grad_(True)  # [B, s, d]
    halo = previous_tokens(x, 2, None)
    expect = full[:, rank * s - 2 : rank * s, 0] if rank else torch.zeros(b, 2, d, dtype=full.dtype)
    (halo * 3).sum().backward()
    grad = torch.zeros_like(x)
    if rank + 1 < world:
        grad[:, -2:] = 3
    errors["halo"] = (halo - expect).abs().max().item()
    errors["halo_grad"] = (x.grad - grad).abs().max().item()
    dist.barrier()
    return errors


@pytest.mark.parametrize("world", [2, 4])
def test_exchanges_match_the_whole_tensor(world):
    for errors in run_ranks(_exchange_rank, world):
        assert max(errors.values()) == 0.0, errors
